"""The slot pool as clients see it: claims, rejection, readiness, quarantine."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from s2s_rt import Server
from s2s_rt.slot import Slot


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
        async with live_server(pool_size=1) as server:
            for _ in range(5):
                async with RealtimeClient.connect(server) as a:
                    await a.until("session.created")
                # The slot may still be draining: the next client waits for it, not refused.
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                async with RealtimeClient.connect(server) as b:
                    assert (await b.recv())["type"] == "session.created"
                assert loop.time() - t0 < 1.0

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


def test_a_client_waiting_for_a_draining_slot_is_refused_if_listening_filled_up_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission is decided again after the wait for a draining slot, not only before it."""
    finish = Slot._finish_drain
    drained = asyncio.Event()
    claiming = asyncio.Event()

    def held_drain(self: Slot) -> None:  # the slot stays draining until the test lets it go
        async def later() -> None:
            await drained.wait()
            finish(self)

        asyncio.get_running_loop().create_task(later())

    claim = Server._claim

    async def watched_claim(self: Server) -> Slot | None:
        claiming.set()  # the claim then runs to its wait for the draining slot before anything else
        return await claim(self)

    monkeypatch.setattr(Slot, "_finish_drain", held_drain)
    monkeypatch.setattr(Server, "_claim", watched_claim)

    async def scenario() -> None:
        async with live_server(pool_size=2) as server, RealtimeClient.connect(server) as staying:
            assert server.clock is not None and server.pool is not None
            await staying.until("session.created")
            async with RealtimeClient.connect(server) as a:
                await a.until("session.created")
            claiming.clear()
            waiting = asyncio.ensure_future(connect(f"ws://127.0.0.1:{server.port}/v1/realtime"))
            await claiming.wait()
            assert server.pool.draining() == 1
            server.clock.max_load = 0.0  # meanwhile, listening is predicted full
            drained.set()
            async with await waiting as b:
                refused = json.loads(await b.recv())
                assert refused["error"]["code"] == "session_limit_reached", refused
                assert "capacity" in refused["error"]["message"]
                await b.wait_closed()
                assert b.close_code == 1013

    run(scenario())
