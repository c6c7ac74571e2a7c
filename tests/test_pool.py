"""The slot pool as clients see it (claims, rejection, readiness, quarantine), and Pool.claim on its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run, tone
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from s2s_rt import Server
from s2s_rt.engines.base import Float32Array
from s2s_rt.engines.fake import EnergyVAD, load_fake_stack
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import SessionEnd
from s2s_rt.server.pool import Pool
from s2s_rt.slot import TRANSITIONS, Slot, SlotEvent, SlotState


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


def test_freed_slot_is_claimable_at_once_even_while_it_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client arriving while the only slot drains waits for it, and gets it the moment the drain ends.

    The drain is held open (the STT stage sits on the session's end) until
    the test lets it go, so the second client surely finds the slot
    draining; it must then be served well before the claim's own wait cap
    (2 s), which is where a claim nobody wakes would be served.
    """
    original = Transcriber._handle
    #: The sessions whose end is held, by id, until their event is set.
    held: dict[str, asyncio.Event] = {}

    async def held_handle(self: Transcriber, item: Any) -> None:
        if isinstance(item, SessionEnd) and item.session_id in held:
            await held[item.session_id].wait()
        await original(self, item)

    monkeypatch.setattr(Transcriber, "_handle", held_handle)

    async def draining(server: Server) -> bool:
        return bool(json.loads((await http_get(server, "/v1/pool"))[1])["states"]["draining"] == 1)

    async def scenario() -> None:
        async with live_server(pool_size=1, drain_timeout_s=4.0) as server:
            loop = asyncio.get_running_loop()
            for _ in range(2):
                async with RealtimeClient.connect(server) as a:
                    release = held[(await a.until("session.created"))["session"]["id"]] = asyncio.Event()
                assert await eventually(lambda: draining(server)), "the slot drains, held open"
                async with RealtimeClient.connect(server) as b:
                    # The next client waits for the draining slot: it is not refused…
                    with pytest.raises(TimeoutError):
                        await b.recv(timeout=0.3)
                    assert await draining(server)
                    release.set()
                    released = loop.time()
                    # …and is served as soon as the drain ends, not at the claim's wait cap.
                    assert (await b.recv())["type"] == "session.created"
                    waited = loop.time() - released
                    assert waited < 0.5, f"served {waited:.2f} s after the slot was free"

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


# --- Pool.claim on its own: no server, slots that only keep a state ------------------------------------------


class _Slot:
    """What :class:`Pool` reads of a slot: its state, its session (none here), and who to tell when it changes."""

    def __init__(self, state: SlotState) -> None:
        self.state = state
        self.session = None
        self.channel_open = False
        self.on_change: list[Callable[[], None]] = []

    def step(self, event: SlotEvent) -> None:
        self.state = TRANSITIONS[(self.state, event)]

    def drained(self) -> None:
        self.step(SlotEvent.DRAINED)
        for callback in self.on_change:
            callback()


def _pool(*states: SlotState) -> tuple[Pool, list[_Slot]]:
    slots = [_Slot(state) for state in states]
    return Pool(cast(list[Slot], slots)), slots


def test_claim_takes_an_idle_slot_and_refuses_when_none_is_left_or_listening_is_full() -> None:
    async def main() -> None:
        pool, (only,) = _pool(SlotState.IDLE)
        assert await pool.claim(lambda: False, 1.0) is None
        assert only.state is SlotState.IDLE, "a refused claim leaves the slot alone"
        assert await pool.claim(lambda: True, 1.0) is only
        assert only.state is SlotState.ACTIVE
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await pool.claim(lambda: True, 1.0) is None
        assert loop.time() - t0 < 0.5, "nothing is about to be free: no wait"

    asyncio.run(main())


def test_claim_waits_for_a_draining_slot_only_while_it_drains() -> None:
    async def main() -> None:
        pool, (busy,) = _pool(SlotState.DRAINING)
        claim = asyncio.create_task(pool.claim(lambda: True, 5.0))
        await asyncio.sleep(0.05)
        assert not claim.done(), "the claim waits for the draining slot"
        busy.drained()
        assert await asyncio.wait_for(claim, 1.0) is busy
        assert busy.state is SlotState.ACTIVE

    asyncio.run(main())


def test_claim_asks_admits_again_after_the_wait() -> None:
    async def main() -> None:
        pool, (busy,) = _pool(SlotState.DRAINING)
        full = False
        claim = asyncio.create_task(pool.claim(lambda: not full, 5.0))
        await asyncio.sleep(0.05)
        full = True  # listening filled up while the claim waited
        busy.drained()
        assert await asyncio.wait_for(claim, 1.0) is None
        assert busy.state is SlotState.IDLE

    asyncio.run(main())


def test_claim_gives_up_at_its_deadline_and_waits_for_nothing_once_refusing() -> None:
    async def main() -> None:
        pool, (busy,) = _pool(SlotState.DRAINING)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await pool.claim(lambda: True, 0.1) is None
        assert 0.09 <= loop.time() - t0 < 1.0
        t0 = loop.time()
        assert await pool.claim(lambda: True, 5.0, refusing=lambda: True) is None
        assert loop.time() - t0 < 0.5, "a server that stops taking sessions waits for no drain"
        assert busy.state is SlotState.DRAINING

    asyncio.run(main())
