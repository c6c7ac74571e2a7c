"""Transcription sessions (live captions from the same pool) and streamed transcription deltas."""

from __future__ import annotations

from typing import Any

from conftest import RealtimeClient, live_server, run, silence, tone

from s2s_rt.config import Config
from s2s_rt.engines.base import Transcript
from s2s_rt.engines.fake import load_fake_stack
from s2s_rt.server import Server


def test_intent_transcription_session_streams_deltas_and_completions_and_never_answers() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, path="/v1/realtime?intent=transcription") as c:
                created = await c.until("session.created")
                assert created["session"]["type"] == "transcription"
                for pitch in (300, 500):
                    await c.append_audio(silence(0.2) + tone(pitch, 0.5) + silence(0.8))
                    done = await c.until("conversation.item.input_audio_transcription.completed")
                    deltas = [
                        e["delta"]
                        for e in c.of_type("conversation.item.input_audio_transcription.delta")
                        if e["item_id"] == done["item_id"]
                    ]
                    assert len(deltas) > 1 and "".join(deltas) == done["transcript"]
                await c.send("response.create", event_id="answer-me")
                err = await c.until("error")
                assert err["error"]["event_id"] == "answer-me"
                assert not c.of_type("response.created")

    run(scenario())


def test_ga_session_update_to_transcription_and_beta_transcription_session_update() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as ga:
                await ga.send(
                    "session.update",
                    session={"type": "transcription", "audio": {"input": {"transcription": {"model": "whisper-1"}}}},
                )
                updated = await ga.until("session.updated")
                assert updated["session"]["type"] == "transcription"
                await ga.append_audio(silence(0.2) + tone(440, 0.5) + silence(0.8))
                await ga.until("conversation.item.input_audio_transcription.completed")
                assert not ga.of_type("response.created")
            async with RealtimeClient.connect(server, beta=True) as beta:
                await beta.until("session.created")
                await beta.send(
                    "transcription_session.update",
                    session={"input_audio_transcription": {"model": "whisper-1", "language": "en"}},
                )
                updated = await beta.until("transcription_session.updated")
                assert updated["session"]["input_audio_transcription"]["language"] == "en"
                await beta.append_audio(silence(0.2) + tone(440, 0.5) + silence(0.8))
                await beta.until("conversation.item.input_audio_transcription.completed")
                assert not beta.of_type("response.created")

    run(scenario())


def test_a_conversation_streams_transcription_deltas_before_the_completion_when_asked() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.append_audio(silence(0.2) + tone(350, 0.5) + silence(0.8))
                done = await c.until("conversation.item.input_audio_transcription.completed")
                deltas = c.of_type("conversation.item.input_audio_transcription.delta")
                assert "".join(e["delta"] for e in deltas) == done["transcript"]
                assert (await c.until("response.done"))["response"]["status"] == "completed"

    run(scenario())


class CountingSTT:
    """Says one word per 250 ms of audio, so a longer pass repeats a shorter one's words and adds to them."""

    WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen".split()

    def transcribe(self, audio: Any, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        return Transcript(" ".join(self.WORDS[: max(1, len(audio) // 4000)]), "en")


def test_a_transcription_session_streams_words_while_the_user_is_still_speaking() -> None:
    stack = load_fake_stack()
    stack.stt = CountingSTT()  # type: ignore[assignment]

    async def scenario() -> list[dict[str, Any]]:
        config = Config(port=0, stack="fake", pool_size=1, drain_timeout_s=2.0, grace_period_s=2.0)
        async with Server(config, stack=stack) as server:
            async with RealtimeClient.connect(server, path="/v1/realtime?intent=transcription") as c:
                await c.until("session.created")
                await c.append_audio(silence(0.2) + tone(300, 3.0) + silence(1.0), pace_s=0.02)
                await c.until("conversation.item.input_audio_transcription.completed")
                return c.events

    events = run(scenario())
    types = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    # Words came while the user spoke (before the turn ended), and all deltas add up to the final transcript.
    assert types.index("conversation.item.input_audio_transcription.delta") < types.index(
        "input_audio_buffer.speech_stopped"
    )
    assert "".join(deltas) == done["transcript"] and len(deltas) == len(done["transcript"].split())
