"""One client can never stop the server or touch another session.

Each test sends what a hostile (or merely unusual) client sent once and
stopped the whole process, or hurt another session, and checks what clients
observe now: the misbehaving session gets an error (or is ended alone, close
1011), the other session's turn completes, and the server still answers and
serves a new client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import numpy as np
from conftest import RealtimeClient, eventually, http_get, live_server, run, silence, tone

from s2s_rt.engines.fake import POISON_LEVEL
from s2s_rt.server import Server


def poison(seconds: float, rate: int = 24_000) -> bytes:
    """Audio the fake VAD fails on (a steady level): an error in this session's share of the clock."""
    return (np.full(int(seconds * rate), POISON_LEVEL * 32767).astype("<i2")).tobytes()


async def still_serving(server: Server) -> None:
    """The process answers /healthz, a new client completes a text turn, and no slot is stuck."""
    status, _ = await http_get(server, "/healthz")
    assert status == 200
    async with RealtimeClient.connect(server) as fresh:
        done = await fresh.say_text("still there?")
        assert done["response"]["status"] == "completed"

    async def all_idle() -> bool:
        _, body = await http_get(server, "/v1/pool")
        return json.loads(body)["states"]["idle"] == len(json.loads(body)["slots"])

    assert await eventually(all_idle, timeout=10)


async def spoken_turn(c: RealtimeClient) -> dict[str, Any]:
    """A spoken turn with server VAD, to response.done."""
    await c.append_audio(silence(0.3) + tone(440, 0.6) + silence(0.8))
    return await c.until("response.done", timeout=15)


def test_an_item_id_announced_by_speech_started_is_refused_and_the_turn_completes() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as other, RealtimeClient.connect(server, transcribe=True) as c:
                await c.until("session.created")
                await c.append_audio(silence(0.3) + tone(440, 0.6))
                started = await c.until("input_audio_buffer.speech_started")
                await c.send(
                    "conversation.item.create",
                    event_id="evt_reuse",
                    item={
                        "id": started["item_id"],
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "mine"}],
                    },
                )
                error = await c.until("error")
                assert error["error"]["code"] == "item_id_already_exists"
                assert error["error"]["event_id"] == "evt_reuse"
                await c.append_audio(silence(0.8))
                committed = await c.until("input_audio_buffer.committed")
                assert committed["item_id"] == started["item_id"]
                done = await c.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
                assert (await other.say_text("hello"))["response"]["status"] == "completed"
            await still_serving(server)

    run(scenario())


def test_a_manual_commit_after_an_announced_id_was_reused_keeps_the_server_up() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                await c.append_audio(silence(0.3) + tone(440, 0.6))
                started = await c.until("input_audio_buffer.speech_started")
                await c.send(
                    "conversation.item.create",
                    item={
                        "id": started["item_id"],
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "mine"}],
                    },
                )
                assert (await c.until("error"))["error"]["code"] == "item_id_already_exists"
                await c.send("input_audio_buffer.commit")
                committed = await c.until("input_audio_buffer.committed")
                assert committed["item_id"] == started["item_id"]
            await still_serving(server)

    run(scenario())


def test_an_error_in_one_sessions_share_of_the_listening_clock_ends_that_session_alone() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as other, RealtimeClient.connect(server) as bad:
                await bad.until("session.created")
                await other.until("session.created")
                # Both stream in the same ticks: the poisoned batch must not fail the other session's audio.
                await asyncio.gather(bad.append_audio(poison(0.5)), other.append_audio(silence(0.3) + tone(440, 0.6)))
                error = await bad.until("error")
                assert error["error"]["code"] == "session_failed" and error["error"]["type"] == "server_error"
                await bad.ws.wait_closed()
                assert bad.ws.close_code == 1011
                await other.append_audio(silence(0.8))
                done = await other.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
                assert not other.of_type("error")
            await still_serving(server)

    run(scenario())


def test_a_failed_session_whose_client_never_answers_the_close_starts_no_work() -> None:
    """The client of a failed session stops reading (so never answers the close) and keeps talking."""

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as other, RealtimeClient.connect(server) as bad:
                await bad.send(
                    "session.update",
                    session={"type": "transcription", "audio": {"input": {"transcription": {"model": "whisper-1"}}}},
                )
                await bad.until("session.updated")
                await bad.append_audio(poison(0.3))
                bad.ws.transport.pause_reading()  # the close frame is never read, never answered
                # Speech long enough for live captions, sent while the server waits for the close reply.
                for _ in range(10):
                    await bad.append_audio(tone(440, 0.2))
                    await asyncio.sleep(0.05)
                assert (await other.say_text("hello"))["response"]["status"] == "completed"
                await spoken_turn(other)
                bad.ws.transport.abort()
            await still_serving(server)

    run(scenario())


def test_switching_to_a_transcription_session_while_a_turn_is_transcribed_answers_nothing_and_crashes_nothing() -> None:
    async def scenario() -> None:
        # A slow STT: the switch arrives while the turn is being transcribed, before its response starts.
        async with live_server(pool_size=2, fake_stt_delay_ms=300) as server:
            for _ in range(6):  # five crashes in a minute used to quarantine the slot
                async with RealtimeClient.connect(server, transcribe=True) as c:
                    await c.append_audio(silence(0.3) + tone(440, 0.6) + silence(0.8))
                    await c.until("input_audio_buffer.speech_stopped")
                    await c.send("session.update", session={"type": "transcription"})
                    await c.until("conversation.item.input_audio_transcription.completed")
                    assert c.of_type("session.updated")
                    # The session goes on as a transcription session: the next turn is transcribed too.
                    await c.append_audio(silence(0.3) + tone(660, 0.6) + silence(0.8))
                    await c.until("conversation.item.input_audio_transcription.completed")
                    assert not c.of_type("response.created")
                    assert not c.of_type("error")
            _, body = await http_get(server, "/v1/pool")
            states = json.loads(body)["states"]
            assert [states[s] for s in ("quarantined", "crashed", "resting")] == [0, 0, 0], states
            await still_serving(server)

    run(scenario())


def _pcmu_silence(seconds: float) -> str:
    return base64.b64encode(b"\xff" * int(8000 * seconds)).decode()


async def _speech_started_after(c: RealtimeClient) -> float:
    """Seconds from sending speech to ``speech_started``."""
    sent = time.perf_counter()
    await c.append_audio(tone(440, 0.4), chunk_bytes=19_200)
    await c.until("input_audio_buffer.speech_started")
    elapsed = time.perf_counter() - sent
    await c.append_audio(silence(0.8), chunk_bytes=19_200)
    await c.until("response.done", timeout=15)
    return elapsed


def test_one_large_append_does_not_make_another_sessions_listening_late() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as other, RealtimeClient.connect(server) as big:
                await other.until("session.created")
                quiet = min([await _speech_started_after(other) for _ in range(2)])
                await big.send(
                    "session.update",
                    session={"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
                )
                await big.until("session.updated")
                # 800 s of G.711 in one 8.5 MB frame, heard by the same clock as the other session's audio.
                await big.send("input_audio_buffer.append", audio=_pcmu_silence(800))
                await asyncio.sleep(0.1)  # it is being heard now
                loaded = await _speech_started_after(other)
                assert loaded < quiet + 0.5, (quiet, loaded)
                assert not big.of_type("error")
            await still_serving(server)

    run(scenario())


def test_an_upload_faster_than_real_time_is_heard_and_a_full_buffer_is_refused_without_closing() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send(
                    "session.update",
                    session={"type": "realtime", "audio": {"input": {"turn_detection": None}}},
                )
                await c.until("session.updated")
                # 950 s of 24 kHz PCM16 in five appends of 10 MB (45 MB: more than the 32 MB that may wait to be
                # heard, and more than the buffer's 900 s).
                second = silence(1.0)
                for _ in range(5):
                    await c.append_audio(second * 190, chunk_bytes=len(second) * 190)
                error = await c.until("error", timeout=30)
                assert error["error"]["code"] == "input_audio_buffer_full"
                await c.send("input_audio_buffer.commit")
                committed = await c.until("input_audio_buffer.committed", timeout=30)
                heard = await c.until("conversation.item.input_audio_transcription.completed", timeout=30)
                assert committed["item_id"] == heard["item_id"]
                assert heard["transcript"].startswith("heard 900000 ms")
                # And the session is still usable.
                assert (await c.say_text("hello"))["response"]["status"] == "completed"
            await still_serving(server)

    run(scenario(), timeout=120)


def test_a_client_reconnecting_at_once_to_a_pool_of_one_is_never_refused() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            for _ in range(8):
                async with RealtimeClient.connect(server) as c:
                    created = await c.until("session.created")
                    assert created["type"] == "session.created"
                    assert (await c.say_text("hi"))["response"]["status"] == "completed"

    run(scenario())


def test_a_client_that_floods_without_reading_and_leaves_gives_its_slot_back() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with RealtimeClient.connect(server, max_size=None) as c:
                big = "x" * (3 << 20)
                await c.send(
                    "conversation.item.create",
                    item={
                        "id": "big",
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": big}],
                    },
                )
                await c.until("conversation.item.added")
                c.ws.transport.pause_reading()
                for _ in range(40):
                    await c.send("conversation.item.retrieve", item_id="big")
                await asyncio.sleep(0.5)
                c.ws.transport.close()

            async def all_idle() -> bool:
                _, body = await http_get(server, "/v1/pool")
                return json.loads(body)["states"]["idle"] == 2

            assert await eventually(all_idle, timeout=5)
            await still_serving(server)

    run(scenario())


def test_a_session_that_gives_up_on_llm_calls_again_and_again_holds_at_most_one_in_the_engine() -> None:
    """A cancelled call goes on in its thread; an engine that runs one call at a time would queue them all."""
    import threading

    from s2s_rt.inference import OneAtATime, StagePool
    from s2s_rt.metrics import Metrics

    async def scenario() -> None:
        pool = StagePool("llm", 4, Metrics(dict, lambda: 0))
        release = threading.Event()
        started: list[int] = []

        def uninterruptible(n: int) -> int:
            started.append(n)
            release.wait(5)  # a long reading of a prompt: nothing stops it
            return n

        mine, theirs = OneAtATime(), OneAtATime()
        first = asyncio.ensure_future(pool.call(uninterruptible, 1, gate=mine))
        await eventually_true(lambda: started == [1])
        first.cancel()  # the session cancels its answer: the call goes on in its thread
        second = asyncio.ensure_future(pool.call(uninterruptible, 2, gate=mine))
        other = asyncio.ensure_future(pool.call(uninterruptible, 3, gate=theirs))
        await eventually_true(lambda: 3 in started)
        assert 2 not in started  # it waits for its own abandoned call, and only it does
        release.set()
        assert await second == 2 and await other == 3
        pool.shutdown()

    run(scenario())


async def eventually_true(check: Any, timeout: float = 5.0) -> None:
    async def ok() -> bool:
        return bool(check())

    assert await eventually(ok, timeout=timeout)
