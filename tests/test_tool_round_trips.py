"""Function calls on the default stack: a tool's result comes back to the user as words.

Over a live socket, with the default model answering, the client does what
every client library does: it runs the call it gets, sends the result as a
``function_call_output`` and asks for the answer with ``response.create``.
The tools are the evaluation's (weather, alarm, currency); answers are
greedy, so each test hears the same answer every run.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from conftest import RealtimeClient, http_get, require_module, run

from s2s_rt import Config, Server
from s2s_rt.evaluation.asking import CallResult
from s2s_rt.evaluation.tool_requests import REQUESTS, TOOLS

pytestmark = pytest.mark.slow

SETTINGS = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0.0, "output_modalities": ["text"]}


@asynccontextmanager
async def default_server() -> AsyncIterator[Server]:
    async with Server(Config(port=0, stack="default", pool_size=2)) as server:
        yield server


def answer_text(done: dict[str, Any]) -> str:
    return " ".join(
        part.get("text") or part.get("transcript") or ""
        for item in done["response"]["output"]
        if item["type"] == "message"
        for part in item["content"]
    ).strip()


async def ask_with_tools(c: RealtimeClient, words: str) -> dict[str, Any]:
    await c.send("session.update", session=SETTINGS)
    await c.until("session.updated")
    return await c.say_text(words)


async def hand_back(c: RealtimeClient, call: dict[str, Any], output: str, **response: Any) -> dict[str, Any]:
    await c.send(
        "conversation.item.create",
        item={"type": "function_call_output", "call_id": call["call_id"], "output": output},
    )
    await c.until("conversation.item.added")
    await c.send("response.create", **({"response": response} if response else {}))
    return await c.until("response.done", timeout=60)


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

    run(scenario(), timeout=120)


def _said(text: str) -> CallResult:
    return CallResult([], [], text)


def test_a_call_identical_to_one_already_answered_is_not_sent_again() -> None:
    """Made to call once more (``tool_choice: required``), the model repeats the call it has the result of."""

    async def scenario() -> None:
        async with default_server() as server, RealtimeClient.connect(server) as c:
            request = REQUESTS[0]
            done = await ask_with_tools(c, request.text)
            [call] = done["response"]["output"]
            answer = await hand_back(c, call, request.output, tool_choice="required")
            assert [o["type"] for o in answer["response"]["output"]] == ["message"]
            assert request.answer_uses_result(_said(answer_text(answer))), answer_text(answer)
            assert len(c.of_type("response.function_call_arguments.done")) == 1
            _, metrics = await http_get(server, "/metrics")
            assert 's2s_tool_calls_total{outcome="repeated"} 1' in metrics

    run(scenario(), timeout=120)


def test_small_talk_and_facts_with_tools_offered_get_no_call() -> None:
    async def scenario() -> None:
        async with default_server() as server:
            for words in ("Thanks, that's all for now.", "Good morning!", "What is the capital of Italy?"):
                async with RealtimeClient.connect(server) as c:
                    done = await ask_with_tools(c, words)
                    assert [o["type"] for o in done["response"]["output"]] == ["message"], (words, done)
                    assert answer_text(done), words

    run(scenario(), timeout=120)


def test_openai_agents_runs_the_tool_once_and_speaks_its_result_on_the_default_stack() -> None:
    require_module("agents.realtime", "openai-agents is not installed (make install installs it)")

    async def scenario() -> None:
        from agents import function_tool
        from agents.realtime import RealtimeAgent, RealtimeRunner

        calls: list[str] = []

        @function_tool
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            calls.append(city)
            return "18 degrees and sunny"

        async with default_server() as server:
            agent = RealtimeAgent(
                name="weather",
                instructions="You are a helpful voice assistant. Answer briefly.",
                tools=[get_weather],
            )
            runner = RealtimeRunner(agent)
            session = await runner.run(
                model_config={
                    "url": f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime",
                    "api_key": "sk-local",
                }
            )
            async with session:
                events: list[Any] = []
                sent = False
                async for event in session:
                    events.append(event)
                    raw = (
                        event.data.data
                        if event.type == "raw_model_event" and event.data.type == "raw_server_event"
                        else {}
                    )
                    if raw.get("type") == "session.updated" and not sent:
                        sent = True
                        await session.send_message("What's the weather like in Paris?")
                    if raw.get("type") == "response.done" and any(
                        o["type"] == "message" for o in raw["response"]["output"]
                    ):
                        break
                    assert event.type != "error", event
            assert calls == ["Paris"]
            assert len([e for e in events if e.type == "tool_end"]) == 1
            audio = b"".join(e.audio.data for e in events if e.type == "audio")
            assert len(audio) > 24_000  # more than half a second of PCM16 at 24 kHz
            dones = [
                e.data.data
                for e in events
                if e.type == "raw_model_event"
                and e.data.type == "raw_server_event"
                and e.data.data.get("type") == "response.done"
            ]
            said = " ".join(
                part.get("transcript") or part.get("text") or ""
                for d in dones
                for o in d["response"]["output"]
                if o["type"] == "message"
                for part in o["content"]
            )
            assert re.search(r"18|eighteen|sunny", said, re.IGNORECASE), said

    run(scenario(), timeout=120)
