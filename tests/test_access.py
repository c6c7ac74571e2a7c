"""API keys, origins and draining, as a connecting client sees them."""

from __future__ import annotations

import json

import pytest
from conftest import RealtimeClient, http_get, live_server, run
from websockets.exceptions import InvalidStatus


def _status(exc: pytest.ExceptionInfo[InvalidStatus]) -> int:
    return exc.value.response.status_code


def test_api_key_required_no_key_and_wrong_key_get_401_without_taking_a_slot() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=["sekrit-1", "sekrit-2"]) as server:
            with pytest.raises(InvalidStatus) as no_key:
                async with RealtimeClient.connect(server):
                    pass
            assert _status(no_key) == 401
            with pytest.raises(InvalidStatus) as wrong:
                async with RealtimeClient.connect(server, additional_headers={"Authorization": "Bearer nope"}):
                    pass
            assert _status(wrong) == 401
            pool = json.loads((await http_get(server, "/v1/pool"))[1])
            assert pool["states"]["idle"] == 1 and pool["slots"][0]["sessions_served"] == 0
            metrics = (await http_get(server, "/metrics"))[1]
            assert 's2s_rejections_total{reason="unauthorized"} 2' in metrics

    run(scenario())


def test_right_key_by_header_or_browser_subprotocol_is_served() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=["sekrit-2"]) as server:
            async with RealtimeClient.connect(server, additional_headers={"Authorization": "Bearer sekrit-2"}) as c:
                assert (await c.recv())["type"] == "session.created"
            async with RealtimeClient.connect(
                server, subprotocols=["realtime", "openai-insecure-api-key.sekrit-2"]
            ) as c:
                assert c.ws.subprotocol == "realtime"
                await c.until("session.created")
            # Health, readiness and metrics stay open without a key.
            assert (await http_get(server, "/healthz"))[0] == 200
            assert (await http_get(server, "/metrics"))[0] == 200

    run(scenario())


def test_disallowed_origin_gets_403() -> None:
    async def scenario() -> None:
        async with live_server(allowed_origins=["https://good.example"]) as server:
            with pytest.raises(InvalidStatus) as bad:
                async with RealtimeClient.connect(server, origin="https://evil.example"):
                    pass
            assert _status(bad) == 403
            async with RealtimeClient.connect(server, origin="https://good.example") as c:
                await c.until("session.created")

    run(scenario())


def test_drain_refuses_new_sessions_while_running_ones_finish() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with RealtimeClient.connect(server) as running:
                await running.until("session.created")
                status, body = await http_get(server, "/drain")
                assert status == 200 and "1 sessions still running" in body
                assert (await http_get(server, "/readyz"))[0] == 503
                with pytest.raises(InvalidStatus) as refused:
                    async with RealtimeClient.connect(server):
                        pass
                assert _status(refused) == 503
                done = await running.say_text("still served")
                assert done["response"]["status"] == "completed"

    run(scenario())
