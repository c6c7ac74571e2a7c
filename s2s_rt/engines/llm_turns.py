"""Turn-taking between sessions on the one LLM: answers not yet heard decode before answers being heard."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from s2s_rt.engines.base import StopCheck

#: Vocabulary entries that end a sentence: marks, then perhaps quotes and line breaks (byte-level BPE
#: writes a space as "Ġ" and a line break as "Ċ"; SentencePiece a space as "▁").
SENTENCE_END = re.compile(r"[Ġ▁]?[.?!]+[\"')]*(Ċ|ĊĊ|<0x0A>)*")


#: An answer goes before answers already being heard for at most this many tokens (about a second), spoken or not.
URGENT_TOKENS = 24
#: An answer pauses for at most this long while its first words are made into speech (:meth:`Turns.hold`).
HOLD_S = 0.5


class Turns:
    """Which answers are waiting for their first words: they decode before answers already being heard.

    CTranslate2 runs one generation at a time per model (``inter_threads``
    1): an answer asked for while another streams would wait for all of it.
    An answer already being heard gives way instead, between two tokens,
    and resumes when no answer is waiting for its first words.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: Answers that have not spoken yet.
        self.urgent = 0
        #: Times an answer resumed after giving way.
        self.resumed = 0
        #: Times an answer paused while its first words were made into speech, and of them, those that ran out.
        self.held = 0
        self.held_out = 0

    def enter(self) -> None:
        with self._changed:
            self.urgent += 1
            self._changed.notify_all()

    def leave(self) -> None:
        with self._changed:
            self.urgent -= 1
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

    def wait_clear(self, should_stop: StopCheck) -> None:
        """Block until no answer is urgent (or ``should_stop``)."""
        with self._changed:
            while self.urgent and not should_stop():
                self._changed.wait(0.05)
