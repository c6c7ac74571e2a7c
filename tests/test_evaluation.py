"""The answer-quality evaluation: its questions, its grading, and one answer timed as the server gives it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from conftest import missing

from s2s_rt.evaluation import held_out_tools, third_tools
from s2s_rt.evaluation.asking import Assistant, CallResult
from s2s_rt.evaluation.cli import _report
from s2s_rt.evaluation.grading import is_right, spoken_word_error_rate
from s2s_rt.evaluation.questions import EVALUATION_NOW, KINDS, QUESTIONS, Question
from s2s_rt.evaluation.tool_requests import REQUESTS, TOOLS, ToolRequest
from s2s_rt.evaluation.voices import ALL_VOICES
from s2s_rt.models import ModelError, ensure_prepared
from s2s_rt.toolcalls import parse_call

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


def test_the_held_out_set_is_twenty_five_round_trips_over_five_other_tools_and_twelve_without() -> None:
    needing = [r for r in held_out_tools.REQUESTS if r.function]
    names = {t["name"] for t in held_out_tools.TOOLS}
    assert len(needing) == 25 and all(r.result and r.says for r in needing)
    assert len([r for r in held_out_tools.REQUESTS if r.function is None]) == 12
    assert len(names) == 5 and {r.function for r in needing} == names
    assert not names & {t["name"] for t in TOOLS}


def test_no_held_out_wording_repeats_one_of_the_first_set() -> None:
    first = {r.text.lower() for r in REQUESTS}
    held_out = [r.text.lower() for r in held_out_tools.REQUESTS]
    assert len(set(held_out)) == len(held_out)
    assert not first & set(held_out)


#: What an argument a request does not check is filled with, to make a call its tool's schema takes.
_PLACEHOLDERS = {"string": "x", "integer": 1, "number": 1}


def _assert_call_is_valid_and_graded_right(request_: ToolRequest, tools: list[dict[str, Any]]) -> None:
    tool = next(t for t in tools if t["name"] == request_.function)
    properties, required = tool["parameters"]["properties"], tool["parameters"]["required"]
    assert set(request_.arguments) <= set(properties)  # a misspelt name would pass where others are allowed
    arguments: dict[str, Any] = {k: _PLACEHOLDERS[properties[k]["type"]] for k in required}
    arguments |= request_.arguments
    name, parsed = parse_call(json.dumps({"name": request_.function, "arguments": arguments}), tools)
    assert json.loads(parsed) == arguments
    assert request_.is_right(CallResult([(name, json.loads(parsed))], [], ""))


@pytest.mark.parametrize("request_", [r for r in held_out_tools.REQUESTS if r.function], ids=lambda r: r.text)
def test_every_held_out_call_is_valid_for_its_tool_and_graded_right(request_: ToolRequest) -> None:
    _assert_call_is_valid_and_graded_right(request_, held_out_tools.TOOLS)


#: For each held-out round trip, answers that say its result; each of its patterns matches one of them.
HELD_OUT_ANSWERS: dict[str, tuple[str, ...]] = {
    "Play some Beatles.": ("Now playing Here Comes the Sun by the Beatles.",),
    "It's too quiet in here, put some music on.": ("Playing the Lo-fi Beats playlist.",),
    "Can you play Bohemian Rhapsody?": ("Here's Bohemian Rhapsody by Queen.",),
    "Put on something relaxing while I study.": ("I've put on the Calm Piano playlist.",),
    "Play the new Taylor Swift album.": ("Playing The Tortured Poets Department by Taylor Swift.",),
    "Text Anna that I'll be ten minutes late.": (
        "Done, I've sent Anna your message.",
        "I let Anna know you'll be ten minutes late.",
        "I told Anna you'll be late.",
    ),
    "Send a message to Mum saying happy birthday.": ("Your birthday message to Mum was delivered.", "I've sent it."),
    "Can you tell David the meeting moved to three o'clock?": (
        "Message sent to David.",
        "I let David know about the meeting.",
        "I told David the meeting moved.",
    ),
    "Message my boss Karen: I'm working from home today.": (
        "Sent: Karen knows you're working from home.",
        "I let Karen know.",
        "I told Karen you're at home today.",
    ),
    "Let Tom know dinner is ready.": ("I've sent Tom a message.", "I let Tom know dinner is ready.", "I told Tom."),
    "What's Apple's stock price?": ("Apple is trading at $189.84.",),
    "How are Microsoft shares doing today?": ("Microsoft is at $415.20, down 1.3% today.",),
    "Check the Tesla share price for me.": ("Tesla shares are at 242.5 dollars.",),
    "Is Nvidia up or down today?": ("Nvidia is up 2.6% today, at $131.40.",),
    "What's Amazon trading at?": ("Amazon is trading at $178.25.",),
    "Book a table for four at Luigi's at seven thirty tonight.": (
        "Your table for four at Luigi's is booked for 7:30 PM.",
        "Confirmed: Luigi's at 19:30 for four.",
        "You're all set for half past seven.",
    ),
    "Can you get us a table at the Golden Dragon at eight in the evening? There are two of us.": (
        "Your table for two is confirmed for 8 PM.",
        "Booked at 20:00.",
    ),
    "I'd like to reserve a table for six at Nando's for lunch at half past twelve.": (
        "Booked: six people at Nando's at 12:30.",
        "Your table is confirmed for half past twelve.",
    ),
    "Reserve Chez Marie for three people at a quarter past eight in the evening.": (
        "Confirmed, Chez Marie at 8:15 PM for three.",
        "Booked for 20:15.",
        "You're booked at a quarter past eight.",
    ),
    "My parents are visiting, find us a table for five at Bella Vista at seven in the evening.": (
        "Sorry, Bella Vista is fully booked at seven, but there's a table at 9 PM.",
        "They have a table at 21:00 instead.",
    ),
    "Set the heating to twenty-one degrees.": ("The heating is set to 21 degrees.",),
    "It's freezing in here, turn the heat up to twenty-three.": ("Turned up to 23°C; it's 17 now.",),
    "Turn on the air conditioning and set it to twenty degrees.": (
        "The air conditioning is on, cooling to 20 degrees.",
    ),
    "Change the thermostat to eighteen and a half.": (
        "The thermostat is set to 18.5 degrees.",
        "Set to eighteen and a half degrees.",
    ),
    "We're going to bed, drop the temperature to sixteen.": ("Done, the temperature will drop to 16 degrees.",),
}


def _assert_every_pattern_matches_an_answer(request_: ToolRequest, texts: tuple[str, ...]) -> None:
    answers = [CallResult([], [], text) for text in texts]
    assert all(request_.answer_uses_result(a) for a in answers)
    for pattern in request_.says:
        alone = dataclasses.replace(request_, says=(pattern,))
        assert any(alone.answer_uses_result(a) for a in answers), pattern
    assert not request_.answer_uses_result(CallResult([], [], "Sorry, I can't help with that right now."))
    assert not request_.answer_uses_result(CallResult([], [], request_.output))


@pytest.mark.parametrize("request_", [r for r in held_out_tools.REQUESTS if r.function], ids=lambda r: r.text)
def test_every_held_out_pattern_matches_an_answer_that_says_the_result(request_: ToolRequest) -> None:
    _assert_every_pattern_matches_an_answer(request_, HELD_OUT_ANSWERS[request_.text])


def test_the_report_names_the_tool_set_and_whether_the_function_was_chosen() -> None:
    calls = [{"expected": r.function, "right": False, "calls": [], "invalid": []} for r in held_out_tools.REQUESTS]
    result = {
        "preset": "default", "typed": [], "spoken": [], "calls": calls, "rss_peak_mb": 900.0,
        "tool_set": "held-out", "tools": [t["name"] for t in held_out_tools.TOOLS], "choose_functions": False,
    }  # fmt: skip
    report = _report({"voices": []}, [result])
    assert "default, function calls on the held-out tool set (5 tools: play_music," in report
    assert "25 requests that need one, 12 that need none), function choice off" in report


def test_the_third_set_is_twenty_five_round_trips_over_five_new_tools_and_twelve_without() -> None:
    needing = [r for r in third_tools.REQUESTS if r.function]
    names = {t["name"] for t in third_tools.TOOLS}
    assert len(needing) == 25 and all(r.result and r.says for r in needing)
    assert len([r for r in third_tools.REQUESTS if r.function is None]) == 12
    assert len(names) == 5 and {r.function for r in needing} == names
    assert all(len([r for r in needing if r.function == name]) == 5 for name in names)
    assert not names & {t["name"] for t in TOOLS + held_out_tools.TOOLS}


def test_no_third_set_wording_repeats_one_of_the_other_sets() -> None:
    others = {r.text.lower() for r in REQUESTS + held_out_tools.REQUESTS}
    third = [r.text.lower() for r in third_tools.REQUESTS]
    assert len(set(third)) == len(third)
    assert not others & set(third)


@pytest.mark.parametrize("request_", [r for r in third_tools.REQUESTS if r.function], ids=lambda r: r.text)
def test_every_third_set_call_is_valid_for_its_tool_and_graded_right(request_: ToolRequest) -> None:
    _assert_call_is_valid_and_graded_right(request_, third_tools.TOOLS)


#: For each round trip of the third set, answers that say its result; each of its patterns matches one of them.
THIRD_ANSWERS: dict[str, tuple[str, ...]] = {
    "Put a dentist appointment in my calendar for the third of July at nine thirty in the morning.": (
        "Your dentist appointment is in the calendar for July 3rd at 9:30 AM.",
        "Done: dentist, the third of July, half past nine.",
        "Added for July the third.",
    ),
    "I've got a job interview on the twentieth of June at two in the afternoon, can you note that down?": (
        "Your interview is in the calendar for June 20th at 2 PM.",
        "Noted for the twentieth at 14:00.",
        "Saved at fourteen hundred.",
    ),
    "Schedule lunch with Priya on June the twenty-fifth at half past twelve.": (
        "Lunch with Priya is scheduled for June 25th at 12:30.",
        "Done, the twenty-fifth at half past twelve.",
    ),
    "Block out two hours on the first of August at ten in the morning for the team offsite.": (
        "The team offsite is blocked out on August 1st from 10:00 until noon.",
        "Done, the first of August, ten to twelve.",
        "Blocked out for August the first.",
    ),
    "My sister's wedding is on the sixteenth of August at three in the afternoon, I don't want to forget it.": (
        "Your sister's wedding is in the calendar for August 16th at 3 PM.",
        "Saved for the sixteenth at 15:00.",
        "Added at fifteen hundred.",
    ),
    "Is BA one one seven on time today?": (
        "Yes, BA117 is on time, leaving at 14:05 from gate B32.",
        "It leaves at two oh five from gate B thirty-two.",
    ),
    "When does Lufthansa four hundred land?": (
        "LH400 is in the air and lands at 16:20.",
        "It lands at twenty past four.",
        "It's due at four twenty this afternoon.",
    ),
    "My mum's flying in on easyJet eight one two, has it landed yet?": (
        "Yes, EZY812 landed at 10:48.",
        "Your mum's flight landed at ten forty-eight.",
    ),
    "Has Air France thirteen seventy-nine been delayed?": (
        "Yes, AF1379 is delayed by 45 minutes and now leaves at 19:15.",
        "It now departs at a quarter past seven.",
        "It's leaving at seven fifteen in the evening.",
    ),
    "Which gate does KLM six oh five leave from?": (
        "KL605 is boarding at gate D7.",
        "Gate D seven, it's boarding now.",
    ),
    "We're out of milk.": ("I've added milk to the list.", "Milk is on your shopping list now."),
    "Add three tins of chopped tomatoes to the shopping list.": ("Added 3 tins of chopped tomatoes.",),
    "Don't let me forget to buy bin bags.": ("I've added bin bags.", "Bin bags are on the list."),
    "Can you put six bananas on the list?": ("Six bananas added.",),
    "We need two loaves of bread for the weekend.": ("I've added 2 loaves of bread to the list.",),
    "How do I say 'where is the train station' in Spanish?": (
        "You'd say: ¿Dónde está la estación de tren?",
        "Donde esta la estacion de tren.",
    ),
    "Translate 'thank you for your help' into Japanese.": (
        "In Japanese: 手伝ってくれてありがとう (tetsudatte kurete arigatō).",
        "It's tetsudatte kurete arigato.",
    ),
    "I'm writing to my landlord in Berlin, how would I put 'the heating is broken' in German?": (
        "You can write: Die Heizung ist kaputt.",
    ),
    "What's the French for 'I'm allergic to peanuts'?": ("It's: Je suis allergique aux cacahuètes.",),
    "My neighbour only speaks Italian. Can you help me tell her 'your cat is in my garden'?": (
        "Tell her: Il tuo gatto è nel mio giardino.",
    ),
    "Get me a cab to the airport.": ("Your taxi is booked: Marek will be there in 6 minutes in a grey Toyota Prius.",),
    "Order me a taxi to the train station for a quarter to seven this evening.": (
        "Your taxi is booked for 18:45.",
        "It picks you up at a quarter to seven.",
        "Booked for six forty-five this evening.",
    ),
    "There are seven of us with suitcases, we need a big car to the Hilton.": (
        "A large taxi is on its way, about 12 minutes.",
    ),
    "My grandfather is in a wheelchair, can you call us a taxi to the hospital?": (
        "An accessible taxi will be there in 15 minutes.",
        "It'll be with you in a quarter of an hour.",
    ),
    "I've missed the last bus and need a ride home.": (
        "A taxi will pick you up in 9 minutes; the fare should be about £18.50.",
    ),
}


@pytest.mark.parametrize("request_", [r for r in third_tools.REQUESTS if r.function], ids=lambda r: r.text)
def test_every_third_set_pattern_matches_an_answer_that_says_the_result(request_: ToolRequest) -> None:
    _assert_every_pattern_matches_an_answer(request_, THIRD_ANSWERS[request_.text])


def test_the_report_names_the_third_tool_set() -> None:
    calls = [{"expected": r.function, "right": False, "calls": [], "invalid": []} for r in third_tools.REQUESTS]
    result = {
        "preset": "default", "typed": [], "spoken": [], "calls": calls, "rss_peak_mb": 900.0,
        "tool_set": "third", "tools": [t["name"] for t in third_tools.TOOLS], "choose_functions": True,
    }  # fmt: skip
    report = _report({"voices": []}, [result])
    assert "default, function calls on the third tool set (5 tools: create_event," in report
    assert "25 requests that need one, 12 that need none), function choice on" in report


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
