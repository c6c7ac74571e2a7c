"""The slot pool as clients see it: claims, rejection, readiness, quarantine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from conftest import RealtimeClient, eventually, http_get, live_server, run, tone
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from s2s_rt import Server
from s2s_rt.engines.base import Float32Array
from s2s_rt.engines.fake import EnergyVAD, load_fake_stack


def test_pool_full_rejects_with_session_limit_reached_and_1013() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with RealtimeClient.connect(server) as a, RealtimeClient.connect(server) as b:
                await a.until("session.created")
                await b.until("session.created")
                async with RealtimeClient.connect(server) as c:
                    err = await c.recv()
                    assert err["type"] == "error"
                    assert err["error"]["code"] == "session_limit_reached"
                    try:
                        await c.recv()
                        raise AssertionError("the rejected socket should close")
                    except ConnectionClosed:
                        pass
                    assert c.ws.close_code == 1013

    run(scenario())


def test_freed_slot_is_claimable_at_once_even_while_it_drains() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, drain_timeout_s=4.0) as server:
            for _ in range(5):
                async with RealtimeClient.connect(server) as a:
                    await a.until("session.created")
                # The slot may still be draining: the next client waits for it, not refused…
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                async with RealtimeClient.connect(server) as b:
                    assert (await b.recv())["type"] == "session.created"
                # …and only while it drains, not until the drain's deadline.
                assert loop.time() - t0 < server.config.drain_deadline_s / 2

    run(scenario())


def test_readyz_flips_to_503_when_full_and_back() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            assert (await http_get(server, "/readyz"))[0] == 200
            async with RealtimeClient.connect(server) as a:
                await a.until("session.created")
                assert (await http_get(server, "/readyz"))[0] == 503

            async def ready() -> bool:
                return (await http_get(server, "/readyz"))[0] == 200

            assert await eventually(ready, 2.0)

    run(scenario())


def test_http_endpoints_and_404() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=3) as server:
            assert await http_get(server, "/healthz") == (200, "ok\n")
            status, body = await http_get(server, "/v1/pool")
            pool = json.loads(body)
            assert status == 200 and pool["size"] == 3 and pool["states"]["idle"] == 3
            async with RealtimeClient.connect(server) as a:
                await a.say_text("count me")
                metrics = (await http_get(server, "/metrics"))[1]
                assert "s2s_sessions_active 1" in metrics
                assert 's2s_events_in_total{type="response.create"} 1' in metrics
                assert 's2s_events_out_total{type="response.done"} 1' in metrics
                assert "s2s_stage_seconds_bucket" in metrics
            assert (await http_get(server, "/nope"))[0] == 404
            assert (await http_get(server, "/v1/realtime/extra"))[0] == 404

    run(scenario())


class SlowingVAD(EnergyVAD):
    """The fake VAD, which costs 150 ms a call once ``slow`` is set: listening then falls behind."""

    def __init__(self) -> None:
        self.slow = threading.Event()

    def speech_probabilities(self, chunks: Float32Array, states: Sequence[Any]) -> Float32Array:
        if self.slow.is_set():
            time.sleep(0.15)
        return super().speech_probabilities(chunks, states)


def test_a_client_waiting_for_a_draining_slot_is_refused_if_listening_filled_up_meanwhile() -> None:
    """Admission is decided again after the wait for a draining slot, not only before it.

    A client that floods and never reads is closed (1008); its slot drains
    while the server waits, up to a second, for it to answer the close. A
    client arriving meanwhile waits for that slot; while it waits,
    listening falls behind (the VAD slows down), and when the slot is free
    the waiting client is refused for capacity rather than given the slot.
    """
    stack = load_fake_stack()
    vad = stack.vad = SlowingVAD()

    async def flood(ws: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                for _ in range(20):
                    await ws.send("x")
                await asyncio.sleep(0.005)

    async def draining(server: Server) -> bool:
        return json.loads((await http_get(server, "/v1/pool"))[1])["states"]["draining"] == 1

    async def listening_behind(server: Server) -> bool:
        return 's2s_errors_total{code="listening_overloaded"} 1' in (await http_get(server, "/metrics"))[1]

    async def scenario() -> None:
        async with (
            live_server(
                stack, pool_size=2, max_events_per_s=60, max_events_burst=60, flood_close_s=0.2, shed_after_ms=100
            ) as server,
            RealtimeClient.connect(server) as staying,
        ):
            await staying.until("session.created")
            url = f"ws://127.0.0.1:{server.port}/v1/realtime"
            async with connect(url, max_queue=1) as flooder:
                flooding = asyncio.create_task(flood(flooder))
                assert await eventually(lambda: draining(server)), "the flooder's session ended and its slot drains"
                async with connect(url) as waiting:  # no slot is free: it waits for the draining one
                    vad.slow.set()
                    talking = asyncio.create_task(staying.append_audio(tone(300, 1.0), pace_s=0.02))
                    assert await eventually(lambda: listening_behind(server), 3.0)
                    assert await draining(server), "listening fell behind while the slot still drained"
                    refused = json.loads(await waiting.recv())
                    assert refused["type"] == "error", refused
                    assert refused["error"]["code"] == "session_limit_reached"
                    assert "capacity" in refused["error"]["message"]
                    await waiting.wait_closed()
                    assert waiting.close_code == 1013
                    vad.slow.clear()
                    await talking
                flooding.cancel()

    run(scenario())
