"""API keys, origins and draining, as a connecting client sees them."""

from __future__ import annotations

import asyncio
import json
import socket

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
            assert (await http_get(server, "/v1/pool"))[0] == 401  # session ids and addresses need a key
            pool = json.loads((await http_get(server, "/v1/pool", headers={"Authorization": "Bearer sekrit-2"}))[1])
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
                status, body = await http_get(server, "/drain", method="POST", headers={"S2S-Operator": "1"})
                assert status == 200 and "1 sessions still running" in body
                assert (await http_get(server, "/readyz"))[0] == 503
                with pytest.raises(InvalidStatus) as refused:
                    async with RealtimeClient.connect(server):
                        pass
                assert _status(refused) == 503
                done = await running.say_text("still served")
                assert done["response"]["status"] == "completed"

    run(scenario())


def test_operator_endpoints_cannot_be_triggered_cross_site_and_drain_can_be_undone() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            # What a web page can make a browser send: a GET (image, link) or a plain POST (form).
            for method, headers in (("GET", {}), ("HEAD", {}), ("POST", {}), ("POST", {"S2S-Operator": "yes"})):
                for path in ("/drain", "/drain/", "/drain?x=1"):
                    status, _ = await http_get(server, path, method=method, headers=headers)
                    assert status in (403, 405), (method, path, headers, status)
            assert (await http_get(server, "/readyz"))[0] == 200
            op = {"method": "POST", "headers": {"S2S-Operator": "1"}}
            assert (await http_get(server, "/drain", **op))[0] == 200
            assert (await http_get(server, "/readyz"))[0] == 503
            assert (await http_get(server, "/undrain", **op))[0] == 200
            assert (await http_get(server, "/readyz"))[0] == 200
            async with RealtimeClient.connect(server) as c:
                assert (await c.say_text("served again"))["response"]["status"] == "completed"

    run(scenario())


def test_with_api_keys_operator_endpoints_and_the_pool_need_a_key() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=["k1"]) as server:
            op = {"S2S-Operator": "1"}
            assert (await http_get(server, "/drain", method="POST", headers=op))[0] == 401
            assert (await http_get(server, "/v1/pool"))[0] == 401
            keyed = op | {"Authorization": "Bearer k1"}
            assert (await http_get(server, "/drain", method="POST", headers=keyed))[0] == 200
            assert (await http_get(server, "/v1/pool", headers={"Authorization": "Bearer k1"}))[0] == 200
            # Probes and scrapers stay open.
            assert (await http_get(server, "/healthz"))[0] == 200
            assert (await http_get(server, "/metrics"))[0] == 200

    run(scenario())


def test_two_authorization_headers_get_400_and_head_gets_no_body() -> None:
    async def scenario() -> None:
        async with live_server() as server:

            def raw(request: bytes) -> bytes:
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                    sock.sendall(request)
                    chunks = []
                    while chunk := sock.recv(65536):
                        chunks.append(chunk)
                    return b"".join(chunks)

            twice = (
                b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n"
            )
            assert (await asyncio.to_thread(raw, twice)).startswith(b"HTTP/1.1 400")
            head = await asyncio.to_thread(raw, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            headers, _, body = head.partition(b"\r\n\r\n")
            assert headers.startswith(b"HTTP/1.1 200") and b"Content-Length: 3" in headers and body == b""

    run(scenario())
