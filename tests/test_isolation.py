"""Nothing one client causes reaches another, and stale work is never sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from conftest import RealtimeClient, live_server, run, silence, tone

ROUNDS = 3
CLIENTS = 8


def _own_ids(events: list[dict]) -> tuple[set[str], set[str]]:
    items, responses = set(), set()
    for e in events:
        if "item" in e and isinstance(e["item"], dict):
            items.add(e["item"]["id"])
        if "item_id" in e:
            items.add(e["item_id"])
        if "response" in e:
            responses.add(e["response"]["id"])
        if "response_id" in e:
            responses.add(e["response_id"])
    return items, responses


def test_eight_clients_on_eight_slots_each_receive_only_their_own_events() -> None:
    async def client(server, n: int, round_: int) -> tuple[list[dict], str]:
        async with RealtimeClient.connect(server, transcribe=True) as c:
            await c.until("session.created")
            # A text turn with words only this client says…
            word = f"client{n}round{round_}"
            done = await c.say_text(f"hello from {word}")
            assert done["response"]["status"] == "completed"
            text = done["response"]["output"][0]["content"][0]["transcript"]
            assert text == f"You said: hello from {word}."
            # …and a spoken turn with a tone only this client plays.
            await c.append_audio(tone(300 + 40 * n + 7 * round_, 0.6) + silence(0.8))
            heard = await c.until("conversation.item.input_audio_transcription.completed")
            done = await c.until("response.done")
            spoken = done["response"]["output"][0]["content"][0]["transcript"]
            assert spoken == f"You said: {heard['transcript']}."
            return c.events, heard["transcript"]

    async def scenario() -> None:
        async with live_server(pool_size=CLIENTS) as server:
            for round_ in range(ROUNDS):
                results = await asyncio.gather(*(client(server, n, round_) for n in range(CLIENTS)))
                transcripts = [t for _, t in results]
                assert len(set(transcripts)) == CLIENTS, "each client's audio is its own"
                owned = [_own_ids(ev) for ev, _ in results]
                for i, (events, _transcript) in enumerate(results):
                    others = [t for j, t in enumerate(transcripts) if j != i]
                    for e in events:
                        blob = str(e)
                        assert not any(o in blob for o in others), f"client {i} saw another client's words"
                    for j, (items, responses) in enumerate(owned):
                        if j != i:
                            assert not (owned[i][0] & items) and not (owned[i][1] & responses)
                    # Nothing lost: every response that was created was finished.
                    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
                    done = [e["response"]["id"] for e in events if e["type"] == "response.done"]
                    assert created == done and len(done) == 2

    run(scenario(), timeout=120)


def test_new_client_on_same_slot_never_receives_the_old_response() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            async with RealtimeClient.connect(server) as old:
                await old.until("session.created")
                await old.ask("[[slow 100]] secret words of the old client")
                await old.until("response.output_audio.delta")
            # Disconnected mid-response; the next client claims the same slot at once.
            t0 = time.monotonic()
            async with RealtimeClient.connect(server) as new:
                first = await new.recv()
                while first["type"] == "error":  # slot still draining: retry
                    assert time.monotonic() - t0 < 2
                    async with RealtimeClient.connect(server) as again:
                        new = again
                        first = await new.recv()
                assert first["type"] == "session.created"
                done = await new.say_text("fresh")
                assert done["response"]["output"][0]["content"][0]["transcript"] == "You said: fresh."
                # Listen on for longer than the old response would have taken.
                try:
                    while True:
                        await new.recv(timeout=1.5)
                except TimeoutError:
                    pass
                for e in new.events:
                    assert "secret" not in str(e)
                    assert "old client" not in str(e)
                old_ids = {e["response"]["id"] for e in old.events if "response" in e}
                assert not any(e.get("response_id") in old_ids for e in new.events)

    run(scenario())


def test_event_loop_stays_responsive_while_engines_block_their_threads() -> None:
    """Four LLM calls block their threads for 300 ms a token; the loop and other sessions do not notice.

    Both figures are compared with the same ones taken on the same server
    before, when nothing was blocked: a loop that ran an engine call itself
    would lag by the 300 ms it blocked, far past the margins.
    """

    async def worst_loop_lag(done: Callable[[], bool]) -> float:
        """How late a 10 ms sleep woke at worst, until ``done()`` (a blocked loop wakes it late once, by all of it)."""
        worst = 0.0
        while not done():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - t - 0.01)
        return worst

    async def blocked(server) -> None:
        async with RealtimeClient.connect(server) as c:
            await c.until("session.created")
            done = await c.say_text("[[block 300]] one two")
            assert done["response"]["status"] == "completed"

    async def quick(server, n: int) -> float:
        async with RealtimeClient.connect(server) as c:
            await c.until("session.created")
            t = time.perf_counter()
            await c.send("session.update", session={"instructions": f"quick {n}"})
            await c.until("session.updated")
            return time.perf_counter() - t

    async def scenario() -> None:
        async with live_server(pool_size=8, stage_workers=4) as server:
            loop = asyncio.get_running_loop()
            quiet_until = loop.time() + 1.0
            quiet_lag = await worst_loop_lag(lambda: loop.time() >= quiet_until)
            quiet_quick = max([await quick(server, n) for n in range(3)])
            slow = asyncio.gather(*(blocked(server) for _ in range(4)))
            lag = asyncio.ensure_future(worst_loop_lag(slow.done))
            await asyncio.sleep(0.5)  # all four LLM threads are now blocked
            quick_times = await asyncio.gather(*(quick(server, n) for n in range(3)))
            await slow
            loaded_lag = await lag
            assert loaded_lag < quiet_lag + 0.1, (
                f"event loop lag {loaded_lag * 1000:.1f} ms, quiet {quiet_lag * 1000:.1f}"
            )
            assert max(quick_times) < 3 * quiet_quick + 0.1, (
                "other sessions' events kept flowing",
                quiet_quick,
                quick_times,
            )

    run(scenario())
