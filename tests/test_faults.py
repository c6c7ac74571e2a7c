"""Faults and abuse: each ends in a clear signal to its client, and nobody else notices."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import time

import pytest
from conftest import RealtimeClient, eventually, http_get, live_server, run, silence, tone
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from s2s_rt.protocol import session as session_module


async def _turn_s(c: RealtimeClient, text: str) -> float:
    """Seconds from asking to a completed answer."""
    started = time.perf_counter()
    done = await c.say_text(text)
    assert done["response"]["status"] == "completed", done["response"]
    return time.perf_counter() - started


def test_llm_failure_fails_the_response_and_the_next_turn_works() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("[[fail]] break please")
                assert done["response"]["status"] == "failed"
                assert done["response"]["status_details"]["error"]["code"] == "llm_failed"
                assert (await c.until("error"))["error"]["code"] == "llm_failed"
                again = await c.say_text("and now")
                assert again["response"]["status"] == "completed"

    run(scenario())


def test_tts_failure_fails_the_response_and_the_next_turn_works() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("say [[tts-fail]] now")
                assert done["response"]["status"] == "failed"
                assert done["response"]["status_details"]["error"]["code"] == "tts_failed"
                assert (await c.say_text("fine"))["response"]["status"] == "completed"

    run(scenario())


def test_stt_failure_sends_transcription_failed_and_the_next_turn_works() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"input_audio_transcription": {"prompt": "[[fail]]"}})
                await c.append_audio(tone(440, 0.5) + silence(0.7))
                failed = await c.until("conversation.item.input_audio_transcription.failed")
                assert "failed" in failed["error"]["message"]
                await c.send("session.update", session={"input_audio_transcription": {"prompt": ""}})
                await c.append_audio(tone(440, 0.5) + silence(0.7))
                await c.until("conversation.item.input_audio_transcription.completed")
                assert (await c.until("response.done"))["response"]["status"] == "completed"

    run(scenario())


def test_a_bug_in_a_stage_ends_that_session_alone_with_1011_and_the_slot_serves_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_prompt = session_module.Session.prompt

    def crashing_prompt(self, r):  # type: ignore[no-untyped-def]
        msgs = real_prompt(self, r)
        if any("crash the stage" in m.content for m in msgs):
            raise RuntimeError("injected bug in the LLM stage")
        return msgs

    monkeypatch.setattr(session_module.Session, "prompt", crashing_prompt)

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("crash the stage")
                with pytest.raises(ConnectionClosed):
                    while True:
                        await c.recv()
                assert c.ws.close_code == 1011
                # The response ends (failed) before the session's error: nothing is left open.
                done = c.of_type("response.done")
                assert len(done) == 1 and done[0]["response"]["status"] == "failed"
                assert c.of_type("error")[-1]["error"]["code"] == "session_failed"
            metrics = (await http_get(server, "/metrics"))[1]
            # The session's failure is its own: the stage went on, it was not restarted.
            assert "s2s_stage_restarts_total 1" not in metrics
            assert 's2s_errors_total{code="session_failed"} 1' in metrics

            async def served() -> bool:
                async with RealtimeClient.connect(server) as again:
                    first = await again.recv()
                    if first["type"] != "session.created":
                        return False
                    return (await again.say_text("after the crash"))["response"]["status"] == "completed"

            assert await eventually(served, 3.0)

    run(scenario())


def test_hung_engine_call_fails_by_deadline_is_counted_and_does_not_starve_others() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=3, stage_workers=1, llm_timeout_s=0.5) as server:
            async with RealtimeClient.connect(server) as stuck, RealtimeClient.connect(server) as other:
                quiet = await _turn_s(other, "quick")
                block_s = 4.0
                t0 = time.monotonic()
                done = await stuck.say_text(f"[[block {block_s * 1000:.0f}]] hang")
                assert done["response"]["status"] == "failed"
                assert done["response"]["status_details"]["error"]["code"] == "llm_timeout"
                assert time.monotonic() - t0 < block_s / 2, "failed by its deadline, not when the call returned"
                metrics = (await http_get(server, "/metrics"))[1]
                assert "s2s_inference_calls_overdue 1" in metrics
                # The only LLM worker is still stuck, yet another session gets its answer as quickly as before.
                stuck_meanwhile = await _turn_s(other, "quick")
                assert "s2s_inference_calls_overdue 1" in (await http_get(server, "/metrics"))[1]
                assert stuck_meanwhile < 3 * quiet + 0.25, (quiet, stuck_meanwhile)

    run(scenario())


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_client_that_stops_reading_is_closed_with_1008_and_others_are_unaffected() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, send_timeout_s=1.0) as server:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            async with RealtimeClient.connect(server) as other:
                before = [await _turn_s(other, "ping") for _ in range(3)]
                async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", sock=sock, max_queue=1) as lazy:
                    await lazy.send(
                        json.dumps(
                            {
                                "type": "session.update",
                                "session": {
                                    "output_modalities": ["audio"],
                                    "audio": {"output": {"format": {"type": "audio/pcm", "rate": 48000}}},
                                },
                            }
                        )
                    )
                    words = " ".join(f"word{i}." for i in range(400))
                    await lazy.send(
                        json.dumps(
                            {
                                "type": "conversation.item.create",
                                "item": {
                                    "type": "message",
                                    "role": "user",
                                    "content": [{"type": "input_text", "text": words}],
                                },
                            }
                        )
                    )
                    rss_before = _rss_mb()
                    await lazy.send(json.dumps({"type": "response.create"}))
                    # The lazy client never reads. Meanwhile the other session is measured.
                    during = [await _turn_s(other, "ping") for _ in range(5)]

                    async def told_to_go() -> bool:
                        metrics = (await http_get(server, "/metrics"))[1]
                        return 's2s_errors_total{code="client_not_reading"} 1' in metrics

                    assert await eventually(told_to_go, 15.0), "the lazy client was not closed"
                    # It reads again at last (within the second the server waits for it to answer the
                    # close): after what was sent before, the close frame says why it was closed.
                    with pytest.raises(ConnectionClosed):
                        while True:
                            await asyncio.wait_for(lazy.recv(), 5)
                    assert lazy.close_code == 1008, (lazy.close_code, lazy.close_reason)
                    assert "not reading" in lazy.close_reason

                    async def freed() -> bool:
                        pool = json.loads((await http_get(server, "/v1/pool"))[1])
                        return pool["states"]["idle"] == 1

                    assert await eventually(freed, 5.0), "the lazy client's slot was not freed"
                    assert _rss_mb() - rss_before < 50
                p50_before, p50_during = sorted(before)[1], sorted(during)[2]
                assert p50_during < p50_before * 3 + 0.05, (before, during)

    run(scenario())


def test_input_buffer_cap_refuses_the_excess_with_an_error() -> None:
    async def scenario() -> None:
        async with live_server(max_input_buffer_s=2.0) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send("session.update", session={"turn_detection": None})
                await c.append_audio(tone(440, 3.0), chunk_bytes=48_000)
                err = await c.until("error")
                assert err["error"]["code"] == "input_audio_buffer_full"
                await c.send("input_audio_buffer.commit")
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                assert heard["transcript"].startswith("heard 2000 ms")

    run(scenario())


def test_event_rate_limit_refuses_excess_events_with_one_counted_notice_a_second() -> None:
    async def scenario() -> None:
        async with live_server(max_events_per_s=50, max_events_burst=20) as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                for i in range(100):
                    await c.send("session.update", event_id=f"e{i}", session={"instructions": f"n{i}"})
                await c.send("conversation.item.retrieve", item_id="nope", event_id="last")
                await asyncio.sleep(1.1)  # the next refusal after a second is counted in a new notice
                await c.send("conversation.item.retrieve", item_id="nope", event_id="probe")
                updated, notices, counted, last = 0, [], 0, 0
                while True:
                    e = await c.recv()
                    if e["type"] == "session.updated":
                        updated += 1
                    elif e["type"] == "error" and e["error"]["code"] == "rate_limit_exceeded":
                        notices.append(e)
                        counted += int(re.search(r"(\d+) event\(s\) were not processed", e["error"]["message"])[1])
                    elif e["type"] == "error" and e["error"]["event_id"] == "last":
                        last = 1
                    elif e["type"] == "error" and e["error"]["event_id"] == "probe":
                        break
                # Nothing silent: every event was processed or counted as refused…
                assert updated >= 20 and updated + last + counted == 101
                # …but the refusals cost one notice, not one event each.
                assert len(notices) <= 2

    run(scenario())


def test_half_open_connections_time_out_and_do_not_block_real_clients() -> None:
    async def scenario() -> None:
        async with live_server(open_timeout_s=0.5) as server:
            loop = asyncio.get_running_loop()
            idle = []
            for _ in range(50):
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", server.port))
                idle.append(s)
            async with RealtimeClient.connect(server) as c:
                assert (await c.say_text("through"))["response"]["status"] == "completed"
            await asyncio.sleep(1.0)
            closed = 0
            for s in idle:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(s, 100), 1.0)
                    closed += data == b""
                except (TimeoutError, ConnectionError):
                    closed += 1
                s.close()
            assert closed == 50

    run(scenario())


def test_per_address_connection_limit() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=4, max_connections_per_ip=2) as server:
            async with RealtimeClient.connect(server) as a, RealtimeClient.connect(server) as b:
                await a.until("session.created")
                await b.until("session.created")
                async with RealtimeClient.connect(server) as c:
                    err = await c.recv()
                    assert err["error"]["code"] == "too_many_connections"
                    with pytest.raises(ConnectionClosed):
                        await c.recv()
                    assert c.ws.close_code == 1008

    run(scenario())


@pytest.mark.parametrize(
    ("limits", "why"), [({"max_session_s": 1.0}, "maximum duration"), ({"idle_session_s": 0.5}, "idle")]
)
def test_session_expiry_sends_session_expired_then_1001(limits: dict, why: str) -> None:
    async def scenario() -> None:
        async with live_server(**limits) as server:
            async with RealtimeClient.connect(server) as c:
                await c.until("session.created")
                if "max_session_s" in limits:
                    for _ in range(4):  # an active client still expires
                        await c.send("session.update", session={"instructions": "busy"})
                        await asyncio.sleep(0.15)
                err = await c.until("error", timeout=5)
                assert err["error"]["code"] == "session_expired" and why in err["error"]["message"]
                with pytest.raises(ConnectionClosed):
                    while True:
                        await c.recv()
                assert c.ws.close_code == 1001

    run(scenario())
