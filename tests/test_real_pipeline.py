"""The default stack end to end: real VAD, Whisper, Qwen and Piper behind a live socket.

The spoken questions are synthesised by the server's own Piper voice (no
external audio) and streamed in at real-time pace, 20 ms per append, as a
microphone would. Whisper — the server's own — checks what was said back,
and each answer is checked for its fact ("Paris") in the words that came
over the wire.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from conftest import RealtimeClient, requires, run, word_error_rate
from openai import AsyncOpenAI

from s2s_rt import Config, Server
from s2s_rt.audio import float_to_pcm16, pcm16_to_float, resample
from s2s_rt.engines.base import PIPELINE_RATE
from s2s_rt.evaluation.voices import Voice, missing_programs, say

pytestmark = pytest.mark.slow

RATE = 24_000
CHUNK = RATE // 50  # 20 ms
#: Voices whose speech is the same every run (for the semantic VAD test).
SEMANTIC_VOICES = (Voice("flite", "slt"), Voice("flite", "rms"))
INSTRUCTIONS = "You are a helpful voice assistant. Answer in one short sentence."
#: Greedy decoding, so each test hears the same answer every run.
SETTINGS = {
    "instructions": INSTRUCTIONS,
    "temperature": 0.0,
    "audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"}}},
}


@asynccontextmanager
async def real_server(pool_size: int = 2) -> AsyncIterator[Server]:
    async with Server(Config(port=0, stack="default", pool_size=pool_size)) as server:
        yield server


def speak(server: Server, text: str, key: str = "") -> bytes:
    """PCM16 at 24 kHz of the server's own voice saying ``text``, in a take Whisper hears right.

    Piper draws noise as it speaks, and Whisper base mishears a take now and
    then ("the capital of France" as "…of friends"); an answer to a misheard
    question cannot be checked for its fact. A take is kept when Whisper
    hears it within 20 % WER and hears ``key``, the word the fact depends on.
    """
    assert server.stack is not None
    tts = server.stack.tts
    for _ in range(5):
        audio = np.concatenate(list(tts.synthesize(text, voice=None, should_stop=lambda: False)))
        pcm = float_to_pcm16(resample(audio, tts.sample_rate, RATE))
        heard = transcribe(server, pcm)
        if word_error_rate(text, heard) <= 0.20 and key.lower() in heard.lower():
            return pcm
    raise AssertionError(f"no take of {text!r} in five was heard right (last: {heard!r})")


async def stream(c: RealtimeClient, pcm: bytes, trailing_silence_s: float = 1.2, silence_slower: float = 1.0) -> float:
    """Send ``pcm`` at real-time pace, then silence ``silence_slower`` times slower; returns when the last
    voiced sample was sent."""
    loop = asyncio.get_running_loop()
    at = loop.time()
    end_of_speech = 0.0
    data = pcm + bytes(int(RATE * trailing_silence_s) * 2)
    for i in range(0, len(data), CHUNK * 2):
        await c.send("input_audio_buffer.append", audio=base64.b64encode(data[i : i + CHUNK * 2]).decode())
        at += CHUNK / RATE * (1.0 if i < len(pcm) else silence_slower)
        if i < len(pcm):
            end_of_speech = loop.time()
        await asyncio.sleep(max(0.0, at - loop.time()))
    return end_of_speech


def transcribe(server: Server, pcm24k: bytes, lead_in_s: float = 0.5, context: str | None = None) -> str:
    assert server.stack is not None
    audio = resample(pcm16_to_float(pcm24k), RATE, PIPELINE_RATE)
    # A moment of silence first, as a listener would have: Whisper tends to
    # mangle a word that starts at the very first sample.
    lead_in = np.zeros(int(PIPELINE_RATE * lead_in_s), np.float32)
    return server.stack.stt.transcribe(np.concatenate([lead_in, audio]), language="en", prompt=context).text


async def ask(server: Server, c: RealtimeClient, question: str, key: str) -> tuple[str, str, bytes]:
    """Speak ``question`` (see :func:`speak`); returns what the server heard, its answer's transcript and audio."""
    send = asyncio.create_task(stream(c, speak(server, question, key)))
    heard = await c.until("conversation.item.input_audio_transcription.completed", timeout=30)
    done = await c.until("response.done", timeout=60)
    await send
    assert done["response"]["status"] == "completed", done["response"]
    rid = done["response"]["id"]
    audio = b"".join(
        base64.b64decode(e["delta"])
        for e in c.events
        if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
    )
    answer = done["response"]["output"][0]["content"][0]["transcript"]
    return heard["transcript"], answer, audio


def check_answer_audio(server: Server, question: str, answer: str, audio: bytes) -> None:
    """The answer's audio is speech of its transcript (within 30 % WER), to a listener who asked ``question``."""
    samples = pcm16_to_float(audio)
    assert len(samples) > RATE * 0.3, "less than 0.3 s of answer"
    assert float(np.sqrt(np.mean(samples**2))) > 0.01, "the answer is silent"
    # Not its fact itself. Whisper base, hearing an answer with no context, mishears some of Piper's takes
    # ("Terraces the capital, the France." for "Paris is the capital of France.": CI failed on it). Measured
    # on 30 takes spoken as the pipeline speaks them, first clause apart: 2 heard with more than 30 % WER
    # alone, none with the question as Whisper's prompt, as the person who asked it hears the answer.
    # Whisper decodes each lead-in of silence apart: a second listening after a shorter one.
    spoken = []
    for lead_in_s in (0.5, 0.25):
        spoken.append(transcribe(server, audio, lead_in_s, context=question))
        if word_error_rate(answer, spoken[-1]) <= 0.30:
            return
    raise AssertionError(f"the answer's audio is not heard as {answer!r}: {spoken}")


def record_what_is_played(server: Server, call_id: str | None) -> list[np.ndarray]:
    """The frames the server's track for ``call_id`` plays from now (int16 at 24 kHz), as its encoder gets them
    (the track sends nothing while it has nothing to play: neither is anything recorded then)."""
    assert server.calls is not None and call_id is not None
    media = server.calls.calls[call_id].playback
    played: list[np.ndarray] = []
    next_frame = media.next_frame

    def recording() -> Any:
        frame = next_frame()
        played.append(frame.copy())
        return frame

    media.next_frame = recording  # type: ignore[method-assign]
    return played


def check_carried(played: np.ndarray, played_rate: int, heard: np.ndarray, heard_rate: int) -> None:
    """What the client heard is what the server played, as loud, 10 ms by 10 ms, from first sound to last.

    Opus changes the samples, not their envelope: audio lost, repeated,
    slowed, cut short or made quieter on the way breaks it.
    """

    def envelope(samples: np.ndarray, rate: int) -> np.ndarray:
        step = rate // 100
        frames = samples[: len(samples) // step * step].astype(np.float32).reshape(-1, step) / 32768.0
        return np.sqrt(np.mean(frames**2, axis=1))

    sent, got = envelope(played, played_rate), envelope(heard, heard_rate)
    loud = np.flatnonzero(sent > 0.01)
    assert loud.size, "nothing loud was played"
    sent = sent[loud[0] : loud[-1] + 1]
    assert len(got) >= len(sent), f"played {10 * len(sent)} ms of sound, heard {10 * len(got)} ms in all"
    # Where in what was heard it begins: the step that follows it best (Opus delays it by 6.5 ms).
    # A stretch of pure silence follows nothing (its correlation is undefined): it is not where the sound is.
    fits = [
        float(np.corrcoef(sent, window)[0, 1]) if np.ptp(window) > 0 else -1.0
        for window in (got[at : at + len(sent)] for at in range(len(got) - len(sent) + 1))
    ]
    at = int(np.argmax(fits))
    gain = float(np.sum(got[at : at + len(sent)]) / np.sum(sent))
    assert fits[at] >= 0.9, f"what was heard does not follow what was played (correlation {fits[at]:.2f})"
    assert 0.8 <= gain <= 1.25, f"what was heard is {gain:.2f} times as loud as what was played"
    before, after = got[: max(0, at - 5)], got[at + len(sent) + 5 :]  # Opus smears an edge over a few ms
    assert np.max(before, initial=0) < 0.01 and np.max(after, initial=0) < 0.01, "sound heard that was not played"


def says(answer: str, fact: str) -> None:
    """The answer's words, as they came over the wire, state ``fact`` (a regular expression)."""
    assert re.search(fact, answer, re.I), f"the answer does not say {fact!r}: {answer!r}"


async def check_spoken_turn(server: Server) -> None:
    """A spoken question is heard within 20 % WER and answered aloud with its fact, which Whisper hears back.

    The take is one Whisper hears right alone (:func:`speak`); the server hears the turn as it ends, 64 ms
    after its last voiced window, and there about one take in 40 that Whisper hears right alone is "the capital
    of friends" (and one the other way; 40 takes measured). An answer to a misheard question cannot be checked
    for its fact: such a turn is asked again with another take, on a fresh connection, at most twice.
    """
    question = "What is the capital of France?"
    for _take in range(3):
        async with RealtimeClient.connect(server, transcribe=True) as c:
            await c.send("session.update", session=SETTINGS)
            heard, answer, audio = await ask(server, c, question, "France")
        assert word_error_rate(question, heard) <= 0.20, heard
        if "france" in heard.lower():
            break
    else:
        raise AssertionError(f"three takes of the question were heard without 'France', the last as {heard!r}")
    says(answer, r"\bParis\b")
    check_answer_audio(server, question, answer, audio)


def test_spoken_question_is_heard_and_answered_aloud() -> None:
    async def scenario() -> None:
        async with real_server() as server:
            await check_spoken_turn(server)

    run(scenario(), timeout=180)


def test_spoken_turn_through_the_openai_sdk() -> None:
    async def scenario() -> None:
        async with real_server() as server:
            question = "Which city is the capital of Italy?"
            pcm = speak(server, question, "Italy") + bytes(int(RATE * 1.2) * 2)
            client = AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
            async with client.realtime.connect(model="s2s-rt") as conn:
                await conn.session.update(session={"type": "realtime", **SETTINGS})

                async def send() -> None:
                    t0 = time.monotonic()
                    for i in range(0, len(pcm), CHUNK * 2):
                        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + CHUNK * 2]).decode())
                        await asyncio.sleep(max(0.0, t0 + (i / 2 + CHUNK) / RATE - time.monotonic()))

                sender = asyncio.create_task(send())
                heard, transcript, audio = "", "", b""
                async for event in conn:
                    if event.type == "conversation.item.input_audio_transcription.completed":
                        heard = event.transcript
                    elif event.type == "response.output_audio.delta":
                        audio += base64.b64decode(event.delta)
                    elif event.type == "response.output_audio_transcript.delta":
                        transcript += event.delta
                    elif event.type == "response.done":
                        assert event.response.status == "completed"
                        break
                await sender
                assert word_error_rate(question, heard) <= 0.20, heard
                says(transcript, r"\bRome\b")
                check_answer_audio(server, question, transcript, audio)

    run(scenario(), timeout=180)


def test_barge_in_with_real_vad_cancels_within_300_ms_of_new_speech() -> None:
    async def scenario() -> None:
        async with real_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send(
                    "session.update",
                    session={"instructions": "You are a storyteller. Tell long, detailed stories of many sentences."},
                )
                interruption = speak(server, "Stop, please stop.")
                send = asyncio.create_task(stream(c, speak(server, "Tell me a long story about a dragon.")))
                await c.until("response.output_audio.delta", timeout=60)
                await send
                loop = asyncio.get_running_loop()
                speech_start = loop.time()
                talk_over = asyncio.create_task(stream(c, interruption, trailing_silence_s=0.8))
                done = await c.until("response.done", timeout=10)
                cancelled_after = loop.time() - speech_start
                await talk_over
                assert done["response"]["status"] == "cancelled"
                assert done["response"]["status_details"]["reason"] == "turn_detected"
                assert cancelled_after <= 0.300, f"barge-in took {cancelled_after * 1000:.0f} ms"

    run(scenario(), timeout=180)


def test_two_sessions_talking_at_once_each_hear_only_their_own_words() -> None:
    async def one(server: Server, question: str, key: str) -> tuple[str, str, list[dict]]:
        async with RealtimeClient.connect(server, transcribe=True) as c:
            await c.send("session.update", session=SETTINGS)
            heard, answer, audio = await ask(server, c, question, key)
            assert pcm16_to_float(audio).size > RATE * 0.3
            return heard, answer, c.events

    async def scenario() -> None:
        async with real_server() as server:
            # Each session's own word (in its question and answer) and its question's fact.
            questions = {
                "germany": ("What is the capital of Germany?", r"\bBerlin\b"),
                "spider": ("How many legs does a spider have?", r"\b(eight|8)\b"),
            }
            results = await asyncio.gather(*(one(server, q, own) for own, (q, _fact) in questions.items()))
            for (heard, answer, events), (own, (question, fact)) in zip(results, questions.items(), strict=True):
                assert word_error_rate(question, heard) <= 0.20, heard
                says(answer, fact)
                other = next(k for k in questions if k != own)
                text = " ".join(str(e) for e in events if e["type"] != "response.output_audio.delta").lower()
                assert own in text and other not in text


@requires(not missing_programs(SEMANTIC_VOICES), "flite is not installed (apt-get install -y flite)")
def test_semantic_vad_ends_a_finished_question_sooner_than_an_unfinished_one() -> None:
    """The real VAD, Whisper and Qwen judging: the same silence ends "…of France?" and not "…a table for".

    Spoken by flite voices, whose speech is the same every run: Piper's
    is not (its synthesis draws noise), and one take in six or so of "…a
    table for" was heard by Whisper base as "…a table for it.", a sentence
    that sounds finished, so the test failed by chance.

    The silence is sent eight times slower than real time, so that the
    judgement is made before the turn's clock has run out whatever the
    machine: the test is of what is decided, not of how fast (on a 2-core
    AMD EPYC reading 25 ms a token, the judgement came after the 1.2 s that
    ends a turn without one, and both sentences ended there).
    """

    async def turn_end_ms(server: Server, voice: Voice, text: str) -> float | None:
        async with RealtimeClient.connect(server, transcribe=True) as c:
            turn = {"type": "semantic_vad", "eagerness": "auto", "create_response": False}
            await c.send("session.update", session={"audio": {"input": {"turn_detection": turn}}})
            await c.until("session.updated")
            pcm = float_to_pcm16(resample(say(voice, text), PIPELINE_RATE, RATE))
            sending = asyncio.create_task(stream(c, pcm, trailing_silence_s=1.5, silence_slower=8))
            try:
                stopped = await c.until("input_audio_buffer.speech_stopped", timeout=len(pcm) / 2 / RATE + 13)
            except TimeoutError:
                return None
            finally:
                await sending
            started = c.of_type("input_audio_buffer.speech_started")[0]
            # Silence the server waited: where it ended the turn, past the speech it heard.
            return float(stopped["audio_end_ms"] - started["audio_start_ms"]) - 1000 * len(pcm) / 2 / RATE

    async def scenario() -> dict[Voice, tuple[float | None, float | None]]:
        async with real_server() as server:
            return {
                voice: (
                    await turn_end_ms(server, voice, "What is the capital of France?"),
                    await turn_end_ms(server, voice, "I would like to book a table for"),
                )
                for voice in SEMANTIC_VOICES
            }

    for voice, (finished, unfinished) in run(scenario(), timeout=180).items():
        assert finished is not None and finished < 1000, (voice, finished)  # ended within the 1.5 s of silence
        assert unfinished is None or unfinished > finished + 500, (voice, finished, unfinished)


#: Questions with a pause mid-sentence that the judge once ended (issue 38): Whisper hears the first part as a
#: sentence that could end there ("Wake me up at 6", "The meeting is at half past."), which the model scored
#: 0.009 and 0.005, at the old threshold (0.005) a turn's end after 0.2 s of silence.
PAUSED_MID_SENTENCE = (("Wake me up at six", "thirty tomorrow."), ("The meeting is at half past", "three, right?"))


@requires(
    not missing_programs((Voice("espeak-ng", "en-gb"),)), "espeak-ng is not installed (apt-get install espeak-ng)"
)
def test_semantic_vad_waits_through_a_pause_after_words_that_could_end_a_sentence() -> None:
    """espeak-ng's British voice pauses 0.9 s mid-sentence; the turn must not end in the pause.

    The pause is sent eight times slower than real time, so that the
    judgement is made within it on any machine (a slow one judges after
    the pause and never cuts: the test is of what is decided).
    """
    voice = Voice("espeak-ng", "en-gb")

    async def ended_in_pause(server: Server, head: str, tail: str) -> bool:
        async with RealtimeClient.connect(server, transcribe=True) as c:
            turn = {"type": "semantic_vad", "eagerness": "auto", "create_response": False}
            await c.send("session.update", session={"audio": {"input": {"turn_detection": turn}}})
            await c.until("session.updated")
            first, rest = (float_to_pcm16(resample(say(voice, text), PIPELINE_RATE, RATE)) for text in (head, tail))
            await stream(c, first, trailing_silence_s=0.9, silence_slower=8)
            await stream(c, rest, trailing_silence_s=0.0)
            with contextlib.suppress(TimeoutError):
                while True:  # what the server said about the pause (no reader runs while the audio is sent)
                    await c.recv(timeout=1.0)
            rest_at_ms = 1000 * len(first) / 2 / RATE + 900
            return any(e["audio_end_ms"] < rest_at_ms for e in c.of_type("input_audio_buffer.speech_stopped"))

    async def scenario() -> list[tuple[str, bool]]:
        async with real_server() as server:
            return [(head, await ended_in_pause(server, head, tail)) for head, tail in PAUSED_MID_SENTENCE]

    assert not [head for head, cut in run(scenario(), timeout=120) if cut]


@requires(not missing_programs(SEMANTIC_VOICES[:1]), "flite is not installed (apt-get install flite)")
def test_a_spoken_turn_over_webrtc_on_the_default_stack() -> None:
    """A question in a voice unlike the server's, spoken into a WebRTC call (aiortc, the SDK posting the offer).

    Heard right, answered with its fact in the events of the ``oai-events``
    channel, and the answer's audio, as it came over the track (Opus both
    ways), is speech of its transcript.
    """
    from s2s_rt.bench.call import CallClient

    async def scenario() -> None:
        async with real_server(pool_size=1) as server:
            question = "What is the capital of France?"
            pcm = float_to_pcm16(resample(say(SEMANTIC_VOICES[0], question), PIPELINE_RATE, RATE))
            call = await CallClient.open(f"http://127.0.0.1:{server.port}/v1", "unused", session=SETTINGS)
            played = record_what_is_played(server, call.call_id)
            try:
                created = await call.next_event("session.created")
                assert created["session"]["instructions"] == INSTRUCTIONS  # the offer's configuration
                spoken_until = call.speak(pcm)
                call.speak(bytes(int(RATE * 1.5) * 2))
                heard = await call.next_event("conversation.item.input_audio_transcription.completed", 30)
                done = await call.next_event("response.done", 60)
                await call.next_event("output_audio_buffer.stopped", 30)
                await asyncio.sleep(0.3)  # its last packets on their way
                assert word_error_rate(question, heard["transcript"]) <= 0.20, heard
                answer = done["response"]["output"][0]["content"][0]["transcript"]
                says(answer, r"\bParis\b")
                first = call.first_sound_after(spoken_until)
                assert first is not None
                latency_ms = 1000 * (first - spoken_until)
                print(f"\nWebRTC, default stack: end of speech -> first audio heard {latency_ms:.0f} ms")
                track = pcm16_to_float(call.heard_between(first).tobytes())
                check_carried(np.concatenate(played), 24_000, call.heard_between(spoken_until), 48_000)
                check_answer_audio(server, question, answer, float_to_pcm16(resample(track, 48_000, RATE)))
            finally:
                await call.close()

    run(scenario(), timeout=180)
