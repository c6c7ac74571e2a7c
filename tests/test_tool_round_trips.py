"""Function calls on the default stack: a tool's result comes back to the user as words.

Over a live socket, with the default model answering, the client does what
every client library does: it runs the call it gets, sends the result as a
``function_call_output`` and asks for the answer with ``response.create``.
The tools are the evaluation's (weather, alarm, currency); answers are
greedy, so each test hears the same answer every run. openai-agents' round
trip on the default stack is in ``test_third_party_clients.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from conftest import RealtimeClient, http_get, run

from s2s_rt import Config, Server
from s2s_rt.evaluation.asking import CallResult
from s2s_rt.evaluation.tool_requests import REQUESTS, TOOLS

pytestmark = pytest.mark.slow

SETTINGS = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0.0, "output_modalities": ["text"]}


@asynccontextmanager
async def default_server() -> AsyncIterator[Server]:
    """The default stack on a free port (also for the third-party clients' round trip on it)."""
    async with Server(Config(port=0, stack="default", pool_size=2)) as server:
        yield server


def answer_text(done: dict[str, Any]) -> str:
    return " ".join(
        part.get("text") or part.get("transcript") or ""
        for item in done["response"]["output"]
        if item["type"] == "message"
        for part in item["content"]
    ).strip()


#: How long an answer may take here. Tools make the prompt long (the evaluation's three are about 400 tokens):
#: on the 2-core Xeon it is read in about a second, on a 2-core AMD EPYC without AVX-512 in about 15 s.
ANSWER_S = 90


async def ask_with_tools(c: RealtimeClient, words: str) -> dict[str, Any]:
    await c.send("session.update", session=SETTINGS)
    await c.until("session.updated")
    await c.ask(words)
    return await c.until("response.done", timeout=ANSWER_S)


async def hand_back(c: RealtimeClient, call: dict[str, Any], output: str, **response: Any) -> dict[str, Any]:
    await c.send(
        "conversation.item.create",
        item={"type": "function_call_output", "call_id": call["call_id"], "output": output},
    )
    await c.until("conversation.item.added")
    await c.send("response.create", **({"response": response} if response else {}))
    return await c.until("response.done", timeout=ANSWER_S)


@pytest.mark.parametrize(
    "request_text",
    [
        "What's the weather like in Paris right now?",
        "Wake me up at six thirty.",
        "How much is one hundred dollars in euros?",
    ],
)
def test_a_result_is_answered_in_words_that_use_it_not_with_another_call(request_text: str) -> None:
    request = next(r for r in REQUESTS if r.text == request_text)

    async def scenario() -> None:
        async with default_server() as server, RealtimeClient.connect(server) as c:
            done = await ask_with_tools(c, request.text)
            [call] = done["response"]["output"]
            assert call["type"] == "function_call" and call["name"] == request.function
            arguments = json.loads(call["arguments"])
            for key in arguments:  # the evaluation's schemas allow no other properties
                assert key in next(t for t in TOOLS if t["name"] == call["name"])["parameters"]["properties"]
            answer = await hand_back(c, call, request.output)
            assert answer["response"]["status"] == "completed"
            assert [o["type"] for o in answer["response"]["output"]] == ["message"]
            said = answer_text(answer)
            assert "{" not in said, said
            assert request.answer_uses_result(_said(said)), said

    run(scenario(), timeout=4 * ANSWER_S)


def _said(text: str) -> CallResult:
    return CallResult([], [], text)


def test_a_call_identical_to_one_already_answered_is_not_sent_again() -> None:
    """Made to call once more (``tool_choice: required``), the model is answered in words that use the result."""

    async def scenario() -> None:
        async with default_server() as server, RealtimeClient.connect(server) as c:
            request = REQUESTS[0]
            done = await ask_with_tools(c, request.text)
            [call] = done["response"]["output"]
            answer = await hand_back(c, call, request.output, tool_choice="required")
            assert [o["type"] for o in answer["response"]["output"]] == ["message"]
            assert request.answer_uses_result(_said(answer_text(answer))), answer_text(answer)
            assert len(c.of_type("response.function_call_arguments.done")) == 1
            # Whether the model repeated its call (not sent) or wrote a broken one (asked again in words)
            # depends on the machine's arithmetic (on CI's AMD EPYC it wrote two broken ones); either way one
            # call only ever reached the client. The repeat itself is tested exactly in test_function_calls.
            _, metrics = await http_get(server, "/metrics")
            assert 's2s_tool_calls_total{outcome="sent"} 1' in metrics

    run(scenario(), timeout=4 * ANSWER_S)


def test_small_talk_and_facts_with_tools_offered_get_no_call() -> None:
    async def scenario() -> None:
        async with default_server() as server:
            for words in ("Thanks, that's all for now.", "Good morning!", "What is the capital of Italy?"):
                async with RealtimeClient.connect(server) as c:
                    done = await ask_with_tools(c, words)
                    assert [o["type"] for o in done["response"]["output"]] == ["message"], (words, done)
                    assert answer_text(done), words

    run(scenario(), timeout=4 * ANSWER_S)


def test_requests_in_everyday_words_call_the_function_they_need_with_its_arguments() -> None:
    """Advice, a lookup that does not say "order", and a clock time in words each get the right call.

    On the code before the function was chosen by likelihood and times and
    amounts were written in digits, the default model answered the umbrella
    from its own imagination, looked the purchase up as ``get_weather(Paris)``
    and set the alarm for ``14:00`` (BENCHMARKS.md, "Function calls").
    """
    wanted = (
        "Do I need an umbrella in Berlin?",
        "Can you check on purchase 91002 for me?",
        "Wake me at a quarter to six.",
    )

    async def scenario() -> None:
        async with default_server() as server:
            for words in wanted:
                request = next(r for r in REQUESTS if r.text == words)
                async with RealtimeClient.connect(server) as c:
                    done = await ask_with_tools(c, words)
                    calls = [
                        (o["name"], json.loads(o["arguments"]))
                        for o in done["response"]["output"]
                        if o["type"] == "function_call"
                    ]
                    assert request.is_right(CallResult(calls, [], answer_text(done))), (words, done["response"])

    run(scenario(), timeout=4 * ANSWER_S)
