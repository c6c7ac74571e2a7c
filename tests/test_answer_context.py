"""What the LLM is told besides the conversation: the date and time, and the language the user spoke."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from conftest import RealtimeClient, run, silence, tone

from s2s_rt import Config, Server
from s2s_rt.engines.base import ChatMessage, LLMRequest
from s2s_rt.engines.fake import EchoLLM, load_fake_stack
from s2s_rt.spoken_answer import (
    ANSWER_EXAMPLES,
    ASKS_MAX_CHARS,
    DEFAULT_INSTRUCTIONS,
    date_context,
    language_context,
    with_answer_context,
)

THURSDAY = datetime(2025, 6, 12, 15, 40)


def test_the_answer_knows_the_date_and_time() -> None:
    assert date_context(THURSDAY) == "Today is Thursday, June 12, 2025, and the time is 3:40 PM."


def test_a_user_who_spoke_german_is_answered_in_german() -> None:
    assert language_context("de") == "The user speaks German: answer in German."


def test_english_needs_no_language_instruction() -> None:
    assert language_context("en") == language_context(None) == ""


def test_a_question_about_the_day_gets_the_date_after_it_and_the_system_message_stays_the_same() -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "What day is it today?")]
    system, user = with_answer_context(messages, now=THURSDAY)
    assert system == messages[0]
    assert user.content == "What day is it today?\n\n(Today is Thursday, June 12, 2025.)"


def test_a_question_about_the_clock_gets_the_time_and_a_time_reckoned_from_now_gets_it_too() -> None:
    for words in ("What time is it?", "Set an alarm in twenty minutes."):
        _, user = with_answer_context([ChatMessage("system", "Be brief."), ChatMessage("user", words)], now=THURSDAY)
        assert user.content == f"{words}\n\n(The time is 3:40 PM.)"


def test_only_the_end_of_a_long_message_is_searched_for_a_question_about_the_time() -> None:
    """The search runs on the event loop: a 200 kB message held it 0.59 s. A question at its end is still seen."""
    padding = "w " * (ASKS_MAX_CHARS * 100)
    for words, asks in ((padding + "What time is it?", True), ("What time is it? " + padding, False)):
        _, user = with_answer_context([ChatMessage("system", "Be brief."), ChatMessage("user", words)], now=THURSDAY)
        assert user.content.endswith("(The time is 3:40 PM.)") == asks


@pytest.mark.parametrize(
    "words",
    [
        "How old was Albert Einstein when he died?",
        "It's going to rain this weekend.",
        "What's the weather in Lisbon right now?",
        "Is it cold in Oslo today?",
        "Wake me up at six thirty tomorrow.",
        "Thanks, that's all for now.",
        "Good morning!",
        "How many hours are there in a day?",
        "What month comes after March?",
        "Hello, how are you today?",
        "What year did the Titanic sink?",
        "How many minutes are there in three and a half hours?",
        "What time zone is Paris in?",
        "What is the first day of the week?",
    ],
)
def test_words_that_mention_time_without_asking_for_it_get_no_date(words: str) -> None:
    """Only a question about the date or the clock is told them: told anyway, small models repeat them."""
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", words)]
    assert with_answer_context(messages, now=THURSDAY) == messages


def test_other_questions_do_not_pay_for_reading_the_date() -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Who painted the Mona Lisa?")]
    assert with_answer_context(messages, now=THURSDAY) == messages
    # Nor an earlier question about time: the date goes only with the words being answered.
    answered = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "What day is it?"),
        ChatMessage("assistant", "Thursday."),
    ]
    assert with_answer_context(answered, now=THURSDAY) == answered


def test_the_default_instructions_come_with_worked_examples() -> None:
    system = with_answer_context([ChatMessage("system", DEFAULT_INSTRUCTIONS), ChatMessage("user", "Hi")])[0]
    assert system.content == f"{DEFAULT_INSTRUCTIONS}\n\n{ANSWER_EXAMPLES}"


def test_no_examples_when_functions_are_offered_or_the_client_gave_instructions() -> None:
    # Examples of answers made the default model answer what a function should (BENCHMARKS.md).
    default = [ChatMessage("system", DEFAULT_INSTRUCTIONS), ChatMessage("user", "Weather in Paris?")]
    assert ANSWER_EXAMPLES not in with_answer_context(default, tools=True)[0].content
    own = [ChatMessage("system", "You are a pirate."), ChatMessage("user", "Hi")]
    assert ANSWER_EXAMPLES not in with_answer_context(own)[0].content


def test_a_conversation_without_instructions_gets_a_system_message_only_for_a_context() -> None:
    (user,) = with_answer_context([ChatMessage("user", "What time is it?")], now=THURSDAY)
    assert user == ChatMessage("user", "What time is it?\n\n(The time is 3:40 PM.)")
    system, user = with_answer_context([ChatMessage("user", "Hallo")], language="de")
    assert (system, user) == (
        ChatMessage("system", "The user speaks German: answer in German."),
        ChatMessage("user", "Hallo"),
    )
    assert with_answer_context([ChatMessage("user", "Hi")]) == [ChatMessage("user", "Hi")]


class RecordingLLM(EchoLLM):
    """The fake LLM, keeping the messages of every answer."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[ChatMessage]] = []

    def stream(self, request: LLMRequest, **options: Any) -> Iterator[str]:
        self.seen.append(list(request.messages))
        return super().stream(request, **options)


@pytest.mark.parametrize(("language", "told"), [("de", "answer in German"), (None, None)])
def test_the_language_heard_reaches_the_answer_and_the_log(
    language: str | None, told: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    llm = RecordingLLM()
    stack = load_fake_stack()
    stack.llm = llm

    async def scenario() -> None:
        config = Config(port=0, stack="fake", pool_size=1, drain_timeout_s=2.0, grace_period_s=2.0)
        async with Server(config, stack=stack) as server, RealtimeClient.connect(server) as c:
            transcription = {"model": "whisper-1", "language": language} if language else {"model": "whisper-1"}
            await c.send("session.update", session={"input_audio_transcription": transcription})
            await c.until("session.updated")
            await c.append_audio(tone(440, 0.5) + silence(0.8))
            await c.until("response.done")

    with caplog.at_level(logging.INFO, logger="s2s_rt.pipeline.transcribing"):
        run(scenario())
    system = llm.seen[-1][0]
    assert system.role == "system"
    if told is None:
        assert "speaks" not in system.content
        assert "the user speaks en (detected)" in caplog.text
    else:
        assert told in system.content
        assert f"the user speaks {language} (given)" in caplog.text


def test_a_default_session_answers_with_examples_but_not_when_functions_are_offered() -> None:
    llm = RecordingLLM()
    stack = load_fake_stack()
    stack.llm = llm
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}

    async def scenario() -> None:
        config = Config(port=0, stack="fake", pool_size=1, drain_timeout_s=2.0, grace_period_s=2.0)
        async with Server(config, stack=stack) as server, RealtimeClient.connect(server) as c:
            await c.say_text("Hello")
            await c.say_text("And the weather?", tools=[tool])

    run(scenario())
    plain, with_tools = (seen[0].content for seen in llm.seen)
    assert ANSWER_EXAMPLES in plain
    assert ANSWER_EXAMPLES not in with_tools and with_tools.startswith(DEFAULT_INSTRUCTIONS)
