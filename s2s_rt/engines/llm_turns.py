"""Turn-taking between sessions on the one LLM: answers not yet heard decode before answers being heard."""

from __future__ import annotations

import re
import threading

from s2s_rt.engines.base import StopCheck

#: Vocabulary entries that end a sentence: marks, then perhaps quotes and line breaks (byte-level BPE
#: writes a space as "Ġ" and a line break as "Ċ"; SentencePiece a space as "▁").
SENTENCE_END = re.compile(r"[Ġ▁]?[.?!]+[\"')]*(Ċ|ĊĊ|<0x0A>)*")


#: An answer goes before answers already being heard for at most this many tokens (about a second), spoken or not.
URGENT_TOKENS = 24


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

    def enter(self) -> None:
        with self._changed:
            self.urgent += 1

    def leave(self) -> None:
        with self._changed:
            self.urgent -= 1
            self._changed.notify_all()

    def wait_clear(self, should_stop: StopCheck) -> None:
        """Block until no answer is urgent (or ``should_stop``)."""
        with self._changed:
            while self.urgent and not should_stop():
                self._changed.wait(0.05)
