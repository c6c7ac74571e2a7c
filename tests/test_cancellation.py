"""A cancelled response stops costing the engines: its LLM sees its stop at once, and nothing more is made for it.

Dropping a cancelled response's late output keeps the client's events
right, but the promise is stronger: the answer's LLM stream ends within a
bound of the cancel, no token and no speech is made for it after the
client has its ``response.done``, and the next answer does not wait for
the cancelled one to run on. The engines are the server's own, watched
(:class:`EngineLog`); on the fake stack, and on the default stack's real
models.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import RealtimeClient, live_server, run

from s2s_rt import Config, Server
from s2s_rt.engines.base import Float32Array, LLMRequest, Stack, StopCheck
from s2s_rt.engines.fake import load_fake_stack
from s2s_rt.models import PreparedModels

#: Words the fake LLM echoes one every 30 ms: an answer of about 3 s, still running when it is cancelled.
LONG_ANSWER = "[[slow 30]] " + " ".join(f"w{i}" for i in range(100))


class EngineLog:
    """When the stack's LLM and TTS made each piece, and when each LLM stream ended (``perf_counter``).

    It wraps the engines' own methods on the instances the server uses, so
    every answer and every synthesis goes through it; the pieces pass
    unchanged.
    """

    def __init__(self, stack: Stack) -> None:
        self.tokens: list[float] = []
        self.speech: list[float] = []
        self.llm_ended: list[float] = []
        self._lock = threading.Lock()
        llm, tts = stack.llm, stack.tts
        stream, synthesize = llm.stream, tts.synthesize

        def watched_stream(request: LLMRequest, *, should_stop: StopCheck, **kwargs: Any) -> Iterator[str]:
            try:
                for piece in stream(request, should_stop=should_stop, **kwargs):
                    self._note(self.tokens)
                    yield piece
            finally:
                self._note(self.llm_ended)

        def watched_synthesize(text: str, **kwargs: Any) -> Iterator[Float32Array]:
            for audio in synthesize(text, **kwargs):
                self._note(self.speech)
                yield audio

        llm.stream = watched_stream  # type: ignore[method-assign]
        tts.synthesize = watched_synthesize  # type: ignore[method-assign]

    def _note(self, times: list[float]) -> None:
        with self._lock:  # engine threads append while the test reads
            times.append(time.perf_counter())

    def made_after(self, t: float) -> tuple[int, int]:
        """Tokens and pieces of speech made after ``t``."""
        with self._lock:
            return sum(x > t for x in self.tokens), sum(x > t for x in self.speech)

    def ran_on(self, t: float) -> float:
        """How long after ``t`` the first LLM stream ended (infinite while it runs)."""
        with self._lock:
            return self.llm_ended[0] - t if self.llm_ended else float("inf")


async def cancel_mid_answer(c: RealtimeClient, engines: EngineLog) -> tuple[float, float]:
    """Cancel the answer being spoken; returns when the cancel was sent and when ``response.done`` came."""
    await c.until("response.output_audio.delta", timeout=120)
    assert not engines.llm_ended, "the answer was over before it was cancelled: make it longer"
    cancelled = time.perf_counter()
    await c.send("response.cancel")
    done = await c.until("response.done")
    assert done["response"]["status"] == "cancelled"
    return cancelled, time.perf_counter()


def test_a_cancelled_answer_stops_its_llm_at_once_and_nothing_more_is_made_for_it() -> None:
    stack = load_fake_stack()
    engines = EngineLog(stack)

    async def scenario() -> None:
        async with live_server(stack, pool_size=1) as server, RealtimeClient.connect(server) as c:
            await c.ask(LONG_ANSWER)
            cancelled, heard = await cancel_mid_answer(c, engines)
            await asyncio.sleep(0.5)  # about 15 more words of the answer, and their speech, if nothing stopped it
            # A token (30 ms of the fake model) and a word of speech may be under way when the stop comes.
            tokens, speech = engines.made_after(heard)
            assert tokens <= 1 and speech <= 1, f"made after response.done: {tokens} tokens, {speech} speech"
            ran_on = engines.ran_on(cancelled)
            assert ran_on < 0.3, f"the LLM stream ran {ran_on:.2f} s past the cancel"

    run(scenario())


def test_the_answer_after_a_cancel_does_not_wait_for_the_cancelled_one() -> None:
    stack = load_fake_stack()
    engines = EngineLog(stack)

    async def scenario() -> None:
        async with live_server(stack, pool_size=1) as server, RealtimeClient.connect(server) as c:
            await c.ask(LONG_ANSWER)
            await cancel_mid_answer(c, engines)
            asked = time.perf_counter()
            await c.ask("next")
            await c.until("response.output_audio.delta")
            waited = time.perf_counter() - asked
            # The cancelled answer had about 3 s to run: its first words would wait for all of them.
            assert waited < 0.5, f"the next answer's first audio came {waited:.2f} s after it was asked"
            done = await c.until("response.done")
            assert done["response"]["status"] == "completed"

    run(scenario())


@pytest.mark.slow
def test_a_cancelled_answer_stops_the_real_models_at_once(default_models: PreparedModels) -> None:
    async def scenario() -> None:
        async with (
            Server(Config(port=0, stack="default", pool_size=1)) as server,
            RealtimeClient.connect(server) as c,
        ):
            assert server.stack is not None
            engines = EngineLog(server.stack)
            await c.send(
                "session.update",
                session={"instructions": "You are a storyteller. Tell long, detailed stories of many sentences."},
            )
            await c.ask("Tell me a long story about a dragon and a knight.")
            cancelled, heard = await cancel_mid_answer(c, engines)
            # A second of the real models on two cores is a dozen tokens and a sentence of speech or more.
            await asyncio.sleep(1.0)
            # The stop is seen between two tokens, and between two sentences of speech: one may be under way.
            tokens, speech = engines.made_after(heard)
            assert tokens <= 1 and speech <= 1, f"made after response.done: {tokens} tokens, {speech} speech"
            ran_on = engines.ran_on(cancelled)
            assert ran_on < 1.0, f"the LLM stream ran {ran_on:.2f} s past the cancel"

    run(scenario(), timeout=180)
