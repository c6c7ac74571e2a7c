"""What the voice says for an LLM's text: no markdown, numbers and symbols in words (s2s_rt.speech_text)."""

from __future__ import annotations

import pytest

from s2s_rt.speech_text import cardinal, ordinal, speakable, year


@pytest.mark.parametrize(
    ("written", "spoken"),
    [
        ("**Canberra** is the capital.", "Canberra is the capital."),
        ("# Steps\n- Mix the flour\n- Bake it", "Steps. Mix the flour. Bake it."),
        ("Here is how:\n\n1. Mix\n2. Bake\n\nDone.", "Here is how: one. Mix. two. Bake. Done."),
        ("Use `print()`:\n```python\nprint(1)\n```\nThat prints one.", "Use print(): That prints one."),
        ("See [the guide](https://example.com/a) or https://www.python.org/doc", "See the guide or python.org"),
        ("*Really* _good_", "Really good"),
        ("| city | temperature |\n|---|---|\n| Paris | 20 |", "city, temperature. Paris, twenty."),
        ("Great! 😀", "Great!"),
    ],
)
def test_markdown_is_not_read_aloud(written: str, spoken: str) -> None:
    assert speakable(written) == spoken


@pytest.mark.parametrize(
    ("written", "spoken"),
    [
        ("A spider has 8 legs.", "A spider has eight legs."),
        ("There are 5,280 feet in a mile.", "There are five thousand two hundred eighty feet in a mile."),
        ("It is 37.8 degrees.", "It is thirty-seven point eight degrees."),
        (
            "100°F is about 37.8 °C.",
            "one hundred degrees Fahrenheit is about thirty-seven point eight degrees Celsius.",
        ),
        ("Humidity is 45%.", "Humidity is forty-five percent."),
        ("It costs $12.50.", "It costs twelve dollars and fifty cents."),
        ("It weighs 1 kg, or 2.2 lbs.", "It weighs one kilogram, or two point two pounds."),
        ("Drive at 50 km/h.", "Drive at fifty kilometers per hour."),
        ("It is 3:40 pm.", "It is three forty PM."),
        ("The train leaves at 15:05.", "The train leaves at fifteen oh five."),
        ("Meet at 9am.", "Meet at nine AM."),
        ("Today is 2025-06-12.", "Today is June twelfth, twenty twenty-five."),
        ("Today is June 12, 2025.", "Today is June twelfth, twenty twenty-five."),
        ("He died in 1955 at 76.", "He died in nineteen fifty-five at seventy-six."),
        ("In the 1990s.", "In the nineteen nineties."),
        ("She came 1st and he 22nd.", "She came first and he twenty-second."),
        ("7 × 8 = 56", "seven times eight equals fifty-six"),
        ("Add 1/2 cup, then 3/4 cup.", "Add one half cup, then three quarters cup."),
        ("Water it 2-3 times a month.", "Water it two to three times a month."),
        ("It was -5 degrees.", "It was minus five degrees."),
        ("Call 555-1234.", "Call five five five, one two three four."),
        ("Fruit, e.g. apples.", "Fruit, for example apples."),
    ],
)
def test_numbers_units_and_symbols_are_spoken_as_words(written: str, spoken: str) -> None:
    assert speakable(written) == spoken


def test_other_languages_keep_their_numbers_for_espeak_to_read() -> None:
    assert speakable("**Es ist** 15:40 Uhr, 20 °C.", "de") == "Es ist 15:40 Uhr, 20 °C."


def test_a_number_that_starts_an_answer_is_said() -> None:
    assert speakable("42. That is the answer.") == "forty-two. That is the answer."


def test_plain_text_is_unchanged() -> None:
    assert speakable("The capital of France is Paris.") == "The capital of France is Paris."
    assert speakable("   ") == ""


@pytest.mark.parametrize(
    ("n", "words"),
    [(0, "zero"), (13, "thirteen"), (40, "forty"), (99, "ninety-nine"), (101, "one hundred one"),
     (3600, "three thousand six hundred"), (1_000_001, "one million one"), (-7, "minus seven")],
)  # fmt: skip
def test_cardinal(n: int, words: str) -> None:
    assert cardinal(n) == words


@pytest.mark.parametrize(
    ("n", "words"), [(1, "first"), (2, "second"), (12, "twelfth"), (20, "twentieth"), (21, "twenty-first")]
)
def test_ordinal(n: int, words: str) -> None:
    assert ordinal(n) == words


@pytest.mark.parametrize(
    ("n", "words"),
    [(1879, "eighteen seventy-nine"), (1905, "nineteen oh five"), (1800, "eighteen hundred"),
     (2005, "two thousand five"), (2025, "twenty twenty-five")],
)  # fmt: skip
def test_year(n: int, words: str) -> None:
    assert year(n) == words
