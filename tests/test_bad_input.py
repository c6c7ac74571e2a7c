"""Every malformed thing a client sends gets an error; the connection and others carry on."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run, tone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

B64_ODD = base64.b64encode(b"\x01\x02\x03").decode()

CASES = [
    ("malformed JSON", "{oops", "invalid_json"),
    ("non-object JSON", "[1,2,3]", "invalid_event"),
    ("missing type", '{"event_id": "e1"}', "missing_type"),
    ("unknown type", '{"type": "session.explode", "event_id": "e1"}', "unknown_event_type"),
    (
        "wrong field type",
        '{"type": "session.update", "event_id": "e1", "session": {"instructions": 42}}',
        "invalid_value",
    ),
    (
        "invalid base64",
        '{"type": "input_audio_buffer.append", "event_id": "e1", "audio": "!!notbase64!!"}',
        "invalid_base64",
    ),
    (
        "odd byte count",
        json.dumps({"type": "input_audio_buffer.append", "event_id": "e1", "audio": B64_ODD}),
        "invalid_audio_length",
    ),
    (
        "commit on empty buffer",
        '{"type": "input_audio_buffer.commit", "event_id": "e1"}',
        "input_audio_buffer_commit_empty",
    ),
    ("cancel without response", '{"type": "response.cancel", "event_id": "e1"}', "response_cancel_not_active"),
    (
        "unknown item id",
        '{"type": "conversation.item.retrieve", "event_id": "e1", "item_id": "item_nope"}',
        "item_retrieve_invalid_item_id",
    ),
    (
        "unknown item to delete",
        '{"type": "conversation.item.delete", "event_id": "e1", "item_id": "item_nope"}',
        "item_delete_invalid_item_id",
    ),
    (
        "unsupported audio format",
        '{"type": "session.update", "event_id": "e1", "session": {"input_audio_format": "opus"}}',
        "unsupported_audio_format",
    ),
    (
        "unsupported rate",
        json.dumps(
            {
                "type": "session.update",
                "event_id": "e1",
                "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}},
            }
        ),
        "unsupported_audio_format",
    ),
    ("binary frame", b"\x00\x01binary", "invalid_event"),
]


@pytest.mark.parametrize(("what", "frame", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_error_and_connection_stays_usable(what: str, frame: str | bytes, code: str) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with RealtimeClient.connect(server) as bad, RealtimeClient.connect(server) as good:
                await bad.until("session.created")
                await good.until("session.created")
                await bad.send_raw(frame)
                err = await bad.until("error")
                assert err["error"]["code"] == code, err
                assert err["error"]["message"]
                assert err["error"]["type"]
                if code not in ("invalid_json", "invalid_event"):
                    assert err["error"]["event_id"] == "e1"
                # Still usable: a following session.update is answered.
                await bad.send("session.update", session={"instructions": "still here"})
                updated = await bad.until("session.updated")
                assert updated["session"]["instructions"] == "still here"
                # The other session noticed nothing.
                done = await good.say_text("unaffected")
                assert done["response"]["status"] == "completed"
                assert not good.of_type("error")

    run(scenario())


def test_second_response_while_one_is_active_is_refused() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("[[slow 50]] take your time. please.")
                await c.send("response.create", event_id="second")
                err = await c.until("error")
                assert err["error"]["code"] == "conversation_already_has_active_response"
                assert err["error"]["event_id"] == "second"
                done = await c.until("response.done")
                assert done["response"]["status"] == "completed"

    run(scenario())


def test_frame_above_max_size_closes_only_that_connection_with_1009() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, max_message_mib=1.0) as server:
            async with RealtimeClient.connect(server) as big, RealtimeClient.connect(server) as other:
                await big.until("session.created")
                await other.until("session.created")
                audio = base64.b64encode(bytes(800_000)).decode()  # > 1 MiB once base64-encoded
                await big.send("input_audio_buffer.append", audio=audio)
                with pytest.raises(ConnectionClosed):
                    while True:
                        await big.recv()
                assert big.ws.close_code == 1009
                done = await other.say_text("fine")
                assert done["response"]["status"] == "completed"

            # The slot comes back.
            async def both_idle() -> bool:
                return json.loads((await http_get(server, "/v1/pool"))[1])["states"]["idle"] == 2

            assert await eventually(both_idle, 2.0)

    run(scenario())


def test_large_append_within_limit_is_accepted() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"turn_detection": None})
                pcm = tone(440, 60.0)  # 60 s of audio in one 2.9 MB append
                await c.send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                await c.send("input_audio_buffer.commit")
                heard = await c.until("conversation.item.input_audio_transcription.completed", timeout=20)
                assert heard["transcript"].startswith("heard 60000 ms")

    run(scenario())


frames = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.builds(
        lambda t, extra: json.dumps({"type": t, **extra}),
        st.sampled_from(
            [
                "session.update",
                "input_audio_buffer.append",
                "input_audio_buffer.commit",
                "conversation.item.create",
                "conversation.item.truncate",
                "response.create",
                "response.cancel",
                "input_audio_buffer.clear",
            ]
        ),
        st.dictionaries(
            st.sampled_from(["session", "item", "audio", "response", "item_id", "audio_end_ms"]),
            st.one_of(
                st.none(),
                st.integers(),
                st.text(max_size=10),
                st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
            ),
            max_size=3,
        ),
    ),
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(frames, min_size=1, max_size=15))
def test_random_frames_never_crash_the_server_or_leak_a_slot(batch: list[str | bytes]) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                for frame in batch:
                    await c.send_raw(frame)
                await c.send("session.update", event_id="probe", session={"instructions": "probe"})
                # Earlier random frames may have been valid updates too: wait for ours.
                updated = await c.until("session.updated", timeout=10)
                while updated["session"]["instructions"] != "probe":
                    updated = await c.until("session.updated", timeout=10)
            for _ in range(100):
                _status, body = await http_get(server, "/v1/pool")
                if json.loads(body)["states"]["idle"] == 2:
                    break
                await asyncio.sleep(0.02)
            assert json.loads(body)["states"]["idle"] == 2

    run(scenario())


def _nested_schema(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_tool_schema_too_deep_for_the_sdk_to_read_back_is_refused_and_the_session_kept() -> None:
    """A tool nested 100 objects deep (the fuzzer's find) was accepted and echoed in ``session.updated``, which the
    official SDK could not read ("recursion limit exceeded"). It is refused by name; 20 levels are accepted and
    the echo conforms (this client checks every event against the SDK's types)."""

    def tool(levels: int) -> dict[str, object]:
        return {"type": "function", "name": "deep", "parameters": _nested_schema(levels)}

    async def scenario() -> None:
        async with live_server() as server, RealtimeClient.connect(server) as c:
            await c.send("session.update", session={"tools": [tool(100)]})
            error = (await c.until("error"))["error"]
            assert error["code"] == "invalid_value" and error["param"] == "session.tools[0].parameters", error
            await c.send("session.update", session={"tools": [tool(20)]})
            updated = await c.until("session.updated")
            assert updated["session"]["tools"][0]["name"] == "deep"

    run(scenario())
