"""Server-side turn detection: VAD probabilities in, speech start and stop out.

Pure and clocked by audio time (milliseconds of input since the session
began), never by wall time, so a turn is cut at the same sample whether the
client streams in real time or faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from s2s_rt.protocol.config import TurnDetection


@dataclass(frozen=True, slots=True)
class SpeechStart:
    #: Where the turn's audio begins: first voiced chunk minus the prefix padding.
    audio_start_ms: float


@dataclass(frozen=True, slots=True)
class SpeechStop:
    #: Where the turn's audio ends: last voiced chunk plus the silence duration.
    audio_end_ms: float


class TurnDetector:
    """Turns per-chunk speech probabilities into speech start and stop.

    Speech starts on the first chunk at or above ``threshold``; it continues
    while chunks stay above a slightly lower threshold (hysteresis, so a soft
    syllable does not end a turn) and stops once ``silence_duration_ms`` of
    audio has passed since the end of the last voiced chunk.

    Args:
        settings: the session's ``server_vad`` settings (read on every chunk,
            so a ``session.update`` applies at once).
    """

    def __init__(self, settings: TurnDetection) -> None:
        self.settings = settings
        self.speaking = False
        self.start_ms = 0.0
        self.last_voice_ms = 0.0

    def feed(self, probability: float, chunk_start_ms: float, chunk_end_ms: float) -> SpeechStart | SpeechStop | None:
        """Account for one chunk; return the turn event it causes, if any."""
        s = self.settings
        if not self.speaking:
            if probability >= s.threshold:
                self.speaking = True
                self.start_ms = max(0.0, chunk_start_ms - s.prefix_padding_ms)
                self.last_voice_ms = chunk_end_ms
                return SpeechStart(self.start_ms)
            return None
        if probability >= max(s.threshold - 0.15, 0.01):
            self.last_voice_ms = chunk_end_ms
            return None
        end = self.last_voice_ms + s.silence_duration_ms
        if chunk_end_ms >= end:
            self.speaking = False
            return SpeechStop(end)
        return None

    def reset(self) -> None:
        self.speaking = False
