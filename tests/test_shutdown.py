"""SIGTERM under load: readiness drops at once, running turns finish, then 1001, exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

from conftest import run
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


def start_server(pool_size: int, grace: float, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``s2s-rt serve --stack fake`` in a subprocess (``args``: more options), and its port once it listens."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s2s_rt",
            "serve",
            "--stack",
            "fake",
            "--port",
            "0",
            "--pool-size",
            str(pool_size),
            "--grace-period",
            str(grace),
            *args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "listening on ws://" in line:
            return proc, int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    proc.kill()
    raise AssertionError("server did not start")


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sigterm_with_eight_sessions_mid_turn() -> None:
    proc, port = start_server(pool_size=8, grace=10)
    url = f"ws://127.0.0.1:{port}/v1/realtime"

    async def session(n: int, started: asyncio.Event, results: list) -> None:
        async with connect(url) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [
                                {"type": "input_text", "text": f"[[slow 150]] session {n} says one. two. three."}
                            ],
                        },
                    }
                )
            )
            await ws.send(json.dumps({"type": "response.create"}))
            status = None
            try:
                while True:
                    e = json.loads(await ws.recv())
                    if e["type"] == "response.created":
                        results.append(("created", n))
                        if sum(1 for r in results if r[0] == "created") == 8:
                            started.set()
                    if e["type"] == "response.done":
                        status = e["response"]["status"]
            except ConnectionClosed:
                pass
            results.append(("end", n, status, ws.close_code))

    async def scenario() -> None:
        started = asyncio.Event()
        results: list = []
        tasks = [asyncio.create_task(session(n, started, results)) for n in range(8)]
        await asyncio.wait_for(started.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(_readyz, port) == 503
        try:
            async with connect(url):
                raise AssertionError("a new session was accepted during shutdown")
        except InvalidStatus as exc:
            assert exc.response.status_code == 503
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        ends = [r for r in results if r[0] == "end"]
        assert len(ends) == 8
        assert all(status == "completed" for _, _, status, _ in ends), ends
        assert all(code == 1001 for _, _, _, code in ends), ends

    try:
        run(scenario())
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_a_process_whose_engine_call_is_wedged_within_the_grace_period_and_a_second() -> None:
    """An engine call that never checks for cancellation holds its thread (and the interpreter's exit) for a minute."""
    grace = 1.0
    proc, port = start_server(pool_size=2, grace=grace)
    url = f"ws://127.0.0.1:{port}/v1/realtime"

    async def scenario() -> tuple[int, float]:
        async with connect(url) as ws:
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "[[block 60000]] wedged"}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.created":
                pass
            await asyncio.sleep(0.3)  # the engine call is under way, blocking its thread
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            return code, time.monotonic() - signalled

    try:
        code, took = run(scenario())
        assert took <= grace + 1.0, f"exited {took:.2f} s after SIGTERM (grace {grace} s)"
        # Not the deadline's exit (status 1): the session stuck in its drain was cut, and the shutdown ended.
        assert proc.stderr is not None
        assert code == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sigterm_with(open_on: Callable[[int], Awaitable[list[asyncio.StreamWriter]]], grace: float = 1.0) -> str:
    """A server with what ``open_on(port)`` opens on its port, then SIGTERM: it must exit 0 within its grace period
    and a second. Returns its log."""
    proc, port = start_server(pool_size=2, grace=grace)

    async def scenario() -> tuple[int, float]:
        writers = await open_on(port)
        try:
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            return code, time.monotonic() - signalled
        finally:
            for writer in writers:
                writer.close()

    try:
        code, took = run(scenario())
        assert proc.stderr is not None
        log = proc.stderr.read()
        assert code == 0, log[-2000:]
        assert took <= grace + 1.0, f"exited {took:.2f} s after SIGTERM (grace {grace} s)"
        return log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_with_a_client_that_never_answers_the_close_exits_0_within_the_grace_period() -> None:
    """A client that completes its handshake and then reads nothing: the server's close (1001) is never answered,
    which websockets would wait for 10 s (its ``close_timeout``)."""

    async def open_on(port: int) -> list[asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
        return [writer]

    log = sigterm_with(open_on)
    assert "1 connection(s) dropped" in log, log[-2000:]


def test_sigterm_with_connections_that_never_send_or_finish_a_request_exits_0_within_the_grace_period() -> None:
    """Sockets open on the server's port that never became a session or a request: the listening socket's own
    close waits for each (the surface fuzzer's SIGTERM found one)."""

    async def open_on(port: int) -> list[asyncio.StreamWriter]:
        _, silent = await asyncio.open_connection("127.0.0.1", port)
        _, unfinished = await asyncio.open_connection("127.0.0.1", port)
        unfinished.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # its blank line never comes
        return [silent, unfinished]

    log = sigterm_with(open_on)
    assert "2 connection(s) dropped" in log and "never retrieved" not in log, log[-2000:]


def test_the_shutdown_deadline_names_what_still_runs() -> None:
    """When a signalled shutdown overruns, the log says which tasks were still running, and where they wait."""
    from s2s_rt.server.lifecycle import still_running

    async def stuck_in_teardown() -> None:
        await asyncio.sleep(60)

    async def main() -> list[str]:
        task = asyncio.create_task(stuck_in_teardown(), name="call-rtc_stuck")
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        seen = await asyncio.to_thread(still_running, loop)  # read from another thread, as the deadline's timer does
        task.cancel()
        return seen

    seen = asyncio.run(main())
    assert any(line.startswith("call-rtc_stuck (") and "stuck_in_teardown line" in line for line in seen), seen
