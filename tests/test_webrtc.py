"""WebRTC calls and client secrets, as a browser or a phone app uses them, on real sockets.

A Python WebRTC client (aiortc, :class:`s2s_rt.bench.call.CallClient`) posts its
offer with the official ``openai`` package, and talks over the media track and
the ``oai-events`` data channel. aiortc gathers no loopback candidates, so the
media flows over this host's own network address (never off the machine).
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from conformance import validate_server_event
from conftest import (
    RealtimeClient,
    collector_off,
    eventually,
    http_get,
    live_server,
    run,
    serving_now,
    silence,
    still_held,
    tone,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import APIStatusError, AsyncOpenAI, AuthenticationError, BadRequestError
from openai.types.realtime import ClientSecretCreateResponse
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from s2s_rt.bench.call import CallClient
from s2s_rt.server import secrets as secrets_module

KEY = "sk-test-key"


def base_url(server: Any) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


@asynccontextmanager
async def a_call(server: Any, key: str = "unused") -> AsyncIterator[CallClient]:
    """A call to ``server`` whose session has begun (``session.created`` taken); closed after the block."""
    call = await CallClient.open(base_url(server), key)
    try:
        await call.next_event("session.created")
        yield call
    finally:
        await call.close()


async def a_call_that_never_connects(server: Any) -> Any:
    """An offer posted and answered whose answer the client never takes: no ICE, no data channel.

    Returns its peer connection (to close).
    """
    from aiortc import RTCPeerConnection

    pc = RTCPeerConnection()
    pc.createDataChannel("oai-events")
    pc.addTransceiver("audio")
    await pc.setLocalDescription(await pc.createOffer())
    client = AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
    try:
        await client.realtime.calls.create(sdp=pc.localDescription.sdp)
    finally:
        await client.close()
    return pc


async def mint(server: Any, key: str = KEY, **params: Any) -> Any:
    """A client secret minted with the official SDK (``params``: ``expires_after``, ``session``)."""
    client = AsyncOpenAI(base_url=base_url(server), api_key=key, max_retries=0)
    try:
        return await client.realtime.client_secrets.create(**params)
    finally:
        await client.close()


def conformant(call: CallClient) -> None:
    """Every event the call's data channel carried is one the official SDK's GA types accept."""
    for event in call.events:
        validate_server_event({k: v for k, v in event.items() if k != "_received"}, beta=False)


async def spoken_turn(call: CallClient) -> tuple[float, dict[str, Any]]:
    """Speak a second of tone and a second of silence; returns when the speech ended and the response's done."""
    spoken_until = call.speak(tone(440, 1.0))
    call.speak(silence(1.2))
    done = await call.next_event("response.done", 20)
    await call.next_event("output_audio_buffer.stopped", 20)
    return spoken_until, done


@pytest.mark.parametrize("media_poll_ms", [10.0, 0.0], ids=["sockets-read-together", "each-datagram-as-it-comes"])
def test_a_spoken_turn_over_webrtc_arrives_as_events_on_the_data_channel_and_audio_on_the_track(
    media_poll_ms: float,
) -> None:
    async def scenario() -> None:
        async with live_server(media_poll_ms=media_poll_ms) as server:
            call = await CallClient.open(base_url(server), "unused")
            try:
                assert call.call_id and call.call_id.startswith("rtc_")
                await call.next_event("session.created")
                call.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
                updated = await call.next_event("session.updated")
                assert updated["session"]["instructions"] == "Be brief."
                spoken_until, done = await spoken_turn(call)
                assert done["response"]["status"] == "completed"
                types = [e["type"] for e in call.events]
                for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.committed", "response.created"):
                    assert kind in types
                # The audio goes on the track: no audio deltas on the data channel, and the buffer events instead.
                assert "response.output_audio.delta" not in types
                rid = done["response"]["id"]
                started = [e for e in call.events if e["type"] == "output_audio_buffer.started"]
                stopped = [e for e in call.events if e["type"] == "output_audio_buffer.stopped"]
                assert [e["response_id"] for e in started] == [rid] and [e["response_id"] for e in stopped] == [rid]
                assert types.index("output_audio_buffer.stopped") > types.index("response.done")
                # The fake answer's tones, heard on the track: not silence.
                first = call.first_sound_after(spoken_until)
                assert first is not None
                heard = call.heard_between(first).astype(np.float32) / 32768.0
                assert float(np.sqrt(np.mean(heard**2))) > 0.02
                print(
                    f"\nWebRTC, fake stack: end of speech -> first audio heard {1000 * (first - spoken_until):.0f} ms"
                )
                # Set up, the call's sockets are read on the process's clock (or as each datagram comes: 0).
                assert (server.calls.sockets.polled > 0) == bool(media_poll_ms)
                conformant(call)
            finally:
                await call.close()

    run(scenario())


def test_a_call_whose_loop_stalls_between_turns_is_still_heard() -> None:
    """The loop stalls for half a second between two spoken turns (the caller's and, here, the server's): the
    next turn is heard and answered, as the first was. Found by the surface fuzzer: a caller whose loop
    stalled went on with the next RTP time, behind what the server had heard as silence, and the server
    heard nothing more of that call."""

    async def scenario() -> None:
        async with live_server() as server:
            call = await CallClient.open(base_url(server), "unused")
            try:
                await call.next_event("session.created")
                _, first = await spoken_turn(call)
                assert first["response"]["status"] == "completed"
                await asyncio.sleep(0.3)
                time.sleep(0.5)  # the loop stalls
                _, second = await spoken_turn(call)
                assert second["response"]["status"] == "completed"
            finally:
                await call.close()

    run(scenario())


def test_a_call_that_lost_a_packet_hears_each_turns_end_as_soon_as_before() -> None:
    """One of the caller's packets is lost: the server hears the turns after it end as soon as those before.
    aiortc's own jitter buffer, as the server had it, stayed 14 packets behind from then on: each turn's
    end came some 275 ms later for the rest of the call."""

    async def scenario() -> None:
        async with live_server() as server:
            call = await CallClient.open(base_url(server), "unused", dtx=False)
            transport = call.pc.getSenders()[0].transport
            send_rtp = transport._send_rtp
            sent = {"packets": 0, "lose": -1}

            async def lossy(data: bytes) -> None:
                sent["packets"] += 1
                if sent["packets"] != sent["lose"]:
                    await send_rtp(data)

            transport._send_rtp = lossy
            try:
                await call.next_event("session.created")
                lags = []
                for turn in range(4):
                    if turn == 2:
                        sent["lose"] = sent["packets"] + 3
                    await asyncio.sleep(0.3)
                    spoken = call.speak(tone(300, 0.8))
                    call.speak(silence(1.0))
                    stopped = await call.next_event("input_audio_buffer.speech_stopped", 10)
                    await call.next_event("output_audio_buffer.stopped", 20)
                    lags.append(stopped["_received"] - spoken)
                assert sent["packets"] > sent["lose"] > 0  # one was lost
                assert max(lags[2:]) - max(lags[:2]) < 0.12, lags
            finally:
                await call.close()

    run(scenario())


def test_a_receiver_that_holds_packets_before_it_plays_hears_the_whole_answer_before_the_next() -> None:
    """aiortc's receiver (this client's) plays a packet only once 4 more have come. The server sends nothing
    between answers, so its answer's talkspurt ends with frames of silence that push the last word out: without
    them, the end of every answer would wait for the next answer's packets."""

    async def scenario() -> None:
        async with live_server() as server:
            call = await CallClient.open(base_url(server), "unused")
            try:
                await call.next_event("session.created")
                spoken_until, done = await spoken_turn(call)
                await asyncio.sleep(0.5)
                words = done["response"]["output"][0]["content"][0]["transcript"].split()
                # The fake voice says each word as a 100 ms tone and 20 ms of silence: 10 ms windows, loud or not.
                heard = call.heard_between(spoken_until).astype(np.float32) / 32768.0
                windows = heard[: len(heard) // 480 * 480].reshape(-1, 480)
                loud = "".join("1" if w > 0.05 else "0" for w in np.sqrt((windows**2).mean(axis=1)))
                tones = [len(run) for run in loud.split("0") if run]
                assert len(tones) == len(words), loud
                assert tones[-1] >= min(tones[:-1]), loud  # the last word whole, as the others
                assert loud.endswith("0"), loud  # and after it, silence: the answer's end was heard
            finally:
                await call.close()

    run(scenario())


def test_barge_in_over_webrtc_truncates_the_item_at_what_was_played_and_clears_the_buffer() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with a_call(server) as call:
                # A long answer (120 ms per word of tone): about 6 s to play.
                call.ask(" ".join(["word"] * 50))
                started = await call.next_event("output_audio_buffer.started", 10)
                done = await call.next_event("response.done", 10)
                item_id = done["response"]["output"][0]["id"]
                began = started["_received"]
                await asyncio.sleep(1.5)
                call.speak(tone(300, 0.8))
                call.speak(silence(1.2))
                cleared = await call.next_event("output_audio_buffer.cleared", 10)
                truncated = await call.next_event("conversation.item.truncated", 5)
                assert cleared["response_id"] == started["response_id"]
                assert truncated["item_id"] == item_id
                # What the client heard of the answer, from its first sound to the last before the clear.
                first = call.first_sound_after(began)
                assert first is not None
                # (Counted in samples, as the server counts what it played: arrival times come in bursts.)
                answer = [pcm for t, pcm in call.heard if first <= t <= cleared["_received"]]
                heard_ms = 1000 * sum(len(pcm) // 2 for pcm in answer) / 48_000
                print(f"\nplayed {truncated['audio_end_ms']} ms by the server's count, heard {heard_ms:.0f} ms here")
                assert abs(truncated["audio_end_ms"] - heard_ms) <= 100
                # The item keeps only what was heard: fewer words than the answer had.
                await asyncio.sleep(0.3)
                call.send({"type": "conversation.item.retrieve", "item_id": item_id})
                item = (await call.next_event("conversation.item.retrieved", 5))["item"]
                kept = item["content"][0]["transcript"].split()
                assert 0 < len(kept) < 50
                # And the track goes quiet: nothing of the cleared answer plays on (the server sends nothing
                # while it has nothing to play; whatever still comes is silence).
                await asyncio.sleep(0.5)
                after = call.heard_between(time.perf_counter() - 0.3)
                assert after.size == 0 or np.abs(after).max() < 300
                conformant(call)

    run(scenario())


def test_output_audio_buffer_clear_cuts_a_call_off_and_is_refused_over_a_websocket() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with a_call(server) as call:
                call.ask(" ".join(["word"] * 40))
                started = await call.next_event("output_audio_buffer.started", 10)
                await asyncio.sleep(0.6)
                call.send({"type": "output_audio_buffer.clear", "event_id": "evt_clear"})
                cleared = await call.next_event("output_audio_buffer.cleared", 5)
                truncated = await call.next_event("conversation.item.truncated", 5)
                assert cleared["response_id"] == started["response_id"]
                assert 400 <= truncated["audio_end_ms"] <= 900
                conformant(call)
            async with RealtimeClient.connect(server) as ws:
                await ws.until("session.created")
                await ws.send("output_audio_buffer.clear", event_id="evt_ws")
                error = await ws.until("error")
                assert error["error"]["event_id"] == "evt_ws" and "WebRTC" in error["error"]["message"]

    run(scenario())


def test_calls_and_websocket_sessions_share_the_pool() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            call = await CallClient.open(base_url(server), "unused")
            try:
                async with RealtimeClient.connect(server) as ws:
                    await ws.until("session.created")
                    assert server.pool.free == 0
                    # A second call finds no slot: refused as OpenAI's API refuses, with the SDK's own error.
                    with pytest.raises(APIStatusError) as refused:
                        await CallClient.open(base_url(server), "unused")
                    assert refused.value.status_code == 503 and refused.value.code == "session_limit_reached"
                    # And so does a WebSocket.
                    async with RealtimeClient.connect(server) as third:
                        error = await third.until("error")
                        assert error["error"]["code"] == "session_limit_reached"
            finally:
                await call.close()
            assert await eventually(lambda: _free(server, 2), 10)

    run(scenario())


async def _free(server: Any, n: int) -> bool:
    return server.pool.free == n


async def _all_ended(server: Any, n: int) -> bool:
    """``n`` slots free and no call left: a call is forgotten once its peer connection has closed, a moment
    after its session ended and gave its slot back."""
    return server.pool.free == n and not server.calls.calls


def test_nothing_of_a_call_stays_referenced_after_it_ends() -> None:
    """A call's session, context, call, peer connection (its audio receiver and transport too) and playback are
    freed by reference counting once it hangs up: not left to the cyclic collector, which the server runs
    seldom."""

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            with collector_off():
                async with a_call(server) as call:
                    await spoken_turn(call)
                    served = server.calls.calls[call.call_id]
                    receiver = next(t.receiver for t in served.pc.getTransceivers() if t.kind == "audio")
                    parts = (served, served.pc, served.playback, receiver, receiver.transport)
                    held = serving_now(server) + [weakref.ref(o) for o in parts]
                    assert len(held) == 7
                    del served, receiver, parts
                assert await eventually(lambda: _free(server, 1), 10)
                assert await eventually(lambda: _no_call_tasks(server), 10)
                await asyncio.sleep(0.1)
                assert not still_held(held), still_held(held)

    run(scenario())


async def _no_call_tasks(server: Any) -> bool:
    return not server.calls.tasks


def test_a_call_whose_ice_never_completes_frees_its_slot_within_its_timeout() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, call_timeout_s=1.5) as server:
            # Offered and answered, but the client never takes the answer: no ICE, no data channel.

            pc = await a_call_that_never_connects(server)
            begun = time.monotonic()
            assert server.pool.free == 1
            assert await eventually(lambda: _free(server, 2), 5)
            waited = time.monotonic() - begun
            print(f"\nslot freed {waited:.2f} s after the offer was answered (timeout 1.5 s)")
            assert waited <= 1.5 + 1.0
            assert await eventually(lambda: _all_ended(server, 2), 2)
            await pc.close()

    run(scenario())


def test_twenty_calls_opened_and_abandoned_leave_every_slot_idle() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=4, call_timeout_s=2.0) as server:
            opened = 0
            for batch in range(5):
                calls = [await CallClient.open(base_url(server), "unused") for _ in range(2)]
                opened += len(calls)
                # Two more never connect: their answers are never taken.
                strays = []
                for _ in range(2):
                    pc = await a_call_that_never_connects(server)
                    strays.append(pc)
                    opened += 1
                for call in calls:
                    await call.next_event("session.created")
                    call.speak(tone(500, 0.3))
                # Abandoned: one half closes its peer connection, the other only its data channel.
                for i, call in enumerate(calls):
                    if (i + batch) % 2:
                        await call.close()
                    else:
                        call.channel.close()
                for pc in strays:
                    await pc.close()
                assert await eventually(lambda: _free(server, 4), 6), server.pool.states()
                for call in calls:
                    await call.close()
            assert opened == 20
            assert await eventually(lambda: _all_ended(server, 4), 5)
            assert server.pool.states() == {
                "idle": 4,
                "active": 0,
                "draining": 0,
                "quarantined": 0,
                "crashed": 0,
                "resting": 0,
            }

    run(scenario(), timeout=120)


def test_hangup_ends_a_call() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=[KEY]) as server:
            call = await CallClient.open(base_url(server), KEY)
            try:
                await call.next_event("session.created")
                status, _ = await http_get(server, f"/v1/realtime/calls/{call.call_id}/hangup", method="POST")
                assert status == 401  # no key
                headers = {"Authorization": f"Bearer {KEY}"}
                path = f"/v1/realtime/calls/{call.call_id}/hangup"
                assert (await http_get(server, path, method="POST", headers=headers))[0] == 200
                assert await eventually(lambda: _free(server, 1), 5)
                assert (await http_get(server, path, method="POST", headers=headers))[0] == 404
            finally:
                await call.close()

    run(scenario())


# --- client secrets ---------------------------------------------------------------------


def test_the_official_sdk_mints_a_client_secret_that_opens_sessions_over_webrtc_and_websocket() -> None:
    async def scenario() -> None:
        async with live_server(api_keys=[KEY]) as server:
            voice = {"output": {"voice": server.stack.tts.voices[0]}}
            minted = await mint(
                server, session={"type": "realtime", "instructions": "You are a pirate.", "audio": voice}
            )
            # The answer has OpenAI's shape: the SDK's own type accepts it, validated.
            raw = minted.model_dump(mode="json")
            ClientSecretCreateResponse.model_validate(raw)
            assert minted.value.startswith("ek_")
            assert 590 <= minted.expires_at - time.time() <= 601  # 10 minutes by default
            assert minted.session.type == "realtime"
            # Over WebRTC, the secret opens a session, which starts with the configuration it carries.
            call = await CallClient.open(base_url(server), minted.value)
            try:
                created = await call.next_event("session.created")
                assert created["session"]["instructions"] == "You are a pirate."
            finally:
                await call.close()
            # Over a WebSocket too: as a bearer token, and as the browser's subprotocol.
            for kw in (
                {"additional_headers": {"Authorization": f"Bearer {minted.value}"}},
                {"subprotocols": ["realtime", f"openai-insecure-api-key.{minted.value}"]},
            ):
                async with RealtimeClient.connect(server, **kw) as ws:
                    created = await ws.until("session.created")
                    assert created["session"]["instructions"] == "You are a pirate."
            # Without it, or with a made-up one, nothing opens.
            for headers in ({}, {"Authorization": "Bearer ek_made_up"}):
                with pytest.raises(InvalidStatus) as refused:
                    async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", additional_headers=headers):
                        pass
                assert refused.value.response.status_code == 401

    run(scenario())


def test_a_client_secret_can_neither_mint_nor_drain_nor_read_the_pool() -> None:
    async def scenario() -> None:
        async with live_server(api_keys=[KEY]) as server:
            secret = (await mint(server)).value
            with pytest.raises(AuthenticationError):
                await mint(server, secret)
            bearer = {"Authorization": f"Bearer {secret}"}
            for path in ("/drain", "/undrain"):
                status, _ = await http_get(server, path, method="POST", headers=bearer | {"S2S-Operator": "1"})
                assert status == 401
            assert not server.draining
            assert (await http_get(server, "/v1/pool", headers=bearer))[0] == 401
            # The key itself can.
            assert (await http_get(server, "/v1/pool", headers={"Authorization": f"Bearer {KEY}"}))[0] == 200

    run(scenario())


def test_a_client_secret_stops_working_once_expired_and_longer_than_the_bound_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        async with live_server(api_keys=[KEY], max_client_secret_s=900) as server:
            with pytest.raises(BadRequestError) as refused:
                await mint(server, expires_after={"anchor": "created_at", "seconds": 901})
            assert "expires_after.seconds" in str(refused.value)
            minted = await mint(server, expires_after={"anchor": "created_at", "seconds": 60})
            assert 55 <= minted.expires_at - time.time() <= 61
            headers = {"Authorization": f"Bearer {minted.value}"}
            async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", additional_headers=headers) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
            # A minute later (the server's clock moved on), it opens nothing: neither a WebSocket nor a call.
            now = time.time() + 61
            monkeypatch.setattr(secrets_module.time, "time", lambda: now)
            with pytest.raises(InvalidStatus) as expired:
                async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", additional_headers=headers):
                    pass
            assert expired.value.response.status_code == 401
            with pytest.raises(AuthenticationError):
                await CallClient.open(base_url(server), minted.value)
            assert server.pool.free == len(server.pool.slots)

    run(scenario())


def test_a_client_secrets_bad_configuration_is_refused_when_it_is_minted() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            with pytest.raises(BadRequestError) as refused:
                await mint(
                    server, "unused", session={"type": "realtime", "audio": {"output": {"voice": "no-such-voice"}}}
                )
            assert "voice" in str(refused.value)

    run(scenario())


# --- the POST parser ---------------------------------------------------------------------


def test_requests_with_bodies_are_read_on_the_session_port_and_bad_ones_are_refused() -> None:
    async def scenario() -> None:
        async with live_server() as server:

            async def raw(data: bytes) -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(data)
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                return answer

            big = b"x" * (300 * 1024)
            answer = await raw(
                b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                b"Content-Length: %d\r\n\r\n" % len(big) + big
            )
            assert answer.startswith(b"HTTP/1.1 413")
            answer = await raw(b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            assert answer.startswith(b"HTTP/1.1 400") and b"application/sdp" in answer
            answer = await raw(
                b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                b"Content-Length: 9\r\n\r\nnot sdp!!"
            )
            assert answer.startswith(b"HTTP/1.1 400")
            answer = await raw(b"POST /v1/realtime/client_secrets HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x}")
            assert answer.startswith(b"HTTP/1.1 400")  # no Host header: h11 refuses it
            answer = await raw(b"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}")
            assert answer.startswith(b"HTTP/1.1 400") and b"invalid_json" in answer
            # A preflight from a page elsewhere is refused (test_hostile_clients: unless its origin is allowed).
            preflight = (
                b"OPTIONS /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
                b"Access-Control-Request-Method: POST\r\n"
                b"Access-Control-Request-Headers: authorization, content-type\r\n\r\n"
            )
            answer = await raw(preflight)
            assert answer.startswith(b"HTTP/1.1 403") and b"Access-Control-Allow-Origin" not in answer
            # Every slot is still free, and the WebSocket still opens on the same port.
            assert server.pool.free == len(server.pool.slots)
            async with RealtimeClient.connect(server) as ws:
                await ws.until("session.created")

    run(scenario())


def test_media_binds_within_the_configured_port_range() -> None:
    async def scenario() -> None:
        async with live_server(media_ports="47100-47119") as server:
            async with a_call(server) as call:
                answer = call.pc.remoteDescription.sdp
                ports = [int(line.split()[5]) for line in answer.splitlines() if line.startswith("a=candidate:")]
                assert ports and all(47100 <= p <= 47119 for p in ports), ports
                call.speak(tone(440, 0.5) + silence(1.0))
                await call.next_event("output_audio_buffer.stopped", 15)

    run(scenario())


def test_a_call_flooding_its_data_channel_is_refused_and_ended_alone() -> None:
    async def scenario() -> None:
        async with live_server(max_events_per_s=50, max_events_burst=50, flood_close_s=1.0) as server:
            calm = await CallClient.open(base_url(server), "unused")
            flood = await CallClient.open(base_url(server), "unused")
            try:
                await calm.next_event("session.created")
                await flood.next_event("session.created")
                frame = json.dumps({"type": "conversation.item.retrieve", "item_id": "nope"})

                async def keep_flooding() -> None:
                    # Past the limit for longer than flood_close_s: 4,000 events a second until the call ends (a
                    # burst sent at once may all be read within the second, on a fast machine).
                    while flood.channel.readyState == "open":
                        for _ in range(200):
                            flood.channel.send(frame)
                        await asyncio.sleep(0.05)

                flooding = asyncio.create_task(keep_flooding())
                codes = set()
                while "rate_limit_exceeded" not in codes:
                    codes.add((await flood.next_event("error", 10))["error"]["code"])
                # The flooding call ends; the calm one still has a turn.
                assert await eventually(lambda: _free(server, len(server.pool.slots) - 1), 15)
                flooding.cancel()
                calm.speak(tone(440, 0.8) + silence(1.2))
                done = await calm.next_event("response.done", 15)
                assert done["response"]["status"] == "completed"
            finally:
                await calm.close()
                await flood.close()

    run(scenario())


def test_calls_count_against_the_per_address_limit_as_websockets_do() -> None:
    async def scenario() -> None:
        async with live_server(max_connections_per_ip=2) as server:
            call = await CallClient.open(base_url(server), "unused")
            try:
                async with RealtimeClient.connect(server) as ws:
                    await ws.until("session.created")
                    with pytest.raises(APIStatusError) as refused:
                        await CallClient.open(base_url(server), "unused")
                    assert refused.value.status_code == 429 and refused.value.code == "too_many_connections"
                    async with RealtimeClient.connect(server) as third:
                        assert (await third.until("error"))["error"]["code"] == "too_many_connections"
            finally:
                await call.close()
            # Once the call has ended, its address may call again.
            assert await eventually(lambda: _free(server, len(server.pool.slots)), 5)
            again = await CallClient.open(base_url(server), "unused")
            await again.close()

    run(scenario())


# --- interleavings a generator picks ------------------------------------------------------

CALL_STEPS = st.sampled_from(
    ["open", "stray", "speak", "junk", "huge", "clear", "update", "close_channel", "close_peer", "hangup", "wait"]
)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(CALL_STEPS, st.integers(0, 2)), min_size=4, max_size=14))
def test_calls_doing_anything_in_any_order_leave_the_pool_whole_and_a_calm_session_answered(
    steps: list[tuple[str, int]],
) -> None:
    """Up to three calls do random things in a random order (open, never connect, speak, send junk or a
    message larger than a call may carry, clear, reconfigure, close their channel or peer, hang up)
    while a calm WebSocket session asks a question: it gets its answer, and afterwards every slot is
    idle and no call is left."""

    async def scenario() -> None:
        async with live_server(pool_size=4, call_timeout_s=1.0) as server:
            calls: list[CallClient | None] = [None, None, None]
            strays: list[Any] = []
            async with RealtimeClient.connect(server) as calm:
                await calm.until("session.created")
                asked = asyncio.create_task(calm.say_text("calm question"))
                for step, who in steps:
                    call = calls[who]
                    try:
                        if step == "open" and call is None:
                            calls[who] = await CallClient.open(base_url(server), "unused", timeout=5)
                        elif step == "stray":
                            pc = await a_call_that_never_connects(server)
                            strays.append(pc)
                        elif call is None or call.channel.readyState != "open":
                            await asyncio.sleep(0.05)
                        elif step == "speak":
                            call.speak(tone(300 + 100 * who, 0.4) + silence(0.8))
                        elif step == "junk":
                            call.send({"type": "response.create", "response": {"modalities": 7}})
                            call.channel.send("{not json")
                        elif step == "huge":
                            call.channel.send(json.dumps({"type": "session.update", "x": "y" * 60_000}))
                        elif step == "clear":
                            call.send({"type": "output_audio_buffer.clear"})
                        elif step == "update":
                            call.send({"type": "session.update", "session": {"type": "realtime", "instructions": "x"}})
                        elif step == "close_channel":
                            call.channel.close()
                        elif step == "close_peer":
                            await call.close()
                        elif step == "hangup" and call.call_id:
                            await http_get(server, f"/v1/realtime/calls/{call.call_id}/hangup", method="POST")
                        elif step == "wait":
                            await asyncio.sleep(0.3)
                    except APIStatusError as exc:
                        assert exc.status_code == 503  # the pool was full: refused, as it should be
                    except TimeoutError:
                        pass  # a call that did not open in time (the pool was full, or the machine busy)
                done = await asyncio.wait_for(asked, 20)
                assert done["response"]["status"] == "completed"
            for call in calls:
                if call is not None:
                    await call.close()
            for pc in strays:
                await pc.close()
            assert await eventually(lambda: _all_ended(server, 4), 10), (server.pool.states(), server.calls.calls)
            assert [server.pool.states()[s] for s in ("quarantined", "crashed", "resting")] == [0, 0, 0]

    run(scenario(), timeout=90)


def test_clearing_after_an_answer_has_all_played_cuts_nothing_off() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with a_call(server) as call:
                call.ask("hi")
                await call.next_event("output_audio_buffer.stopped", 10)
                call.send({"type": "output_audio_buffer.clear"})
                call.send({"type": "conversation.item.retrieve", "item_id": "none"})  # a marker: all before it is in
                await call.next_event("error", 5)
                types = [e["type"] for e in call.events]
                assert "conversation.item.truncated" not in types and "output_audio_buffer.cleared" not in types

    run(scenario())


def test_a_call_offered_with_the_beta_header_speaks_the_beta_dialect() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            call = await CallClient.open(base_url(server), "unused", beta=True)
            try:
                await call.next_event("session.created")
                call.ask("hello there")
                await call.next_event("output_audio_buffer.stopped", 10)
                types = {e["type"] for e in call.events}
                assert "response.audio_transcript.delta" in types and "response.audio.delta" not in types
                for event in call.events:
                    validate_server_event({k: v for k, v in event.items() if k != "_received"}, beta=True)
            finally:
                await call.close()

    run(scenario())
