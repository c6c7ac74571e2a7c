"""Numbers and clock times said in words are written in digits for a function's arguments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from s2s_rt.speech_text import cardinal
from s2s_rt.written_numbers import number, written


@pytest.mark.parametrize(
    ("said", "digits"),
    [
        ("Wake me at a quarter to six.", "Wake me at 5:45."),
        ("Set an alarm for a quarter past eight.", "Set an alarm for 8:15."),
        ("I need to get up at half past five tomorrow.", "I need to get up at 5:30 tomorrow."),
        ("Can you get me up at ten past seven?", "Can you get me up at 7:10?"),
        ("twenty-five to twelve", "11:35"),
        ("Set an alarm for nine in the evening.", "Set an alarm for 21:00."),
        ("Set an alarm for seven in the morning called gym.", "Set an alarm for 07:00 called gym."),
        ("wake me at four fifteen", "wake me at 4:15"),
        ("at ten oh five", "at 10:05"),
        ("at six o'clock", "at 6:00"),
        ("a table at 7 pm", "a table at 19:00"),
        ("at twelve in the morning", "at 00:00"),
        ("ring at noon", "ring at 12:00"),
        ("by midnight", "by 00:00"),
        ("Change one thousand Swedish kronor into euros.", "Change 1000 Swedish kronor into euros."),
        ("two hundred and fifty dollars", "250 dollars"),
        ("Set it to eighteen point five degrees.", "Set it to 18.5 degrees."),
        ("a table for two", "a table for 2"),
        ("Twenty euros in dollars, please.", "20 euros in dollars, please."),
        ("Thanks. Fifty pounds to yen?", "Thanks. 50 pounds to yen?"),
        # Digits said one by one, three or more: one number (a flight, an order, a phone number).
        ("Is BA one one seven on time today?", "Is BA 117 on time today?"),
        ("Which gate does KLM six oh five leave from?", "Which gate does KLM 605 leave from?"),
        ("Check order nine one zero zero two.", "Check order 91002."),
        ("Set an alarm for six oh five.", "Set an alarm for 6:05."),  # after "for": a time
        # A day of a month as an ordinal, and a time with "this evening".
        ("an interview on the twentieth of June at two in the afternoon", "an interview on June 20 at 14:00"),
        ("lunch on June the twenty-fifth at half past twelve", "lunch on June 25 at 12:30"),
        ("on March thirty-first", "on March 31"),
        ("a taxi for a quarter to seven this evening", "a taxi for 18:45"),
    ],
)
def test_times_and_amounts_in_words_are_written_in_digits(said: str, digits: str) -> None:
    assert written(said) == digits


@pytest.mark.parametrize(
    "said",
    [
        "One of my friends is here.",  # "one" alone is a word, not an amount
        "I have two twenty dollar bills.",  # two numbers, not 22
        "Who composed The Four Seasons?",  # a name
        "Play Ocean's Eleven.",
        "What is the capital of Italy?",
        "Quelle heure est-il?",
        "I want two three bedroom flats.",  # two numbers said one by one are not digits of one
        "May I have the second one?",  # an ordinal without a month is not a date
    ],
)
def test_words_that_are_not_one_amount_or_time_stay_as_they_are(said: str) -> None:
    assert written(said) == said


@given(st.integers(min_value=2, max_value=999_999_999))
def test_any_number_said_in_words_is_read_back(n: int) -> None:
    assert number(cardinal(n)) == n


def test_with_functions_offered_the_users_last_words_are_shown_in_digits_unless_too_long_for_the_loop() -> None:
    from s2s_rt.engines.base import ChatMessage
    from s2s_rt.spoken_answer import WRITTEN_MAX_CHARS, with_answer_context

    short = with_answer_context([ChatMessage("user", "Wake me at a quarter to six.")], tools=True)
    assert short[-1].content == "Wake me at 5:45."
    assert with_answer_context([ChatMessage("user", "Wake me at a quarter to six.")])[-1].content.endswith("six.")
    long = "Wake me at a quarter to six. " * (WRITTEN_MAX_CHARS // 20)
    assert with_answer_context([ChatMessage("user", long)], tools=True)[-1].content == long
