"""A stage built alone: a stage context, its queues and callbacks, the fake engines, and no server or slot.

What the stage emits is read from its outbox's queue, decoded as a client
would read the frames.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from s2s_rt.engines.base import PIPELINE_RATE, ChatMessage, LLMRequest
from s2s_rt.engines.fake import EchoLLM, checksum_transcript, load_fake_stack
from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline import responding
from s2s_rt.pipeline.anticipation import Anticipation
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.outbox import Outbox
from s2s_rt.pipeline.responding import Responder
from s2s_rt.pipeline.speaking import Speaker
from s2s_rt.pipeline.stage import Stage, StageContext
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import ResponseEnd, ResponseRequest, SessionEnd, Speak, Transcribe
from s2s_rt.protocol.config import Transcription
from s2s_rt.protocol.server_events import GA
from s2s_rt.protocol.session import Session
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd


def _events(outbox: Outbox) -> list[dict[str, Any]]:
    out = []
    while not outbox.queue.empty():
        item = outbox.queue.get_nowait()
        out.append(json.loads(item.data))
    return out


def test_the_transcribing_stage_alone_transcribes_a_turn_and_starts_its_response() -> None:
    async def main() -> None:
        metrics = Metrics(dict, lambda: 0)
        stack = load_fake_stack()
        pools = {"stt": StagePool("stt", 1, metrics)}
        failures: list[tuple[BaseException, str, Scope | None]] = []
        outbox = Outbox(0, metrics, 64, 1.0)
        stage = StageContext(0, stack, pools, metrics, outbox, lambda e, w, s: failures.append((e, w, s)))
        session = Session(GA)
        session.config.transcription = Transcription()  # the client asked for transcription events
        session.commit_audio("item_1")  # as the listener does when the turn ends
        ctx = SessionContext(None, session, "test", stack.vad.new_state(), SemanticTurnEnd(), lambda c: None)  # type: ignore[arg-type]
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        to_llm: asyncio.Queue[Any] = asyncio.Queue()
        stage_task = asyncio.create_task(Transcriber(stage, lambda: ctx, inbox, to_llm).run())
        try:
            audio = (0.3 * np.sin(np.arange(PIPELINE_RATE) / 7)).astype(np.float32)
            # A job whose handling raises (it is not a job at all) ends its session's share, not the stage.
            await inbox.put(types.SimpleNamespace(scope=session.scope))
            await inbox.put(Transcribe(session.scope, "item_1", audio, True, None))
            request = await asyncio.wait_for(to_llm.get(), 10)
        finally:
            stage_task.cancel()
            pools["stt"].executor.shutdown(wait=False)
        assert len(failures) == 1 and failures[0][1] == "the STT stage" and failures[0][2] is session.scope
        assert isinstance(request, ResponseRequest) and request.response is session.response
        events = _events(outbox)
        done = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
        assert [(e["item_id"], e["transcript"]) for e in done] == [("item_1", checksum_transcript(audio))]
        assert events[-1]["type"] == "response.created"

    asyncio.run(main())


async def _until(queue: asyncio.Queue[Any], last: Callable[[Any], bool]) -> list[Any]:
    """What comes out of a stage, up to and with the first item for which ``last`` is true."""
    out = [await asyncio.wait_for(queue.get(), 10)]
    while not last(out[-1]):
        out.append(await asyncio.wait_for(queue.get(), 10))
    return out


@pytest.mark.parametrize("name", ["stt", "llm", "tts"])
def test_every_stage_passes_a_sessions_end_on_behind_its_work_drops_stale_work_and_fails_one_item_alone(
    name: str,
) -> None:
    """The stage contract (:class:`Stage`), as each of the three stages keeps it: stale work is dropped and
    counted under the stage's name; an item that raises ends its own session, and the stage goes on; the
    session's end comes out after what the work before it made."""

    async def main() -> None:
        metrics = Metrics(dict, lambda: 0)
        stack = load_fake_stack()
        pools = {kind: StagePool(kind, 1, metrics) for kind in ("stt", "llm", "tts")}
        failures: list[tuple[str, Scope | None]] = []
        outbox = Outbox(0, metrics, 256, 1.0)
        stage = StageContext(0, stack, pools, metrics, outbox, lambda e, w, s: failures.append((w, s)))
        session = Session(GA)
        session.commit_audio("item_1")
        session.transcribed("item_1", "What a fine day.", 1.0)
        session.start_response(None)
        r = session.response
        assert r is not None and r.audio
        ctx = SessionContext(None, session, "test", stack.vad.new_state(), SemanticTurnEnd(), lambda c: None)  # type: ignore[arg-type]
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        out: asyncio.Queue[Any] = asyncio.Queue()
        gone = Scope("a response cancelled meanwhile", parent=session.scope)
        gone.close("cancelled")
        ahead = Anticipation(LLMRequest.of([], max_tokens=1, temperature=1.0), 1.0, "tone", Scope("ahead"))
        worker: Stage[SessionContext, Any]
        stale: Any
        live: Any
        last: Callable[[Any], bool]
        if name == "stt":
            worker = Transcriber(stage, lambda: ctx, inbox, out)
            stale = Transcribe(gone, "item_0", np.zeros(1600, np.float32), True, None)
            live = ResponseRequest(r.scope, r)  # a response.create passes through, behind the turns before it
            last = lambda item: item is live  # noqa: E731
        elif name == "llm":
            worker = Responder(stage, lambda: ctx, inbox, out)
            stale, live = ResponseRequest(gone, r, ahead), ResponseRequest(r.scope, r)
            last = lambda item: isinstance(item, ResponseEnd)  # noqa: E731
        else:
            worker = Speaker(stage, lambda: ctx, inbox, lambda c: None, lambda c: None)
            stale, live = Speak(gone, r, "Never said."), Speak(r.scope, r, "What a fine day.")
            out = outbox.queue
            last = lambda item: item.type.endswith("audio.delta")  # noqa: E731
        assert worker.name == name
        task = asyncio.create_task(worker.run())
        try:
            broken = types.SimpleNamespace(scope=session.scope)  # not work at all: its handling raises
            for item in (stale, broken, live):
                await inbox.put(item)
            done = await _until(out, last)
            speaking_for = getattr(worker, "_resampling_for", None)
            await inbox.put(SessionEnd(session.id))
            done += await _until(out, lambda item: isinstance(item, SessionEnd))
        finally:
            task.cancel()
            for pool in pools.values():
                pool.executor.shutdown(wait=False)
        assert failures == [(f"the {name.upper()} stage", session.scope)]
        assert metrics.dropped_stale.get(stage=name) == 1
        end = done.pop()
        assert isinstance(end, SessionEnd) and end.session_id == session.id
        if name == "stt":
            assert done == [live]
        elif name == "llm":
            assert [type(item) for item in done] == [Speak] * (len(done) - 1) + [ResponseEnd] and len(done) > 1
            assert ahead.scope.stale  # the stale request's answer begun ahead is dropped with it
        else:
            assert done and all(item.scope.outermost is session.scope for item in done)
            assert "Never said." not in b"".join(item.data for item in done).decode()
            # The resampler is the response's while it speaks, and no session's after its end.
            assert (speaking_for, getattr(worker, "_resampling_for", None)) == (r.id, None)

    asyncio.run(main())


def test_a_stage_pool_is_awaited_until_no_call_runs_and_a_waiter_given_up_leaves_nothing() -> None:
    async def main() -> None:
        pool = StagePool("llm", 2, Metrics(dict, lambda: 0))
        release = [threading.Event(), threading.Event()]
        try:
            await asyncio.wait_for(pool.idle(), 0.1)  # nothing runs: at once
            calls = [asyncio.create_task(pool.call(r.wait, 5)) for r in release]
            while pool.running < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(TimeoutError):  # given up on: it leaves no waiter behind
                await asyncio.wait_for(pool.idle(), 0.05)
            idle = asyncio.create_task(pool.idle())
            release[0].set()
            await calls[0]
            await asyncio.sleep(0.1)
            assert not idle.done()  # one call still runs
            release[1].set()
            started = time.perf_counter()
            await asyncio.wait_for(idle, 1.0)
            assert time.perf_counter() - started < 0.5
            await calls[1]
            assert pool.running == 0 and pool._idle_waiters == []
        finally:
            for r in release:
                r.set()
            pool.shutdown()

    asyncio.run(main())


class _ReadsAhead(EchoLLM):
    """The fake model, reading conversations ahead (as the CTranslate2 model keeps their state)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[tuple[Sequence[ChatMessage], Sequence[dict[str, Any]]]] = []

    def prime(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> bool:
        self.read.append((messages, tools))
        return True


def test_reading_the_conversation_ahead_waits_for_the_model_to_be_free_then_reads_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers come first: the conversation is read ahead only once no engine call runs on the LLM's threads,
    woken when the last one ends, and given up (``busy``) when none ends within its wait."""
    monkeypatch.setattr(responding, "PRIME_WAIT_S", 0.3)

    async def main() -> None:
        metrics = Metrics(dict, lambda: 0)
        llm = _ReadsAhead()
        stack = dataclasses.replace(load_fake_stack(), llm=llm)
        pools = {"llm": StagePool("llm", 2, metrics)}
        outbox = Outbox(0, metrics, 64, 1.0)
        stage = StageContext(0, stack, pools, metrics, outbox, lambda e, w, s: None)
        session = Session(GA)
        ctx = SessionContext(None, session, "test", stack.vad.new_state(), SemanticTurnEnd(), lambda c: None)  # type: ignore[arg-type]
        responder = Responder(stage, lambda: ctx, asyncio.Queue(), asyncio.Queue())
        release = threading.Event()

        async def until(outcome: str, within_s: float) -> None:
            began = time.perf_counter()
            while not metrics.primes.get(outcome=outcome):
                assert time.perf_counter() - began < within_s, f"no {outcome} prime within {within_s} s"
                await asyncio.sleep(0.005)

        try:
            answer = asyncio.create_task(pools["llm"].call(release.wait, 5))  # another session's answer
            while not pools["llm"].running:
                await asyncio.sleep(0.01)
            responder.read_ahead(ctx)
            await until("busy", 1.0)  # it ran on past the wait
            monkeypatch.setattr(responding, "PRIME_WAIT_S", 10.0)
            responder.read_ahead(ctx)
            await asyncio.sleep(0.1)
            assert llm.read == [] and metrics.primes.get(outcome="held") == 0
            release.set()
            await answer
            await until("held", 0.5)  # woken as the answer ended, well within its wait
            assert len(llm.read) == 1 and llm.read[0][0][0].role == "system"
        finally:
            release.set()
            session.end()
            pools["llm"].shutdown()

    asyncio.run(main())
