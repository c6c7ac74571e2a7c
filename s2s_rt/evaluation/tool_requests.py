"""The function-calling set: thirty-two round trips over four tools, and twelve requests that need none.

The first ten round trips and six requests without a call are the set's
first version; the rest came with issue 38 (``ToolRequest.issue``): everyday
wordings that never name the tool (advice on what to wear for the weather,
clock times in words, currencies' names spelled out, a lookup by an order's
number), so that a figure over the first set stays comparable with older runs.

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
    {
        "type": "function",
        "name": "get_order_status",
        "description": "Look up where a customer's order is, by its order number.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "The order number, e.g. 10442"}},
            "required": ["order_id"],
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
    #: The issue that added it to the set (None: the set's first version).
    issue: int | None = None

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
    # Issue 38: the same tools asked for as people ask, never by name.
    ToolRequest(
        "Should I wear a coat in Oslo today?",
        "get_weather",
        {"city": "Oslo"},
        {"temperature_c": -2, "conditions": "snow"},
        (r"\btwo\b", r"\bsnow", r"\byes\b"),
        issue=38,
    ),
    ToolRequest(
        "Do I need sunglasses in Madrid this afternoon?",
        "get_weather",
        {"city": "Madrid"},
        {"temperature_c": 27, "conditions": "clear and sunny"},
        (r"\btwenty-seven\b", r"\bsun", r"\bclear\b", r"\byes\b"),
        issue=38,
    ),
    ToolRequest(
        "What's it like outside in Tokyo?",
        "get_weather",
        {"city": "Tokyo"},
        {"temperature_c": 21, "conditions": "cloudy"},
        (r"\btwenty-one\b", r"\bcloud"),
        issue=38,
    ),
    ToolRequest(
        "Is it warm enough for shorts in Rome?",
        "get_weather",
        {"city": "Rome"},
        {"temperature_c": 24, "conditions": "sunny"},
        (r"\btwenty-four\b", r"\bsun", r"\byes\b"),
        issue=38,
    ),
    ToolRequest(
        "Is it a good day for a picnic in Vienna?",
        "get_weather",
        {"city": "Vienna"},
        {"temperature_c": 9, "conditions": "windy with rain"},
        (r"\bnine\b", r"\bwind", r"\brain", r"\bno\b"),
        issue=38,
    ),
    ToolRequest(
        "How hot is it in Cairo?",
        "get_weather",
        {"city": "Cairo"},
        {"temperature_c": 35, "conditions": "sunny"},
        (r"\bthirty-five\b", r"\bsun"),
        issue=38,
    ),
    ToolRequest(
        "Wake me at a quarter to six.",
        "set_alarm",
        {"time": "05:45"},
        {"ok": True, "time": "05:45"},
        (r"\bfive forty-five\b", r"\b0?5:45\b", r"quarter to six"),
        issue=38,
    ),
    ToolRequest(
        "Set an alarm for nine in the evening.",
        "set_alarm",
        {"time": "21:00"},
        {"ok": True, "time": "21:00"},
        (r"\bnine\b", r"\b21:00\b", r"\b0?9:00\b"),
        issue=38,
    ),
    ToolRequest(
        "I need to get up at half past five tomorrow.",
        "set_alarm",
        {"time": "05:30"},
        {"ok": True, "time": "05:30"},
        (r"\bfive thirty\b", r"\b0?5:30\b", r"half past five"),
        issue=38,
    ),
    ToolRequest(
        "Can you get me up at ten past seven?",
        "set_alarm",
        {"time": "07:10"},
        {"ok": True, "time": "07:10"},
        (r"\bseven ten\b", r"\b0?7:10\b", r"ten past seven"),
        issue=38,
    ),
    ToolRequest(
        "Make it ring at noon, please, I have a call.",
        "set_alarm",
        {"time": "12:00"},
        {"ok": True, "time": "12:00", "label": "call"},
        (r"\bnoon\b", r"\btwelve\b", r"\b12:00\b", r"\bmidday\b"),
        issue=38,
    ),
    ToolRequest(
        "I have an early flight, wake me at four fifteen.",
        "set_alarm",
        {"time": "04:15"},
        {"ok": True, "time": "04:15", "label": "flight"},
        (r"\bfour fifteen\b", r"\b0?4:15\b", r"quarter past four"),
        issue=38,
    ),
    ToolRequest(
        "How many yen is fifty US dollars?",
        "convert_currency",
        {"amount": 50, "from_currency": "USD", "to_currency": "JPY"},
        {"converted": 7420, "currency": "JPY"},
        (r"\bseven thousand,? four hundred (and )?twenty\b",),
        issue=38,
    ),
    ToolRequest(
        "What are thirty euros worth in Swiss francs?",
        "convert_currency",
        {"amount": 30, "from_currency": "EUR", "to_currency": "CHF"},
        {"result": 28.1, "currency": "CHF"},
        (r"\btwenty-eight\b",),
        issue=38,
    ),
    ToolRequest(
        "I have twenty British pounds, how many US dollars is that?",
        "convert_currency",
        {"amount": 20, "from_currency": "GBP", "to_currency": "USD"},
        {"result": 25.3, "currency": "USD"},
        (r"\btwenty-five\b",),
        issue=38,
    ),
    ToolRequest(
        "Change one thousand Swedish kronor into euros.",
        "convert_currency",
        {"amount": 1000, "from_currency": "SEK", "to_currency": "EUR"},
        {"result": 87.6, "currency": "EUR"},
        (r"\beighty-seven\b",),
        issue=38,
    ),
    ToolRequest(
        "How many Mexican pesos do I get for ten Canadian dollars?",
        "convert_currency",
        {"amount": 10, "from_currency": "CAD", "to_currency": "MXN"},
        {"result": 124.5, "currency": "MXN"},
        (r"\bone hundred (and )?twenty-four\b",),
        issue=38,
    ),
    ToolRequest(
        "Where is my order 48213?",
        "get_order_status",
        {"order_id": "48213"},
        {"order_id": "48213", "status": "shipped", "arrives": "Thursday"},
        (r"\bshipped\b", r"\bthursday\b"),
        issue=38,
    ),
    ToolRequest(
        "Has order number 77120 been sent yet?",
        "get_order_status",
        {"order_id": "77120"},
        {"status": "packing", "ships": "tomorrow"},
        (r"\bpack", r"\btomorrow\b", r"\bnot yet\b"),
        issue=38,
    ),
    ToolRequest(
        "When will my package from order 30518 arrive?",
        "get_order_status",
        {"order_id": "30518"},
        {"status": "out for delivery", "arrives": "today"},
        (r"\btoday\b", r"out for delivery"),
        issue=38,
    ),
    ToolRequest(
        "Can you check on purchase 91002 for me?",
        "get_order_status",
        {"order_id": "91002"},
        {"status": "delivered", "delivered": "Monday"},
        (r"\bdelivered\b", r"\bmonday\b"),
        issue=38,
    ),
    ToolRequest(
        "My delivery hasn't come, the number is 65537.",
        "get_order_status",
        {"order_id": "65537"},
        {"status": "delayed", "arrives": "Friday"},
        (r"\bdelay", r"\bfriday\b"),
        issue=38,
    ),
    ToolRequest("How are you today?", issue=38),
    ToolRequest("At what temperature does water boil, in Celsius?", issue=38),
    ToolRequest("Can you recommend a good book?", issue=38),
    ToolRequest("What does bonjour mean?", issue=38),
    ToolRequest("How many days are there in a leap year?", issue=38),
    ToolRequest("Nice to meet you, I'm Sam.", issue=38),
)
