"""English speech from voices unlike the project's own is heard as English (Whisper base on the default models).

Whisper base, left to choose among its 99 languages, hears short English
clips from flite and espeak-ng voices as Japanese, Thai or Malay (12 of 52
questions from espeak-ng's Scottish voice, 17 from its Caribbean one). The
server detects only among the languages it serves (its voices'), and a
session's own transcription language still wins. Test speech comes from
Debian's ``flite`` and ``espeak-ng`` (``.ci/run`` installs them; without them
these tests skip, and fail in CI). What is checked is the words heard, not
the language a transcript is labelled with: with one served language the
label is that language whatever was heard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import requires

from s2s_rt.engines.base import Float32Array
from s2s_rt.engines.piper import VoiceConfig, voice_languages
from s2s_rt.engines.whisper import WhisperSTT
from s2s_rt.evaluation.voices import FOREIGN_VOICES, Voice, missing_programs, say
from s2s_rt.models import PreparedModels

#: The synthesisers of the voices below (flite, espeak-ng) that are not installed.
MISSING = missing_programs(FOREIGN_VOICES)

pytestmark = [
    pytest.mark.slow,
    requires(
        not MISSING,
        f"{' and '.join(MISSING)} {'is' if len(MISSING) == 1 else 'are'} not installed"
        f" (apt-get install -y {' '.join(MISSING)})",
    ),
]

#: Questions Whisper base heard in another language from at least one of the voices.
QUESTIONS = (
    "How many legs does a spider have?",
    "Who wrote Pride and Prejudice?",
    "What day of the week is it today?",
    "Set a timer for twenty minutes.",
    "Convert one hundred degrees Fahrenheit to Celsius.",
    "How many centimeters are there in a meter?",
    "What is half of ninety?",
    "How many continents are there?",
    "What time is it?",
    "Good morning!",
)
#: Letters of Latin-script languages (and no others): English text never needs more.
LATIN = re.compile(r"^[\x00-\u024f\u2018-\u201d°]*$")


@pytest.fixture(scope="module")
def prepared(default_models: PreparedModels) -> PreparedModels:
    return default_models


@pytest.fixture(scope="module")
def clips() -> list[tuple[Voice, str, Float32Array]]:
    return [(voice, text, say(voice, text)) for voice in FOREIGN_VOICES for text in QUESTIONS]


@pytest.fixture(scope="module")
def served_stt(prepared: PreparedModels) -> WhisperSTT:
    """Whisper as the server loads it: detecting among the languages of the installed voices."""
    return WhisperSTT(prepared.whisper, languages=voice_languages(prepared.voices))


def test_the_served_languages_are_those_of_the_voices(prepared: PreparedModels, served_stt: WhisperSTT) -> None:
    assert voice_languages(prepared.voices) == ["en"]
    assert served_stt.languages == ("en",)
    assert "language en" in served_stt.describe()


def test_english_from_foreign_voices_is_heard_as_english_every_time(
    served_stt: WhisperSTT, clips: list[tuple[Voice, str, Float32Array]]
) -> None:
    wrong = []
    for voice, text, audio in clips:
        heard = served_stt.transcribe(audio).text
        # Decoded as English: the words Whisper writes when told the speech is English, in Latin letters.
        english = served_stt.transcribe(audio, language="en").text
        if heard != english or not LATIN.match(heard):
            wrong.append(f"{voice.label} {text!r} -> {heard!r} (as English: {english!r})")
    assert not wrong, f"{len(wrong)} of {len(clips)} clips heard in another language:\n" + "\n".join(wrong)


def test_detection_chooses_only_among_the_served_languages(
    prepared: PreparedModels, clips: list[tuple[Voice, str, Float32Array]]
) -> None:
    stt = WhisperSTT(prepared.whisper, languages=["en", "de"])
    assert "languages en, de (detected)" in stt.describe()
    heard = [stt.transcribe(audio).language for _voice, _text, audio in clips]
    assert set(heard) <= {"en", "de"}
    assert heard.count("en") >= 0.9 * len(heard)


def test_a_sessions_own_language_wins(served_stt: WhisperSTT) -> None:
    german = say(Voice("espeak-ng", "de"), "Ich möchte einen Tisch für zwei Personen reservieren.")
    asked = served_stt.transcribe(german, language="de")
    assert asked.language == "de" and "Tisch" in asked.text, asked  # German words, as the session asked
    # Without a language of its own, speech is heard in English, all this server speaks.
    served = served_stt.transcribe(german)
    assert served.language == "en" and "Tisch" not in served.text and LATIN.match(served.text), served


def test_a_language_whisper_does_not_know_is_refused(prepared: PreparedModels) -> None:
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        WhisperSTT(prepared.whisper, languages=["en", "xx"])


def test_region_tags_name_their_language(prepared: PreparedModels) -> None:
    assert WhisperSTT(prepared.whisper, languages=["en_US", "de-AT"]).languages == ("en", "de")


def test_a_voice_config_without_a_language_section_takes_its_espeak_voice(tmp_path: Path) -> None:
    config = {
        "audio": {"sample_rate": 22050},
        "espeak": {"voice": "de"},
        "phoneme_id_map": {"^": [1], "$": [2], "_": [0]},
    }
    path = tmp_path / "de_DE-test.onnx.json"
    path.write_text(json.dumps(config))
    assert VoiceConfig.load(path).language == "de"
    assert voice_languages({"de_DE-test": tmp_path / "de_DE-test.onnx"}) == ["de"]
