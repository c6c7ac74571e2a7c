"""semantic_vad: a turn ends sooner when the words so far sound finished, and waits when they do not.

On the fake stack with two stand-ins: an STT that hears a tone's pitch as
words (a finished question at one pitch, an unfinished sentence at another)
and a judge that finds words ending a sentence finished. The real VAD,
Whisper and LLM judging are in ``test_real_pipeline.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from conftest import RealtimeClient, run, silence, tone

from s2s_rt.config import Config
from s2s_rt.engines.base import PIPELINE_RATE, ChatMessage, Float32Array, Transcript
from s2s_rt.engines.fake import ChecksumSTT, EchoLLM, load_fake_stack
from s2s_rt.protocol.config import EAGERNESS_MAX_MS, TurnDetection
from s2s_rt.server import Server
from s2s_rt.turn import SemanticTurnEnd, TurnDetector

# A 20 ms append at real time: judgements arrive in the silence, as they would from a microphone.
PACE_S = 0.02
FINISHED, UNFINISHED = "What is the capital of France?", "I would like to book a table for"
#: What the test's STT hears in a tone of each pitch: the same length of speech, different words.
WORDS_BY_PITCH = {300: FINISHED, 500: UNFINISHED}


class WordsSTT(ChecksumSTT):
    """Hears a tone as the words of its pitch (:data:`WORDS_BY_PITCH`), whatever its length."""

    def transcribe(self, audio: Float32Array, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        spectrum = np.abs(np.fft.rfft(audio))
        pitch = float(np.argmax(spectrum)) * PIPELINE_RATE / len(audio)
        heard = min(WORDS_BY_PITCH, key=lambda f: abs(f - pitch))
        return Transcript(WORDS_BY_PITCH[heard], language or "en")


class JudgingLLM(EchoLLM):
    """The fake LLM, recording what it judged: words that end a sentence sound finished, others do not."""

    def __init__(self) -> None:
        super().__init__()
        self.judged: list[list[ChatMessage]] = []

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float:
        self.judged.append(list(messages))
        return 0.95 if messages[-1].content.rstrip().endswith((".", "?", "!")) else 1e-6


async def _speech_stopped(c: RealtimeClient, speech: bytes, silence_s: float) -> dict[str, Any] | None:
    """Speak, then stay silent in real time; the speech_stopped event, if the turn ended within the silence."""
    await c.append_audio(speech, pace_s=PACE_S)
    sender = asyncio.ensure_future(c.append_audio(silence(silence_s), pace_s=PACE_S))
    try:
        while True:
            event = await c.recv(timeout=silence_s + 1.0)
            if event["type"] == "input_audio_buffer.speech_stopped":
                return event
    except TimeoutError:
        return None
    finally:
        await sender


def _server(llm: EchoLLM, **config: Any) -> Server:
    stack = load_fake_stack()
    stack.stt, stack.llm = WordsSTT(), llm
    return Server(
        Config(port=0, stack="fake", pool_size=2, drain_timeout_s=2.0, grace_period_s=2.0, **config), stack=stack
    )


def test_a_finished_question_ends_sooner_than_an_unfinished_one_with_the_same_silence() -> None:
    """Two turns alike in all but their words: 0.8 s of speech, then the same silence."""
    complete, fragment = tone(300, 0.8), tone(500, 0.8)
    llm = JudgingLLM()

    async def scenario() -> tuple[Any, Any, Any]:
        async with _server(llm) as server:
            turn = {"type": "semantic_vad", "eagerness": "high", "create_response": False}
            async with RealtimeClient.connect(server) as a:
                await a.send("session.update", session={"turn_detection": turn})
                await a.until("session.updated")
                done = await _speech_stopped(a, complete, 1.2)
            async with RealtimeClient.connect(server) as b:
                await b.send("session.update", session={"turn_detection": turn})
                await b.until("session.updated")
                waiting = await _speech_stopped(b, fragment, 1.2)
                # It does end, at the eagerness's longest wait (2 s for high).
                later = await _speech_stopped(b, b"", 1.5)
            return done, waiting, later

    done, waiting, later = run(scenario())
    assert done is not None and 800 + 200 - 40 <= done["audio_end_ms"] <= 800 + 200 + 40
    assert waiting is None
    assert later is not None and later["audio_end_ms"] == pytest.approx(800 + EAGERNESS_MAX_MS["high"], abs=40)
    judged = {m[-1].content for m in llm.judged}
    assert judged == {FINISHED, UNFINISHED}, judged  # the words were judged, nothing else
    assert llm.judged[0][0].role == "system" and llm.judged[0][-1].role == "user"


def test_never_before_the_configured_minimum() -> None:
    llm = JudgingLLM()

    async def scenario() -> Any:
        async with _server(llm, semantic_min_silence_ms=450) as server, RealtimeClient.connect(server) as c:
            turn = {"type": "semantic_vad", "eagerness": "high", "create_response": False}
            await c.send("session.update", session={"turn_detection": turn})
            await c.until("session.updated")
            return await _speech_stopped(c, tone(300, 0.6), 1.0)

    done = run(scenario())
    assert done is not None and 600 + 450 - 40 <= done["audio_end_ms"] <= 600 + 450 + 40


def test_server_vad_keeps_its_configured_silence() -> None:
    llm = JudgingLLM()

    async def scenario() -> Any:
        async with _server(llm) as server, RealtimeClient.connect(server) as c:
            turn = {"type": "server_vad", "silence_duration_ms": 700, "create_response": False}
            await c.send("session.update", session={"turn_detection": turn})
            await c.until("session.updated")
            return await _speech_stopped(c, tone(300, 0.6), 1.2)

    done = run(scenario())
    assert done is not None and done["audio_end_ms"] == pytest.approx(600 + 700, abs=40)
    assert not llm.judged


@pytest.mark.parametrize("eagerness", ["low", "medium", "high", "auto"])
def test_the_wait_grows_with_doubt_up_to_openais_maximum(eagerness: str) -> None:
    policy = SemanticTurnEnd(min_silence_ms=200, unknown_ms=1200)
    cap = EAGERNESS_MAX_MS[eagerness]
    waits = [policy.wait_ms(p, eagerness) for p in (0.99, 0.5, 0.02, 0.003, 0.0005, 1e-6, 0.0)]
    assert waits == sorted(waits) and waits[0] == 200 and waits[-1] == cap
    assert policy.wait_ms(None, eagerness) == min(1200, cap)
    # Eagerer settings never wait longer.
    assert policy.wait_ms(0.01, "high") <= policy.wait_ms(0.01, "medium") <= policy.wait_ms(0.01, "low")


def test_speech_that_resumes_forgets_the_judgement() -> None:
    d = TurnDetector(TurnDetection(type="semantic_vad", eagerness="high"))
    d.feed(1.0, 0, 32)
    d.finished = 0.99
    assert d.silence_needed_ms() == 200
    d.feed(1.0, 32, 64)  # the user goes on
    assert d.finished is None and d.silence_needed_ms() == 1200
