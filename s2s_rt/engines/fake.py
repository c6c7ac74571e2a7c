"""The deterministic ``fake`` stack: exact, fast engines for tests and load tests.

Nothing here is a model. Each engine does something a test can check
exactly:

- :class:`EnergyVAD` calls a chunk speech when its RMS level is at least 0.01;
  a chunk held at a steady -0.5 (:data:`POISON_LEVEL`) makes it raise.
- :class:`ChecksumSTT` "transcribes" audio as its duration and a CRC-32 of
  its 16-bit samples: ``heard 1230 ms crc 1a2b3c4d``; it fails when the
  session's transcription prompt contains ``[[fail]]``.
- :class:`EchoLLM` answers ``You said: <the last user text>.`` word by word.
  Words in double brackets in the user's text steer it, for fault tests:
  ``[[slow N]]`` waits N ms per token, ``[[block N]]`` blocks its thread N ms
  per token without checking for cancellation, ``[[fail]]`` raises mid-stream.
  Offered tools, it calls the one whose name the user says (see
  :func:`fake_tool_call`), and answers ``You said: the result is …`` once a
  function's result comes back. ``[[mute]]`` makes it answer nothing at
  all, ``[[mute-with-tools]]`` nothing while it is offered tools (as a
  small model may end its turn at once). The call comes in one piece, or, with
  ``stream_tool_calls``, token by token as a real model streams it
  (:func:`tool_call_tokens`: ``<``, ``tool_call``, ``>``, a newline, ``{``, ``"``, …).
- :class:`ToneTTS` speaks each word as a 100 ms tone whose pitch depends on
  the word, then 20 ms of silence, at 22.05 kHz (so resampling is exercised);
  it fails on the word ``[[tts-fail]]``.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from s2s_rt.engines.base import (
    PIPELINE_RATE,
    ChatMessage,
    Float32Array,
    LLMRequest,
    LLMUsage,
    NoiseReduction,
    Stack,
    StopCheck,
    Transcript,
)
from s2s_rt.toolcalls import frame

_CONTROL = re.compile(r"\[\[(slow|block|fail)(?:\s+(\d+))?\]\]")
#: What :func:`tool_call_tokens` cuts a call into: words, runs of spaces, and each other character alone.
_TOKEN = re.compile(r"\w+|[^\S\n]+|\n|[^\w\s]")


#: :class:`EnergyVAD` fails on a window whose samples all hold this level (fault tests).
POISON_LEVEL = -0.5


class EnergyVAD:
    chunk_samples = 512

    def new_state(self) -> None:
        return None

    def speech_probabilities(self, chunks: Float32Array, states: Sequence[Any]) -> Float32Array:
        # A window of steady -0.5 (see POISON_LEVEL) makes the call fail: one session's audio breaks the batch.
        steady = np.ptp(chunks, axis=1) < 1e-3
        if steady.any() and np.any(np.abs(chunks[steady, 0] - POISON_LEVEL) < 1e-2):
            raise RuntimeError("fake VAD failure requested by the audio (a steady level of -0.5)")
        rms = np.sqrt(np.mean(np.square(chunks, dtype=np.float32), axis=1))
        speech: Float32Array = (rms >= 0.01).astype(np.float32)
        return speech


class ChecksumSTT:
    """Reports duration and checksum of what it was given.

    Args:
        delay_ms: extra time each call takes, for latency tests.
    """

    def __init__(self, delay_ms: int = 0) -> None:
        self.delay_ms = delay_ms

    def transcribe(self, audio: Float32Array, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        if prompt and "[[fail]]" in prompt:
            raise RuntimeError("fake STT failure requested by the transcription prompt")
        return Transcript(checksum_transcript(audio), language or "en")


def checksum_transcript(audio: Float32Array) -> str:
    """What :class:`ChecksumSTT` says for ``audio`` at ``PIPELINE_RATE``."""
    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype("<i2")
    ms = int(round(len(audio) * 1000 / PIPELINE_RATE, -1))
    return f"heard {ms} ms crc {zlib.crc32(pcm.tobytes()):08x}"


class EchoLLM:
    """Answers with the user's last words.

    Args:
        token_delay_ms: time per token (default pace of the fake model).
        stream_tool_calls: stream a tool call token by token (:func:`tool_call_tokens`), as a real
            model does, instead of in one piece.
        context_tokens: its context (a word a token), for tests of ``truncation``.
    """

    def __init__(self, token_delay_ms: int = 0, *, stream_tool_calls: bool = False, context_tokens: int = 4096) -> None:
        self.token_delay_ms = token_delay_ms
        self.stream_tool_calls = stream_tool_calls
        self.context_tokens = context_tokens

    def message_tokens(self, message: ChatMessage) -> int:
        """A word a token, and four for the turn's markup."""
        return len(message.content.split()) + 4

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float:
        """The fake model finds every utterance finished (``semantic_vad`` ends turns after its shortest wait)."""
        return 0.9

    def stream(self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage) -> Iterator[str]:
        messages, max_tokens, tools = request.messages, request.max_tokens, request.tools
        user = next((m.shown_without_images() for m in reversed(messages) if m.role == "user"), "")
        usage.input_tokens = sum(len(m.content.split()) for m in messages)
        usage.boarded = time.perf_counter()  # the fake model is never busy: an answer takes it at once
        delay_s, block_s, fail = self.token_delay_ms / 1000, 0.0, False
        for kind, arg in _CONTROL.findall(user):
            if kind == "slow":
                delay_s = int(arg or 0) / 1000
            elif kind == "block":
                block_s = int(arg or 0) / 1000
            else:
                fail = True
        if "[[mute]]" in user or ("[[mute-with-tools]]" in user and tools):
            return
        if tools:
            call = fake_tool_call(messages, user, tools, request.require_tool)
            if call is not None:
                if not self.stream_tool_calls:
                    usage.output_tokens = len(call.split())
                    yield call
                    return
                for token in tool_call_tokens(call):
                    if should_stop():
                        return
                    if delay_s:
                        time.sleep(delay_s)
                    usage.output_tokens += 1
                    yield token
                return
        if messages and messages[-1].role == "tool":
            user = f"the result is {messages[-1].content}"
        words = f"You said: {_CONTROL.sub('', user).strip()}.".split()
        for i, word in enumerate(words[:max_tokens]):
            if block_s:
                time.sleep(block_s)  # a stuck engine: does not look at should_stop
            if should_stop():
                return
            if delay_s:
                time.sleep(delay_s)
            if fail and i == 2:
                raise RuntimeError("fake LLM failure requested by [[fail]]")
            usage.output_tokens += 1
            yield word if i == 0 else " " + word


def fake_tool_call(
    messages: Sequence[ChatMessage], user: str, tools: Sequence[dict[str, Any]], required: bool
) -> str | None:
    """The call :class:`EchoLLM` makes: to the tool the user's words name.

    Arguments fill the schema's required properties (the word after the
    tool's name for strings). ``[[bad-args]]`` in the user's words leaves
    them out on the first try; ``[[always-bad]]`` on every try.
    ``[[repeat-call]]`` makes the same call again when its result comes
    back, as small models do with the functions in view. ``[[invent-call]]``
    calls ``hello``, a function no one offered, as small models do when
    greeted with functions in view.
    """
    last = messages[-1] if messages else None
    if "[[invent-call]]" in user:
        return frame(json.dumps({"name": "hello", "arguments": {}}))
    if last is not None and last.role == "tool" and not last.content.startswith("Error:"):
        if "[[repeat-call]]" not in user:
            return None  # a result came back: answer in words
    retry = last is not None and last.role == "tool"
    words = user.replace("?", " ").replace(".", " ").split()
    tool = next((t for t in tools if t.get("name") in words), tools[0] if required else None)
    if tool is None:
        return None
    name = str(tool.get("name"))
    args: dict[str, Any] = {}
    broken = "[[always-bad]]" in user or ("[[bad-args]]" in user and not retry)
    if not broken:
        schema = tool.get("parameters") or {}
        after = words[words.index(name) + 1] if name in words and words.index(name) + 1 < len(words) else "x"
        for prop in schema.get("required", []):
            spec = (schema.get("properties") or {}).get(prop, {})
            kind = spec.get("type", "string")
            if "enum" in spec:
                args[prop] = spec["enum"][0]
            elif kind in ("number", "integer"):
                args[prop] = 1
            elif kind == "boolean":
                args[prop] = True
            else:
                args[prop] = after
    return frame(json.dumps({"name": name, "arguments": args}))


def tool_call_tokens(call: str) -> list[str]:
    """``call`` cut as a tokenizer might: each word, run of spaces and other character a token of its own.

    The tag ``<tool_call>`` arrives as ``<``, ``tool_call``, ``>``, so a
    reader must hold back a ``<`` that may begin one.
    """
    tokens = _TOKEN.findall(call)
    assert "".join(tokens) == call, "every character of the call is in a token"
    return tokens


class ToneTTS:
    sample_rate = 22_050
    voices: Sequence[str] = ("tone", "tone-low")

    def __init__(self, delay_ms: int = 0) -> None:
        self.delay_ms = delay_ms

    def synthesize(
        self, text: str, *, voice: str | None, should_stop: StopCheck, speed: float = 1.0
    ) -> Iterator[Float32Array]:
        if voice not in (None, *self.voices):
            raise ValueError(f"unknown voice {voice!r}; available: {', '.join(self.voices)}")
        scale = 0.5 if voice == "tone-low" else 1.0
        for word in text.split():
            if "[[tts-fail]]" in word:
                raise RuntimeError("fake TTS failure requested by [[tts-fail]]")
            if should_stop():
                return
            if self.delay_ms:
                time.sleep(self.delay_ms / 1000)
            yield word_tone(word, self.sample_rate, scale, speed)


def word_tone(word: str, rate: int, scale: float = 1.0, speed: float = 1.0) -> Float32Array:
    """100 ms tone (pitch from the word; shorter when faster) and 20 ms of silence."""
    freq = (300 + (zlib.crc32(word.encode()) % 40) * 25) * scale
    t = np.arange(int(rate * 0.1 / speed)) / rate
    tone = 0.3 * np.sin(2 * np.pi * freq * t)
    return np.concatenate([tone, np.zeros(int(rate * 0.02))]).astype(np.float32)


def load_fake_stack(
    *, stt_delay_ms: int = 0, llm_token_delay_ms: int = 0, tts_delay_ms: int = 0, stream_tool_calls: bool = False
) -> Stack:
    """The fake engines; ``stream_tool_calls`` makes :class:`EchoLLM` stream its tool calls token by token."""
    return Stack(
        name="fake",
        vad=EnergyVAD(),
        stt=ChecksumSTT(stt_delay_ms),
        llm=EchoLLM(llm_token_delay_ms, stream_tool_calls=stream_tool_calls),
        tts=ToneTTS(tts_delay_ms),
        description=["fake stack: energy VAD, checksum STT, echo LLM, tone TTS (for tests)"],
        noise=_rnnoise(),
    )


def _rnnoise() -> NoiseReduction | None:
    """The real noise reduction where it is installed (small, fast and deterministic); else none."""
    from s2s_rt.engines.rnnoise import DenoiserUnavailable, LazyRNNoise

    try:
        return LazyRNNoise()
    except DenoiserUnavailable:
        return None
