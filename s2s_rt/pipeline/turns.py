"""What the listener keeps about a session's turns: its buffered audio, where it is, and the turn detector."""

from __future__ import annotations

from typing import Any

from s2s_rt.listening.buffer import InputBuffer
from s2s_rt.turn import SemanticTurnEnd, TurnDetector


class TurnState:
    """One session's turn-taking state. Only the slot's listener (run by the listening clock) touches it.

    Args:
        turn_detection: the session's turn detection settings (None: the client commits).
        semantic: the waits of ``semantic_vad``.
    """

    def __init__(self, turn_detection: Any, semantic: SemanticTurnEnd | None = None) -> None:
        #: Samples of input audio heard so far (the session's sample clock).
        self.position = 0
        self.buffer = InputBuffer()
        self.detector = TurnDetector(turn_detection, semantic) if turn_detection is not None else None
        #: The item id ``speech_started`` announced for the turn being spoken.
        self.turn_item_id: str | None = None
        #: Where idle time started counting (``idle_timeout_ms``).
        self.idle_from = 0
        #: Audio time of the last live-caption pass (transcription sessions).
        self.captioned_ms = 0.0
        #: The client was told the buffer is full; not again until it has room.
        self.buffer_full = False
        #: The ``event_id`` of the last append heard.
        self.heard_event_id: str | None = None
        #: ``perf_counter()`` when the last voiced audio was heard (a turn's waterfall counts from it).
        self.voice_heard: float | None = None
