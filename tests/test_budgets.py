"""No client can exhaust the server: memory, output and work per session are bounded.

Each test plays a hostile client found in a probe of the server and checks
the bounded, explained outcome: what the abuser is told, what the server's
memory does (measured on a server in its own process), and that another
session's turns stay quick meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from conftest import (
    RealtimeClient,
    collector_off,
    eventually,
    http_get,
    live_server,
    run,
    serving_now,
    still_held,
    tone,
)
from websockets.asyncio.client import connect

MIB = 1024 * 1024


# --- a server in its own process, for memory figures ----------------------------


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"

    def _status(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    @property
    def rss(self) -> int:
        return self._status("VmRSS")

    @property
    def peak(self) -> int:
        return self._status("VmHWM")

    def reset_peak(self) -> None:
        # Writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")


@contextmanager
def server_process(**env: str) -> Iterator[ServerProcess]:
    with tempfile.TemporaryFile() as log:
        environ = os.environ | {f"S2S_RT_{k.upper()}": v for k, v in env.items()}
        cmd = [sys.executable, "-m", "s2s_rt", "serve", "--stack", "fake", "--port", "0", "--pool-size", "2"]
        proc = subprocess.Popen(cmd, stderr=log, env=environ)
        try:
            deadline = time.monotonic() + 20
            port = None
            while port is None and time.monotonic() < deadline:
                time.sleep(0.1)
                log.seek(0)
                for line in log.read().decode().splitlines():
                    if "listening on ws://" in line:
                        port = int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            assert port is not None, "server did not start"
            yield ServerProcess(proc, port)
        finally:
            proc.terminate()
            proc.wait(10)


async def _settle(server: ServerProcess) -> int:
    """RSS once it stops falling (freed buffers go back to the system)."""
    last = server.rss
    for _ in range(20):
        await asyncio.sleep(0.1)
        now = server.rss
        if abs(now - last) < MIB:
            return now
        last = now
    return last


# --- 1: audio appends ----------------------------------------------------------


def test_big_appends_of_distinct_lengths_stay_within_the_budget_and_memory_comes_back() -> None:
    budget = {"max_input_queue_mib": "8", "max_input_buffer_s": "120"}

    async def scenario(server: ServerProcess) -> None:
        async with connect(server.url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await ws.recv()
            base = await _settle(server)
            server.reset_peak()
            # G.711 at 8 kHz, ~1 MB each, every length different (each used to cache its own plan)…
            for n in range(4):
                pcmu = bytes([0x55]) * (1_000_000 + 37 * n)
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcmu).decode()})
                )
                await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_format": "pcm16"}}))
            # …then 8 MiB PCM16 frames, as fast as the socket takes them: more than the budget of audio
            # waiting to be heard (the sender waits while it is heard), and more than the buffer holds
            # (the client is told, and the session stays).
            pcm = tone(300, 8 * MIB / 48_000)
            frame = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
            for _ in range(12):
                await ws.send(frame)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            codes = []
            async for raw in ws:
                event = json.loads(raw)
                if event["type"] == "error":
                    codes.append(event["error"]["code"])
                if event["type"] == "input_audio_buffer.committed":
                    break
            assert ws.close_code is None and "input_audio_buffer_full" in codes, (ws.close_code, codes)
            grew = server.peak - base
            # Before the budgets: 1.5 GB for the four G.711 appends alone, 2.4 GB for forty 16 MiB frames.
            assert grew < 250 * MIB, f"peak RSS grew by {grew / MIB:.0f} MiB"
        await asyncio.sleep(0.5)
        after = await _settle(server)
        assert after - base < 60 * MIB, f"RSS stayed {(after - base) / MIB:.0f} MiB above its start"

    with server_process(**budget) as server:
        run(scenario(server), timeout=90)


# --- 2: the conversation ---------------------------------------------------------


def test_conversation_past_its_budget_drops_its_oldest_items_and_tells_the_client() -> None:
    async def scenario() -> None:
        async with live_server(max_conversation_mib=0.05) as server:  # 52 KB
            async with RealtimeClient.connect(server) as c:
                ids = []
                for i in range(30):
                    await c.add_user_text(f"{i} " + "x" * 4000)
                    ids.append((await c.until("conversation.item.added"))["item"]["id"])
                deleted = [e["item_id"] for e in c.of_type("conversation.item.deleted")]
                assert deleted and deleted == ids[: len(deleted)], "oldest first"
                assert ids[-1] not in deleted
                await c.send("conversation.item.retrieve", item_id=ids[0])
                assert (await c.until("error"))["error"]["code"] == "item_retrieve_invalid_item_id"
                # A conversation that keeps growing keeps working.
                done = await c.say_text("still talking")
                assert done["response"]["status"] == "completed"
                # One item larger than the whole budget is refused, and nothing else is lost.
                await c.add_user_text("y" * 60_000)
                err = await c.until("error")
                assert err["error"]["code"] == "conversation_item_too_large"
                await c.send("conversation.item.retrieve", item_id=ids[-1])
                assert (await c.until("conversation.item.retrieved"))["item"]["id"] == ids[-1]

    run(scenario())


def test_nothing_of_a_session_stays_referenced_after_it_ends() -> None:
    """Freed when its slot lets go of it, by reference counting alone: not left to the cyclic collector, which may
    come minutes later."""

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            with collector_off():
                async with RealtimeClient.connect(server) as c:
                    await c.until("session.created")
                    await c.say_text("remember me")
                    await c.append_audio(tone(300, 0.5) + bytes(48_000))
                    await c.until("response.done")
                    held = serving_now(server)
                    assert len(held) == 2
                assert await eventually(lambda: _idle(server))
                await asyncio.sleep(0.1)
                assert not still_held(held), still_held(held)

    run(scenario())


async def _idle(server) -> bool:  # type: ignore[no-untyped-def]
    return all(s.state.value == "idle" for s in server.pool.slots)


# --- 3 and 4: amplification and floods, while another session talks --------------


async def _turn_ms(c: RealtimeClient) -> float:
    started = time.perf_counter()
    done = await c.say_text("how quick")
    assert done["response"]["status"] == "completed"
    return (time.perf_counter() - started) * 1000


async def _median_turn_ms(c: RealtimeClient, n: int = 5) -> float:
    return statistics.median([await _turn_ms(c) for _ in range(n)])


@asynccontextmanager
async def _quiet_figure(server) -> AsyncIterator[tuple[RealtimeClient, float]]:  # type: ignore[no-untyped-def]
    async with RealtimeClient.connect(server) as other:
        await other.until("session.created")
        await _median_turn_ms(other, 2)  # warm up
        yield other, await _median_turn_ms(other)


def _within_twice(loaded: float, quiet: float) -> bool:
    # 2x the quiet figure, plus 25 ms for the timer and scheduling noise of a shared 2-core machine.
    return loaded <= 2 * quiet + 25


def test_pipelined_retrieves_of_a_big_item_are_paced_by_the_reader_and_dropped_when_it_leaves() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, max_output_mib=4, max_conversation_mib=4) as server:
            async with _quiet_figure(server) as (other, quiet):
                async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", max_queue=1) as abuser:
                    await abuser.send(
                        json.dumps(
                            {
                                "type": "conversation.item.create",
                                "item": {
                                    "id": "big",
                                    "type": "message",
                                    "role": "user",
                                    "content": [{"type": "input_text", "text": "z" * (3 * MIB)}],
                                },
                            }
                        )
                    )
                    retrieve = json.dumps({"type": "conversation.item.retrieve", "item_id": "big"})
                    for _ in range(300):  # 900 MB asked for with 18 KB, and never read
                        await abuser.send(retrieve)
                    await asyncio.sleep(0.5)
                    loaded = await _median_turn_ms(other)
                    assert _within_twice(loaded, quiet), (quiet, loaded)
                    out = (await http_get(server, "/metrics"))[1]
                    held = float(out.split('s2s_session_bytes{budget="output"} ', 1)[1].split()[0])
                    assert held <= 4 * MIB + 4 * MIB, held  # the budget, plus one item that passes alone
                left = time.monotonic()
                assert await eventually(lambda: _free(server, 1), 3.0)
                assert time.monotonic() - left < 2.0, "the dead client's backlog is dropped at once"

    run(scenario(), timeout=60)


async def _free(server, n: int) -> bool:  # type: ignore[no-untyped-def]
    return sum(s.state.value == "idle" for s in server.pool.slots) >= n


#: A client flooding the server with one-byte frames from a process of its own (so that its sending costs
#: the server's loop nothing); prints a JSON line of how it went once it is closed.
FLOODER = """
import asyncio, json, sys
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

async def main(url):
    sent = notices = 0
    async with connect(url) as ws:
        async def read():
            nonlocal notices
            try:
                async for raw in ws:
                    notices += json.loads(raw).get("error", {}).get("code") == "rate_limit_exceeded"
            except ConnectionClosed:
                pass
        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                for _ in range(200):
                    await ws.send("x")
                    sent += 1
                await asyncio.sleep(0)
        except ConnectionClosed:
            pass
        await reader
    print(json.dumps({"sent": sent, "notices": notices, "close_code": ws.close_code}), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_flood_of_tiny_frames_gets_one_notice_a_second_then_is_closed_alone() -> None:
    flood_close_s = 3.0

    async def scenario() -> None:
        async with live_server(
            pool_size=2, max_events_per_s=100, max_events_burst=100, flood_close_s=flood_close_s
        ) as server:
            async with _quiet_figure(server) as (other, quiet):
                url = f"ws://127.0.0.1:{server.port}/v1/realtime"
                flood = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", FLOODER, url, stdout=asyncio.subprocess.PIPE
                )
                assert flood.stdout is not None
                closed = asyncio.ensure_future(flood.stdout.readline())
                try:
                    # The other session talks from the flood's first frames to its close.
                    turns = []
                    while not closed.done():
                        turns.append(await _turn_ms(other))
                        # Within its own event budget (two events a turn): the other session is not refused itself.
                        await asyncio.sleep(0.05)
                    outcome = json.loads(await asyncio.wait_for(closed, flood_close_s + 10))
                finally:
                    if flood.returncode is None:
                        flood.kill()
                    await flood.wait()
                assert outcome["close_code"] == 1008, outcome
                assert outcome["sent"] > 2000 and 1 <= outcome["notices"] <= flood_close_s + 2, outcome
                # Every turn stays quick: none waits for the flood to end (a noisy machine's spike is allowed).
                slowest = max(turns)
                assert slowest < 10 * quiet + 250, f"a turn took {slowest:.0f} ms of the flood (quiet: {quiet:.0f} ms)"
                assert _within_twice(statistics.median(turns), quiet), (quiet, turns)

    run(scenario(), timeout=60)


# --- 7: malformed values ------------------------------------------------------------


def test_malformed_values_get_error_events_naming_the_parameter_and_the_session_lives_on() -> None:
    deep = '{"a":' * 50_000 + "1" + "}" * 50_000
    cases = [
        ('{"type":"response.create","response":{"metadata":' + deep + "}}", "invalid_json", None),
        (
            json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": ["x"]}]}}),
            "invalid_value",
            "session.tools[0].name",
        ),
        (
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "tools": [{"type": "function", "name": "f"}],
                        "tool_choice": {"type": "function", "function": "f"},
                    },
                }
            ),
            "invalid_value",
            "session.tool_choice",
        ),
        (
            json.dumps({"type": "response.create", "response": {"temperature": -5}}),
            "invalid_value",
            "response.temperature",
        ),
        (
            json.dumps({"type": "response.create", "response": {"temperature": 1e308}}),
            "invalid_value",
            "response.temperature",
        ),
    ]

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                for frame, code, param in cases:
                    await c.send_raw(frame)
                    err = (await c.until("error"))["error"]
                    assert err["code"] == code and err["param"] == param, (frame[:80], err)
                done = await c.say_text("still fine")
                assert done["response"]["status"] == "completed"

    run(scenario())


# --- 8: client addresses behind a proxy ------------------------------------------------


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    async def connects(server, forwarded: str) -> bool:  # type: ignore[no-untyped-def]
        async with RealtimeClient.connect(server, additional_headers={"X-Forwarded-For": forwarded}) as c:
            e = await c.recv()
            return e["type"] == "session.created"

    async def scenario() -> None:
        async with live_server(pool_size=4, max_connections_per_ip=1, trusted_proxies=["127.0.0.1"]) as server:
            async with RealtimeClient.connect(server, additional_headers={"X-Forwarded-For": "203.0.113.7"}):
                assert await connects(server, "198.51.100.1")  # another client behind the same proxy
                assert not await connects(server, "203.0.113.7")  # the same client twice
        async with live_server(pool_size=4, max_connections_per_ip=1) as server:
            async with RealtimeClient.connect(server, additional_headers={"X-Forwarded-For": "203.0.113.7"}):
                # Not a trusted proxy: its header is ignored, and it is one address.
                assert not await connects(server, "198.51.100.1")

    run(scenario())


def test_a_server_collects_cyclic_garbage_seldom_while_it_runs_and_gives_the_thresholds_back() -> None:
    """An application embedding servers gets its collector back as it was once the last of them has closed."""
    from s2s_rt.memory import YOUNG_ALLOCATIONS

    found = gc.get_threshold()
    before = (700, 10, 10)  # CPython's own, whatever an earlier test left
    seldom = (YOUNG_ALLOCATIONS, 10, 10)

    async def scenario() -> None:
        async with live_server() as first:
            assert gc.get_threshold() == seldom
            async with live_server():
                assert gc.get_threshold() == seldom
            assert gc.get_threshold() == seldom, "the first server still runs"
            async with RealtimeClient.connect(first) as c:
                await c.until("session.created")
        assert gc.get_threshold() == before

    gc.set_threshold(*before)
    try:
        run(scenario())
    finally:
        gc.set_threshold(*found)
