"""The answer-quality evaluation: its questions, its grading, and one answer timed as the server gives it."""

from __future__ import annotations

import pytest
from conftest import missing

from s2s_rt.evaluation.asking import Assistant, CallResult
from s2s_rt.evaluation.grading import is_right, spoken_word_error_rate
from s2s_rt.evaluation.questions import EVALUATION_NOW, KINDS, QUESTIONS, Question
from s2s_rt.evaluation.tool_requests import REQUESTS, TOOLS, ToolRequest
from s2s_rt.evaluation.voices import ALL_VOICES
from s2s_rt.models import ModelError, ensure_prepared

SPIDER = next(q for q in QUESTIONS if "spider" in q.text)


def test_the_set_has_forty_questions_or_more_of_every_kind() -> None:
    assert len(QUESTIONS) >= 40
    assert {q.kind for q in QUESTIONS} == set(KINDS)
    assert len({q.text for q in QUESTIONS}) == len(QUESTIONS)


def test_every_question_is_spoken_by_several_engines() -> None:
    assert {v.engine for v in ALL_VOICES} == {"piper", "flite", "espeak-ng"}


@pytest.mark.parametrize("answer", ["A spider has 8 legs.", "Spiders have eight legs!"])
def test_a_number_is_right_in_digits_or_words(answer: str) -> None:
    assert is_right(SPIDER, answer)


@pytest.mark.parametrize("answer", ["A spider has four legs.", "Eight, or maybe six.", "I don't know."])
def test_a_wrong_or_hedged_answer_is_wrong(answer: str) -> None:
    assert not is_right(SPIDER, answer)


def test_every_fact_asked_for_must_be_there() -> None:
    colors = Question("Name the three primary colors.", "instruction", (r"\bred\b", r"\bblue\b", r"yellow"))
    assert is_right(colors, "Red, blue and yellow.")
    assert not is_right(colors, "Red, blue and green.")


def test_only_a_question_about_time_may_be_answered_with_the_date() -> None:
    assert not is_right(SPIDER, "A spider has eight legs, today, Thursday June 12, 2025.")
    assert not is_right(SPIDER, "It is 3:40 PM and a spider has eight legs.")
    today = next(q for q in QUESTIONS if q.text == "What day of the week is it today?")
    assert is_right(today, "Today is Thursday, June 12, 2025.")


def test_word_error_rate_does_not_count_numbers_written_as_digits() -> None:
    assert spoken_word_error_rate("Set a timer for twenty minutes.", "Set a timer for 20 minutes.") == 0.0
    one_wrong = spoken_word_error_rate("Set a timer for twenty minutes.", "Set a time for 20 minutes.")
    assert one_wrong == pytest.approx(1 / 6)


def test_the_function_calling_set_is_thirty_two_round_trips_over_four_tools_and_twelve_without() -> None:
    needing = [r for r in REQUESTS if r.function]
    assert len(needing) == 32 and all(r.result and r.says for r in needing)
    assert len([r for r in REQUESTS if r.function is None]) == 12
    assert {r.function for r in needing} == {t["name"] for t in TOOLS}
    assert {t["name"] for t in TOOLS} == {"get_weather", "set_alarm", "convert_currency", "get_order_status"}


def test_the_first_version_of_the_function_calling_set_comes_first_unchanged() -> None:
    first = [r for r in REQUESTS if r.issue is None]
    assert REQUESTS[: len(first)] == tuple(first)
    assert len([r for r in first if r.function]) == 10 and len([r for r in first if not r.function]) == 6


ALARM = ToolRequest("Wake me up at six thirty.", "set_alarm", {"time": "06:30"}, {"ok": True}, (r"six thirty",))


def test_a_call_is_right_with_the_expected_function_and_arguments() -> None:
    assert ALARM.is_right(CallResult([("set_alarm", {"time": "6:30", "label": "wake up"})], [], ""))
    assert not ALARM.is_right(CallResult([("set_alarm", {"time": "18:30"})], [], ""))
    assert not ALARM.is_right(CallResult([], [], "Sure, six thirty."))
    chat = ToolRequest("Tell me a joke.")
    assert chat.is_right(CallResult([], [], "Why did the chicken cross the road?"))
    assert not chat.is_right(CallResult([("get_weather", {"city": "Paris"})], [], ""))


def test_a_round_trip_is_right_only_when_the_answer_says_the_result_in_words() -> None:
    assert ALARM.answer_uses_result(CallResult([], [], "Your alarm is set for 6:30."))
    assert ALARM.answer_uses_result(CallResult([], [], "Done, I'll wake you at six thirty."))
    assert not ALARM.answer_uses_result(CallResult([], [], '{"ok": true, "time": "06:30"}'))
    assert not ALARM.answer_uses_result(CallResult([("set_alarm", {"time": "06:30"})], [], ""))
    assert not ALARM.answer_uses_result(CallResult([], [], "Sorry, I can't set alarms."))


def test_a_date_the_request_did_not_ask_for_is_seen_in_the_arguments() -> None:
    weather = next(r for r in REQUESTS if r.function == "get_weather")
    assert weather.dated_arguments(
        CallResult([("get_weather", {"city": "Paris", "time": "2026-12-01T14:57:00"})], [], "")
    )
    assert weather.dated_arguments(CallResult([("get_weather", {"city": "Paris", "when": "2:57 PM"})], [], ""))
    assert not weather.dated_arguments(CallResult([("get_weather", {"city": "Paris"})], [], ""))
    assert not ALARM.dated_arguments(CallResult([("set_alarm", {"time": "06:30"})], [], ""))


@pytest.mark.slow
def test_an_answer_is_timed_to_its_first_token_and_first_audio() -> None:
    try:
        prepared = ensure_prepared(llm="tiny", progress=lambda _line: None)
    except ModelError as exc:
        missing(f"models unavailable: {exc}")
    from s2s_rt.engines.llm import CT2ChatLLM
    from s2s_rt.engines.piper import PiperTTS

    assert prepared.llm is not None
    assistant = Assistant(
        CT2ChatLLM(prepared.llm), PiperTTS(prepared.voices), instructions="Be brief.", temperature=0.0,
        now=EVALUATION_NOW, max_tokens=40,
    )  # fmt: skip
    answer = assistant.answer("What is the capital of France?")
    assert answer.text
    assert answer.first_token_s is not None and answer.first_audio_s is not None
    assert 0 < answer.first_token_s <= answer.first_audio_s <= answer.total_s + 1.0
    asked = assistant.messages("What day is it?")  # as the server asks: the date after the question
    assert "Thursday, June 12, 2025" in asked[-1].content and "Thursday" not in asked[0].content
