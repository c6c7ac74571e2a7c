"""Clauses: an answer streamed as text, cut where speech can begin before the answer ends."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

#: An answer's first clause is cut after this many words or a few more, where a pause fits. Two rather than three
#: cut "The sky | is blue" and "A spider | has four legs" where three waited for the sentence's end: on two cores
#: (AMD EPYC, 16 one-question conversations a run, alternated with the code before) the first audio came
#: 886/931/963 ms after the user's last word instead of 975/977/987, 4-5 tokens to the first clause instead of 5-7.
FIRST_CLAUSE_WORDS = 2

#: Where a clause ends: after a sentence's or clause's mark and the space that follows it; or at a full stop,
#: exclamation or question mark that ends the text so far after a word of two letters or more, a token before
#: that space comes (the place is the same: "3.14", "e.g." and "U.S." are not cut there); or after a comma and
#: the space and a word of two letters that follow it ("1,000" is not cut).
_CLAUSE_END = re.compile(r"(?<=[.!?;:])\s+|(?<=[^\W\d_]{2}[.!?])\Z|(?<=[,])\s+(?=\S{2,})")
#: A complete word: one with a space after it. It starts only where a word starts, so that a long run without
#: a space (a URL, a number, a hostile "aaaa…") is tried once, not again from each of its characters: that
#: made each call quadratic in the run, and an answer fed token by token cubic, on the event loop.
_WORD = re.compile(r"(?<!\S)\S+\s+")

#: Words after which English does not pause: they lean on the word that follows (articles, prepositions,
#: conjunctions, auxiliaries, determiners, subject pronouns). The first clause is never cut after one.
LEANING_WORDS = frozenset(
    """
    a an the this that these those my your his her its our their some any each every no not very so too
    of to in on at by for with from into onto upon about over under after before than as like per via
    and or but nor if because while although though whether since unless until when where which who whom whose
    is are was were be been being am do does did has have had will would shall should can could may might must
    i you he she it we they there here what how why
    """.split()
)
#: Numbers, spelled or written: "twenty | five", "3 | million" are not where a speaker pauses.
_NUMBER = re.compile(
    r"[\d.,%$€£]+|zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen"
    r"|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand"
    r"|million|billion|point|half|quarter"
)
#: How fast the voice speaks, in characters of text a second at speed 1 (Piper's voice: 31 characters in 2.2 s).
SPOKEN_CHARS_PER_S = 14.0
#: A piece must be cut this long before those before it have played out, for its speech to be made in time
#: (Piper's step for a short piece about 0.1 s on two cores, the LLM's pause for the first clause besides).
SPEECH_MADE_S = 0.25

#: A piece is cut at this length whatever it holds (at its last space, else here): text without a place to cut
#: (a URL, a long number, a run of letters) must not wait for the answer's end, nor be searched again and again
#: at every token, ever longer.
MAX_PIECE_CHARS = 400

#: Words that bind to the one before them: nobody pauses before them ("The capital | of France").
BOUND_TO_PREVIOUS = frozenset({"of"})
#: Contractions lean on what follows too ("it's | a", "you're | welcome").
_CONTRACTION = re.compile(r".+'(s|re|m|ll|ve|d)|.+n't")


def _bare(word: str) -> str:
    """``word`` without its spacing, quotes and brackets, in lower case, with a plain apostrophe."""
    return word.strip().strip("\"'()[]*_").lower().replace("\u2019", "'")


def _leans(word: str) -> bool:
    bare = _bare(word)
    return not bare or bare in LEANING_WORDS or bool(_NUMBER.fullmatch(bare) or _CONTRACTION.fullmatch(bare))


def pause_fits_between(word: str, following: str) -> bool:
    """Whether a speaker may pause between ``word`` and the ``following`` one (the first clause's prosody check).

    Between a word that does not lean on the next and a word that opens a
    phrase of its own (a verb's auxiliary, a preposition, a conjunction, a
    pronoun): "The capital of France | is Paris", "Einstein | was born",
    "a voice assistant | and I", never "The capital of | France", "The
    capital | of France" nor "a voice | assistant".
    """
    bare = _bare(following)
    opens = bare in LEANING_WORDS and bare not in BOUND_TO_PREVIOUS
    return not _leans(word) and (opens or bool(_CONTRACTION.fullmatch(bare)))


class ClauseSplitter:
    """Cuts streamed text into clauses so speech can start before the answer ends.

    The first piece is cut at the first clause boundary (comma included), or
    after ``first_words`` words if no boundary comes sooner, to start
    speaking soon: a short answer is often one sentence, and waiting for its
    end would wait for the whole answer. A cut between words is made only
    where a speaker could pause (:func:`pause_fits_between`): "The capital of
    France | is Paris", never "The capital of | France"; it waits for such
    a place up to ``first_words + 6`` words. The second piece is cut the same
    way after twice as many words: while it is made, the listener hears only
    the first, which may be two words long ("The Earth | is about 150
    million kilometres away | from the Sun"). Later pieces are cut at
    sentence ends, so the voice keeps a natural flow. But whenever the
    pieces cut so far would have played out (less the time speech takes to
    make) before such a place comes, the next piece is cut at its last word
    that does not lean on the next: "The Earth | is approximately | 149,597
    kilometers away …", whose digits come a token each, or a long sentence
    after a short piece.

    Each piece of text is scanned once (plus a few characters of context):
    feeding a long answer token by token costs time linear in its length.
    """

    #: How far back a boundary may start before the end of what was scanned.
    _CONTEXT = 4
    #: Pieces cut where a pause fits after a few words (the first, then the second after twice as many).
    _EARLY_PIECES = 2

    def __init__(
        self,
        first_min_chars: int = 12,
        min_chars: int = 20,
        first_words: int = FIRST_CLAUSE_WORDS,
        *,
        speed: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.text = ""
        #: Pieces cut so far.
        self.pieces = 0
        self.speed = speed
        self.clock = clock
        #: When the pieces cut so far will have played out, as a listener hears them (None: none cut yet).
        self._plays_until: float | None = None
        self.first_min_chars = first_min_chars
        self.min_chars = min_chars
        self.first_words = first_words
        self._scanned = 0

    def feed(self, piece: str) -> list[str]:
        self.text += piece
        out: list[str] = []
        while True:
            early = self.pieces < self._EARLY_PIECES
            limit = self.first_min_chars if early else self.min_chars
            cut: re.Match[str] | None = None
            for m in _CLAUSE_END.finditer(self.text, max(0, self._scanned - self._CONTEXT)):
                is_sentence = self.text[m.start() - 1] in ".!?;:"
                if m.start() >= limit and (is_sentence or early):
                    cut = m
                    break
            end = cut.start() if cut is not None else None
            after = cut.end() if cut is not None else None
            if cut is None and early:
                after = end = self._pause_after(self.first_words * (1 + self.pieces))
            if end is None and self._plays_until is not None and self.clock() >= self._plays_until - SPEECH_MADE_S:
                after = end = self._last_word_end()
            if end is None and len(self.text) > MAX_PIECE_CHARS:
                space = self.text.rfind(" ", 1, MAX_PIECE_CHARS + 1)
                after = end = space if space > 0 else MAX_PIECE_CHARS
            if end is None or after is None:
                self._scanned = len(self.text)
                return out
            clause = self.text[:end].strip()
            self.text = self.text[after:]
            self._scanned = 0
            if clause:
                out.append(clause)
                now = self.clock()
                plays_from = now if self._plays_until is None else max(now, self._plays_until)
                self._plays_until = plays_from + len(clause) / (SPOKEN_CHARS_PER_S * self.speed)
                self.pieces += 1

    @property
    def first(self) -> bool:
        """No piece is cut yet: the next is the first clause."""
        return self.pieces == 0

    def _pause_after(self, least: int) -> int | None:
        """Where a piece may end between words: after ``least`` words or more, where a pause fits, or after
        ``least + 6`` words whatever they are.

        The word after the last complete one is judged as far as it is written: a model writes a common word
        in one token, so " is" is "is", not yet "island"; the rare longer word only moves a pause. That judges
        the place a token sooner than waiting for the word's end (the next token's space).
        """
        words = _WORD.finditer(self.text)
        word, n = next(words, None), 0
        while word is not None:
            n += 1
            after = next(words, None)
            if n >= least + 6:
                return word.end()
            if n >= least:
                following = after.group() if after is not None else self.text[word.end() :]
                if pause_fits_between(word.group(), following):
                    return word.end()
            word = after
        return None

    def _last_word_end(self) -> int | None:
        """The end of the last complete word (one with a space after it) that does not lean on the next (None:
        there is none)."""
        for word in reversed(list(_WORD.finditer(self.text))):
            if not _leans(word.group()):
                return word.end()
        return None

    def flush(self) -> str:
        rest, self.text = self.text.strip(), ""
        self._scanned = 0
        return rest

    def ends_first(self, piece: str) -> bool:
        """Fed an answer piece by piece (as :meth:`feed`): True at the piece that completes the first clause.

        For the model's own thread (:class:`~s2s_rt.engines.base.FirstWordsPause`), on a splitter of its own.
        """
        return self.first and bool(self.feed(piece))
