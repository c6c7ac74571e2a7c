"""Whisper speech-to-text on CTranslate2."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import ctranslate2
import numpy as np
import tokenizers

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array, Transcript
from s2s_rt.engines.languages import language_code
from s2s_rt.engines.mel import LogMelSpectrogram

#: Shorter audio than this (0.1 s) holds no word; it is not decoded at all.
MIN_SAMPLES = PIPELINE_RATE // 10
#: Whisper's decoder context, prompt included.
MAX_TOKENS = 448
#: Whisper's rule for a window without speech: the no-speech token is likely
#: and the decoded text is unlikely. Without it, noise turns into invented
#: sentences ("Thank you for watching").
NO_SPEECH_THRESHOLD = 0.6
LOG_PROB_THRESHOLD = -1.0


class WhisperTokenizer:
    """Token ids <-> text for a Whisper model directory.

    Uses ``tokenizer.json`` when the directory has one. Otherwise it falls
    back to ``vocabulary.txt`` (one byte-level BPE token per line), which can
    decode but not encode: prompts are then ignored.

    Args:
        model_dir: a CTranslate2 Whisper conversion.

    Raises:
        FileNotFoundError: the directory has neither file.
    """

    def __init__(self, model_dir: Path) -> None:
        tokenizer_json = model_dir / "tokenizer.json"
        vocabulary_txt = model_dir / "vocabulary.txt"
        self._tokenizer: tokenizers.Tokenizer | None = None
        self._vocabulary: list[str] = []
        if tokenizer_json.exists():
            self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        elif vocabulary_txt.exists():
            self._vocabulary = vocabulary_txt.read_text(encoding="utf-8").splitlines()
            self._byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
        else:
            raise FileNotFoundError(f"{model_dir} has neither tokenizer.json nor vocabulary.txt")
        #: The first special token; every id from here on is a control token.
        self.end_of_text = self._required_id("<|endoftext|>")
        self.start_of_transcript = self._required_id("<|startoftranscript|>")
        self.start_of_previous = self._required_id("<|startofprev|>")
        self.no_timestamps = self._required_id("<|notimestamps|>")
        self.transcribe_task = self.token_to_id("<|transcribe|>")

    def token_to_id(self, token: str) -> int | None:
        """The id of a (special) token, or None when the vocabulary lacks it."""
        if self._tokenizer is not None:
            return self._tokenizer.token_to_id(token)
        try:
            return self._vocabulary.index(token)
        except ValueError:
            return None

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (empty when only vocabulary.txt is known)."""
        if self._tokenizer is None:
            return []
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ordinary tokens in ``ids``; control tokens are dropped."""
        text_ids = [i for i in ids if i < self.end_of_text]
        if self._tokenizer is not None:
            return str(self._tokenizer.decode(text_ids))
        data = bytes(self._byte_of[c] for i in text_ids for c in self._vocabulary[i])
        return data.decode("utf-8", errors="replace")

    def _required_id(self, token: str) -> int:
        token_id = self.token_to_id(token)
        if token_id is None:
            raise ValueError(f"not a Whisper vocabulary: {token} is missing")
        return token_id


class WhisperSTT:
    """Transcribe utterances with a CTranslate2 Whisper model.

    Decoding is greedy without timestamps: an utterance is short and the
    caller wants its text, once. Audio longer than Whisper's 30 s window is
    cut into windows, each prompted with the text of the one before.

    Args:
        model_dir: a CTranslate2 Whisper conversion (``model.bin``,
            ``config.json``, ``tokenizer.json`` or ``vocabulary.txt``).
        device: ``cpu`` or ``cuda`` (see :mod:`s2s_rt.engines.device`).
        device_index: the CUDA device.
        compute_type: CTranslate2 compute type; None means ``int8`` on the
            CPU and ``float16`` on CUDA.
        inter_threads: how many transcriptions may run at once.
        intra_threads: threads each transcription may use.
        full_window: feed the encoder a zero-padded 30 s window, as Whisper
            was trained, rather than the frames the audio fills plus a
            margin (10 s at least). Off by default: on 27 short utterances
            the shorter window was about 7x faster at the same word error
            rate. A window whose decoding never ends (a repetition loop) is
            decoded again with the full window. See
            :class:`~s2s_rt.engines.mel.LogMelSpectrogram`.
        languages: the languages the server serves (ISO 639-1 codes such
            as ``en``). A transcription without a language of its own is
            heard as the most likely one of these: Whisper base takes a
            few seconds of accented English for Japanese or Thai, and a
            server that can only answer in English helps nobody by
            transcribing Thai. One language skips detection; none means
            every language the model knows.

    Raises:
        FileNotFoundError: the model directory lacks a tokenizer.
        RuntimeError: CTranslate2 cannot load the model on this device.
        ValueError: a language the model does not know.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        device_index: int = 0,
        compute_type: str | None = None,
        inter_threads: int = 1,
        intra_threads: int = 1,
        full_window: bool = False,
        languages: Sequence[str] = (),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.compute_type = compute_type or ("int8" if device == "cpu" else "float16")
        self._model = ctranslate2.models.Whisper(
            str(self.model_dir),
            device=device,
            device_index=device_index,
            compute_type=self.compute_type,
            inter_threads=inter_threads,
            intra_threads=intra_threads,
        )
        self.tokenizer = WhisperTokenizer(self.model_dir)
        n_mels = self._n_mels()
        self.features = LogMelSpectrogram(n_mels, pad_to_window=full_window)
        self._full_window = self.features if full_window else LogMelSpectrogram(n_mels, pad_to_window=True)
        self.multilingual: bool = self._model.is_multilingual
        codes = list(dict.fromkeys(map(language_code, languages))) if self.multilingual else ["en"]
        #: The language tokens detection chooses among (empty: any).
        self._served = [token for token in map(self._language_token, codes) if token is not None]
        #: The languages transcripts may be in when no language is asked for (empty: any).
        self.languages: tuple[str, ...] = tuple(codes)

    def describe(self) -> str:
        """One line for the start-up log."""
        window = "30 s window" if self.features.pad_to_window else "audio + margin window"
        if not self.multilingual:
            heard = "English only"
        elif len(self._served) == 1:
            heard = f"language {self.languages[0]}"
        else:
            heard = f"languages {', '.join(self.languages) or 'any'} (detected)"
        return f"STT Whisper {self.model_dir} (CTranslate2 {self.compute_type} on {self.device}, {window}, {heard})"

    def transcribe(self, audio: Float32Array, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        """Transcribe float32 mono audio at 16 kHz.

        Args:
            audio: the utterance, float32 in [-1, 1].
            language: an ISO code such as ``en``; None detects it among the
                served languages (the only one, when there is one).
            prompt: earlier text that biases spelling and style.

        Returns:
            The text (empty for audio under 0.1 s or without speech) and the
            language, given, served or detected.

        Raises:
            ValueError: ``language`` is not one this model knows.
        """
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if language:
            language_token = self._language_token(language)
        else:
            language_token = self._served[0] if len(self._served) == 1 else None
            language = self.languages[0] if len(self.languages) == 1 else None
        if len(audio) < MIN_SAMPLES:
            return Transcript("", language)
        texts: list[str] = []
        previous = prompt.strip() if prompt else ""
        window = self.features.window_samples
        for start in range(0, len(audio), window):
            piece = audio[start : start + window]
            if len(piece) < MIN_SAMPLES:
                break
            text, language_token = self._transcribe_window(piece, language_token, previous)
            if text:
                texts.append(text)
                previous = text
        if language_token is not None:
            language = language_token[2:-2]
        elif not self.multilingual:
            language = "en"
        return Transcript(" ".join(texts), language)

    def _transcribe_window(
        self, audio: Float32Array, language_token: str | None, previous: str
    ) -> tuple[str, str | None]:
        """Transcribe at most 30 s; returns the text and the language token used."""
        for features in (self.features, self._full_window):
            encoded = self._encode(features(audio))
            if language_token is None and self.multilingual:
                language_token = self._detect_language(encoded)
            text, finished = self._decode(encoded, language_token, previous, len(audio))
            # A decoder that never ends is repeating itself. Seen only on
            # shortened windows; the full window, as trained, ends it.
            if finished or features is self._full_window:
                break
        return text, language_token

    def _encode(self, features: Float32Array) -> ctranslate2.StorageView:
        batch = np.ascontiguousarray(features[np.newaxis])
        # Encode once; language detection and decoding both reuse the output.
        return self._model.encode(ctranslate2.StorageView.from_array(batch), to_cpu=False)

    def _detect_language(self, encoded: ctranslate2.StorageView) -> str:
        """The most likely language token, among the served ones when there are any."""
        ranked = self._model.detect_language(encoded)[0]
        if self._served:
            # Ranked best first over every language the model knows.
            return next((str(token) for token, _p in ranked if token in self._served), self._served[0])
        return str(ranked[0][0])

    def _decode(
        self,
        encoded: ctranslate2.StorageView,
        language_token: str | None,
        previous: str,
        samples: int,
    ) -> tuple[str, bool]:
        """Greedy decoding; returns the text and whether the decoder ended it."""
        tokenizer = self.tokenizer
        tokens: list[int] = []
        previous_ids = tokenizer.encode(" " + previous) if previous else []
        if previous_ids:
            # Whisper keeps at most half its context for the previous text.
            tokens += [tokenizer.start_of_previous, *previous_ids[-(MAX_TOKENS // 2 - 1) :]]
        tokens.append(tokenizer.start_of_transcript)
        if self.multilingual and language_token is not None:
            language_id = tokenizer.token_to_id(language_token)
            if language_id is not None:
                tokens.append(language_id)
            if tokenizer.transcribe_task is not None:
                tokens.append(tokenizer.transcribe_task)
        tokens.append(tokenizer.no_timestamps)
        # Speech runs at a few tokens a second; a generous bound per second
        # stops a decoder stuck repeating itself long before 448 tokens.
        # CTranslate2 counts the prompt but its first token in max_length.
        budget = 16 + 12 * samples // PIPELINE_RATE
        max_length = min(MAX_TOKENS - 1, len(tokens) - 1 + budget)
        result = self._model.generate(
            encoded,
            [tokens],
            beam_size=1,
            max_length=max_length,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=[-1],
        )[0]
        ids = result.sequences_ids[0]
        finished = len(tokens) - 1 + len(ids) < max_length
        score = result.scores[0] if result.scores else 0.0
        if result.no_speech_prob > NO_SPEECH_THRESHOLD and score < LOG_PROB_THRESHOLD:
            return "", True
        return tokenizer.decode(ids).strip(), finished

    def _language_token(self, language: str) -> str | None:
        code = language_code(language)
        if not self.multilingual:
            if code != "en":
                raise ValueError(f"this Whisper model is English-only, not {language!r}")
            return None
        token = f"<|{code}|>"
        if self.tokenizer.token_to_id(token) is None:
            raise ValueError(f"unknown language {language!r} for Whisper")
        return token

    def _n_mels(self) -> int:
        # Newer CTranslate2 reads it from the model; converted models from
        # Transformers also carry it in preprocessor_config.json.
        n_mels = getattr(self._model, "n_mels", None)
        if isinstance(n_mels, int) and n_mels > 0:
            return n_mels
        config = self.model_dir / "preprocessor_config.json"
        if config.exists():
            return int(json.loads(config.read_text()).get("feature_size", 80))
        return 80


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
