"""One spoken question and what came back: its event times, the intervals between them, its record."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from s2s_rt.wer import word_error_rate

INTERVALS: tuple[tuple[str, str, str], ...] = (
    ("end of speech → speech_stopped", "eos", "speech_stopped"),
    ("speech_stopped → transcription completed", "speech_stopped", "transcribed"),
    ("transcription completed → response.created", "transcribed", "response_created"),
    ("response.created → first audio delta", "response_created", "first_audio"),
    ("first audio delta → response.done", "first_audio", "response_done"),
    ("END OF SPEECH → FIRST AUDIO DELTA", "eos", "first_audio"),
    ("end of speech → response.done", "eos", "response_done"),
)
#: A listener hears a gap when the answer's audio runs out before more arrives; shorter ones are not counted.
GAP_S = 0.02


@dataclass
class Turn:
    """One spoken question and what came back (times are ``perf_counter()`` seconds)."""

    session: int
    index: int
    question: str
    respond: bool
    speech_sent: float | None = None  # first chunk of the clip sent
    eos: float | None = None  # chunk holding the last voiced sample sent
    eos_index: int = -1
    speech_started: float | None = None
    speech_stopped: float | None = None
    committed: float | None = None
    transcribed: float | None = None
    response_created: float | None = None
    first_audio: float | None = None
    response_done: float | None = None
    transcript: str | None = None
    answer: str | None = None
    status: str | None = None
    answer_audio_s: float = 0.0
    #: When a listener playing the answer from its first delta runs out of audio (None: nothing heard yet).
    played_until: float | None = None
    #: Silences inside the answer that a listener hears (each over :data:`GAP_S`), and their total.
    gaps: int = 0
    gap_s: float = 0.0
    input_tokens: int | None = None
    cached_tokens: int | None = None
    segments: int = 0
    cancelled: int = 0
    started_decision: float | None = None
    stopped_decision: float | None = None
    final_item: str | None = None
    response_id: str | None = None
    failure: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def new_answer(self) -> None:
        """A response began: what was heard of an earlier one is not this answer's."""
        self.first_audio = self.played_until = None
        self.answer_audio_s = self.gap_s = 0.0
        self.gaps = 0

    def hear(self, now: float, seconds: float) -> None:
        """``seconds`` of the answer's audio arrived at ``now``: play it after what came before, as a client
        would, and count the silence heard if what came before had already run out."""
        if self.first_audio is None:
            self.first_audio = now
        start = now if self.played_until is None else max(now, self.played_until)
        if self.played_until is not None and now - self.played_until > GAP_S:
            self.gaps += 1
            self.gap_s += now - self.played_until
        self.played_until = start + seconds
        self.answer_audio_s += seconds

    def record(self) -> dict[str, Any]:
        base = self.eos or 0.0

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - base, 4)

        times = {
            name: rel(getattr(self, name))
            for name in (
                "speech_sent",
                "speech_started",
                "speech_stopped",
                "committed",
                "transcribed",
                "response_created",
                "first_audio",
                "response_done",
            )
        }
        return {
            "session": self.session,
            "turn": self.index,
            "question": self.question,
            "transcript": self.transcript,
            "transcript_wer": None
            if self.transcript is None
            else round(word_error_rate(self.question, self.transcript), 3),
            "answer": self.answer,
            "status": self.status,
            "answer_audio_s": round(self.answer_audio_s, 3),
            "answer_gaps": self.gaps,
            "answer_gap_s": round(self.gap_s, 3),
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "segments": self.segments,
            "cancelled_responses": self.cancelled,
            "failure": self.failure,
            "times_from_end_of_speech_s": times,
            "vad_decision_s": {"speech_started": self.started_decision, "speech_stopped": self.stopped_decision},
            "intervals_s": {label: self.interval(a, b) for label, a, b in INTERVALS},
        }

    def interval(self, a: str, b: str) -> float | None:
        ta, tb = getattr(self, a), getattr(self, b)
        return None if ta is None or tb is None else tb - ta

    def missing(self) -> list[str]:
        """Events this turn should have produced and did not."""
        need = [
            ("speech_started", "input_audio_buffer.speech_started"),
            ("speech_stopped", "input_audio_buffer.speech_stopped"),
            ("committed", "input_audio_buffer.committed"),
            ("transcribed", "conversation.item.input_audio_transcription.completed"),
        ]
        if self.respond:
            need += [
                ("response_created", "response.created"),
                ("first_audio", "response.output_audio.delta"),
                ("response_done", "response.done"),
            ]
        return [event for attr, event in need if getattr(self, attr) is None]
