"""The function-calling set: ten round trips over three tools, and six requests that need none.

A round trip is what a client library does with a call: the model calls a
function, the client runs it and hands back its result (here a fixed one),
and the model's next answer is spoken to the user. A round trip is right
when the first call is the expected function with the expected arguments
(checked against the tool's schema, as the server checks it), and the answer
to its result is words that say what the result says: no second call, no
JSON. A request that needs no tool is right when it is answered in words
without a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from s2s_rt.evaluation.asking import CallResult
from s2s_rt.speech_text import speakable

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "set_alarm",
        "description": "Set an alarm clock.",
        "parameters": {
            "type": "object",
            "properties": {
                "time": {"type": "string", "description": "When it rings, as HH:MM on a 24-hour clock"},
                "label": {"type": "string", "description": "What the alarm is for"},
            },
            "required": ["time"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from_currency": {"type": "string", "description": "ISO 4217 code, e.g. USD"},
                "to_currency": {"type": "string", "description": "ISO 4217 code, e.g. EUR"},
            },
            "required": ["amount", "from_currency", "to_currency"],
            "additionalProperties": False,
        },
    },
]

#: A date or a clock time (as a call's arguments would carry one the request did not ask for).
_DATE_OR_TIME = re.compile(r"\b\d{4}-\d{2}-\d{2}|\b\d{1,2}:\d{2}\b|\b(am|pm)\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request, the call a right answer makes (None: no call), the result it gets back, and what the answer says."""

    text: str
    function: str | None = None
    #: Arguments the call must have (strings compared without case, times as written or without a leading 0).
    arguments: dict[str, Any] = field(default_factory=dict)
    #: What the client's function returns.
    result: dict[str, Any] = field(default_factory=dict)
    #: Patterns the spoken answer to the result matches, one of them at least (numbers also in words).
    says: tuple[str, ...] = ()

    @property
    def output(self) -> str:
        """The result as the client sends it back (``function_call_output.output``)."""
        return json.dumps(self.result)

    def is_right(self, result: CallResult) -> bool:
        """Whether the model's first answer did what this request needs (the call, or words without one)."""
        if self.function is None:
            return not result.calls and not result.invalid and bool(result.text)
        if len(result.calls) != 1:
            return False
        name, arguments = result.calls[0]
        return name == self.function and all(_same(arguments.get(k), v) for k, v in self.arguments.items())

    def dated_arguments(self, result: CallResult) -> bool:
        """Whether a call carries a date or clock time in an argument this request does not set."""
        return any(
            _DATE_OR_TIME.search(json.dumps(value))
            for _name, arguments in result.calls
            for key, value in arguments.items()
            if key not in self.arguments
        )

    def answer_uses_result(self, answer: CallResult) -> bool:
        """Whether the answer to the result is words that say it: no call, no JSON, one of ``says``."""
        if answer.calls or answer.invalid or not answer.text or "{" in answer.text:
            return False
        texts = (answer.text, speakable(answer.text))
        return any(re.search(p, t, re.IGNORECASE) for p in self.says for t in texts)


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, str):
        if not isinstance(actual, str):
            return False
        if re.fullmatch(r"\d{2}:\d{2}", expected):
            return actual.strip().zfill(5) == expected
        return expected.lower() in actual.lower()
    return isinstance(actual, (int, float)) and not isinstance(actual, bool) and actual == expected


REQUESTS: tuple[ToolRequest, ...] = (
    ToolRequest(
        "What's the weather like in Paris right now?",
        "get_weather",
        {"city": "Paris"},
        {"city": "Paris", "temperature_c": 18, "conditions": "sunny"},
        (r"\beighteen\b", r"\bsun"),
    ),
    ToolRequest(
        "Is it raining in London?",
        "get_weather",
        {"city": "London"},
        {"temperature_c": 11, "conditions": "heavy rain"},
        (r"\beleven\b", r"\bheavy\b", r"\byes\b"),
    ),
    ToolRequest(
        "How cold is it in Oslo today?",
        "get_weather",
        {"city": "Oslo"},
        {"temperature_c": -4, "conditions": "snow"},
        (r"\bfour\b", r"\bsnow"),
    ),
    ToolRequest(
        "Do I need an umbrella in Berlin?",
        "get_weather",
        {"city": "Berlin"},
        {"conditions": "showers", "chance_of_rain_percent": 80},
        (r"\bshower", r"\beighty\b", r"\byes\b"),
    ),
    ToolRequest(
        "Wake me up at six thirty.",
        "set_alarm",
        {"time": "06:30"},
        {"ok": True, "alarm_id": 3, "time": "06:30"},
        (r"\bsix thirty\b", r"\b0?6:30\b", r"half past six"),
    ),
    ToolRequest(
        "Set an alarm for seven in the morning called gym.",
        "set_alarm",
        {"time": "07:00"},
        {"status": "set", "time": "07:00", "label": "gym"},
        (r"\bseven\b", r"\b0?7:00\b"),
    ),
    ToolRequest(
        "Set an alarm for a quarter past eight.",
        "set_alarm",
        {"time": "08:15"},
        {"ok": True, "time": "08:15"},
        (r"\beight fifteen\b", r"\b0?8:15\b", r"quarter past eight"),
    ),
    ToolRequest(
        "How much is one hundred dollars in euros?",
        "convert_currency",
        {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
        {"amount": 100, "from": "USD", "to": "EUR", "result": 92.4},
        (r"\bninety-two\b",),
    ),
    ToolRequest(
        "Convert fifty British pounds to Japanese yen.",
        "convert_currency",
        {"amount": 50, "from_currency": "GBP", "to_currency": "JPY"},
        {"converted": 9650, "currency": "JPY"},
        (r"\bnine thousand,? six hundred (and )?fifty\b",),
    ),
    ToolRequest(
        "What is two hundred euros in US dollars?",
        "convert_currency",
        {"amount": 200, "from_currency": "EUR", "to_currency": "USD"},
        {"result": 216.5, "currency": "USD"},
        (r"\btwo hundred (and )?sixteen\b",),
    ),
    ToolRequest("What is the capital of Italy?"),
    ToolRequest("Thanks, that's all for now."),
    ToolRequest("Tell me a joke."),
    ToolRequest("How many legs does a spider have?"),
    ToolRequest("Good morning!"),
    ToolRequest("Who wrote Romeo and Juliet?"),
)
