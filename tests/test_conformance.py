"""The conformance validator itself: it accepts OpenAI's shapes and rejects anything else.

Every event a :class:`~conftest.RealtimeClient` receives goes through
:func:`conformance.validate_server_event`; these tests pin down that the
validator is strict (unknown event types, unknown or misspelt fields at any
depth, missing required fields, wrong literals, wrong JSON types) and that the
client hook uses the right dialect and cannot be swallowed silently; and that
what the server sends in spoken turns conforms in both dialects, with the
fake stack speculating as the default stack does and without.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from conformance import ConformanceError, event_types, validate_server_event
from conftest import RealtimeClient, both_speculation_modes, http_get, live_server, run, silence, tone

# -- correct events of each dialect -------------------------------------------------------------

GA_OK: list[dict[str, Any]] = [
    {
        "type": "session.created",
        "event_id": "event_1",
        "session": {
            "type": "realtime",
            "model": "gpt-realtime",
            "instructions": "Be brief.",
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "tool_choice": "auto",
            "tools": [],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "transcription": None,
                    "noise_reduction": None,
                    "turn_detection": {
                        "type": "server_vad",
                        "threshold": 0.5,
                        "prefix_padding_ms": 300,
                        "silence_duration_ms": 500,
                        "create_response": True,
                        "interrupt_response": True,
                        "idle_timeout_ms": None,
                    },
                },
                "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy", "speed": 1.0},
            },
        },
    },
    {
        "type": "conversation.created",
        "event_id": "event_2",
        "conversation": {"id": "conv_1", "object": "realtime.conversation"},
    },
    {
        "type": "conversation.item.added",
        "event_id": "event_3",
        "previous_item_id": None,
        "item": {
            "id": "item_1",
            "object": "realtime.item",
            "type": "message",
            "status": "completed",
            "role": "user",
            "content": [{"type": "input_text", "text": "hello"}],
        },
    },
    {
        "type": "response.content_part.added",
        "event_id": "event_4",
        "response_id": "resp_1",
        "item_id": "item_2",
        "output_index": 0,
        "content_index": 0,
        "part": {"type": "audio", "transcript": ""},
    },
    {
        "type": "response.output_audio.delta",
        "event_id": "event_5",
        "response_id": "resp_1",
        "item_id": "item_2",
        "output_index": 0,
        "content_index": 0,
        "delta": "AAAA",
    },
    {
        "type": "response.output_audio_transcript.done",
        "event_id": "event_6",
        "response_id": "resp_1",
        "item_id": "item_2",
        "output_index": 0,
        "content_index": 0,
        "transcript": "Hi there.",
    },
    {
        "type": "response.done",
        "event_id": "event_7",
        "response": {
            "id": "resp_1",
            "object": "realtime.response",
            "status": "cancelled",
            "status_details": {"type": "cancelled", "reason": "turn_detected"},
            "conversation_id": "conv_1",
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "metadata": None,
            "output": [
                {
                    "id": "item_2",
                    "object": "realtime.item",
                    "type": "message",
                    "status": "incomplete",
                    "role": "assistant",
                    "content": [{"type": "output_audio", "transcript": "Hi"}],
                }
            ],
            "usage": {
                "total_tokens": 12,
                "input_tokens": 10,
                "output_tokens": 2,
                "input_token_details": {"text_tokens": 10, "audio_tokens": 0, "cached_tokens": 0},
                "output_token_details": {"text_tokens": 2, "audio_tokens": 0},
            },
        },
    },
    {
        "type": "error",
        "event_id": "event_8",
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_value",
            "message": "nope",
            "param": "type",
            "event_id": "client_1",
        },
    },
    {"type": "input_audio_buffer.speech_started", "event_id": "event_9", "audio_start_ms": 0, "item_id": "item_3"},
]

BETA_OK: list[dict[str, Any]] = [
    {
        "type": "session.created",
        "event_id": "event_1",
        "session": {
            "id": "sess_1",
            "model": "gpt-4o-realtime-preview",
            "modalities": ["text", "audio"],
            "instructions": "Be brief.",
            "voice": "alloy",
            "input_audio_format": "pcm16",
            "output_audio_format": "g711_ulaw",
            "input_audio_transcription": None,
            "turn_detection": {"type": "semantic_vad", "eagerness": "auto", "create_response": True},
            "tools": [],
            "tool_choice": "auto",
            "temperature": 0.8,
            "max_response_output_tokens": 4096,
        },
    },
    {
        "type": "conversation.item.created",
        "event_id": "event_2",
        "previous_item_id": None,
        "item": {
            "id": "item_1",
            "object": "realtime.item",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "audio", "transcript": "Hi"}],
        },
    },
    {
        "type": "response.content_part.added",
        "event_id": "event_3",
        "response_id": "resp_1",
        "item_id": "item_1",
        "output_index": 0,
        "content_index": 0,
        "part": {"type": "audio", "transcript": ""},
    },
    {
        "type": "response.audio.delta",
        "event_id": "event_4",
        "response_id": "resp_1",
        "item_id": "item_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "AAAA",
    },
    {
        "type": "response.done",
        "event_id": "event_5",
        "response": {
            "id": "resp_1",
            "object": "realtime.response",
            "status": "completed",
            "status_details": None,
            "modalities": ["text"],
            "output": [],
            "usage": {
                "total_tokens": 3,
                "input_tokens": 2,
                "output_tokens": 1,
                "input_token_details": {"text_tokens": 2, "audio_tokens": 0, "cached_tokens": 0},
                "output_token_details": {"text_tokens": 1, "audio_tokens": 0},
            },
        },
    },
    {
        "type": "error",
        "event_id": "event_6",
        "error": {"type": "invalid_request_error", "code": None, "message": "nope", "param": None, "event_id": None},
    },
]


@pytest.mark.parametrize("event", GA_OK, ids=lambda e: e["type"])
def test_correct_ga_events_pass(event: dict[str, Any]) -> None:
    validate_server_event(event, beta=False)


@pytest.mark.parametrize("event", BETA_OK, ids=lambda e: e["type"])
def test_correct_beta_events_pass(event: dict[str, Any]) -> None:
    validate_server_event(event, beta=True)


def test_every_documented_server_event_has_a_ga_type() -> None:
    documented = {
        "session.created", "session.updated", "conversation.created",
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "input_audio_buffer.cleared", "input_audio_buffer.timeout_triggered",
        "conversation.item.created", "conversation.item.added", "conversation.item.done",
        "conversation.item.retrieved", "conversation.item.truncated", "conversation.item.deleted",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.input_audio_transcription.failed",
        "response.created", "response.output_item.added", "response.output_item.done",
        "response.content_part.added", "response.content_part.done",
        "response.output_audio.delta", "response.output_audio.done",
        "response.output_audio_transcript.delta", "response.output_audio_transcript.done",
        "response.output_text.delta", "response.output_text.done",
        "response.done", "rate_limits.updated", "error",
    }  # fmt: skip
    assert documented <= set(event_types(beta=False)), documented - set(event_types(beta=False))


# -- deliberately wrong events --------------------------------------------------------------------


def _fails(event: dict[str, Any], beta: bool, *expected: str) -> ConformanceError:
    with pytest.raises(ConformanceError) as info:
        validate_server_event(event, beta=beta)
    message = str(info.value)
    assert repr(event.get("type")) in message, message
    for text in expected:
        assert text in message, message
    return info.value


def _ga(type: str) -> dict[str, Any]:
    return copy.deepcopy(next(e for e in GA_OK if e["type"] == type))


def _beta(type: str) -> dict[str, Any]:
    return copy.deepcopy(next(e for e in BETA_OK if e["type"] == type))


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_content_part_of_type_output_audio_fails(beta: bool) -> None:
    event = _beta("response.content_part.added") if beta else _ga("response.content_part.added")
    event["part"]["type"] = "output_audio"  # the item's content says output_audio; a content part says audio
    _fails(event, beta, "$.part.type", "'text' or 'audio'")


def test_unknown_top_level_field_fails() -> None:
    event = _ga("response.output_audio.delta") | {"generation": 3}
    _fails(event, False, "$.generation", "not defined")


@pytest.mark.parametrize(
    ("parent", "key"),
    [
        (("response", "usage"), "input_token_detail"),
        (("response", "output", 0, "content", 0), "trnascript"),
        (("response", "status_details"), "why"),
        (("response", "output", 0), "latency_ms"),
    ],
    ids=["usage", "item-content", "status-details", "item"],
)
def test_unknown_nested_field_fails(parent: tuple[str | int, ...], key: str) -> None:
    event = _ga("response.done")
    target: Any = event
    for step in parent:
        target = target[step]
    target[key] = "x"
    where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*parent, key))
    _fails(event, False, where, "not defined")


def test_unknown_field_in_the_session_fails_in_both_dialects() -> None:
    ga = _ga("session.created")
    ga["session"]["audio"]["input"]["turn_detection"]["treshold"] = 0.4
    _fails(ga, False, "$.session.audio.input.turn_detection.treshold")
    beta = _beta("session.created")
    beta["session"]["output_audio_formt"] = "pcm16"
    _fails(beta, True, "$.session.output_audio_formt")


def test_missing_required_field_fails() -> None:
    event = _ga("response.output_audio.delta")
    del event["item_id"]
    _fails(event, False, "$.item_id", "Field required")
    error = _ga("error")
    del error["error"]["message"]
    _fails(error, False, "$.error.message", "Field required")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("response", "status"), "ok"),
        (("response", "status_details", "reason"), "barge_in"),
        (("response", "output", 0, "role"), "bot"),
        (("response", "output", 0, "content", 0, "type"), "audio"),  # an item's content part is output_audio in GA
        (("response", "object"), "response"),
    ],
    ids=["status", "reason", "role", "item-content-type", "object"],
)
def test_wrong_literal_fails(path: tuple[str | int, ...], value: str) -> None:
    event = _ga("response.done")
    target: Any = event
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    _fails(event, False, "$.response")


def test_wrong_json_type_is_not_coerced() -> None:
    event = _ga("response.output_audio.delta") | {"output_index": "0"}
    _fails(event, False, "$.output_index")
    event = _ga("input_audio_buffer.speech_started") | {"audio_start_ms": 1.5}
    _fails(event, False, "$.audio_start_ms")


def test_event_type_of_the_other_dialect_fails() -> None:
    _fails(_ga("response.output_audio.delta"), True, "not a server event type of the beta dialect", "GA event type")
    _fails(_beta("response.audio.delta"), False, "not a server event type of the GA dialect", "beta event type")
    _fails({"type": "response.audio.bogus", "event_id": "e"}, False, "not a server event type")
    _fails({"event_id": "e"}, False, "$.type")


# -- the RealtimeClient hook ----------------------------------------------------------------------


class _FakeSocket:
    """Stands in for a websockets connection: hands out queued frames."""

    request = None

    def __init__(self, *frames: dict[str, Any]) -> None:
        self.frames = [json.dumps(f) for f in frames]

    async def recv(self) -> str:
        return self.frames.pop(0)


def test_recv_rejects_a_non_conformant_event_unless_the_client_opts_out() -> None:
    bad = _ga("response.output_audio.delta") | {"generation": 1}

    async def scenario() -> None:
        client = RealtimeClient(_FakeSocket(bad))  # type: ignore[arg-type]
        with pytest.raises(AssertionError, match="generation"):
            await client.recv()
        assert client.events == [bad] and len(client.nonconformant) == 1
        raw = RealtimeClient(_FakeSocket(bad), conformance=False)  # type: ignore[arg-type]
        assert await raw.recv() == bad
        # a beta client gets beta names; a GA name is a failure for it
        beta = RealtimeClient(_FakeSocket(_ga("response.output_audio.delta")), beta=True)  # type: ignore[arg-type]
        with pytest.raises(AssertionError, match="beta dialect"):
            await beta.recv()

    run(scenario())


@pytest.mark.parametrize(
    ("kw", "beta"),
    [
        ({}, False),
        ({"beta": True}, True),
        ({"subprotocols": ["realtime", "openai-beta.realtime-v1"]}, True),
        ({"additional_headers": {"OpenAI-Beta": "realtime=v1"}}, True),
    ],
    ids=["ga", "beta-flag", "beta-subprotocol", "beta-header"],
)
def test_the_client_validates_with_the_dialect_its_handshake_asked_for(kw: dict[str, Any], beta: bool) -> None:
    async def scenario() -> None:
        # this checks which dialect the hook picks; the server's events themselves are checked by every other test
        async with live_server(pool_size=1) as server, RealtimeClient.connect(server, conformance=False, **kw) as c:
            assert c.beta is beta
            event = await c.until("session.created")
            assert ("modalities" in event["session"]) is beta  # the server answered in that dialect too

    run(scenario())


def test_a_swallowed_nonconformity_still_fails_when_the_client_closes() -> None:
    bad = _ga("response.output_audio.delta") | {"generation": 1}

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            with pytest.raises(AssertionError, match="1 non-conformant server event"):
                async with RealtimeClient.connect(server) as c:
                    c.ws.recv = _FakeSocket(bad).recv  # type: ignore[method-assign]
                    try:
                        await c.recv()
                    except Exception:
                        pass  # a careless test swallows it

    run(scenario())


# -- what the server sends ------------------------------------------------------------------------


@both_speculation_modes
@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_spoken_turns_a_barge_in_and_a_tool_call_send_only_conformant_events(beta: bool, speculation: int) -> None:
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }

    async def scenario() -> None:
        async with live_server(fake_llm_token_delay_ms=30) as server:
            # Every event this client receives is validated in its dialect (a failure ends the test).
            async with RealtimeClient.connect(server, beta=beta, transcribe=True) as c:
                await c.send("session.update", session={"tools": [weather]})
                await c.append_audio(tone(440, 0.6) + silence(0.8), pace_s=0.005)
                assert (await c.until("response.done"))["response"]["status"] == "completed"
                # Speech while the next answer plays cancels it.
                await c.ask(" ".join(f"word{i}" for i in range(40)))
                await c.until("response.created")
                await c.append_audio(tone(520, 0.6) + silence(0.8), pace_s=0.005)
                cancelled = await c.until("response.done")
                assert cancelled["response"]["status_details"]["reason"] == "turn_detected"
                assert (await c.until("response.done"))["response"]["status"] == "completed"
                called = await c.say_text("get_weather Paris")
                assert called["response"]["output"][0]["type"] == "function_call"
            metrics = (await http_get(server, "/metrics"))[1]
            assert ('s2s_speculative_stt_total{outcome="' in metrics) is bool(speculation), "speculated as asked"

    run(scenario())


def test_the_session_features_agent_sdks_send_get_only_conformant_events() -> None:
    """Voices by name and custom voice objects, truncation and images, in OpenAI's GA types.

    (Noise reduction is left null here: loading RNNoise slows this process's later default-stack tests.)"""
    import base64
    import dataclasses
    import io

    from PIL import Image

    from s2s_rt.engines.fake import EchoLLM, load_fake_stack

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    image = {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}
    stack = dataclasses.replace(load_fake_stack(), llm=EchoLLM(context_tokens=300))

    async def scenario() -> None:
        async with live_server(stack, voice_names={"ash": "tone-low"}) as server:
            async with RealtimeClient.connect(server, beta=False) as c:
                await c.send(
                    "session.update",
                    session={
                        "type": "realtime",
                        "output_modalities": ["text"],
                        "max_output_tokens": 40,
                        "audio": {"input": {"noise_reduction": None}, "output": {"voice": "ash"}},
                        "truncation": {"type": "retention_ratio", "retention_ratio": 0.5},
                    },
                )
                updated = (await c.until("session.updated"))["session"]
                assert updated["audio"]["output"]["voice"] == "tone-low"
                await c.send(
                    "session.update", session={"type": "realtime", "audio": {"output": {"voice": {"id": "tone"}}}}
                )
                await c.until("session.updated")
                await c.send(
                    "conversation.item.create",
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "look"}, image],
                    },
                )
                assert (await c.until("conversation.item.done"))["item"]["content"][1]["type"] == "input_image"
                for n in range(6):  # past the fake model's 300 tokens: items left out
                    done = await c.say_text(" ".join(f"w{n}x{i}" for i in range(30)))
                    assert done["response"]["status"] == "completed"
                await c.send("session.update", session={"type": "realtime", "truncation": "disabled"})
                await c.until("session.updated")
                await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": " ".join(["long"] * 400)}]})  # fmt: skip
                await c.until("conversation.item.done")
                await c.send("response.create")
                failed = await c.until("response.done")
                assert failed["response"]["status_details"]["error"]["code"] == "context_length_exceeded"
                assert (await c.until("error"))["error"]["code"] == "context_length_exceeded"

    run(scenario())
