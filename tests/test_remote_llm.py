"""The LLM behind an OpenAI-compatible endpoint (``--llm-url``), tested against a real server.

The server is llama.cpp's, from ``llama-cpp-python[server]`` (see
:mod:`llama_server`), serving the GGUF files the project ships: SmolLM2-135M
where only the plumbing matters, Qwen2.5-Coder-0.5B where the model must
make sense. A relay between s2s-rt and it (:class:`llama_server.ConnectionLog`)
shows when the HTTP stream is closed and what s2s-rt asked for.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RealtimeClient, http_get, run, silence, tone
from llama_server import Connection, ConnectionLog, LlamaServer, free_port

from s2s_rt import Config, Server
from s2s_rt.engines.base import ChatMessage, FunctionCall
from s2s_rt.engines.remote_llm import chat_messages
from s2s_rt.models.recipes import source_gguf
from s2s_rt.protocol.prompt import call_message

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STORY = {
    "instructions": "You are a storyteller. Tell long, detailed stories of many sentences.",
    "temperature": 0.0,
}


def _remote(url: str, **config: Any) -> Config:
    """A fake-stack server (exact VAD, STT and TTS) whose LLM is the endpoint at ``url``."""
    return Config(**({"port": 0, "stack": "fake", "pool_size": 4, "llm_url": url} | config))


def _requests(connection: Connection) -> list[dict[str, Any]]:
    """The JSON bodies of the chat completions requests sent on ``connection``."""
    data, bodies = bytes(connection.sent), []
    while (head_end := data.find(b"\r\n\r\n")) >= 0:
        head, data = data[:head_end].decode("latin-1"), data[head_end + 4 :]
        length = next(
            (int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.lower().startswith("content-length:")),
            0,
        )
        body, data = data[:length], data[length:]
        if head.startswith("POST") and "/chat/completions" in head.split("\r\n", 1)[0]:
            bodies.append(json.loads(body))
    return bodies


# --- messages in chat completions form (no server) ---------------------------------


def test_a_call_and_its_result_become_a_native_tool_call_answered_by_its_id() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    messages = chat_messages(
        [
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "Weather in Paris?"),
            ChatMessage("assistant", "Let me look."),
            ChatMessage("assistant", call),
            ChatMessage("tool", '{"sky": "sunny"}'),
        ]
    )
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]


def test_results_answer_the_calls_they_name_in_whatever_order_they_came() -> None:
    paris, rome = (FunctionCall("get_weather", json.dumps({"city": c}), f"call_{c}") for c in ("Paris", "Rome"))
    messages = chat_messages(
        [
            ChatMessage("user", "Weather in Paris and Rome?"),
            call_message(paris),
            call_message(rome),
            ChatMessage("tool", "rain", answers=rome),
            ChatMessage("tool", "sun", answers=paris),
        ]
    )
    [_, turn, *results] = messages
    assert [c["id"] for c in turn["tool_calls"]] == ["call_Paris", "call_Rome"]
    assert results == [
        {"role": "tool", "tool_call_id": "call_Rome", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_Paris", "content": "sun"},
    ]


def test_a_call_without_a_result_is_left_out_and_a_result_without_a_call_is_user_text() -> None:
    unanswered = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    messages = chat_messages(
        [
            ChatMessage("user", "Weather?"),
            ChatMessage("assistant", unanswered),
            ChatMessage("user", "Never mind."),
            ChatMessage("tool", "21 degrees"),
        ]
    )
    assert messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "user", "content": "Never mind."},
        {"role": "user", "content": "Function result: 21 degrees"},
    ]


def test_an_unreachable_endpoint_fails_each_answer_with_llm_unavailable_and_the_session_goes_on() -> None:
    async def scenario() -> None:
        nothing_there = f"http://127.0.0.1:{free_port()}/v1"
        async with Server(_remote(nothing_there, llm_model="m")) as server:
            async with RealtimeClient.connect(server) as c:
                for _ in range(2):
                    done = await c.say_text("Hello?")
                    assert done["response"]["status"] == "failed"
                    assert done["response"]["status_details"]["error"]["code"] == "llm_unavailable"
                    error = await c.until("error")
                    assert error["error"]["code"] == "llm_unavailable" and "cannot reach" in error["error"]["message"]
                await c.send("session.update", session={"instructions": "still here"})
                assert (await c.until("session.updated"))["session"]["instructions"] == "still here"

    run(scenario())


# --- against llama.cpp's server ------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """Qwen2.5-Coder-0.5B (the default preset's GGUF) behind llama.cpp's server, for this module."""
    directory = tmp_path_factory.mktemp("qwen-gguf")
    with LlamaServer(source_gguf("default", directory), directory / "server.log") as server:
        yield server


@pytest.fixture
def smollm(tmp_path: Path) -> Iterator[LlamaServer]:
    """SmolLM2-135M behind a llama.cpp server of the test's own (it gets killed), with an API key."""
    with LlamaServer(source_gguf("tiny", tmp_path), tmp_path / "server.log", api_key="sk-test-key") as server:
        yield server


@pytest.mark.slow
def test_spoken_question_is_answered_aloud_through_the_endpoint(qwen: LlamaServer) -> None:
    from test_real_pipeline import check_spoken_turn

    async def scenario() -> None:
        config = Config(port=0, stack="default", pool_size=1, llm_url=qwen.url)
        async with Server(config) as server:
            assert server.stack is not None and qwen.url in server.stack.description[-1]
            await check_spoken_turn(server)

    run(scenario(), timeout=240)


@pytest.mark.slow
def test_tool_call_round_trip_uses_native_tool_calls(qwen: LlamaServer) -> None:
    async def scenario() -> None:
        async with ConnectionLog(qwen.port) as relay, Server(_remote(relay.url, llm_model=qwen.model)) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "session.update",
                    session={"tools": [WEATHER], "tool_choice": "required", "temperature": 0.0},
                )
                done = await c.say_text("What is the weather like in Paris?", output_modalities=["text"])
                [item] = done["response"]["output"]
                assert item["type"] == "function_call" and item["name"] == "get_weather"
                assert isinstance(json.loads(item["arguments"])["city"], str)
                await c.send(
                    "conversation.item.create",
                    item={"type": "function_call_output", "call_id": item["call_id"], "output": '{"sky": "sunny"}'},
                )
                await c.until("conversation.item.added")
                await c.send("response.create", response={"tool_choice": "none", "output_modalities": ["text"]})
                answer = await c.until("response.done", timeout=60)
                assert answer["response"]["status"] == "completed"
                assert answer["response"]["output"][0]["content"][0]["text"].strip()

        asked, answered = [body for connection in relay.connections for body in _requests(connection)]
        # The tool went as a native tool, forced by name (one tool offered and a call required) ...
        assert asked["tools"] == [
            {
                "type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
            }
        ]
        assert asked["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        # ... and the call and its result came back as a tool call and a tool message.
        call, result = answered["messages"][-2:]
        assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "get_weather"
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": '{"sky": "sunny"}'}
        assert "tools" not in answered

    run(scenario(), timeout=180)


async def _story_begun(c: RealtimeClient, **response: Any) -> None:
    """Ask for a long story and return once its first words arrive."""
    await c.send("session.update", session=STORY)
    await c.ask("Tell me a long story about a dragon who learns to sing.", **response)
    delta = (
        "response.output_text.delta" if response.get("output_modalities") == ["text"] else "response.output_audio.delta"
    )
    await c.until(delta, timeout=60)


async def _stream_story(c: RealtimeClient, relay: ConnectionLog, **response: Any) -> Connection:
    """Ask for a long story and wait for its first words; returns the connection streaming it."""
    await _story_begun(c, **response)
    [streaming] = [connection for connection in relay.connections if connection.closed is None]
    return streaming


@pytest.mark.slow
@pytest.mark.parametrize("how", ["response.cancel", "barge-in"])
def test_cancelling_closes_the_remote_stream_within_300_ms(qwen: LlamaServer, how: str) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with ConnectionLog(qwen.port) as relay, Server(_remote(relay.url, llm_model=qwen.model)) as server:
            async with RealtimeClient.connect(server) as c:
                if how == "response.cancel":
                    streaming = await _stream_story(c, relay, output_modalities=["text"])
                    started = loop.time()
                    await c.send("response.cancel")
                else:
                    streaming = await _stream_story(c, relay)
                    started = loop.time()
                    await c.append_audio(tone(440, 0.3) + silence(0.1))
                done = await c.until("response.done")
                closed = await relay.wait_closed(streaming, timeout=5.0)
                assert done["response"]["status"] == "cancelled"
                assert closed is not None, "the HTTP stream to the endpoint was never closed"
                print(f"{how}: HTTP stream closed {1000 * (closed - started):.1f} ms later")
                assert closed - started <= 0.300, f"the stream closed {1000 * (closed - started):.0f} ms after {how}"

    run(scenario(), timeout=180)


@pytest.mark.slow
def test_concurrent_sessions_share_one_connection_pool(qwen: LlamaServer) -> None:
    async def one(server: Server, n: int) -> list[str]:
        async with RealtimeClient.connect(server) as c:
            await c.send("session.update", session={"temperature": 0.0})
            answers = []
            for question in (f"Say the number {n}.", "Say hello."):
                # Three sessions' answers queue at one llama.cpp server: on a busy 2-core machine one waited
                # past the usual 10 s (the subject here is the connections, not the time).
                await c.ask(question, output_modalities=["text"], max_output_tokens=12)
                done = await c.until("response.done", timeout=60)
                assert done["response"]["status"] == "completed", done["response"]
                answers.append(done["response"]["output"][0]["content"][0]["text"])
            return answers

    async def scenario() -> None:
        # No llm_model: the model name is asked of the endpoint once.
        async with ConnectionLog(qwen.port) as relay, Server(_remote(relay.url)) as server:
            results = await asyncio.gather(*(one(server, n) for n in range(3)))
            assert all(answer.strip() for answers in results for answer in answers)
            # Each answer's time is in the LLM stage's latency, as for the in-process model.
            status, metrics = await http_get(server, "/metrics")
            assert status == 200 and 's2s_stage_seconds_count{stage="llm"} 6' in metrics
        answers = [body for connection in relay.connections for body in _requests(connection)]
        assert len(answers) == 6 and {body["model"] for body in answers} == {qwen.model}
        # Six answers (plus the model lookup) over at most three connections: reused, never one per answer.
        assert len(relay.connections) <= 3, len(relay.connections)

    run(scenario(), timeout=180)


@pytest.mark.slow
def test_an_endpoint_killed_mid_answer_fails_it_and_the_session_recovers(smollm: LlamaServer) -> None:
    async def scenario() -> None:
        config = _remote(smollm.url, llm_model=smollm.model, llm_api_key=smollm.api_key)
        async with Server(config) as server:
            async with RealtimeClient.connect(server) as c:
                await _story_begun(c, output_modalities=["text"])
                smollm.kill()
                done = await c.until("response.done")
                assert done["response"]["status"] == "failed"
                assert done["response"]["status_details"]["error"]["code"] == "llm_unavailable"
                # While it is down, each answer fails at once; the session itself is fine.
                down = await c.say_text("Are you there?", output_modalities=["text"])
                assert down["response"]["status_details"]["error"]["code"] == "llm_unavailable"
                await asyncio.to_thread(smollm.start)
                back = await c.say_text("Say hello.", output_modalities=["text"], max_output_tokens=16)
                assert back["response"]["status"] == "completed", back["response"]
                assert back["response"]["output"][0]["content"][0]["text"].strip()

    run(scenario(), timeout=180)


@pytest.mark.slow
def test_an_endpoint_that_stops_sending_fails_the_answer_with_llm_timeout(smollm: LlamaServer) -> None:
    async def scenario() -> None:
        config = _remote(smollm.url, llm_model=smollm.model, llm_api_key=smollm.api_key, llm_timeout_s=1.0)
        async with Server(config) as server:
            async with RealtimeClient.connect(server) as c:
                await _story_begun(c, output_modalities=["text"])
                smollm.pause()
                try:
                    done = await c.until("response.done", timeout=5)
                finally:
                    smollm.resume()
                assert done["response"]["status_details"]["error"]["code"] == "llm_timeout"
                back = await c.say_text("Say hello.", output_modalities=["text"], max_output_tokens=16)
                assert back["response"]["status"] == "completed", back["response"]

    run(scenario(), timeout=180)


@pytest.mark.slow
def test_a_refused_key_fails_the_answer_with_llm_failed_naming_the_status(smollm: LlamaServer) -> None:
    async def scenario() -> None:
        async with Server(_remote(smollm.url, llm_model=smollm.model, llm_api_key="sk-wrong")) as server:
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("Hello?")
                assert done["response"]["status_details"]["error"]["code"] == "llm_failed"
                assert "401" in (await c.until("error"))["error"]["message"]

    run(scenario(), timeout=120)
