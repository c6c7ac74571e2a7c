"""Turn-taking between sessions on the one LLM: answers not yet heard decode before answers being heard."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from s2s_rt.engines.base import FirstWordsPause, StopCheck

#: Vocabulary entries that end a sentence: marks, then perhaps quotes and line breaks (byte-level BPE
#: writes a space as "Ġ" and a line break as "Ċ"; SentencePiece a space as "▁").
SENTENCE_END = re.compile(r"[Ġ▁]?[.?!]+[\"')]*(Ċ|ĊĊ|<0x0A>)*")


#: An answer goes before answers already being heard for at most this many tokens (about a second), spoken or not.
URGENT_TOKENS = 24
#: An answer pauses for at most this long while its first words are made into speech (:meth:`Turns.hold`).
HOLD_S = 0.5


class Turns:
    """Which answers are waiting for their first words: they decode before answers already being heard.

    Answers take the model one at a time in each of its lanes
    (:class:`~s2s_rt.engines.llm_lanes.Lanes`; each lane has its own
    turn-taking): an answer asked for while another streams would wait for
    all of it. An answer already being heard gives way instead, between two
    tokens, and resumes once the answers that were waiting for their first
    words when it gave way have spoken: those asked for later do not hold it
    too, or answers asked for one after another (many sessions talking)
    would hold it for good. Resumed, it gives way again only after
    :data:`URGENT_TOKENS` more tokens.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: Answers that have not spoken yet.
        self.urgent = 0
        #: How many answers have ever been urgent: each is numbered in the order it became so.
        self.entered = 0
        self._waiting: set[int] = set()
        #: Times an answer resumed after giving way.
        self.resumed = 0
        #: Times an answer paused while its first words were made into speech, and of them, those that ran out.
        self.held = 0
        self.held_out = 0

    def enter(self) -> int:
        """An answer waits for its first words; returns its number (for :meth:`leave`)."""
        with self._changed:
            self.urgent += 1
            self.entered += 1
            self._waiting.add(self.entered)
            self._changed.notify_all()
            return self.entered

    def leave(self, number: int) -> None:
        with self._changed:
            self.urgent -= 1
            self._waiting.discard(number)
            self._changed.notify_all()

    def hold(self, holding: Callable[[], bool], should_stop: StopCheck, *, own: Callable[[], int]) -> None:
        """Block while ``holding()`` (an answer's first words are being made into speech), for at most
        :data:`HOLD_S`, unless another answer is waiting for its first words or ``should_stop``.

        On two cores the model's threads and the speech synthesiser's share the cores: the first clause's
        speech, which the user waits for, is made in about two thirds of the time while the model waits.
        ``own()`` is how many of :attr:`urgent` are the holding answer's own (0 or 1).
        """
        deadline = time.monotonic() + HOLD_S
        with self._changed:
            self.held += 1
            while holding() and not should_stop() and self.urgent <= own():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.held_out += 1
                    return
                # Woken when another answer becomes urgent; the speech's end is seen within 2 ms.
                self._changed.wait(min(left, 0.002))

    def wait_clear(self, should_stop: StopCheck, *, entered_by: int | None = None) -> None:
        """Block until none of the answers numbered up to ``entered_by`` (None: any) is urgent, or ``should_stop``."""
        with self._changed:
            while not should_stop() and any(entered_by is None or n <= entered_by for n in self._waiting):
                self._changed.wait(0.05)


class AnswerTurn:
    """One answer's place in the turn-taking: urgent until it has spoken, then giving way; pausing once.

    The reader of the answer's tokens calls :meth:`took` after each token
    and :meth:`close` at the end; CTranslate2's worker calls
    :meth:`after_token` (see :meth:`~s2s_rt.engines.llm_lanes.Lanes.steps`).

    Args:
        turns: the model's turn-taking.
        decode: turns a token id into text (a fresh ``TextStream``'s ``push``), for the pause.
        end_ids: tokens that end the answer.
        urgent: True while the answer has not been heard yet; None: never urgent.
        pause: where the answer pauses while its first words are made into speech.
        should_stop: True ends the answer.
    """

    def __init__(
        self,
        turns: Turns,
        decode: Callable[[int], str],
        end_ids: Sequence[int],
        *,
        urgent: Callable[[], bool] | None,
        pause: FirstWordsPause | None,
        should_stop: StopCheck,
    ) -> None:
        self._turns = turns
        self._decode = decode
        self._end_ids = end_ids
        self._urgent = urgent
        self._pause = pause
        self._should_stop = should_stop
        #: True while the answer is counted in ``turns.urgent``.
        self.waiting = urgent is not None and urgent()
        self._number = turns.enter() if self.waiting else 0
        #: Tokens said so far (the reader's count), and how many it says before it may give way again.
        self._said = 0
        self._gives_way_from = 0

    def after_token(self, step: Any, closed: threading.Event, beside: int = 0) -> bool:
        """Run in CTranslate2's worker after each token, the token already handed over: True stops the decoding
        itself (not only our reading of it); it may block, which pauses it (and the answers decoded beside it).
        ``beside``: answers waiting for their first words decoded in the same call; it does not give way to them."""
        pause = self._pause
        if pause is not None and step.token_id not in self._end_ids:
            piece = self._decode(step.token_id)
            if piece and pause.ends_first_clause(piece):
                spoken = pause.spoken
                self._turns.hold(
                    lambda: not spoken(),
                    lambda: closed.is_set() or self._should_stop(),
                    own=lambda: 1 if self.waiting else 0,
                )
                self._pause = None  # once: the first clause only
        gives_way = not self.waiting and self._said >= self._gives_way_from and self._turns.urgent > beside
        return self._should_stop() or gives_way

    def resumed(self) -> None:
        """It resumes after giving way: its next :data:`URGENT_TOKENS` tokens are its own, whoever waits."""
        self._gives_way_from = self._said + URGENT_TOKENS
        self._turns.resumed += 1

    def took(self, said: int) -> None:
        """The reader has ``said`` tokens of the answer so far."""
        self._said = said
        if self.waiting and (said >= URGENT_TOKENS or (self._urgent is not None and not self._urgent())):
            # It has spoken, or had its share: from now on it gives way to answers that have not. (An answer
            # whose words are held back, a tool call, would otherwise stay urgent for its whole length and
            # hold every other session's answer.)
            self.close()

    def close(self) -> None:
        """The answer has spoken, had its share, or ended: it no longer goes before others."""
        if self.waiting:
            self.waiting = False
            self._turns.leave(self._number)
