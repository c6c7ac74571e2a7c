"""What a hostile web page, call or request cannot do to the server (issue 37's findings, each a test).

Every way in is untrusted: a page on any website the user visits can make the
browser send requests to a server on the user's own machine, and a caller
controls its offer, its form, its JSON and its data channel. Each bad thing
is a 4xx or an ``error`` for that one client; no slot is lost or quarantined,
and other sessions never notice.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run, silence, tone
from openai import APIStatusError, AsyncOpenAI
from test_shutdown import start_server
from test_webrtc import a_call_that_never_connects, base_url

from s2s_rt.bench.call import CallClient

EVIL = "http://evil.example"


async def raw(server: Any, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request written as bytes on the server's port: its status, headers (lower-cased) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"] + [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def an_offer() -> tuple[Any, str]:
    """A real offer of aiortc's (audio and the events channel), and its peer connection (to close)."""
    from aiortc import RTCPeerConnection

    pc = RTCPeerConnection()
    pc.createDataChannel("oai-events")
    pc.addTransceiver("audio")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def free(server: Any, n: int) -> bool:
    return bool(server.pool.free == n)


def no_quarantine(server: Any) -> bool:
    return all(s["state"] not in ("quarantined", "crashed", "resting") for s in server.pool.describe()["slots"])


# --- 1. an event larger than a data channel carries ---------------------------------------------


def test_an_event_larger_than_the_data_channel_carries_ends_that_call_alone_and_quarantines_no_slot() -> None:
    """A call's session.updated grows past the peer's 256 KiB message limit: that call is told and ends.

    Six such calls in a row on a pool of one: none crashes the slot's stages (five crashes quarantined
    it), and a WebSocket session still opens and answers afterwards.
    """

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            for _ in range(6):
                call = await CallClient.open(base_url(server), "unused")
                try:
                    await call.next_event("session.created")
                    call.send(
                        {"type": "session.update", "session": {"type": "realtime", "instructions": "x" * 150_000}}
                    )
                    await call.next_event("session.updated")
                    tool = {"type": "function", "name": "f", "description": "y" * 120_000, "parameters": {}}
                    call.send({"type": "session.update", "session": {"type": "realtime", "tools": [tool]}})
                    error = await call.next_event("error", 10)
                    assert error["error"]["code"] == "event_too_large", error
                    assert "session.updated" in error["error"]["message"]
                    assert await eventually(lambda: free(server, 1), 10)
                finally:
                    await call.close()
                assert no_quarantine(server), server.pool.describe()
            async with RealtimeClient.connect(server) as ws:
                await ws.until("session.created")
                done = await ws.say_text("still here")
                assert done["response"]["status"] == "completed"

    run(scenario(), timeout=120)


# --- 2, 3. foreign pages: drain, secrets, calls ---------------------------------------------------


def test_a_foreign_page_gets_no_preflight_and_cannot_drain_a_local_server() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            for path, asked in (
                ("/drain", "s2s-operator"),
                ("/drain", "content-type"),
                ("/v1/realtime/calls", "authorization, content-type"),
                ("/v1/realtime/client_secrets", "authorization"),
            ):
                preflight = request(
                    "OPTIONS",
                    path,
                    {"Origin": EVIL, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked},
                )
                status, headers, _ = await raw(server, preflight)
                assert status == 403 and "access-control-allow-origin" not in headers, (path, status, headers)
            # Even a POST it sends without asking (a form, a no-cors fetch) is refused, unread.
            drain = request("POST", "/drain", {"Origin": EVIL, "S2S-Operator": "1"})
            status, headers, _ = await raw(server, drain)
            assert status == 403 and "access-control-allow-origin" not in headers
            offer = request("POST", "/v1/realtime/calls", {"Origin": EVIL, "Content-Type": "text/plain"}, b"v=0")
            assert (await raw(server, offer))[0] == 403
            assert not server.draining
            assert server.pool.free == 1

    run(scenario())


def test_no_page_drains_the_server_and_an_allowed_origin_is_never_approved_the_operator_header() -> None:
    async def scenario() -> None:
        good = "http://app.example"
        async with live_server(pool_size=1, allowed_origins=[good]) as server:
            preflight = request(
                "OPTIONS",
                "/drain",
                {
                    "Origin": good,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type",
                },
            )
            assert (await raw(server, preflight))[0] == 403
            asked = {"Origin": good, "Access-Control-Request-Method": "POST"}
            preflight = request(
                "OPTIONS", "/v1/realtime/calls", asked | {"Access-Control-Request-Headers": "S2S-Operator"}
            )
            assert (await raw(server, preflight))[0] == 403
            # Its own routes are approved for the allowed origin.
            preflight = request(
                "OPTIONS",
                "/v1/realtime/calls",
                asked | {"Access-Control-Request-Headers": "authorization, content-type"},
            )
            status, headers, _ = await raw(server, preflight)
            assert status == 204 and headers["access-control-allow-origin"] == good
            assert "s2s-operator" not in headers["access-control-allow-headers"].lower()
            # A page of the server's own origin names itself too: it drains nothing either.
            own = f"http://127.0.0.1:{server.port}"
            drain = request("POST", "/drain", {"Origin": own, "S2S-Operator": "1"}).replace(
                b"Host: 127.0.0.1", f"Host: 127.0.0.1:{server.port}".encode()
            )
            assert (await raw(server, drain))[0] == 403
            assert not server.draining
            # The operator's own program (no Origin) still drains it.
            status, _, _ = await raw(server, request("POST", "/drain", {"S2S-Operator": "1"}))
            assert status == 200 and server.draining

    run(scenario())


def test_a_page_secret_is_minted_for_the_servers_own_page_only() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=["K"], page_secrets=True) as server:
            foreign = request("POST", "/page/client_secret", {"Origin": EVIL})
            status, headers, body = await raw(server, foreign)
            assert status == 403 and b"ek_" not in body and "access-control-allow-origin" not in headers
            own = f"http://127.0.0.1:{server.port}"
            mine = request("POST", "/page/client_secret", {"Origin": own}).replace(
                b"Host: 127.0.0.1", f"Host: 127.0.0.1:{server.port}".encode()
            )
            status, _, body = await raw(server, mine)
            assert status == 200 and json.loads(body)["value"].startswith("ek_")

    run(scenario())


def test_a_page_of_a_name_pointed_at_this_machine_is_not_the_servers_own_unless_allowed() -> None:
    """DNS rebinding: evil.example resolves to 127.0.0.1, so its page's Origin and the Host agree."""

    async def scenario() -> None:
        async with live_server(pool_size=1, api_keys=["K"], page_secrets=True) as server:
            rebound = f"evil.example:{server.port}"
            mint = request("POST", "/page/client_secret", {"Origin": f"http://{rebound}"})
            mint = mint.replace(b"Host: 127.0.0.1", f"Host: {rebound}".encode())
            status, _, body = await raw(server, mint)
            assert status == 403 and b"ek_" not in body
        # A server the operator reaches by its name allows that name's origin.
        async with live_server(
            pool_size=1, api_keys=["K"], page_secrets=True, allowed_origins=["http://s2s.example"]
        ) as server:
            mint = request("POST", "/page/client_secret", {"Origin": "http://s2s.example"})
            mint = mint.replace(b"Host: 127.0.0.1", b"Host: s2s.example")
            status, _, body = await raw(server, mint)
            assert status == 200 and json.loads(body)["value"].startswith("ek_")

    run(scenario())


def test_a_foreign_page_opens_no_session_over_a_websocket() -> None:
    async def scenario() -> None:
        from websockets.exceptions import InvalidStatus

        async with live_server(pool_size=1) as server:
            with pytest.raises(InvalidStatus) as refused:
                async with RealtimeClient.connect(server, origin=EVIL):
                    pass
            assert refused.value.response.status_code == 403
            # A program that names no page, and the server's own page, are served.
            async with RealtimeClient.connect(server) as ws:
                await ws.until("session.created")
            async with RealtimeClient.connect(server, origin=f"http://127.0.0.1:{server.port}") as ws:
                await ws.until("session.created")

    run(scenario())


# --- 4. the per-address limit, offers sent together ----------------------------------------------


def test_offers_sent_together_from_one_address_are_held_to_its_limit() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=4, max_connections_per_ip=1, call_timeout_s=3.0) as server:
            offers = [await an_offer() for _ in range(3)]
            client = AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
            try:
                results = await asyncio.gather(
                    *(client.realtime.calls.create(sdp=sdp) for _, sdp in offers), return_exceptions=True
                )
            finally:
                await client.close()
                for pc, _ in offers:
                    await pc.close()
            answered = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, APIStatusError)]
            assert len(answered) == 1 and len(refused) == 2, results
            assert all(r.status_code == 429 and r.code == "too_many_connections" for r in refused)
            assert await eventually(lambda: free(server, 4), 8)
            assert server.calls.connections.per_ip == {}

    run(scenario())


# --- 5. offers and forms too large to parse cheaply ----------------------------------------------


def test_an_offer_of_thousands_of_sections_or_a_form_of_thousands_of_parts_is_refused_unparsed() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            pc, sdp = await an_offer()
            await pc.close()
            head, _, rest = sdp.partition("m=audio")
            section = "m=audio" + rest.split("m=application")[0]
            huge = head + section * 2400
            body = huge.encode()[: 250 * 1024]
            began = time.monotonic()
            status, _, answer = await raw(
                server, request("POST", "/v1/realtime/calls", {"Content-Type": "application/sdp"}, body)
            )
            assert status == 400 and b"invalid_offer" in answer, answer[:300]
            boundary = "b"
            parts = "".join(f"--{boundary}\r\n\r\nx\r\n" for _ in range(5000))
            form = (
                parts + f'--{boundary}\r\nContent-Disposition: form-data; name="sdp"\r\n\r\n{sdp}\r\n--{boundary}--\r\n'
            ).encode()
            status, _, answer = await raw(
                server,
                request(
                    "POST", "/v1/realtime/calls", {"Content-Type": f"multipart/form-data; boundary={boundary}"}, form
                ),
            )
            assert status == 400 and b"parts" in answer, answer[:300]
            took = time.monotonic() - began
            print(f"\nrefused a 2,400-section offer and a 5,000-part form in {1000 * took:.0f} ms")
            assert server.pool.free == 1

    run(scenario())


# --- 7, 8. malformed SDP and JSON: 400, not 500 ----------------------------------------------------


def test_malformed_offers_are_400_not_500() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            pc, sdp = await an_offer()
            await pc.close()
            lines = sdp.split("\r\n")
            setup = next(line for line in lines if line.startswith("a=setup:"))
            candidate = next(line for line in lines if line.startswith("a=candidate:"))
            connection = next(line for line in lines if line.startswith("c="))
            broken = {
                "a bare m=audio": "v=0\r\nm=audio\r\n",
                "a candidate without a type": sdp.replace(candidate, " ".join(candidate.split()[:6])),
                "a port that is not a number": sdp.replace(
                    candidate, candidate.replace(candidate.split()[5], "port", 1)
                ),
                "no a=setup": sdp.replace(setup + "\r\n", ""),
                "an unknown a=setup": sdp.replace(setup, "a=setup:sideways"),
                "a short c= line": sdp.replace(connection, "c=IN"),
            }
            for what, offer in broken.items():
                status, _, answer = await raw(
                    server, request("POST", "/v1/realtime/calls", {"Content-Type": "application/sdp"}, offer.encode())
                )
                assert status == 400 and b"invalid_offer" in answer, (what, status, answer[:300])
                assert await eventually(lambda: free(server, 1), 5), what

    run(scenario())


def test_json_too_deep_or_with_a_lone_surrogate_is_400_not_500() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            pc, sdp = await an_offer()
            await pc.close()
            bodies = [
                b"[" * 100_000 + b"]" * 100_000,
                b'{"session": {"instructions": "\\ud800"}}',
                b'"\\udc00"',
                # The same surrogate as raw bytes (not UTF-8), and a byte that begins no character.
                b'["\xed\xa0\x80"]',
                b'{"session": {"type": "realtime", "instructions": "\xff"}}',
            ]
            for body in bodies:
                mint = request("POST", "/v1/realtime/client_secrets", {"Content-Type": "application/json"}, body)
                status, _, answer = await raw(server, mint)
                assert status == 400 and b"invalid_json" in answer, (body[:40], status, answer[:200])
                boundary = "xyz"
                form = (
                    (
                        f'--{boundary}\r\nContent-Disposition: form-data; name="sdp"\r\n\r\n{sdp}\r\n'
                        f'--{boundary}\r\nContent-Disposition: form-data; name="session"\r\n\r\n'
                    ).encode()
                    + body
                    + f"\r\n--{boundary}--\r\n".encode()
                )
                offer = request(
                    "POST", "/v1/realtime/calls", {"Content-Type": f"multipart/form-data; boundary={boundary}"}, form
                )
                status, _, answer = await raw(server, offer)
                assert status == 400 and b"invalid_json" in answer, (body[:40], status, answer[:200])
            assert server.pool.free == 1

    run(scenario())


# --- 6. SIGTERM with a call that never connected ---------------------------------------------------


def test_sigterm_with_a_call_that_never_connected_and_a_body_half_sent_exits_0_within_the_grace_period() -> None:
    grace = 2.0
    proc, port = start_server(2, grace, "--call-timeout", "60")
    assert proc.stderr is not None
    try:

        class At:
            pass

        at = At()
        at.port = port  # type: ignore[attr-defined]

        async def scenario() -> tuple[int, float]:
            pc = await a_call_that_never_connects(at)
            # A request that says 5,000 bytes follow, sends five, and waits.
            _, slow = await asyncio.open_connection("127.0.0.1", port)
            slow.write(
                b"POST /v1/realtime/calls HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/sdp\r\n"
                b"Content-Length: 5000\r\n\r\nv=0\r\n"
            )
            try:
                await asyncio.sleep(0.5)
                began = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, grace + 10)
                return code, time.monotonic() - began
            finally:
                slow.close()
                await pc.close()

        code, took = run(scenario())
        log = proc.stderr.read()
        assert code == 0, log[-2000:]
        assert took <= grace + 1.0, f"exited {took:.2f} s after SIGTERM (grace {grace} s)"
        assert "Task was destroyed" not in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- 9. a peer that vanishes, and one that is only silent ------------------------------------------


def vanish(call: CallClient) -> None:
    """The caller's machine is gone: its sockets close with no word to the server (no DTLS or SCTP goodbye)."""
    for transceiver in call.pc.getTransceivers():
        connection = transceiver.receiver.transport.transport._connection
        for protocol in list(connection._protocols):
            if protocol.transport is not None:
                protocol.transport.close()


def test_a_caller_that_vanishes_frees_its_slot_within_seconds_and_a_silent_one_stays() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, idle_session_s=0) as server:
            silent = await CallClient.open(base_url(server), "unused")
            gone = await CallClient.open(base_url(server), "unused")
            try:
                await silent.next_event("session.created")
                await gone.next_event("session.created")
                # The silent caller sends no audio at all (a muted microphone whose track was removed).
                for sender in silent.pc.getSenders():
                    if sender.track is not None:
                        sender.replaceTrack(None)
                began = time.monotonic()
                vanish(gone)
                assert await eventually(lambda: free(server, 1), 15)
                took = time.monotonic() - began
                print(f"\na vanished caller's slot came back {took:.1f} s after it went")
                assert took < 12, took
                await asyncio.sleep(max(0.0, 12 - took))
                # Twelve seconds without a packet of audio or an event: the silent call is still served.
                assert server.pool.free == 1
                silent.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}})
                await silent.next_event("session.updated", 5)
            finally:
                await silent.close()
                await gone.close()

    run(scenario(), timeout=90)


def test_an_answer_still_plays_to_a_caller_beside_a_vanished_one() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            calm = await CallClient.open(base_url(server), "unused")
            gone = await CallClient.open(base_url(server), "unused")
            try:
                await calm.next_event("session.created")
                vanish(gone)
                calm.speak(tone(440, 0.8) + silence(1.2))
                done = await calm.next_event("response.done", 15)
                assert done["response"]["status"] == "completed"
            finally:
                await calm.close()
                await gone.close()

    run(scenario())


def test_a_task_that_aiortc_left_behind_fails_as_a_call_not_as_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    """aiortc starts some of a call's work in tasks it never awaits; one failing after its call closed is that
    call's warning, counted, and not asyncio's "Task exception was never retrieved" (the fuzzer's finding:
    ``RTCPeerConnection.__connect`` meeting a closed connection). Any other task's failure is still reported."""
    import gc

    from aiortc import RTCPeerConnection

    async def own_code_fails() -> None:
        raise RuntimeError("a task of our own")

    async def scenario() -> None:
        async with live_server() as server:
            pc = RTCPeerConnection()
            # Left unreferenced on purpose, as aiortc leaves its own: aiortc's code failing (no offer to
            # answer), and ours.
            asyncio.ensure_future(pc.createAnswer())  # noqa: RUF006
            asyncio.ensure_future(own_code_fails())  # noqa: RUF006
            await asyncio.sleep(0.05)
            gc.collect()  # the tasks, unreferenced, report their exceptions as they are collected
            await asyncio.sleep(0.05)
            await pc.close()
            _, metrics = await http_get(server, "/metrics")
            assert 's2s_errors_total{code="webrtc_task_failed"} 1' in metrics

    with caplog.at_level("WARNING"):
        run(scenario())
    never_retrieved = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(never_retrieved) == 1 and "own_code_fails" in never_retrieved[0], never_retrieved
    assert any("WebRTC call's own task" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
