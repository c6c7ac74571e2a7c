"""The first clause: cut soon, and only where a speaker could pause."""

from __future__ import annotations

import pytest

from s2s_rt.pipeline.clauses import ClauseSplitter, pause_fits_between


def clauses(text: str, first_words: int) -> list[str]:
    """``text`` fed word by word as a model streams it (each token starts with its space), then flushed."""
    splitter = ClauseSplitter(first_words=first_words)
    tokens = text.replace(" ", "\0 ").split("\0")
    out = [clause for token in tokens for clause in splitter.feed(token)]
    rest = splitter.flush()
    return [*out, rest] if rest else out


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("The capital of France is Paris, a city on the Seine.", "The capital of France"),
        ("Albert Einstein was seventy six years old when he died.", "Albert Einstein was seventy six years old"),
        ("I am a voice assistant and I can help you with many things.", "I am a voice assistant"),
        ("It's about twenty degrees in Paris today.", "It's about twenty degrees"),
        ("Hello there, how are you doing today?", "Hello there,"),
        ("Water boils at one hundred degrees Celsius at sea level.", "Water boils at one hundred degrees Celsius"),
    ],
)
def test_the_first_clause_ends_where_a_pause_fits(text: str, first: str) -> None:
    said = clauses(text, first_words=3)
    assert said[0] == first
    assert " ".join(said).split() == text.split()  # nothing lost or doubled


def test_it_never_ends_on_a_word_that_leans_on_the_next() -> None:
    text = "The best way to get from the airport to the city centre is the train, which runs every ten minutes."
    for first_words in (1, 2, 3, 4, 5):
        first = clauses(text, first_words)[0]
        assert len(first.split()) >= first_words
        assert first.split()[-1].lower() not in ("the", "to", "from", "is"), first


def test_without_a_place_to_pause_it_is_cut_after_six_more_words() -> None:
    words = " ".join(["big"] * 20)  # no word here opens a phrase: nowhere fits, it waits, then cuts anyway
    assert len(clauses(words, first_words=3)[0].split()) == 9


@pytest.mark.parametrize(
    ("word", "following", "fits"),
    [
        ("France", "is", True),
        ("of", "France", False),
        ("voice", "assistant", False),
        ("assistant", "and", True),
        ("twenty", "in", False),  # a number may go on ("twenty | five")
        ("It's", "about", False),
        ("minutes", "you're", True),
    ],
)
def test_the_prosody_check(word: str, following: str, fits: bool) -> None:
    assert pause_fits_between(word, following) is fits
