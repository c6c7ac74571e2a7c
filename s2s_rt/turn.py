"""Server-side turn detection: VAD probabilities in, speech start and stop out.

Pure and clocked by audio time (milliseconds of input since the session
began), never by wall time, so a turn is cut at the same sample whether the
client streams in real time or faster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from s2s_rt.engines.base import Float32Array, ms_to_samples
from s2s_rt.protocol.config import EAGERNESS_MAX_MS, TurnDetection

#: The longest pause inside a turn that the recogniser hears whole; a longer one is heard this long (its
#: middle is left out). Whisper takes a long pause for the end of what was said: in 12 questions with a
#: 0.7-1.0 s pause mid-sentence ("Tell me a word that rhymes with | house"), said by Piper, flite (slt, awb)
#: and espeak-ng (en-us), it dropped or misheard the words after the pause, and with the pauses heard 0.3 s
#: long (plus the voices' own edges) the word error rate fell from 7.2/10.9/8.8/11.5 % to 5.0/8.9/7.8/11.4 %.
PAUSE_HEARD_MS = 400


@dataclass(frozen=True, slots=True)
class SpeechStart:
    #: Where the turn's audio begins: first voiced chunk minus the prefix padding.
    audio_start_ms: float


@dataclass(frozen=True, slots=True)
class SpeechStop:
    #: Where the turn's audio ends: last voiced chunk plus the silence duration.
    audio_end_ms: float


@dataclass(frozen=True, slots=True)
class SemanticTurnEnd:
    """How long ``semantic_vad`` waits in a silence, by how finished the words so far sound.

    The probability that the user has finished comes from the chat LLM
    reading the speculative transcript (its probability that the sentence
    ends there: :meth:`~s2s_rt.engines.llm.CT2ChatLLM.turn_end_probability`).
    At or above the eagerness's threshold the turn ends after
    ``min_silence_ms``; below it the wait grows with the doubt, on a log
    scale, up to OpenAI's maximum for the eagerness (2, 4 or 8 s) at
    ``decades`` powers of ten below the threshold.

    Measured on the default model (the judge's prompt of 2026-12-04), with
    Whisper base hearing 24 questions cut at a pause mid-sentence ("Set a
    timer for twenty |", "Turn the volume up to |") and the same 24 whole,
    in six voices unlike Piper's (flite kal and awb, espeak-ng en-gb,
    en-gb-x-rp at 190 words a minute, en-029, en-us+f2 at 140): the whole
    questions score 0.006 (p10), 0.04 (p25), 0.27 (median); the fragments
    mostly 0.0001 or less, but a fragment Whisper mishears or closes with a
    number scores like a question ("My phone number is 555" 0.03-0.13, "Is
    it going to rain in" heard as "Is it going to Raymond?" 0.03, as "Is it
    going to ruin it?" 0.49). The threshold was 0.005 with two decades: a
    judgement of 0.005 ended the turn after 0.2 s, and 31 % of the
    fragments (up to 47 % for one voice) were cut off in a 0.6-1.2 s pause.
    At 0.2 with one and a half decades, 8 % (worst voice 28 %), and the
    median whole question still ends after 0.2 s; a quarter of them (those
    the model expects to go on, "Can you recommend a good Italian
    restaurant" 0.02) wait a second or more.

    Args:
        min_silence_ms: the turn never ends sooner.
        unknown_ms: no probability yet (the transcript or the model is
            still busy): the turn ends after this much silence anyway.
        speculate_ms: silence after which the words so far are transcribed
            and judged.
        thresholds: probability at or above which the turn ends at once, per eagerness.
        decades: how many powers of ten below the threshold the wait reaches the eagerness's maximum.
    """

    min_silence_ms: int = 200
    unknown_ms: int = 1200
    speculate_ms: int = 100
    thresholds: dict[str, float] = field(default_factory=lambda: {"high": 0.08, "medium": 0.2, "auto": 0.2, "low": 0.4})
    decades: float = 1.5

    def wait_ms(self, probability: float | None, eagerness: str) -> float:
        """Silence needed to end the turn, given the probability that the user has finished."""
        cap = EAGERNESS_MAX_MS[eagerness]
        if probability is None:
            return min(self.unknown_ms, cap)
        threshold = self.thresholds[eagerness]
        if probability >= threshold:
            return self.min_silence_ms
        doubt = min(1.0, math.log10(threshold / max(probability, 1e-12)) / self.decades)
        return self.min_silence_ms + doubt * (cap - self.min_silence_ms)


class TurnDetector:
    """Turns per-chunk speech probabilities into speech start and stop.

    Speech starts on the first chunk at or above ``threshold``; it continues
    while chunks stay above a slightly lower threshold (hysteresis, so a soft
    syllable does not end a turn) and stops once enough silence has passed
    since the end of the last voiced chunk: ``silence_duration_ms`` for
    ``server_vad``; for ``semantic_vad``, what :class:`SemanticTurnEnd` says
    for :attr:`finished` (the probability that the words so far end the
    turn, set by the listener; None until it is known).

    Args:
        settings: the session's turn detection settings (read on every chunk,
            so a ``session.update`` applies at once).
        semantic: the waits of ``semantic_vad``.
    """

    def __init__(self, settings: TurnDetection, semantic: SemanticTurnEnd | None = None) -> None:
        self.settings = settings
        self.semantic = semantic or SemanticTurnEnd()
        self.speaking = False
        self.start_ms = 0.0
        self.last_voice_ms = 0.0
        #: ``semantic_vad``: the probability that the user has finished, for the silence running now.
        self.finished: float | None = None
        #: The turn's pauses longer than :data:`PAUSE_HEARD_MS` so far: (last voice, voice again), in ms.
        self.pauses: list[tuple[float, float]] = []

    def silence_needed_ms(self) -> float:
        """How much silence ends the turn now."""
        s = self.settings
        if s.type != "semantic_vad":
            return s.silence_duration_ms
        return self.semantic.wait_ms(self.finished, s.eagerness)

    def feed(self, probability: float, chunk_start_ms: float, chunk_end_ms: float) -> SpeechStart | SpeechStop | None:
        """Account for one chunk; return the turn event it causes, if any."""
        s = self.settings
        if not self.speaking:
            if probability >= s.threshold:
                self.speaking = True
                self.start_ms = max(0.0, chunk_start_ms - s.prefix_padding_ms)
                self.last_voice_ms = chunk_end_ms
                self.finished = None
                self.pauses = []
                return SpeechStart(self.start_ms)
            return None
        if probability >= max(s.threshold - 0.15, 0.01):
            if chunk_start_ms - self.last_voice_ms > PAUSE_HEARD_MS:
                self.pauses.append((self.last_voice_ms, chunk_start_ms))
            self.last_voice_ms = chunk_end_ms
            self.finished = None  # the judgement was of words the user went on from
            return None
        end = self.last_voice_ms + self.silence_needed_ms()
        if chunk_end_ms >= end:
            self.speaking = False
            return SpeechStop(end)
        return None

    def reset(self) -> None:
        self.speaking = False


def shorten_pauses(audio: Float32Array, start: int, pauses: Sequence[tuple[float, float]]) -> Float32Array:
    """``audio`` (which begins at sample ``start`` of the session) as the recogniser should hear it: each
    pause (in ms of the session's audio) longer than
    :data:`PAUSE_HEARD_MS` cut to that length, half of it kept after the voice before and half before the
    voice after. The audio a turn commits is not changed; only what is transcribed."""
    if not pauses:
        return audio
    keep = ms_to_samples(PAUSE_HEARD_MS / 2)
    pieces, at = [], 0
    for begin_ms, end_ms in pauses:
        begin, end = ms_to_samples(begin_ms) - start, ms_to_samples(end_ms) - start
        if begin < at or end - begin <= 2 * keep or end > len(audio):
            continue  # not inside what is left of this audio
        pieces.append(audio[at : begin + keep])
        at = end - keep
    if not pieces:
        return audio
    pieces.append(audio[at:])
    return np.concatenate(pieces)
