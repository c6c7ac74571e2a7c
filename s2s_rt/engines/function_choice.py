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
:data:`NO_FUNCTIONS`, heads that describe kinds of talk without one. The
request goes to the function whose head makes its words likeliest; when
that is a kind of talk, the model answers as before, functions in view,
and may still call one itself.

Routed (the choice alone, typed; BENCHMARKS.md, "Function calls"), with
one head for all talk, then with three (:data:`NO_FUNCTIONS`):

- the first set (four functions, 32 requests, 12 turns that need none):
  30/32 to their function, none of the 12 to one; the same with three;
- the held-out set (five others, 25 and 12): 22/25, 3 of 12 to a function
  (questions on a function's topic: "Who composed The Four Seasons?" beside
  ``play_music``); with three heads (chosen on these two sets) 22/25, 0 of 12;
- the third set (five others again, 25 and 12, first answered after the
  three heads were chosen): 23/25, 3 of 12; with three heads 22/25, 1 of 12
  ("How much should I tip a taxi driver in New York?" beside ``call_taxi``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from s2s_rt.engines.base import ChatMessage
from s2s_rt.toolcalls import chat_tool

#: The most tokens of the user's words a function is chosen by (their end, where the request usually is).
WORDS_TOKENS = 96

#: The choices that need no function, each a kind of talk: the model answers in words (and may still call one
#: itself). One head alone ("talk: greetings, thanks, general knowledge") lost questions on a function's topic
#: to the function ("Who composed The Four Seasons?" beside ``play_music``); a head for knowledge and one for
#: small talk, each scored on its own, keep them (BENCHMARKS.md, "Function calls").
NO_FUNCTION = {
    "name": "chat",
    "description": "Talk with the user: greetings, thanks, and questions answered from general knowledge.",
}
NO_FUNCTIONS = (
    NO_FUNCTION,
    {
        "name": "chat",
        "description": "Answer a question from general knowledge: facts about people, places, history, science, art,"
        " music, money and how things work.",
    },
    {"name": "chat", "description": "Small talk: greetings, thanks, how the user is, jokes."},
)


def heads(tools: Sequence[dict[str, Any]]) -> list[tuple[str | None, str]]:
    """For each function, then each of :data:`NO_FUNCTIONS` (named None), the text the user's request follows."""
    described = [chat_tool(tool)["function"] for tool in tools]
    return [
        *((f["name"], _head(f["name"], f.get("description") or "")) for f in described if f.get("name")),
        *((None, _head(talk["name"], talk["description"])) for talk in NO_FUNCTIONS),
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
    """The function whose head made the request likeliest; None when that is one of :data:`NO_FUNCTIONS`."""
    best = max(range(len(names)), key=lambda n: log_likelihoods[n])
    return names[best]


def call_opening(name: str) -> str:
    """The start of a call to ``name``, written into the answer's opening: the model writes its arguments."""
    return f'{{"name": {json.dumps(name)}, "arguments": {{'
