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
        ("capital", "of", False),  # "of" binds to the noun before it
        ("capital", "in", True),
    ],
)
def test_the_prosody_check(word: str, following: str, fits: bool) -> None:
    assert pause_fits_between(word, following) is fits


def test_the_second_piece_is_cut_early_too_and_the_rest_at_sentence_ends() -> None:
    """While the second piece is made, the listener hears only the first (perhaps two words): it is cut where a
    pause fits after twice the first's words, not at the sentence's end; the third waits for the sentence's end."""
    text = (
        "The Earth is about one hundred and fifty million kilometres away from the Sun"
        " and it takes light eight minutes to reach us. It is far."
    )
    said = clauses(text, first_words=2)
    assert said[:2] == ["The Earth", "is about one hundred and fifty million kilometres away"]
    assert said[2] == "from the Sun and it takes light eight minutes to reach us."
    assert said[3:] == ["It is far."]


def test_the_default_first_clause_is_two_words_where_a_pause_fits() -> None:
    splitter = ClauseSplitter()
    out = [
        clause for token in "The sky is blue today.".replace(" ", "\0 ").split("\0") for clause in splitter.feed(token)
    ]
    assert out[0] == "The sky"


def test_the_first_clause_is_cut_at_the_token_that_writes_the_word_after_it() -> None:
    """The word after the place is judged as written: the cut comes with " is", not a token later with " Paris"
    (the next token's space), and a word that does not open a phrase, whole or not yet, does not cut."""
    splitter = ClauseSplitter()
    fed = {token: splitter.feed(token) for token in ("The", " capital", " of", " France", " is")}
    assert fed == {"The": [], " capital": [], " of": [], " France": [], " is": ["The capital of France"]}
    assert splitter.flush() == "is"
    splitter = ClauseSplitter()
    assert [splitter.feed(token) for token in ("A", " blue", " wh", "ale", " is")] == [[], [], [], [], ["A blue whale"]]


def test_the_second_piece_is_cut_where_it_can_be_before_the_first_has_played_out() -> None:
    """ "The Earth" plays about 0.64 s; the second piece has no place for a pause before "away", and the digits
    come a token each: by the time the first has nearly played out, the second is cut at its last word that does
    not lean on the next. Tokens that come fast enough are cut by the pause rule as before."""

    def cut(seconds_a_token: float) -> list[str]:
        now = 0.0
        splitter = ClauseSplitter(clock=lambda: now)
        out: list[str] = []
        tokens = [
            "The", " Earth", " is", " approximately", " ", "1", "4", "9", ",", "5", "9", "7",
            " kilometers", " away", " from", " the", " Moon", ".",
        ]  # fmt: skip
        for token in tokens:
            out += splitter.feed(token)
            now += seconds_a_token
        return [*out, splitter.flush()]

    slow = cut(0.05)
    assert slow[:2] == ["The Earth", "is approximately"]
    assert " ".join(slow).split() == "The Earth is approximately 149,597 kilometers away from the Moon.".split()
    assert cut(0.01)[:2] == ["The Earth", "is approximately 149,597 kilometers away"]


def test_a_sentence_is_cut_at_its_mark_not_a_token_later() -> None:
    """A full stop, exclamation or question mark after a word ends the clause with the token that writes it, not
    with the next token's space or the answer's end; where the mark may go on ("3.14", "U.S."), it waits."""

    def fed(tokens: list[str]) -> list[list[str]]:
        splitter = ClauseSplitter()
        return [splitter.feed(token) for token in tokens]

    assert fed(["Half", " of", " ninety", " is", " forty", "-five", "."])[-1] == ["Half of ninety is forty-five."]
    assert fed(["Good", " morning", "!", " How"])[2] == ["Good morning!"]
    assert fed(["Pi", " is", " about", " three", " point", " 3", "."]) == [[], [], [], [], [], [], []]
    assert fed(["Made", " in", " the", " U", ".S", "."]) == [[], [], [], [], [], []]
