"""Which function a user's request needs, chosen by likelihood before a small model answers.

Asked to decide for itself, the default model (Qwen2.5-Coder-0.5B) answers
advice-like requests from its own imagination ("Do I need an umbrella in
Berlin?" → "Yes, you need an umbrella in Berlin.", no call) and calls the
wrong function for a request that does not name its subject ("Can you check
on purchase 91002?" → ``get_weather(Paris)``). Asked outright which
function a request needs (by letter, or yes or no for each), it does no
better than chance: it does not read the request. What it does well is
language modelling, so the choice is made by likelihood instead: for each
function, how likely the user's words are as a request that needs it,
after a short head that describes the function, against the same for
:data:`NO_FUNCTION`, a head that describes talk without one. The request
goes to the function whose head makes its words likeliest; when that is
:data:`NO_FUNCTION`, the model answers as before, functions in view, and
may still call one itself.

Measured on the evaluation's 44 typed requests (32 for one of four
functions, 12 for none; BENCHMARKS.md, "Function calls"): 42 of 44 went
where they should, none of the 12 to a function. On the held-out set (five
other functions, 25 requests, 12 turns that need none): 22 of 25 went to
their function, and 3 of the 12 (questions on a function's topic: "Who
composed The Four Seasons?" next to ``play_music``) went to a function too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from s2s_rt.engines.base import ChatMessage
from s2s_rt.toolcalls import chat_tool

#: The most tokens of the user's words a function is chosen by (their end, where the request usually is).
WORDS_TOKENS = 96

#: The choice that needs no function: the model answers in words (and may still call one itself).
NO_FUNCTION = {
    "name": "chat",
    "description": "Talk with the user: greetings, thanks, and questions answered from general knowledge.",
}


def heads(tools: Sequence[dict[str, Any]]) -> list[tuple[str | None, str]]:
    """For each function (then :data:`NO_FUNCTION`, named None), the text the user's request follows."""
    described = [chat_tool(tool)["function"] for tool in tools]
    return [
        *((f["name"], _head(f["name"], f.get("description") or "")) for f in described if f.get("name")),
        (None, _head(NO_FUNCTION["name"], NO_FUNCTION["description"])),
    ]


def _head(name: str, description: str) -> str:
    described = " ".join(description.split())
    return f"Function: {name}\nWhat it does: {described}\nA user's request that needs this function: \""


def choose(
    tools: Sequence[dict[str, Any]],
    messages: Sequence[ChatMessage],
    encode: Callable[[str], list[int]],
    score: Callable[[list[list[int]]], list[list[float]] | None],
) -> str | None:
    """The function the user's last words need; None for none, or when the last message is not theirs.

    Args:
        tools: the functions offered.
        messages: the conversation; only its last message, the user's, is read (its last
            :data:`WORDS_TOKENS` tokens).
        encode: text to token ids.
        score: for each sequence of ids, the log-probability of each id after the first (None: not scored).
    """
    words = request_words(messages)
    if not tools or words is None:
        return None
    choices = heads(tools)
    said = encode(f'{words}"')[-WORDS_TOKENS:]
    opened = [encode(head) for _name, head in choices]
    scores = score([[*ids, *said] for ids in opened])
    if scores is None:
        return None
    return chosen(
        [name for name, _head in choices], [sum(s[len(ids) - 1 :]) for s, ids in zip(scores, opened, strict=True)]
    )


def request_words(messages: Sequence[ChatMessage]) -> str | None:
    """The words to choose a function for: the last message when it is the user's (not after a result)."""
    if not messages or messages[-1].role != "user":
        return None
    words = " ".join(messages[-1].content.split())
    return words or None


def chosen(names: Sequence[str | None], log_likelihoods: Sequence[float]) -> str | None:
    """The function whose head made the request likeliest; None when that is :data:`NO_FUNCTION`."""
    best = max(range(len(names)), key=lambda n: log_likelihoods[n])
    return names[best]


def call_opening(name: str) -> str:
    """The start of a call to ``name``, written into the answer's opening: the model writes its arguments."""
    return f'{{"name": {json.dumps(name)}, "arguments": {{'
