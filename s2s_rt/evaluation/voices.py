"""Voices that speak the evaluation's questions: the project's Piper voice and Debian's synthesisers.

Whisper hears the project's own Piper voice well; people sound different.
Debian's ``flite`` (diphone and cluster-unit voices) and ``espeak-ng``
(formant voices with British, Scottish and Caribbean accents) are unlike it
and install offline (``apt-get install flite espeak-ng``); the runtime never
needs them.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from s2s_rt.audio import resample
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array


@dataclass(frozen=True, slots=True)
class Voice:
    """A voice that can say a question."""

    #: ``piper``, ``flite`` or ``espeak-ng``.
    engine: str
    #: The engine's name for the voice (``slt``, ``en-gb-scotland+f3``; for Piper, a voice of the stack).
    name: str

    @property
    def label(self) -> str:
        return f"{self.engine}:{self.name}"


#: Voices unlike the project's own: two flite voices, four espeak-ng accents.
FOREIGN_VOICES = (
    Voice("flite", "slt"),
    Voice("flite", "awb"),
    Voice("flite", "rms"),
    Voice("espeak-ng", "en-us"),
    Voice("espeak-ng", "en-gb-scotland+f3"),
    Voice("espeak-ng", "en-029+m3"),
)
#: The project's own voice (the first Piper voice of the stack).
PIPER_VOICE = Voice("piper", "en_US-joe-medium")
ALL_VOICES = (PIPER_VOICE, *FOREIGN_VOICES)


def missing_programs(voices: tuple[Voice, ...] = FOREIGN_VOICES) -> list[str]:
    """The synthesiser programs ``voices`` need that are not on ``PATH``."""
    return sorted({v.engine for v in voices if v.engine != "piper" and shutil.which(v.engine) is None})


def say(voice: Voice, text: str, piper: Callable[[str, str], tuple[Float32Array, int]] | None = None) -> Float32Array:
    """``text`` spoken by ``voice``, as float32 mono at the pipeline's rate (16 kHz).

    Args:
        voice: who speaks.
        text: what they say.
        piper: for Piper voices, a function ``(text, voice name) -> (audio, rate)``.

    Raises:
        FileNotFoundError: the synthesiser is not installed.
        ValueError: a Piper voice without ``piper``.
        subprocess.CalledProcessError: the synthesiser failed.
    """
    if voice.engine == "piper":
        if piper is None:
            raise ValueError("a Piper voice needs the piper function")
        audio, rate = piper(text, voice.name)
        return resample(audio, rate, PIPELINE_RATE)
    program = shutil.which(voice.engine)
    if program is None:
        raise FileNotFoundError(f"{voice.engine} is not installed (apt-get install {voice.engine})")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        if voice.engine == "flite":
            command = [program, "-voice", voice.name, "-t", text, "-o", str(out)]
        else:
            command = [program, "-v", voice.name, "-w", str(out), text]
        subprocess.run(command, check=True, capture_output=True, timeout=60)
        data = out.read_bytes()
    return _wav_to_pipeline_rate(data)


def _wav_to_pipeline_rate(data: bytes) -> Float32Array:
    with wave.open(io.BytesIO(data), "rb") as w:
        channels, rate = w.getnchannels(), w.getframerate()
        frames = w.readframes(w.getnframes())
    pcm = np.frombuffer(frames[: len(frames) - len(frames) % (2 * channels)], dtype="<i2")
    mono = (pcm.reshape(-1, channels).astype(np.float32).mean(axis=1) / np.float32(32768.0)).astype(np.float32)
    return resample(mono, rate, PIPELINE_RATE)
