"""The function-calling set: ten requests for two tools, five that need none.

A request is right when the model calls the expected function with the
expected arguments (checked against the tool's schema, as the server checks
it), or, for a request that needs no tool, answers without calling one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from s2s_rt.evaluation.asking import CallResult

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "set_timer",
        "description": "Start a countdown timer.",
        "parameters": {
            "type": "object",
            "properties": {
                "minutes": {"type": "number", "description": "How long the timer runs, in minutes"},
                "label": {"type": "string", "description": "What the timer is for"},
            },
            "required": ["minutes"],
        },
    },
]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request, and the call a right answer makes (None: no call)."""

    text: str
    function: str | None = None
    #: Arguments the call must have (strings compared without case); others may be present too.
    arguments: dict[str, Any] = field(default_factory=dict)

    def is_right(self, result: CallResult) -> bool:
        """Whether the model did what this request needs."""
        if self.function is None:
            return not result.calls and not result.invalid and bool(result.text)
        if len(result.calls) != 1:
            return False
        name, arguments = result.calls[0]
        return name == self.function and all(_same(arguments.get(k), v) for k, v in self.arguments.items())


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(actual, str) and expected.lower() in actual.lower()
    return isinstance(actual, (int, float)) and not isinstance(actual, bool) and actual == expected


REQUESTS: tuple[ToolRequest, ...] = (
    ToolRequest("What's the weather like in Paris?", "get_weather", {"city": "Paris"}),
    ToolRequest("Is it raining in London right now?", "get_weather", {"city": "London"}),
    ToolRequest("Tell me the temperature in Tokyo in Fahrenheit.", "get_weather", {"city": "Tokyo"}),
    ToolRequest("Do I need an umbrella in Berlin today?", "get_weather", {"city": "Berlin"}),
    ToolRequest("How hot is it in Madrid?", "get_weather", {"city": "Madrid"}),
    ToolRequest("Set a timer for ten minutes.", "set_timer", {"minutes": 10}),
    ToolRequest("Start a five minute timer for the eggs.", "set_timer", {"minutes": 5}),
    ToolRequest("Set a timer for twenty minutes, please.", "set_timer", {"minutes": 20}),
    ToolRequest("Can you time thirty minutes for my laundry?", "set_timer", {"minutes": 30}),
    ToolRequest("Set a timer for one hour.", "set_timer", {"minutes": 60}),
    ToolRequest("What is the capital of Italy?"),
    ToolRequest("Tell me a joke."),
    ToolRequest("How many legs does a spider have?"),
    ToolRequest("Thank you very much!"),
    ToolRequest("Who wrote Romeo and Juliet?"),
)
