"""Spoken questions for the load script, synthesised once by the project's own TTS.

The load script needs speech, and the project already has a voice: the
questions below are spoken by the default stack's Piper voice (or, with
``source="tone"``, by the fake stack's tone TTS, which needs no model),
resampled to the session format (PCM16 mono at 24 kHz), trimmed to the
voiced part and kept in a cache directory. No external audio, no network.

The cache key holds everything the audio depends on (source, voice file,
text, rate, format version), so a changed voice is synthesised again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from s2s_rt.audio import Float32Array, float_to_pcm16, resample

#: The session format the load script speaks (the Realtime API's default).
RATE = 24_000

#: Short questions a voice assistant answers in a sentence.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "How many days are there in a week?",
    "What colour is the sky on a clear day?",
    "What is the largest ocean on Earth?",
    "Name a fruit that is yellow.",
)

#: Questions said with a pause in the middle (0.7–1.0 s, where people stop to think): the first part
#: alone is not a whole question, so a turn detector that ends the turn in the pause cuts the user off.
PAUSED_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("I would like to book a table for", "four people at seven."),
    ("Can you tell me the capital of", "Australia?"),
    ("How many days are there in", "a leap year?"),
    ("What is the tallest mountain in", "Europe?"),
    ("Please remind me to call my", "mother tomorrow."),
    ("How far is it from the Earth to", "the Moon?"),
    ("What is the difference between a frog and", "a toad?"),
    ("Could you tell me how to make", "a cup of tea?"),
    ("How many minutes are there in", "two hours?"),
    ("What is the boiling point of", "water in Fahrenheit?"),
    ("Which animal is the largest", "in the ocean?"),
    ("Tell me a word that rhymes with", "house."),
)
#: The pause inserted in each paused question, in turn (milliseconds of silence).
PAUSES_MS: tuple[int, ...] = (700, 800, 900, 1000)

#: A 10 ms frame is voiced when its RMS level reaches this (-40 dBFS); the fake
#: stack's energy VAD uses the same level.
VOICED_RMS = 0.01

_FORMAT_VERSION = 1

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Clip:
    """One spoken question.

    Attributes:
        text: what is said.
        pcm: PCM16 mono little-endian at :data:`RATE`, starting at the first
            voiced sample and ending with the last.
    """

    text: str
    pcm: bytes

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / RATE


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where clips are kept: ``path``, ``$S2S_RT_BENCH_CACHE`` or ``~/.cache/s2s-rt/bench-speech``."""
    if path is not None:
        return Path(path)
    env = os.environ.get("S2S_RT_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "s2s-rt" / "bench-speech"


def trim_to_voice(samples: Float32Array, rate: int) -> Float32Array:
    """Cut leading and trailing silence: keep first voiced 10 ms frame .. last voiced frame."""
    frame = rate // 100
    n = len(samples) // frame
    if n == 0:
        return samples
    frames = samples[: n * frame].reshape(n, frame)
    voiced = np.flatnonzero(np.sqrt(np.mean(np.square(frames, dtype=np.float32), axis=1)) >= VOICED_RMS)
    if not len(voiced):
        return samples[:0]
    return samples[voiced[0] * frame : (voiced[-1] + 1) * frame]


class _Synth:
    """A TTS that says text as float32 audio at its own rate."""

    def __init__(self, key: str, rate: int, speak: Callable[[str], Float32Array]) -> None:
        self.key = key
        self.rate = rate
        self.speak = speak


def _piper(models_dir: str | None, progress: Progress) -> _Synth:
    from s2s_rt import models
    from s2s_rt.engines.piper import PiperTTS

    prepared = models.ensure_prepared(models_dir, progress=progress)
    name, path = next(iter(prepared.voices.items()))
    stat = path.stat()
    tts = PiperTTS({name: path})

    def speak(text: str) -> Float32Array:
        pieces = list(tts.synthesize(text, voice=None))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    return _Synth(f"piper:{name}:{stat.st_size}", tts.sample_rate, speak)


def _tone() -> _Synth:
    from s2s_rt.engines.fake import ToneTTS

    tts = ToneTTS()

    def speak(text: str) -> Float32Array:
        return np.concatenate(list(tts.synthesize(text, voice=None, should_stop=lambda: False)))

    return _Synth("tone", tts.sample_rate, speak)


def _debian(source: str) -> _Synth:
    from s2s_rt.engines.base import PIPELINE_RATE
    from s2s_rt.evaluation.voices import Voice, say

    engine, name = source.split(":", 1)
    voice = Voice(engine, name)
    return _Synth(source, PIPELINE_RATE, lambda text: say(voice, text))


def load_paused_questions(
    source: str = "piper",
    *,
    pairs: Sequence[tuple[str, str]] = PAUSED_QUESTIONS,
    pauses_ms: Sequence[int] = PAUSES_MS,
    directory: str | os.PathLike[str] | None = None,
    models_dir: str | None = None,
    progress: Progress = lambda line: None,
) -> list[Clip]:
    """Questions said in two parts with a pause between: each part a clip of :func:`load_questions`, joined."""
    heads = load_questions(
        source, texts=[a for a, _ in pairs], directory=directory, models_dir=models_dir, progress=progress
    )
    tails = load_questions(
        source, texts=[b for _, b in pairs], directory=directory, models_dir=models_dir, progress=progress
    )
    clips = []
    for i, (head, tail) in enumerate(zip(heads, tails, strict=True)):
        pause = bytes(2 * RATE * pauses_ms[i % len(pauses_ms)] // 1000)
        clips.append(Clip(f"{head.text} {tail.text}", head.pcm + pause + tail.pcm))
    return clips


def load_questions(
    source: str = "piper",
    *,
    texts: Sequence[str] = QUESTIONS,
    directory: str | os.PathLike[str] | None = None,
    models_dir: str | None = None,
    progress: Progress = lambda line: None,
) -> list[Clip]:
    """The questions as clips, synthesising (and caching) those not cached yet.

    Args:
        source: ``piper`` (the default stack's voice; needs the prepared
            models), ``tone`` (the fake stack's tone TTS; needs nothing), or
            a Debian voice, ``flite:NAME`` or ``espeak-ng:NAME`` (needs the
            program: ``apt-get install flite espeak-ng``).
        texts: what to say.
        directory: the cache (see :func:`cache_dir`).
        models_dir: the model cache, for ``piper``.
        progress: called with a line for each clip synthesised.

    Raises:
        ValueError: an unknown source.
        s2s_rt.models.ModelError: ``piper`` and the models are not prepared.
    """
    if source not in ("piper", "tone") and not source.startswith(("flite:", "espeak-ng:")):
        raise ValueError(f"unknown speech source {source!r}: use 'piper', 'tone', 'flite:NAME' or 'espeak-ng:NAME'")
    root = cache_dir(directory)
    root.mkdir(parents=True, exist_ok=True)
    synth: _Synth | None = None
    key_prefix = _source_key(source, models_dir)
    clips: list[Clip] = []
    for text in texts:
        key = hashlib.sha256(f"{_FORMAT_VERSION}|{key_prefix}|{RATE}|{text}".encode()).hexdigest()[:20]
        pcm_path = root / f"{key}.pcm"
        if pcm_path.is_file():
            clips.append(Clip(text, pcm_path.read_bytes()))
            continue
        if synth is None:
            synth = (
                _piper(models_dir, progress) if source == "piper" else _tone() if source == "tone" else _debian(source)
            )
        audio = trim_to_voice(resample(synth.speak(text), synth.rate, RATE), RATE)
        pcm = float_to_pcm16(audio)
        tmp = pcm_path.with_suffix(".tmp")
        tmp.write_bytes(pcm)
        tmp.replace(pcm_path)
        (root / f"{key}.json").write_text(
            json.dumps({"text": text, "source": synth.key, "rate": RATE, "seconds": len(audio) / RATE})
        )
        progress(f"synthesised {len(audio) / RATE:.2f} s with {synth.key}: {text!r}")
        clips.append(Clip(text, pcm))
    return clips


def _source_key(source: str, models_dir: str | None) -> str:
    """What the cached audio depends on, without loading the TTS."""
    if source != "piper":
        return source
    from s2s_rt import models

    prepared = models.ensure_prepared(models_dir, progress=lambda line: None)
    name, path = next(iter(prepared.voices.items()))
    return f"piper:{name}:{path.stat().st_size}"
