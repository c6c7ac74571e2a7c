"""Answers sound like answers: Piper says markdown-free text with numbers as words, at the speed asked for.

Checked by ear, with Whisper: the audio Piper makes is transcribed back
and compared with the words it should have said.
"""

from __future__ import annotations

import numpy as np
import pytest

from s2s_rt.audio import resample
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array
from s2s_rt.engines.phonemes import espeak_phonemizer
from s2s_rt.engines.piper import PiperTTS
from s2s_rt.engines.whisper import WhisperSTT
from s2s_rt.evaluation.grading import spoken_word_error_rate
from s2s_rt.models import PreparedModels
from s2s_rt.speech_text import speakable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(default_models: PreparedModels) -> PreparedModels:
    return default_models


@pytest.fixture(scope="module")
def tts(prepared: PreparedModels) -> PiperTTS:
    return PiperTTS(prepared.voices)


@pytest.fixture(scope="module")
def stt(prepared: PreparedModels) -> WhisperSTT:
    return WhisperSTT(prepared.whisper, languages=["en"])


def spoken(tts: PiperTTS, text: str, speed: float = 1.0) -> Float32Array:
    return np.concatenate(list(tts.synthesize(text, voice=None, should_stop=lambda: False, speed=speed)))


def heard(tts: PiperTTS, stt: WhisperSTT, text: str) -> str:
    return stt.transcribe(resample(spoken(tts, text), tts.sample_rate, PIPELINE_RATE)).text


class RecordingPhonemizer:
    """The real phonemizer, remembering what it was asked to say."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._phonemizer = espeak_phonemizer()

    def phonemize(self, text: str, voice: str) -> list[list[str]]:
        self.texts.append(text)
        return self._phonemizer.phonemize(text, voice)


def test_piper_is_given_the_text_as_it_should_be_said(prepared: PreparedModels) -> None:
    phonemizer = RecordingPhonemizer()
    tts = PiperTTS(prepared.voices, phonemizer=phonemizer)  # type: ignore[arg-type]
    list(tts.synthesize("**Yes!** It is 100°F at 3:40 pm.", voice=None, should_stop=lambda: False))
    assert phonemizer.texts == ["Yes! It is one hundred degrees Fahrenheit at three forty PM."]


@pytest.mark.parametrize(
    "text",
    [
        "**Canberra** is the capital of Australia.",
        "# Steps\n- Mix the flour.\n- Bake it for 20 minutes.",
        "It is 100°F, about 37.8 °C, at 3:40 pm.",
        "Today is 2025-06-12, and 10% of $200 is $20.",
    ],
)
def test_markdown_and_numbers_are_heard_as_words(tts: PiperTTS, stt: WhisperSTT, text: str) -> None:
    transcript = heard(tts, stt, text)
    assert spoken_word_error_rate(speakable(text), transcript) <= 0.25, transcript
    assert not any(word in transcript.lower() for word in ("asterisk", "hash", "star", "dash")), transcript


def test_speed_changes_how_long_the_answer_takes(tts: PiperTTS) -> None:
    text = "The capital of Australia is Canberra."
    normal = len(spoken(tts, text))
    assert 0.55 < len(spoken(tts, text, speed=1.5)) / normal < 0.8
    assert 1.6 < len(spoken(tts, text, speed=0.5)) / normal < 2.4
    # Beyond the API's range (0.25-1.5) the nearest end is used; VITS durations vary a little run to run.
    assert 0.55 < len(spoken(tts, text, speed=9.0)) / normal < 0.8


def test_each_voice_knows_its_language(tts: PiperTTS) -> None:
    assert dict(tts.languages) == {"en_US-joe-medium": "en"}
