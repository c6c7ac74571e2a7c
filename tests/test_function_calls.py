"""Function calling over the Realtime protocol, exactly, on the fake stack.

Every test runs twice: with the fake LLM's tool call in one piece, and
streamed token by token as a real model streams it (``<``, ``tool_call``,
``>``, …), so the server's reading of a call that arrives in pieces crosses
the wire too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import RealtimeClient, http_get, live_server, run
from openai import AsyncOpenAI

from s2s_rt.engines.base import Stack
from s2s_rt.engines.fake import load_fake_stack
from s2s_rt.pipeline.responding import NO_ANSWER, NUDGE
from s2s_rt.toolcalls import is_error_result, parse_call

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
REMINDER = {
    "type": "function",
    "name": "set_reminder",
    "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]},
}


@pytest.fixture(params=[False, True], ids=["call-in-one-piece", "call-token-by-token"])
def engines(request: pytest.FixtureRequest) -> Stack:
    """The fake stack, its LLM streaming tool calls whole or token by token."""
    return load_fake_stack(stream_tool_calls=request.param)


def test_model_call_becomes_function_call_item_and_result_is_spoken(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER, REMINDER], "tool_choice": "auto"})
                done = await c.say_text("please get_weather Paris now")
                [item] = done["response"]["output"]
                assert item["type"] == "function_call" and item["name"] == "get_weather"
                assert json.loads(item["arguments"]) == {"city": "Paris", "unit": "celsius"}
                added = c.of_type("response.output_item.added")[-1]
                assert added["item"]["type"] == "function_call" and added["item"]["call_id"] == item["call_id"]
                args_done = c.of_type("response.function_call_arguments.done")[-1]
                assert args_done["call_id"] == item["call_id"] and args_done["name"] == "get_weather"
                assert (
                    "".join(d["delta"] for d in c.of_type("response.function_call_arguments.delta"))
                    == item["arguments"]
                )
                # Nothing of the call was spoken, nor shown as the answer's words.
                assert not c.of_type("response.output_audio.delta")
                assert not c.of_type("response.output_audio_transcript.delta")
                assert not any("tool_call" in json.dumps(e) for e in c.events if "delta" in e and "audio" in e["type"])
                # The client runs the function and hands back the result.
                await c.send(
                    "conversation.item.create",
                    item={"type": "function_call_output", "call_id": item["call_id"], "output": '{"temp": 21}'},
                )
                await c.until("conversation.item.added")
                await c.send("response.create")
                answer = await c.until("response.done")
                spoken = answer["response"]["output"][0]["content"][0]["transcript"]
                assert spoken == 'You said: the result is {"temp": 21}.'
                assert c.of_type("response.output_audio.delta")

    run(scenario())


def test_function_call_output_with_unknown_call_id_is_an_error() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "conversation.item.create",
                    event_id="fco",
                    item={"type": "function_call_output", "call_id": "call_nope", "output": "{}"},
                )
                err = await c.until("error")
                assert err["error"]["code"] == "unknown_call_id" and err["error"]["event_id"] == "fco"

    run(scenario())


def test_tool_choice_none_required_and_named(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER, REMINDER]})
                none = await c.say_text("get_weather Oslo", tool_choice="none")
                assert none["response"]["output"][0]["type"] == "message"
                required = await c.say_text("hello there", tool_choice="required", output_modalities=["text"])
                assert required["response"]["output"][0]["name"] == "get_weather"
                assert not c.of_type("response.output_text.delta")  # no piece of the call is shown as text
                named = await c.say_text("hello again", tool_choice={"type": "function", "name": "set_reminder"})
                assert named["response"]["output"][0]["name"] == "set_reminder"
                assert json.loads(named["response"]["output"][0]["arguments"]) == {"minutes": 1}
                await c.send(
                    "response.create", event_id="bad", response={"tool_choice": {"type": "function", "name": "nope"}}
                )
                assert (await c.until("error"))["error"]["param"] == "response.tool_choice"

    run(scenario())


def test_tools_per_response_without_session_tools(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("set_reminder please", tools=[REMINDER])
                assert done["response"]["output"][0]["name"] == "set_reminder"
                plain = await c.say_text("set_reminder please")
                assert plain["response"]["output"][0]["type"] == "message"

    run(scenario())


def test_invalid_arguments_are_retried_once_then_answered_in_words(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER]})
                fixed = await c.say_text("get_weather Rome [[bad-args]]")
                assert fixed["response"]["output"][0]["type"] == "function_call"
                assert json.loads(fixed["response"]["output"][0]["arguments"])["city"] == "Rome"
                calls_before = len(c.of_type("response.function_call_arguments.done"))
                hopeless = await c.say_text("get_weather Rome [[always-bad]]")
                [message] = hopeless["response"]["output"]
                assert message["type"] == "message"
                said = message["content"][0]["transcript"]
                # Asked once more with the functions out of view: the model's own words, never the server's
                # complaint about the call.
                assert said.startswith("You said: get_weather Rome"), said
                assert len(c.of_type("response.function_call_arguments.done")) == calls_before

    run(scenario())


def test_a_call_to_a_function_not_offered_is_never_read_as_an_apology_the_answer_is_asked_in_words(
    engines: Stack,
) -> None:
    """Greeted with functions in view, a small model calls one it made up: the user hears its words instead."""

    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER, REMINDER]})
                done = await c.say_text("hello there [[invent-call]]")
                [message] = done["response"]["output"]
                assert done["response"]["status"] == "completed"
                assert message["type"] == "message"
                assert message["content"][0]["transcript"] == "You said: hello there [[invent-call]]."
                assert c.of_type("response.output_audio.delta")
                assert [e["item"]["type"] for e in c.of_type("response.output_item.added")] == ["message"]
                assert not c.of_type("response.function_call_arguments.done")
                assert not any("Sorry" in json.dumps(e) or "hello'" in json.dumps(e) for e in c.events)
                status, metrics = await http_get(server, "/metrics")
                assert status == 200
                assert 's2s_tool_calls_total{outcome="invented"} 1' in metrics

    run(scenario())


def test_an_answer_with_nothing_in_it_is_asked_again_without_the_functions(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER, REMINDER]})
                done = await c.say_text("what should I wear in Paris [[mute-with-tools]]")
                assert done["response"]["status"] == "completed"
                [message] = done["response"]["output"]
                assert message["type"] == "message"
                # The fake model says back what it was asked: the user's words, and the nudge that followed them.
                said = message["content"][0]["transcript"]
                assert said == f"You said: what should I wear in Paris [[mute-with-tools]] {NUDGE}."
                assert not c.of_type("response.function_call_arguments.done")
                assert c.of_type("response.output_audio.delta")

    run(scenario())


@pytest.mark.parametrize("tools", [[WEATHER], []], ids=["tools-offered", "no-tools"])
def test_an_answer_still_empty_when_asked_again_ends_in_words_that_say_so(tools: list[dict[str, Any]]) -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": tools})
                spoken = await c.say_text("what should I wear in Paris [[mute]]")
                [message] = spoken["response"]["output"]
                assert message["content"][0]["transcript"] == NO_ANSWER
                assert c.of_type("response.output_audio.delta")
                written = await c.say_text("and in Rome [[mute]]", output_modalities=["text"])
                [message] = written["response"]["output"]
                assert message["content"][0]["text"] == NO_ANSWER

    run(scenario())


async def answer_call(c: RealtimeClient, call: dict[str, Any], output: str) -> dict[str, Any]:
    """The client's result for ``call``, and the response to it."""
    await c.send(
        "conversation.item.create",
        item={"type": "function_call_output", "call_id": call["call_id"], "output": output},
    )
    await c.until("conversation.item.added")
    await c.send("response.create")
    return await c.until("response.done")


async def call_and_answer(c: RealtimeClient, words: str, output: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A user turn that makes a call, the client's result for it, and the response to that result."""
    done = await c.say_text(words)
    [call] = done["response"]["output"]
    assert call["type"] == "function_call"
    return call, await answer_call(c, call, output)


def test_a_call_made_again_while_answering_its_result_is_not_sent_and_the_result_is_answered(engines: Stack) -> None:
    """A client library runs every call it gets: the same call again would be run again, until its turn limit."""

    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER]})
                _, answer = await call_and_answer(c, "please get_weather Paris [[repeat-call]]", '{"temp": 21}')
                [message] = answer["response"]["output"]
                assert answer["response"]["status"] == "completed"
                assert message["type"] == "message"
                assert message["content"][0]["transcript"] == 'You said: the result is {"temp": 21}.'
                added = [e["item"] for e in c.of_type("response.output_item.added")]
                assert [i["type"] for i in added] == ["function_call", "message"]
                assert len(c.of_type("response.function_call_arguments.done")) == 1
                status, metrics = await http_get(server, "/metrics")
                assert status == 200
                assert 's2s_tool_calls_total{outcome="repeated"} 1' in metrics
                assert 's2s_tool_calls_total{outcome="sent"} 1' in metrics

    run(scenario())


def test_a_call_made_again_after_an_error_result_is_a_retry_sent_to_the_client_at_most_twice(engines: Stack) -> None:
    """The client's function failed and its result says so: the same call again is a retry, not a loop."""
    failed = "Error: service unavailable, call get_weather again"

    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER]})
                first, answer = await call_and_answer(c, "please get_weather Paris", failed)
                ids = [first["call_id"]]
                for _ in range(2):
                    [retry] = answer["response"]["output"]
                    assert retry["type"] == "function_call" and retry["name"] == "get_weather"
                    assert json.loads(retry["arguments"]) == json.loads(first["arguments"])
                    assert retry["call_id"] not in ids
                    ids.append(retry["call_id"])
                    answer = await answer_call(c, retry, failed)
                # Failed three times: the model's third repeat is not sent, the failure is answered in words.
                [message] = answer["response"]["output"]
                assert message["type"] == "message"
                assert message["content"][0]["transcript"] == f"You said: the result is {failed}."
                status, metrics = await http_get(server, "/metrics")
                assert status == 200
                assert 's2s_tool_calls_total{outcome="sent"} 3' in metrics
                assert 's2s_tool_calls_total{outcome="repeated"} 1' in metrics

    run(scenario())


@pytest.mark.parametrize(
    ("output", "failed"),
    [
        ("Error: service unavailable, call get_weather again", True),
        ("ERROR 503", True),
        ("An error occurred while running the tool. Please try again.", True),  # openai-agents' default
        ("An internal error occurred", True),  # LiveKit Agents', for an unexpected exception
        ("Failed to reach the weather service", True),
        ('{"error": "city not found"}', True),
        ('{"status": "error", "message": "timeout"}', True),
        ('{"ok": false}', True),
        ('"Error: quota exceeded"', True),
        ('{"temp": 21}', False),
        ('{"error": null, "temp": 21}', False),
        ("sunny, no errors reported", False),
        ("Errand booked for 5 pm", False),
    ],
)
def test_a_result_is_an_error_when_it_begins_by_saying_so_or_its_json_has_an_error(output: str, failed: bool) -> None:
    assert is_error_result(output) is failed


def test_the_same_request_in_a_later_turn_is_a_new_call(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"tools": [WEATHER]})
                first, _ = await call_and_answer(c, "please get_weather Paris", '{"temp": 21}')
                again = await c.say_text("please get_weather Paris")
                [call] = again["response"]["output"]
                assert call["type"] == "function_call" and call["call_id"] != first["call_id"]
                assert json.loads(call["arguments"]) == json.loads(first["arguments"])

    run(scenario())


def test_arguments_a_closed_schema_does_not_declare_are_left_out_of_the_call() -> None:
    closed = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": False}}
    raw = json.dumps({"name": "get_weather", "arguments": {"city": "Lisboa", "unit": "celsius", "time": "14:57"}})
    assert json.loads(parse_call(raw, [closed])[1]) == {"city": "Lisboa", "unit": "celsius"}
    # A schema that allows other properties (JSON Schema's default) gets the call as the model made it.
    assert json.loads(parse_call(raw, [WEATHER])[1])["time"] == "14:57"


def test_openai_sdk_function_call_round_trip(engines: Stack) -> None:
    async def scenario() -> None:
        async with live_server(engines) as server:
            client = AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
            async with client.realtime.connect(model="s2s-rt") as conn:
                await conn.session.update(
                    session={"type": "realtime", "output_modalities": ["text"], "tools": [WEATHER]}
                )
                await conn.conversation.item.create(
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "get_weather Lima"}],
                    }
                )
                await conn.response.create()
                call = None
                async for event in conn:
                    if event.type == "response.function_call_arguments.done":
                        call = event
                    if event.type == "response.done":
                        break
                assert call is not None and call.name == "get_weather"
                await conn.conversation.item.create(
                    item={"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
                )
                await conn.response.create()
                text = ""
                async for event in conn:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                    if event.type == "response.done":
                        break
                assert text == "You said: the result is sunny."

    run(scenario())
