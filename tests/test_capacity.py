"""Graceful refusal instead of collapse: load shedding on the listening backlog.

The listening clock hears every session's audio in batches; when it falls
behind, the server says "full" before admitted sessions degrade, a session
whose own audio piles up is closed alone with a clear error, and pings are
answered whatever audio is waiting.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run, silence, tone
from websockets.asyncio.client import connect

from s2s_rt import Server
from s2s_rt.audio import AudioFormat
from s2s_rt.engines.fake import EnergyVAD
from s2s_rt.inference import call_lowered
from s2s_rt.listening.admission import ListeningCost


async def _readiness_is(server: Server, status: int) -> bool:
    return (await http_get(server, "/readyz"))[0] == status


def test_when_listening_falls_behind_new_sessions_are_refused_and_admitted_ones_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = threading.Event()
    original = EnergyVAD.speech_probabilities

    def vad(self, chunks, states):  # type: ignore[no-untyped-def]
        if slow.is_set():
            time.sleep(0.15)  # a VAD that cannot keep up
        return original(self, chunks, states)

    monkeypatch.setattr(EnergyVAD, "speech_probabilities", vad)

    async def scenario() -> None:
        async with live_server(pool_size=4, shed_after_ms=100) as server:
            async with RealtimeClient.connect(server) as admitted:
                await admitted.until("session.created")
                slow.set()
                talk = asyncio.create_task(admitted.append_audio(tone(400, 1.0) + silence(0.8), pace_s=0.02))
                assert await eventually(lambda: _readiness_is(server, 503), 2.0), "readiness drops while behind"
                async with RealtimeClient.connect(server) as late:
                    refused = await late.recv()
                    assert refused["error"]["code"] == "session_limit_reached"
                    assert "capacity" in refused["error"]["message"]
                await talk
                slow.clear()
                # The admitted session's turn is still heard and answered.
                await admitted.until("input_audio_buffer.speech_stopped", timeout=15)
                done = await admitted.until("response.done", timeout=15)
                assert done["response"]["status"] == "completed"
            assert await eventually(lambda: _readiness_is(server, 200), 5.0)
            async with RealtimeClient.connect(server) as again:
                assert (await again.recv())["type"] == "session.created"

    run(scenario(), timeout=60)


#: The flood test's VAD: seconds of work per second of audio it scores (capacity ≈ max load / this).
FLOOD_VAD_COST = 0.04


def test_a_flood_beyond_capacity_is_refused_while_the_admitted_keep_their_decisions_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forty clients connect at once, thirty more a second later, to a server that can listen to about fifteen.

    The VAD costs 40 ms per second of audio (a sleep, so the measure does
    not depend on the test machine's speed): seventeen sessions would keep
    the clock 70 % busy. Admission counts every admitted session as
    streaming, those not yet sending too, so the excess of each flood is
    refused at once with ``session_limit_reached`` (the first by the cost
    calibrated at start, the second by the cost measured meanwhile), and
    each admitted session's audio keeps being heard within 50 ms: a
    ``clear`` sent after its audio is answered once that audio is heard,
    as the load script probes. Without the prediction all are admitted
    and the probes go unanswered for seconds (checked).
    """
    original = EnergyVAD.speech_probabilities

    def vad(self, chunks, states):  # type: ignore[no-untyped-def]
        time.sleep(FLOOD_VAD_COST * len(chunks) * self.chunk_samples / 16_000)
        return original(self, chunks, states)

    monkeypatch.setattr(EnergyVAD, "speech_probabilities", vad)
    chunk = silence(0.02)
    append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
    clear = json.dumps({"type": "input_audio_buffer.clear"})

    async def client(server: object, delays: list[float]) -> str:
        """Stream 3 s of silence at real time, probing every 200 ms; returns how the session went."""
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"  # type: ignore[attr-defined]
        async with connect(url) as ws:
            first = json.loads(await ws.recv())
            if first["type"] == "error":
                await ws.wait_closed()
                assert ws.close_code == 1013, ws.close_code
                return first["error"]["code"]
            assert first["type"] == "session.created"
            loop = asyncio.get_running_loop()
            probes: dict[int, float] = {}

            async def read() -> None:
                async for raw in ws:
                    event = json.loads(raw)
                    assert event["type"] in ("input_audio_buffer.cleared", "conversation.created"), event
                    if event["type"] == "input_audio_buffer.cleared":
                        delays.append(loop.time() - probes.pop(min(probes)))

            reader = asyncio.create_task(read())
            start = loop.time()
            for i in range(150):
                await ws.send(append)
                if i % 10 == 9:
                    probes[i] = loop.time()
                    await ws.send(clear)
                await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - loop.time()))
            for _ in range(100):
                if not probes:
                    break
                await asyncio.sleep(0.02)
            if reader.done():
                reader.result()  # raises what the reader found
            reader.cancel()
            assert not probes, "every probe is answered"
            return "admitted"

    async def scenario() -> tuple[list[str], list[float], float]:
        async with live_server(pool_size=70, max_listening_load=0.7) as server:
            delays: list[float] = []
            first = [asyncio.create_task(client(server, delays)) for _ in range(40)]
            await asyncio.sleep(1.0)  # a second flood while the admitted are streaming
            second = [asyncio.create_task(client(server, delays)) for _ in range(30)]
            outcomes = list(await asyncio.gather(*first, *second))
            cost = server.clock.cost.value_at(time.monotonic())  # as measured while they streamed
            return outcomes, delays, cost

    outcomes, delays, cost = run(scenario(), timeout=60)
    admitted = outcomes.count("admitted")
    refused = outcomes.count("session_limit_reached")
    assert admitted + refused == 70, outcomes
    assert cost >= 0.9 * FLOOD_VAD_COST  # the clock measured the VAD's cost
    # Refused are only those beyond what listening can take: at least half of it is used, never more than all.
    capacity = 0.7 / FLOOD_VAD_COST
    assert capacity / 2 <= admitted <= capacity, (admitted, cost)
    delays.sort()
    assert len(delays) == admitted * 15
    p90 = delays[int(0.9 * len(delays))]
    assert p90 < 0.05, (admitted, f"probe p50 {delays[len(delays) // 2] * 1000:.0f} ms, p90 {p90 * 1000:.0f} ms")


def test_the_cost_of_hearing_is_what_ticks_measure_and_returns_to_the_calibrated_one_when_none_stream() -> None:
    cost = ListeningCost(prior=0.002, overhead_s=0.0003, window_s=2.0, prior_weight_s=1.0)
    assert cost.value_at(0.0) == pytest.approx(0.002)
    # 200 sessions streaming: ticks of 2 s of audio in all, each busy 0.3 ms plus 5 ms per second of audio.
    for i in range(1000):
        cost.add(0.0003 + 0.005 * 2.0, 2.0, now=i * 0.01)
    assert cost.value_at(10.0) == pytest.approx(0.005, rel=0.01)
    # Ticks that heard nothing (commands only) neither lower nor raise it; nor does a reading taken meanwhile.
    for i in range(100):
        cost.add(0.0001, 0.0, now=10.0 + i * 0.01)
    assert cost.value_at(9.5) == pytest.approx(0.005, rel=0.01)
    assert cost.value_at(11.0) == pytest.approx(0.005, rel=0.01)
    # A slow spell nobody remeasures (the sessions stopped) fades back to the calibrated cost.
    cost.add(0.5, 0.1, now=11.0)
    assert cost.value_at(11.0) > 0.005
    assert cost.value_at(41.0) == pytest.approx(0.002, rel=0.01)


def test_the_first_session_is_admitted_whatever_the_prediction_and_the_next_one_is_refused_by_it() -> None:
    """With no session, nothing is ever measured again: a bad start must not refuse everyone for good."""

    async def scenario() -> None:
        async with live_server(pool_size=4, max_listening_load=1e-9) as server:
            async with RealtimeClient.connect(server) as first:
                assert (await first.recv())["type"] == "session.created"
                assert (await http_get(server, "/readyz"))[0] == 503
                async with RealtimeClient.connect(server) as second:
                    refused = await second.recv()
                    assert refused["error"]["code"] == "session_limit_reached"
                    assert "capacity" in refused["error"]["message"]
            assert await eventually(lambda: _readiness_is(server, 200), 2.0)
            async with RealtimeClient.connect(server) as again:
                assert (await again.recv())["type"] == "session.created"

    run(scenario(), timeout=30)


def test_a_session_whose_audio_piles_up_is_closed_alone_with_its_error() -> None:
    async def scenario() -> None:
        # Each session is heard at real time at most; one that sends far faster falls behind.
        async with live_server(pool_size=2, listen_s_per_tick=0.02, max_audio_backlog_s=0.5) as server:
            async with RealtimeClient.connect(server) as calm:
                await calm.until("session.created")
                async with RealtimeClient.connect(server) as flood:
                    await flood.until("session.created")
                    calm_turn = asyncio.create_task(calm.append_audio(tone(500, 0.6) + silence(0.8), pace_s=0.02))
                    await flood.append_audio(tone(300, 4.0))  # 4 s of audio at once
                    err = await flood.until("error", timeout=10)
                    assert err["error"]["code"] == "audio_backlog_exceeded"
                    await asyncio.wait_for(flood.ws.wait_closed(), 5)
                    assert flood.ws.close_code == 1013
                    await calm_turn
                    done = await calm.until("response.done", timeout=15)
                    assert done["response"]["status"] == "completed"
                    assert not [e for e in calm.events if e["type"] == "error"]

    run(scenario(), timeout=60)


def test_pings_are_answered_while_audio_waits_and_a_session_past_its_input_budget_is_slowed_not_closed() -> None:
    async def scenario() -> None:
        async with live_server(
            pool_size=2, listen_s_per_tick=0.02, max_audio_backlog_s=30, max_input_queue_mib=1
        ) as server:
            url = f"ws://127.0.0.1:{server.port}/v1/realtime"
            async with connect(url, max_size=None) as ws:
                await ws.recv()
                chunk = json.dumps(
                    {"type": "input_audio_buffer.append", "audio": base64.b64encode(tone(300, 0.5)).decode()}
                )
                for _ in range(8):  # 4 s of audio, heard at real time: it waits
                    await ws.send(chunk)
                started = time.monotonic()
                await asyncio.wait_for(await ws.ping(), 2)
                assert time.monotonic() - started < 1.0
                for _ in range(60):  # past the 1 MiB budget of waiting audio: the sender waits while it is heard
                    await ws.send(chunk)
                await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))  # behind all of that audio
                events = []
                async for raw in ws:
                    events.append(json.loads(raw))
                    if events[-1]["type"] == "input_audio_buffer.cleared":
                        break
                # Every append was heard (30 s of tone make turns), none refused, and the session stays.
                assert not [e for e in events if e["type"] == "error"]
                assert [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
                await asyncio.wait_for(await ws.ping(), 5)

    run(scenario(), timeout=60)


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_answers_run_nicer_than_listening_so_a_full_machine_delays_answers_not_vad_decisions() -> None:
    async def scenario() -> None:
        base = _niceness()
        async with live_server(engine_nice=3) as server:
            seen = {stage: await pool.call(_niceness) for stage, pool in server.pools.items()}
        assert seen == {"vad": base, "stt": base + 3, "llm": base + 3, "tts": base + 3}
        assert _niceness() == base  # the caller's own thread is left as it was

    run(scenario(), timeout=30)


def test_an_engine_loaded_lowered_computes_on_lowered_threads() -> None:
    base = _niceness()
    seen: list[int] = []

    def load() -> str:
        # An engine's own worker threads are started while it loads (CTranslate2's, ONNX Runtime's).
        worker = threading.Thread(target=lambda: seen.append(_niceness()))
        worker.start()
        worker.join()
        return "engine"

    assert call_lowered(load, 4) == "engine"
    assert seen == [base + 4] and _niceness() == base
    with pytest.raises(ValueError, match="bad model"):
        call_lowered(lambda: (_ for _ in ()).throw(ValueError("bad model")), 4)


def test_appends_arriving_with_a_format_change_in_one_read_are_heard_in_the_new_format() -> None:
    """Appends take a direct route as they are parsed; they must not overtake the update queued before them."""

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"turn_detection": None})
                await c.until("session.updated")
                ulaw = AudioFormat("audio/pcmu", 8_000)
                second = ulaw.encode((np.sin(np.arange(8_000) * 2 * np.pi * 440 / 8_000) * 0.3).astype(np.float32))
                burst = [
                    {"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}},
                    *(
                        {"type": "input_audio_buffer.append", "audio": base64.b64encode(second[i : i + 800]).decode()}
                        for i in range(0, len(second), 800)
                    ),
                    {"type": "input_audio_buffer.commit"},
                ]
                # Every frame in one write, so that the server parses them in one read.
                for event in burst:
                    c.ws.protocol.send_text(json.dumps(event).encode())
                c.ws.send_data()
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                # One second of 8 kHz audio; read as 24 kHz PCM16 it would be a sixth of that.
                assert heard["transcript"].startswith("heard 1000 ms")

    run(scenario(), timeout=30)


def test_a_clear_and_a_commit_read_with_appends_act_on_the_audio_before_them_and_no_more() -> None:
    """The buffer's commands take the direct route too: each must act once the audio sent before it is heard,
    neither on less (what waits to be heard) nor on more (what the client sent after it)."""

    def frame(event: dict[str, Any]) -> bytes:
        return json.dumps(event).encode()

    def appends(pcm: bytes) -> list[bytes]:
        return [
            frame({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + 4800]).decode()})
            for i in range(0, len(pcm), 4800)
        ]

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"turn_detection": None})
                await c.until("session.updated")
                burst = [
                    *appends(tone(440, 0.5)),
                    frame({"type": "input_audio_buffer.clear", "event_id": "clear-1"}),
                    frame({"type": "input_audio_buffer.commit", "event_id": "commit-empty"}),
                    *appends(tone(440, 0.3)),
                    frame({"type": "input_audio_buffer.commit", "event_id": "commit-1"}),
                    *appends(tone(440, 0.2)),
                ]
                # Every frame in one write, so that the server parses them in one read, ahead of the clock.
                for data in burst:
                    c.ws.protocol.send_text(data)
                c.ws.send_data()
                await c.until("input_audio_buffer.cleared")
                refused = await c.until("error")
                assert refused["error"]["code"] == "input_audio_buffer_commit_empty"
                assert refused["error"]["event_id"] == "commit-empty"
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                assert heard["transcript"].startswith("heard 300 ms")

    run(scenario(), timeout=30)


def test_a_failure_on_the_direct_route_leaves_the_frame_to_the_usual_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from s2s_rt.pipeline.dispatch import Dispatcher

    failed: list[str] = []

    def broken(self: Dispatcher, message: str) -> bool:
        failed.append(message)
        raise RuntimeError("a bug on the direct route")

    monkeypatch.setattr(Dispatcher, "receive_now", broken)

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"turn_detection": None})
                await c.until("session.updated")
                await c.append_audio(tone(440, 0.5))
                await c.send("input_audio_buffer.commit")
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                assert heard["transcript"].startswith("heard 500 ms")
        assert failed  # the appends were offered to the direct route first

    run(scenario(), timeout=30)


def test_an_append_that_is_not_utf8_closes_the_connection_as_any_such_frame_does() -> None:
    """The direct route reads a frame's bytes as JSON: bytes that are not UTF-8 are left to websockets (1007)."""

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                c.ws.protocol.send_text(b'{"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "\xff"}')
                c.ws.send_data()
                await asyncio.wait_for(c.ws.wait_closed(), 5)
                assert c.ws.close_code == 1007

    run(scenario(), timeout=30)


def _hearing_measured(monkeypatch: pytest.MonkeyPatch, before: Callable[[list[Any]], None]) -> None:
    """Each pass of hearing that admission measures calls ``before(batch)`` first (to slow it, count it, fail it):
    the clock's hearing, for clocks made after this."""
    from s2s_rt.listening import admission, clock

    real = admission.hear

    def hear(vad: Any, batch: Any) -> Any:
        before(batch)
        return real(vad, batch)

    monkeypatch.setattr(admission, "hear", hear)
    monkeypatch.setattr(clock, "hear", hear)


@contextlib.asynccontextmanager
async def _measured_clock() -> AsyncIterator[tuple[Any, asyncio.Task[None]]]:
    """A listening clock on the fake VAD, measured as at a server's start, then measuring again every 50 ms."""
    from s2s_rt.inference import StagePool
    from s2s_rt.listening.clock import ListeningClock
    from s2s_rt.metrics import Metrics

    metrics = Metrics(dict, lambda: 0)
    pool = StagePool("vad", 1, metrics)
    clock = ListeningClock(EnergyVAD(), pool, metrics)
    remeasuring: asyncio.Task[None] | None = None
    try:
        await clock.calibrate()
        remeasuring = asyncio.create_task(clock.remeasure(every_s=0.05))
        yield clock, remeasuring
    finally:
        if remeasuring is not None:
            remeasuring.cancel()
        pool.executor.shutdown(wait=False)


def test_a_cost_measured_while_the_machine_was_busy_is_measured_again_and_the_least_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server started while something else held the cores must not admit half as many for good."""
    contended = {"on": True}
    passes = [0]

    def slowed(batch: list[Any]) -> None:
        passes[0] += 1
        if contended["on"]:
            time.sleep(40e-6 * len(batch))  # each session's share takes longer: the cores are busy elsewhere

    _hearing_measured(monkeypatch, slowed)

    async def scenario() -> None:
        async with _measured_clock() as (clock, _):
            busy_start = clock.capacity()  # measured at start, while contended
            contended["on"] = False
            assert await eventually(lambda: _true(clock.capacity() > 2 * busy_start), 10.0), (
                clock.capacity(),
                busy_start,
            )
            quiet = clock.capacity()
            # A busy moment again: its measurement does not lower what a quiet machine was measured to take.
            contended["on"] = True
            measured = passes[0]
            assert await eventually(lambda: _true(passes[0] > measured + 100), 10.0)  # two measurements, or more
            assert clock.capacity() >= 0.8 * quiet
            # While the clock is busy with sessions, it is not measured again: the ticks measure.
            for _ in range(200):
                clock.cost.add(clock.tick_s, 1.0, time.monotonic())
            await asyncio.sleep(0.3)  # a measurement begun before ends
            measured = passes[0]
            await asyncio.sleep(0.3)
            assert passes[0] == measured

    run(scenario(), timeout=60)


async def _true(value: bool) -> bool:
    return value


def test_a_measurement_that_fails_keeps_what_was_measured_and_the_next_one_is_taken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failing = {"on": False}

    def failed(batch: list[Any]) -> None:
        if failing["on"]:
            raise RuntimeError("the VAD failed")

    _hearing_measured(monkeypatch, failed)

    async def scenario() -> None:
        async with _measured_clock() as (clock, remeasuring):
            measured = clock.capacity()
            failing["on"] = True
            with caplog.at_level(logging.WARNING, "s2s_rt.listening.clock"):
                assert await eventually(lambda: _true(len(caplog.records) >= 3), 10.0)
            assert not remeasuring.done()  # it goes on, each minute
            assert clock.capacity() == pytest.approx(measured)
            failing["on"] = False
            count = len(clock._measured)
            assert await eventually(
                lambda: _true(len(clock._measured) > count or count == clock._measured.maxlen), 10.0
            )

    run(scenario(), timeout=60)
    assert "hearing could not be measured again (RuntimeError('the VAD failed'))" in caplog.records[0].getMessage()
