"""Clauses: an answer streamed as text, cut where speech can begin before the answer ends."""

from __future__ import annotations

import re

_CLAUSE_END = re.compile(r"(?<=[.!?;:])\s+|(?<=[,])\s+(?=\S{2,})")


class ClauseSplitter:
    """Cuts streamed text into clauses so speech can start before the answer ends.

    The first piece is cut at the first clause boundary (comma included), or
    after ``first_words`` words if no boundary comes sooner, to start
    speaking soon: a short answer is often one sentence, and waiting for its
    end would wait for the whole answer. Later pieces are cut at sentence
    ends, so the voice keeps a natural flow.

    Each piece of text is scanned once (plus a few characters of context):
    feeding a long answer token by token costs time linear in its length.
    """

    #: How far back a boundary may start before the end of what was scanned.
    _CONTEXT = 4

    def __init__(self, first_min_chars: int = 12, min_chars: int = 20, first_words: int = 5) -> None:
        self.text = ""
        self.first = True
        self.first_min_chars = first_min_chars
        self.min_chars = min_chars
        self._first_words = re.compile(r"\s*(?:\S+\s+){" + str(first_words) + "}")
        self._scanned = 0

    def feed(self, piece: str) -> list[str]:
        self.text += piece
        out: list[str] = []
        while True:
            limit = self.first_min_chars if self.first else self.min_chars
            cut: re.Match[str] | None = None
            for m in _CLAUSE_END.finditer(self.text, max(0, self._scanned - self._CONTEXT)):
                is_sentence = self.text[m.start() - 1] in ".!?;:"
                if m.start() >= limit and (is_sentence or self.first):
                    cut = m
                    break
            if cut is None and self.first:
                cut = self._first_words.match(self.text)
            if cut is None:
                self._scanned = len(self.text)
                return out
            clause = self.text[: cut.end()].strip() if cut.re is self._first_words else self.text[: cut.start()].strip()
            self.text = self.text[cut.end() :]
            self._scanned = 0
            if clause:
                out.append(clause)
                self.first = False

    def flush(self) -> str:
        rest, self.text = self.text.strip(), ""
        self._scanned = 0
        return rest
