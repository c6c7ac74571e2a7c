"""The pipeline's promises hold under any timing: one regression test per bad timing found.

Each test makes an event arrive at the moment that used to break a promise:
a session never sees another's output, a slot always comes back, a cancelled
or failed response never leaks past its ``response.done``, and a finished one
is always delivered whole. Every test runs twice: on the fake stack as it is,
and speculating (transcribing and answering during a turn's closing silence)
as the default stack does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import socket
import threading
import time
from typing import Any

import pytest
from conftest import (
    RealtimeClient,
    both_speculation_modes,
    eventually,
    http_get,
    live_server,
    run,
    silence,
    tone,
)
from websockets.asyncio.client import connect

from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline import clauses
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import SessionEnd

pytestmark = both_speculation_modes


async def _pool_states(server) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return json.loads((await http_get(server, "/v1/pool"))[1])["states"]


async def _all_idle(server) -> bool:  # type: ignore[no-untyped-def]
    states = await _pool_states(server)
    return states["idle"] == len(server.pool.slots)


def _restarts(metrics: str) -> float:
    m = re.search(r"^s2s_stage_restarts_total (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else 0.0


# 1 ---------------------------------------------------------------------------


def test_turning_turn_detection_off_while_audio_is_scored_never_crashes_a_stage() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            for _ in range(6):  # five crashes within a minute used to quarantine the slot for good
                async with RealtimeClient.connect(server) as c:
                    await c.until("session.created")
                    await c.append_audio(tone(300, 2.0), chunk_bytes=9600)
                    await c.send("session.update", session={"turn_detection": None})
                    await c.until("session.updated")
                    # The session is still usable: a manual commit and a text turn work.
                    await c.send("input_audio_buffer.commit")
                    await c.until("input_audio_buffer.committed")
                    done = await c.say_text("still here")
                    assert done["response"]["status"] == "completed"
            assert await eventually(lambda: _all_idle(server))
            assert _restarts((await http_get(server, "/metrics"))[1]) == 0

    run(scenario())


# 2 ---------------------------------------------------------------------------


def test_slow_engine_call_at_session_end_does_not_take_the_slot_out_of_service() -> None:
    block_s = 3.0

    async def scenario() -> None:
        async with live_server(pool_size=1, drain_timeout_s=0.3) as server:
            async with RealtimeClient.connect(server) as a:
                await a.until("session.created")
                # An engine call that blocks its thread per token and never checks for cancellation.
                await a.ask(f"[[block {block_s * 1000:.0f}]] hi")
                await a.until("response.created")
            started = time.monotonic()
            async with RealtimeClient.connect(server) as b:
                await b.until("session.created")
                assert time.monotonic() - started < block_s / 2, "served long before the stuck call ends"
                done = await b.say_text("next client")
                assert done["response"]["status"] == "completed"
            states = await _pool_states(server)
            assert [states[s] for s in ("quarantined", "crashed", "resting")] == [0, 0, 0], states

    run(scenario())


def test_slot_quarantined_for_a_late_drain_returns_to_service_when_its_stuck_work_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Work in flight is cancelled at a session's end, so only a stage held up by
    # something it cannot cancel makes a drain late: here, once, the STT stage.
    original = Transcriber._handle
    held = threading.Event()

    async def slow_handle(self, item):  # type: ignore[no-untyped-def]
        if isinstance(item, SessionEnd) and not held.is_set():
            held.set()
            await asyncio.sleep(1.2)
        await original(self, item)

    monkeypatch.setattr(Transcriber, "_handle", slow_handle)

    async def scenario() -> None:
        async with live_server(pool_size=1, drain_timeout_s=0.2) as server:
            async with RealtimeClient.connect(server) as a:
                await a.until("session.created")

            async def quarantined() -> bool:
                return (await _pool_states(server))["quarantined"] == 1

            assert await eventually(quarantined, 2.0)
            pool = json.loads((await http_get(server, "/v1/pool"))[1])
            assert "drain" in pool["slots"][0]["quarantine_reason"]
            # The held-up work ends; the slot comes back and serves.
            assert await eventually(lambda: _all_idle(server), 5.0)
            async with RealtimeClient.connect(server) as b:
                done = await b.say_text("back")
                assert done["response"]["status"] == "completed"

    run(scenario())


# 3 ---------------------------------------------------------------------------


def test_finished_response_is_delivered_whole_when_a_newer_one_starts_before_it_was_read() -> None:
    words = " ".join(f"w{i}" for i in range(150))

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            # A client that stops reading, with a small receive buffer: the answer waits in the server.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            async with RealtimeClient.connect(server, max_queue=1, sock=sock) as c:
                await c.send(
                    "session.update",
                    session={"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcm", "rate": 48000}}}},
                )
                await c.ask(words)

                async def first_finished_on_the_server() -> bool:
                    metrics = (await http_get(server, "/metrics"))[1]
                    return 's2s_turns_total{status="completed"} 1' in metrics

                # The first response completes on the server while its tail still waits to be read…
                assert await eventually(first_finished_on_the_server, 20.0)
                # …and the next one starts before the client has read it.
                await c.send("response.create")
                await c.until("response.done")
                await c.until("response.done")
                first = c.of_type("response.created")[0]["response"]["id"]
                done = next(e for e in c.events if e["type"] == "response.done" and e["response"]["id"] == first)
                assert done["response"]["status"] == "completed"
                transcript = "".join(
                    e["delta"]
                    for e in c.events
                    if e["type"] == "response.output_audio_transcript.delta" and e["response_id"] == first
                )
                assert transcript == f"You said: {words}."
                assert any(e["type"] == "response.output_item.done" and e["response_id"] == first for e in c.events)

    run(scenario(), timeout=90)


# 4 ---------------------------------------------------------------------------


def test_failed_response_sends_nothing_after_its_response_done_and_its_item_is_closed() -> None:
    async def scenario() -> None:
        async with live_server(fake_llm_token_delay_ms=20) as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("one two three four five six [[tts-fail]] seven eight nine ten eleven twelve")
                done = await c.until("response.done")
                assert done["response"]["status"] == "failed"
                rid = done["response"]["id"]
                # Whatever was still in flight for it never arrives.
                await c.say_text("next")
                after = c.events[c.events.index(done) + 1 :]
                assert not [e for e in after if e.get("response_id") == rid]
                assert not [
                    e
                    for e in after
                    if e["type"] == "conversation.item.added"
                    and e["item"]["role"] == "assistant"
                    and e["item"]["id"] in {o["id"] for o in done["response"]["output"]}
                ]
                for item in done["response"]["output"]:
                    assert item["status"] == "incomplete"
                # Everything it opened was closed before its response.done.
                mine = [e["type"] for e in c.events[: c.events.index(done)] if e.get("response_id") == rid]
                assert mine.count("response.output_item.added") == mine.count("response.output_item.done")
                assert mine.count("response.content_part.added") == mine.count("response.content_part.done")

    run(scenario())


# 5 ---------------------------------------------------------------------------


def test_truncation_survives_the_cancel_that_follows_it() -> None:
    async def scenario() -> None:
        async with live_server(fake_llm_token_delay_ms=60) as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")
                first = await c.until("response.output_audio.delta")
                await c.until("response.output_audio_transcript.delta")
                item_id = first["item_id"]
                await c.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=120)
                truncated = await c.until("conversation.item.truncated")
                assert truncated["audio_end_ms"] == 120
                await c.send("response.cancel")
                done = await c.until("response.done")
                assert done["response"]["status"] == "cancelled"
                await c.send("conversation.item.retrieve", item_id=item_id)
                item = (await c.until("conversation.item.retrieved"))["item"]
                assert item["content"][0]["transcript"] == "You"
                assert item["status"] == "incomplete"

    run(scenario())


# 6 ---------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_events_are_snapshots_items_arrive_in_progress_and_empty() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"type": "realtime", "tools": [TOOL]})
                await c.ask("call get_weather for Paris please")
                await c.until("response.done")
                added = [e for e in c.events if e["type"] in ("response.output_item.added", "conversation.item.added")]
                calls = [e for e in added if e["item"]["type"] == "function_call"]
                assert len(calls) == 2
                for e in calls:
                    assert e["item"]["status"] == "in_progress" and e["item"]["arguments"] == ""
                done = next(e for e in c.events if e["type"] == "response.output_item.done")
                assert done["item"]["status"] == "completed" and json.loads(done["item"]["arguments"])
                # A spoken answer's item is announced empty, before any transcript exists.
                await c.say_text("hello there")
                messages = [
                    e
                    for e in c.events
                    if e["type"] in ("response.output_item.added", "conversation.item.added")
                    and e["item"]["type"] == "message"
                    and e["item"]["role"] == "assistant"
                ]
                assert messages
                for e in messages:
                    assert e["item"]["status"] == "in_progress" and e["item"]["content"] == []
                part = next(e for e in c.events if e["type"] == "response.content_part.added")
                assert part["part"] == {"type": "audio", "transcript": ""}

    run(scenario())


# 7 ---------------------------------------------------------------------------


def test_discarded_speculations_never_pile_up_engine_calls() -> None:
    async def scenario() -> None:
        async with live_server(fake_stt_delay_ms=1000, speculate_after_ms=60, stage_workers=1) as server:
            assert server.stack is not None
            calls: list[float] = []
            original = server.stack.stt.transcribe

            def counted(audio, **kw):  # type: ignore[no-untyped-def]
                calls.append(len(audio))
                return original(audio, **kw)

            server.stack.stt.transcribe = counted  # type: ignore[method-assign]
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                # Five short pauses inside one turn, streamed in real time.
                pcm = b"".join(tone(330, 0.3) + silence(0.15) for _ in range(5)) + silence(0.8)
                await c.append_audio(pcm, chunk_bytes=960, pace_s=0.02)
                done = await c.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
            # Each pause used to start a call that ran to its end: five guesses and the final one.
            assert len(calls) <= 3, calls

    run(scenario(), timeout=60)


# 8 ---------------------------------------------------------------------------


def test_cancelling_an_engine_call_as_it_completes_is_never_swallowed() -> None:
    """The call's result is already on its way to the loop when its caller is cancelled: the caller is cancelled."""

    async def scenario() -> None:
        pool = StagePool("stt", 2, Metrics(dict, lambda: 0), 5.0)
        submitted: list[concurrent.futures.Future[Any]] = []
        submit = pool.executor.submit

        def recorded(*args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
            submitted.append(submit(*args, **kwargs))
            return submitted[-1]

        pool.executor.submit = recorded  # type: ignore[method-assign]
        outcomes = []
        for _ in range(20):
            task = asyncio.create_task(pool.call(lambda: 1))
            await asyncio.sleep(0)  # the call is submitted, and its caller waits for the result
            handed_over = threading.Event()
            # Called after the caller's own callback, which hands the result to the loop.
            submitted[-1].add_done_callback(lambda _, handed_over=handed_over: handed_over.set())
            assert handed_over.wait(5)  # the loop stands still meanwhile: the result waits in its queue
            task.cancel()
            await asyncio.wait((task,))
            outcomes.append("cancelled" if task.cancelled() else f"returned {task.result()!r}")
        pool.shutdown()
        assert outcomes == ["cancelled"] * 20

    run(scenario())


# 9 ---------------------------------------------------------------------------


def test_handshake_with_a_repeated_header_is_served_and_leaks_no_slot() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            url = f"ws://127.0.0.1:{server.port}/v1/realtime"
            headers = [("OpenAI-Beta", "realtime=v1"), ("OpenAI-Beta", "realtime=v1")]
            for _ in range(3):
                async with connect(url, additional_headers=headers) as ws:
                    created = json.loads(await ws.recv())
                    assert created["type"] == "session.created"
                    assert "modalities" in created["session"]  # the beta shape
            assert await eventually(lambda: _all_idle(server))

    run(scenario())


def test_smallest_queue_size_serves_sessions_and_leaks_no_slot() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, queue_size=1) as server:
            for _ in range(3):
                async with RealtimeClient.connect(server) as c:
                    await c.until("conversation.created")
                    done = await c.say_text("tiny queues")
                    assert done["response"]["status"] == "completed"
            assert await eventually(lambda: _all_idle(server))

    run(scenario())


# 11 --------------------------------------------------------------------------


def test_no_transcription_events_unless_the_session_asks_but_the_answer_still_hears() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.append_audio(silence(0.2) + tone(440, 0.5) + silence(0.8))
                done = await c.until("response.done")
                assert not [e for e in c.events if "input_audio_transcription" in e["type"]]
                committed = next(e for e in c.events if e["type"] == "conversation.item.added")
                assert committed["item"]["content"] == [{"type": "input_audio", "transcript": None}]
                answer = done["response"]["output"][0]["content"][0]["transcript"]
                assert answer.startswith("You said: heard ") and " crc " in answer

    run(scenario())


def _scanned(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the characters the clause splitter's pattern ``name`` is handed to search (in the one item)."""
    scanned = [0]
    pattern = getattr(clauses, name)

    class Counting:
        def finditer(self, text: str, pos: int = 0):  # type: ignore[no-untyped-def]
            scanned[0] += len(text) - pos
            return pattern.finditer(text, pos)

    monkeypatch.setattr(clauses, name, Counting())
    return scanned


def test_clause_splitter_scans_each_character_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    scanned = _scanned(monkeypatch, "_CLAUSE_END")
    splitter = clauses.ClauseSplitter()
    tokens = [f" word{i}" for i in range(4096)]
    out = [c for t in tokens for c in splitter.feed(t)]
    out.append(splitter.flush())
    assert " ".join(out).split() == "".join(tokens).split()
    assert scanned[0] < 10 * len("".join(tokens))


def test_a_run_without_a_space_is_cut_into_pieces_and_never_searched_from_each_of_its_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A URL, a long number or a run of letters an answer spells out has no place to pause: searched for words
    again from each of its characters at every token, 8,000 characters fed 4 at a time took minutes of the event
    loop (the session fuzzer's seed 504120: every session stalled for a minute)."""
    started = time.process_time()
    assert list(clauses._WORD.finditer("x" * 20_000)) == []
    assert time.process_time() - started < 0.5  # one search of the run, not 20,000
    scanned = _scanned(monkeypatch, "_WORD")
    splitter = clauses.ClauseSplitter()
    tokens = ["Here it is: ", *["abcd"] * 8000, " and that is all."]
    out = [c for t in tokens for c in splitter.feed(t)]
    out.append(splitter.flush())
    assert "".join(out).replace(" ", "") == "".join(tokens).replace(" ", "")  # nothing lost
    assert max(len(piece) for piece in out) <= clauses.MAX_PIECE_CHARS
    assert scanned[0] < 2 * clauses.MAX_PIECE_CHARS * len(tokens)


def test_an_answer_that_spells_a_long_run_without_a_space_does_not_hold_up_another_session() -> None:
    def user_text(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as long, RealtimeClient.connect(server) as other:
                # The client runs on the server's event loop: what stalls the loop shows in the time taken.
                asked = time.monotonic()
                await long.send("conversation.item.create", item=user_text("z" * 30_000 + " and so on"))
                await long.send("response.create")
                await asyncio.sleep(0.2)
                await other.send("conversation.item.create", item=user_text("hello there"))
                await other.send("response.create")
                done = await other.until("response.done", timeout=3.0)
                assert done["response"]["status"] == "completed"
                assert time.monotonic() - asked < 3.0
                assert (await long.until("response.done", timeout=10.0))["response"]["status"] == "completed"

    run(scenario())


# the pool never shrinks -------------------------------------------------------


def test_the_pool_never_shrinks_under_the_bad_timings() -> None:
    async def misbehave(server, n: int) -> None:  # type: ignore[no-untyped-def]
        async with RealtimeClient.connect(server) as c:
            await c.until("session.created")
            kind = n % 4
            if kind == 0:
                await c.append_audio(tone(300, 1.0), chunk_bytes=9600)
                await c.send("session.update", session={"turn_detection": None})
            elif kind == 1:
                await c.ask("[[block 300]] slow")
                await c.until("response.created")
            elif kind == 2:
                await c.ask("a b c d [[tts-fail]] e f")
                await c.send("response.cancel")
            else:
                await c.ask("w " * 50)
                await c.until("response.output_audio.delta")
                await c.send("response.create")

    async def scenario() -> None:
        async with live_server(pool_size=3, drain_timeout_s=0.5) as server:
            for round_ in range(4):
                await asyncio.gather(*(misbehave(server, 3 * round_ + i) for i in range(3)))
            assert await eventually(lambda: _all_idle(server), 5.0)
            assert _restarts((await http_get(server, "/metrics"))[1]) == 0
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("served")
                assert done["response"]["status"] == "completed"

    run(scenario(), timeout=90)


def test_beta_and_ga_clients_may_send_null_for_unset_fields() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.add_user_text("hi")
                await c.send(
                    "response.create",
                    response={
                        "instructions": None,
                        "tools": None,
                        "metadata": None,
                        "voice": None,
                        "conversation": None,
                    },
                )
                done = await c.until("response.done")
                assert done["response"]["status"] == "completed"
                await c.send(
                    "session.update",
                    session={"instructions": None, "temperature": None, "audio": {"output": {"voice": None}}},
                )
                await c.until("session.updated")
                assert not c.of_type("error")

    run(scenario())
