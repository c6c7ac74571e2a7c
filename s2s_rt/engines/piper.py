"""Piper (VITS) text-to-speech on ONNX Runtime."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from s2s_rt.audio import resample
from s2s_rt.engines.base import Float32Array, StopCheck
from s2s_rt.engines.device import CPU_PROVIDER, OnnxProviders, session_options
from s2s_rt.engines.languages import language_code
from s2s_rt.engines.phonemes import EspeakPhonemizer, espeak_phonemizer
from s2s_rt.speech_text import speakable

#: Piper's control symbols: begin and end of an utterance, and the pad that
#: separates phonemes.
BOS, EOS, PAD = "^", "$", "_"
#: Peak level of each synthesised sentence.
OUTPUT_PEAK = 0.9
#: Speaking rates a voice accepts, as the Realtime API's ``audio.output.speed``.
MIN_SPEED, MAX_SPEED = 0.25, 1.5


@dataclass(frozen=True, slots=True)
class VoiceConfig:
    """What a Piper voice's ``.onnx.json`` says about running it."""

    sample_rate: int
    espeak_voice: str
    #: ISO 639-1 code of the voice's language (``en``).
    language: str
    phoneme_id_map: Mapping[str, Sequence[int]]
    #: Phoneme substitutions applied before ids (usually empty).
    phoneme_map: Mapping[str, Sequence[str]]
    noise_scale: float
    length_scale: float
    noise_w: float
    num_speakers: int

    @classmethod
    def load(cls, path: Path) -> VoiceConfig:
        """Read a voice's config.

        Raises:
            ValueError: the config is not a Piper espeak voice.
        """
        config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if config.get("phoneme_type", "espeak") != "espeak":
            raise ValueError(f"{path}: phoneme_type {config['phoneme_type']!r} is not supported")
        inference = config.get("inference", {})
        espeak_voice = str(config["espeak"]["voice"])
        language = config.get("language")
        family = None
        if isinstance(language, dict):
            family = language.get("family") or language.get("code")
        id_map = config["phoneme_id_map"]
        for symbol in (BOS, EOS, PAD):
            if symbol not in id_map:
                raise ValueError(f"{path}: phoneme_id_map lacks {symbol!r}")
        return cls(
            sample_rate=int(config["audio"]["sample_rate"]),
            espeak_voice=espeak_voice,
            # Older voice configs have no language section; their espeak voice names it.
            language=language_code(str(family or espeak_voice)),
            phoneme_id_map=id_map,
            phoneme_map=config.get("phoneme_map") or {},
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
            num_speakers=int(config.get("num_speakers", 1)),
        )

    def phoneme_ids(self, phonemes: Sequence[str]) -> list[int]:
        """Ids of one sentence as Piper builds them: ``^ _ p1 _ p2 _ … $``.

        Phonemes the voice does not know are dropped, as Piper does.
        """
        id_map = self.phoneme_id_map
        ids = [*id_map[BOS], *id_map[PAD]]
        for phoneme in phonemes:
            for mapped in self.phoneme_map.get(phoneme, (phoneme,)):
                if mapped in id_map:
                    ids += id_map[mapped]
                    ids += id_map[PAD]
        ids += id_map[EOS]
        return ids


class _Voice:
    """One loaded voice: its config and its ONNX session."""

    def __init__(self, model_path: Path, providers: OnnxProviders, intra_threads: int) -> None:
        self.model_path = model_path
        self.config = VoiceConfig.load(model_path.with_name(model_path.name + ".json"))
        self.session = onnxruntime.InferenceSession(
            str(model_path), sess_options=session_options(intra_threads), providers=providers
        )
        inputs = {i.name for i in self.session.get_inputs()}
        self.multi_speaker = "sid" in inputs
        self.scales = np.array(
            [self.config.noise_scale, self.config.length_scale, self.config.noise_w],
            dtype=np.float32,
        )

    def speak(self, phoneme_ids: list[int], speed: float = 1.0) -> Float32Array:
        ids = np.array([phoneme_ids], dtype=np.int64)
        scales = self.scales
        if speed != 1.0:
            # VITS's length scale stretches every phoneme: a shorter one speaks faster.
            scales = scales.copy()
            scales[1] /= min(max(speed, MIN_SPEED), MAX_SPEED)
        feeds = {
            "input": ids,
            "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
            "scales": scales,
        }
        if self.multi_speaker:
            feeds["sid"] = np.zeros(1, dtype=np.int64)  # the voice's first speaker
        audio = self.session.run(None, feeds)[0]
        return np.asarray(audio, dtype=np.float32).reshape(-1)


class PiperTTS:
    """Speak text with Piper voices, one sentence at a time.

    All voices are loaded at start-up. The output rate is the first voice's;
    a voice with another rate is resampled to it.

    Args:
        voices: voice name -> ``.onnx`` path (its config is the ``.onnx.json``
            beside it). The first voice is the default.
        providers: ONNX Runtime providers, best first (CPU when None).
        intra_threads: threads one inference may use.
        phonemizer: the espeak-ng phonemizer (the process-wide one when None).

    Raises:
        ValueError: no voices, or a voice whose config is unusable.
        FileNotFoundError: a model or its config is missing.
    """

    def __init__(
        self,
        voices: Mapping[str, Path],
        *,
        providers: OnnxProviders | None = None,
        intra_threads: int = 1,
        phonemizer: EspeakPhonemizer | None = None,
    ) -> None:
        if not voices:
            raise ValueError("PiperTTS needs at least one voice")
        self._voices = {
            name: _Voice(Path(path), providers or [CPU_PROVIDER], intra_threads) for name, path in voices.items()
        }
        self.voices: Sequence[str] = list(self._voices)
        self.sample_rate: int = self._voices[self.voices[0]].config.sample_rate
        self.providers: list[str] = self._voices[self.voices[0]].session.get_providers()
        self._phonemizer = phonemizer or espeak_phonemizer()
        #: Each voice's language, by voice name.
        self.languages: Mapping[str, str] = {name: v.config.language for name, v in self._voices.items()}

    def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        should_stop: StopCheck = lambda: False,
        speed: float = 1.0,
    ) -> Iterator[Float32Array]:
        """Yield float32 mono audio at ``sample_rate``, one piece per sentence.

        The text is said as a person would read it aloud: markdown is left
        out and, for English voices, numbers, units and symbols are spoken
        as words (see :func:`s2s_rt.speech_text.speakable`).

        Args:
            text: what to say.
            voice: one of :attr:`voices`; None means the default (first) one.
            should_stop: checked before each sentence; synthesis ends early
                once it returns True.
            speed: speaking rate, 1.0 the voice's own; kept within 0.25-1.5
                (the Realtime API's ``audio.output.speed``).

        Raises:
            ValueError: ``voice`` is not one of :attr:`voices`.
        """
        chosen = self._voice(voice)
        if should_stop():
            return
        sentences = self._phonemizer.phonemize(speakable(text, chosen.config.language), chosen.config.espeak_voice)
        for phonemes in sentences:
            if should_stop():
                return
            audio = chosen.speak(chosen.config.phoneme_ids(phonemes), speed)
            if chosen.config.sample_rate != self.sample_rate:
                audio = resample(audio, chosen.config.sample_rate, self.sample_rate)
            yield _normalize(audio)

    def _voice(self, name: str | None) -> _Voice:
        if name is None:
            return self._voices[self.voices[0]]
        try:
            return self._voices[name]
        except KeyError:
            raise ValueError(f"unknown voice {name!r}; available: {', '.join(self.voices)}") from None

    def describe(self) -> list[str]:
        """Lines for the start-up log: each voice's model, rate and providers."""
        return [
            f"TTS Piper voice {name!r}: {v.model_path} ({v.config.sample_rate} Hz, "
            f"espeak {v.config.espeak_voice!r}) on {', '.join(v.session.get_providers())}"
            for name, v in self._voices.items()
        ]


def voice_languages(voices: Mapping[str, Path]) -> list[str]:
    """The languages of Piper voices (from their ``.onnx.json``), in order, without repeats.

    Raises:
        ValueError: a voice config is unusable.
        FileNotFoundError: a voice config is missing.
    """
    configs = (VoiceConfig.load(Path(path).with_name(Path(path).name + ".json")) for path in voices.values())
    return list(dict.fromkeys(config.language for config in configs))


def _normalize(audio: Float32Array) -> Float32Array:
    """Scale a sentence to a fixed peak, as Piper does before writing PCM.

    VITS output level varies from sentence to sentence; Piper divides each
    one by its peak (never amplifying near-silence by more than 100x). The
    peak here is a little below full scale so that resampling to the wire's
    rate, whose filter overshoots slightly, does not clip.
    """
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    return (audio * (OUTPUT_PEAK / max(peak, 0.01))).astype(np.float32)
