"""Answering ahead: an answer begun in the closing silence is used when the turn ends, and never seen otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import RealtimeClient, run, silence, tone

from s2s_rt.config import Config
from s2s_rt.server import Server

PACE_S = 0.02  # 20 ms appends at real time: the speculation runs in the silence, as with a microphone


def _config(**overrides: Any) -> Config:
    base: dict[str, Any] = dict(
        port=0, stack="fake", pool_size=1, drain_timeout_s=2.0, grace_period_s=2.0, speculate_after_ms=100
    )
    return Config(**(base | overrides))


def _metric(server: Server, line: str) -> float:
    for row in server.metrics.render().splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return 0.0


async def _talk(c: RealtimeClient, *parts: bytes) -> None:
    for part in parts:
        await c.append_audio(part, pace_s=PACE_S)


def _said(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")


def test_an_answer_begun_in_the_silence_is_the_turns_answer() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], float, float]:
        async with Server(_config(fake_llm_token_delay_ms=20)) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                sender = asyncio.ensure_future(_talk(c, tone(300, 0.6), silence(1.5)))
                await c.until("response.done", timeout=15)
                await sender
                used = _metric(server, 's2s_speculative_responses_total{outcome="used"}')
                dropped = _metric(server, 's2s_speculative_responses_total{outcome="discarded"}')
                return c.events, used, dropped

    events, used, dropped = run(scenario())
    heard = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert _said(events) == f"You said: {heard['transcript']}."
    assert [e["type"] for e in events].count("response.created") == 1
    assert (used, dropped) == (1, 0)
    # Nothing of it came before the turn ended.
    types = [e["type"] for e in events]
    assert types.index("input_audio_buffer.speech_stopped") < types.index("response.created")


def test_an_answer_begun_before_the_user_went_on_never_reaches_the_client() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], float, float]:
        # A 300 ms pause: the speculation starts at 100 ms and the answer with it; then speech returns.
        async with Server(_config(fake_llm_token_delay_ms=20)) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                sender = asyncio.ensure_future(_talk(c, tone(300, 0.6), silence(0.3), tone(300, 0.6), silence(1.5)))
                await c.until("response.done", timeout=15)
                await sender
                await asyncio.sleep(0.3)
                while True:  # anything still coming would be of the dropped answer
                    try:
                        await c.recv(timeout=0.3)
                    except TimeoutError:
                        break
                used = _metric(server, 's2s_speculative_responses_total{outcome="used"}')
                dropped = _metric(server, 's2s_speculative_responses_total{outcome="discarded"}')
                return c.events, used, dropped

    events, used, dropped = run(scenario())
    heard = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(heard) == 1 and heard[0]["transcript"].startswith("heard 1")  # the whole turn: over a second
    assert [e["type"] for e in events].count("response.created") == 1
    assert [e["type"] for e in events].count("response.output_audio.delta") > 0
    assert _said(events) == f"You said: {heard[0]['transcript']}."
    assert dropped >= 1 and used == 1


def test_an_answer_begun_before_the_instructions_changed_is_not_used() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], float, float]:
        async with Server(_config(fake_llm_token_delay_ms=20)) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await _talk(c, tone(300, 0.6), silence(0.3))  # the answer is begun 100 ms into this silence
                await c.send("session.update", session={"instructions": "Answer in one word."})
                await _talk(c, silence(1.2))
                await c.until("response.done", timeout=15)
                used = _metric(server, 's2s_speculative_responses_total{outcome="used"}')
                unused = _metric(server, 's2s_speculative_responses_total{outcome="unused"}')
                return c.events, used, unused

    events, used, unused = run(scenario())
    heard = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert (used, unused) == (0, 1)  # it asked the model something else: answered afresh
    assert _said(events) == f"You said: {heard['transcript']}."


class _Synthesised:
    """The fake voice, keeping what it was asked to say."""

    def __init__(self, tts: Any) -> None:
        self._tts = tts
        self.texts: list[str] = []
        self.sample_rate = tts.sample_rate
        self.voices = tts.voices

    def synthesize(self, text: str, **kw: Any) -> Any:
        self.texts.append(text)
        return self._tts.synthesize(text, **kw)


class _FirstCallFails(_Synthesised):
    """The fake voice, failing its first synthesis: the first clause spoken ahead of the turn's end."""

    def synthesize(self, text: str, **kw: Any) -> Any:
        speech = super().synthesize(text, **kw)
        if len(self.texts) == 1:
            raise RuntimeError("the first clause's speech failed")
        return speech


def test_a_first_clause_whose_speech_fails_ahead_is_spoken_again_and_the_session_goes_on() -> None:
    """A failure of the speech made ahead used to raise in the slot's task group: every stage restarted, 1011."""
    import dataclasses

    from s2s_rt.engines.fake import EchoLLM, load_fake_stack

    class Opening(EchoLLM):
        """Answers with a short sentence first: a first clause cut, and spoken, before the turn ends (the fake
        transcript itself, "heard 900 ms crc …", has no place where a speaker would pause)."""

        def stream(self, request: Any, **options: Any) -> Any:
            yield "Sure, I can tell you. "
            yield from super().stream(request, **options)

    fake = load_fake_stack()
    tts = _FirstCallFails(fake.tts)
    stack = dataclasses.replace(fake, tts=tts, llm=Opening())

    async def scenario() -> None:
        async with Server(_config(), stack=stack) as server:
            async with RealtimeClient.connect(server) as c:
                await _talk(c, silence(0.3), tone(440, 0.6), silence(0.8))
                done = await c.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
                assert _said(c.events).startswith("Sure, I can tell you. You said:")
                assert _metric(server, 's2s_speculative_responses_total{outcome="used"}') == 1
                assert (await c.say_text("still here"))["response"]["status"] == "completed"
        assert len(tts.texts) >= 2  # the failed clause was synthesised again

    run(scenario())


def test_the_answer_begun_ahead_speaks_its_first_clause_alone_and_the_waterfall_keeps_its_order() -> None:
    """The answer begun ahead makes the speech of its first clause only; the rest is the response's. Once the
    response had taken that speech, the answer ahead went on cutting and speaking the next clause with a splitter
    of its own, and reported that clause's end as the first clause's: after its first audio was sent."""
    import dataclasses
    import time

    from s2s_rt.engines.fake import EchoLLM, load_fake_stack

    class Pausing(EchoLLM):
        """A first sentence at once, then a second after the turn has ended (the response has adopted it)."""

        def stream(self, request: Any, *, should_stop: Any, usage: Any) -> Any:
            yield "Sure, I can tell you. "
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not should_stop():
                time.sleep(0.01)
            yield "It is a fine day. "
            yield from super().stream(request, should_stop=should_stop, usage=usage)

    fake = load_fake_stack()
    tts = _Synthesised(fake.tts)
    stack = dataclasses.replace(fake, tts=tts, llm=Pausing())

    async def scenario() -> tuple[list[dict[str, Any]], dict[str, float]]:
        async with Server(_config(), stack=stack) as server:
            async with RealtimeClient.connect(server) as c:
                await _talk(c, silence(0.3), tone(440, 0.6), silence(0.8))
                done = await c.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
                assert _metric(server, 's2s_speculative_responses_total{outcome="used"}') == 1
                steps = {
                    step: _metric(server, f's2s_turn_waterfall_seconds_sum{{step="{step}"}}')
                    for step in ("first_clause", "synthesised", "audio_sent")
                }
                return c.events, steps

    events, steps = run(scenario())
    assert _said(events).startswith("Sure, I can tell you. It is a fine day. You said:")
    assert tts.texts[:2] == ["Sure, I can tell you.", "It is a fine day."]
    assert len(tts.texts) == len(set(tts.texts)), tts.texts  # each clause's speech made once
    assert 0 < steps["first_clause"] <= steps["synthesised"] <= steps["audio_sent"], steps


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_the_request_built_ahead_is_the_one_the_turns_response_builds(monkeypatch: Any) -> None:
    """The answer begun in the closing silence asks exactly what the turn's response then asks, with every
    setting that shapes the request in play (instructions, functions and their choice, temperature, token limit,
    voice, speed, the language heard): the response adopts it only if the two are equal."""
    from s2s_rt.engines.base import LLMRequest
    from s2s_rt.pipeline.anticipation import Anticipation

    compared: list[tuple[LLMRequest, LLMRequest]] = []
    answers = Anticipation.answers

    def recorded(self: Anticipation, request: LLMRequest, speed: float, voice: str) -> bool:
        compared.append((self.request, request))
        return answers(self, request, speed, voice)

    monkeypatch.setattr(Anticipation, "answers", recorded)
    settings = {
        "instructions": "You are terse. Answer in one sentence.",
        "tools": [WEATHER],
        "tool_choice": "auto",
        "temperature": 0.7,
        "max_response_output_tokens": 200,
        "voice": "tone-low",
        "speed": 1.2,
    }

    async def scenario() -> tuple[list[dict[str, Any]], float, float]:
        async with Server(_config()) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session=settings)
                await c.until("session.updated")
                await _talk(c, silence(0.3), tone(440, 0.6), silence(0.8))
                done = await c.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
                used = _metric(server, 's2s_speculative_responses_total{outcome="used"}')
                unused = _metric(server, 's2s_speculative_responses_total{outcome="unused"}')
                return c.events, used, unused

    events, used, unused = run(scenario())
    assert len(compared) == 1
    ahead, asked = compared[0]
    assert asked == ahead
    # Every setting reached the request compared.
    assert asked.tools and asked.tools[0]["name"] == "get_weather" and not asked.require_tool
    assert (asked.temperature, asked.max_tokens) == (0.7, 200)
    assert settings["instructions"] in asked.messages[0].content
    heard = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert asked.messages[-1].role == "user" and heard["transcript"] in asked.messages[-1].content
    assert (used, unused) == (1, 0)
