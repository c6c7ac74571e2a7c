"""How a conversation with function calls is rendered for a chat model, read back as text.

A character tokenizer stands in for a model's: each character is its own id
and markup tokens have ids of their own, so a rendered turn decodes to
exactly the text the model would read.
"""

from __future__ import annotations

from collections.abc import Sequence

from s2s_rt.engines.base import ChatMessage, FunctionCall
from s2s_rt.engines.chat_formats import ChatML
from s2s_rt.protocol.prompt import call_message

_MARKUP = ("<|im_start|>", "<|im_end|>")
_FIRST_MARKUP_ID = 0x110000  # past every character


class CharacterTokenizer:
    """One id per character; the ChatML markup tokens above them (decoded as nothing)."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(char) for char in text]

    def control_id(self, token: str) -> int | None:
        return _FIRST_MARKUP_ID + _MARKUP.index(token) if token in _MARKUP else None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if i < _FIRST_MARKUP_ID)


def rendered_turns(messages: list[ChatMessage]) -> list[str]:
    tokenizer = CharacterTokenizer()
    chat = ChatML(tokenizer).encode(messages)
    return [tokenizer.decode(turn) for turn in chat.turns]


def test_a_result_follows_the_request_of_its_call_not_a_later_user_turn() -> None:
    weather = FunctionCall("get_weather", '{"city": "Paris"}', "call_weather")
    alarm = FunctionCall("set_alarm", '{"time": "07:00"}', "call_alarm")
    turns = rendered_turns(
        [
            ChatMessage("user", "What is the weather in Paris?"),
            call_message(weather),
            ChatMessage("user", "And set an alarm for 7"),
            call_message(alarm),
            ChatMessage("tool", '{"sky": "sunny"}', answers=weather),
            ChatMessage("tool", '{"set": true}', answers=alarm),
        ]
    )
    assert turns == [
        "user\nWhat is the weather in Paris?\n\n(get_weather says: sky: sunny)\n",
        "user\nAnd set an alarm for 7\n\n(set_alarm says: set: yes)\n",
        "assistant\n",
    ]


def test_a_result_whose_call_is_not_in_the_conversation_follows_the_last_user_turn_before_it() -> None:
    gone = FunctionCall("get_weather", '{"city": "Paris"}', "call_gone")
    turns = rendered_turns(
        [
            ChatMessage("user", "What is the weather in Paris?"),
            ChatMessage("user", "And in Rome?"),
            ChatMessage("tool", '{"sky": "rain"}', answers=gone),
        ]
    )
    assert turns[1] == "user\nAnd in Rome?\n\n(get_weather says: sky: rain)\n"


def test_results_of_calls_made_before_any_user_turn_share_one_user_turn() -> None:
    weather = FunctionCall("get_weather", '{"city": "Paris"}', "call_weather")
    alarm = FunctionCall("set_alarm", '{"time": "07:00"}', "call_alarm")
    turns = rendered_turns(
        [
            call_message(weather),
            call_message(alarm),
            ChatMessage("tool", '{"sky": "sunny"}', answers=weather),
            ChatMessage("tool", '{"set": true}', answers=alarm),
        ]
    )
    assert turns == ["user\n(get_weather says: sky: sunny)\n\n(set_alarm says: set: yes)\n", "assistant\n"]


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_a_result_is_answered_without_the_tools_but_a_failed_one_keeps_them_for_a_retry() -> None:
    tokenizer = CharacterTokenizer()
    call = FunctionCall("get_weather", '{"city": "Paris"}', "call_weather")

    def system_turn(output: str) -> str:
        asked = [ChatMessage("user", "What is the weather in Paris?"), call_message(call)]
        chat = ChatML(tokenizer).encode([*asked, ChatMessage("tool", output, answers=call)], [WEATHER])
        return tokenizer.decode(chat.turns[0])

    assert "# Tools" not in system_turn('{"sky": "sunny"}')
    assert "# Tools" in system_turn("Error: service unavailable, call get_weather again")
