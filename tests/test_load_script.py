"""The load script (``bin/s2s-rt-load``) against a fake-stack server, for a few seconds.

It must report every turn it played, with every interval, and it must notice
an event that belongs to another session: a proxy between it and the server
copies one session's event into another session's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from conftest import live_server, run
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from s2s_rt.bench.cli import parse_args, run_async
from s2s_rt.bench.turn import INTERVALS

ROOT = Path(__file__).resolve().parent.parent
#: Short turns: tone questions (the fake stack's own TTS), 300 ms of silence ends a turn.
QUICK = ["--speech", "tone", "--silence-ms", "300", "--pause-s", "0.2", "--ramp-s", "0.3", "--quiet"]
TURN_TIMES = ("speech_sent", "speech_started", "speech_stopped", "committed", "transcribed")
RESPONSE_TIMES = ("response_created", "first_audio", "response_done")


def test_load_script_answers_every_turn_and_reports_every_interval(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(ROOT / "bin" / "s2s-rt-load"), "--spawn", "--stack", "fake"]
    argv += ["--sessions", "3", "--turns", "2", "--json", str(out), "--speech-cache", str(tmp_path / "speech"), *QUICK]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())

    assert report["ok"] is True
    counts = report["counts"]
    assert counts["sessions_opened"] == 3
    assert counts["turns_planned"] == counts["turns_answered"] == 6
    for key in ("foreign_events", "lost_events", "unanswered_turns", "rejections", "error_events"):
        assert counts[key] == 0, key
    assert len(report["turns"]) == 6
    for turn in report["turns"]:
        assert turn["status"] == "completed" and turn["failure"] is None
        assert turn["transcript"].startswith("heard ")
        times = turn["times_from_end_of_speech_s"]
        assert all(times[name] is not None for name in TURN_TIMES + RESPONSE_TIMES), times
        assert times["speech_sent"] < 0 < times["speech_stopped"] <= times["first_audio"] <= times["response_done"]
    for label, _, _ in INTERVALS:
        stats = report["intervals_s"][label]
        assert stats["n"] == 6 and stats["p50"] is not None and stats["p99"] >= stats["p50"], label
    # The turn ends no sooner than the silence the session asked for.
    assert report["intervals_s"]["end of speech → speech_stopped"]["p50"] >= 0.3
    assert report["settings"]["silence_duration_ms"] == 300
    server = report["server"]
    assert server["cpu_s"] > 0 and server["rss_mb_after"] > 0 and server["messages_per_s"] > 0
    assert server["loop_lag"]["count"] > 0
    assert "END OF SPEECH → FIRST AUDIO DELTA" in done.stdout


#: Passes one server message on to the load script: (which connection, the message, every connection so far).
Forward = Callable[[int, str, list[ServerConnection]], Awaitable[None]]


@asynccontextmanager
async def relay(upstream: str, forward: Forward) -> AsyncIterator[str]:
    """A relay between the load script and ``upstream``; ``forward`` sends each server message on."""
    downstream: list[ServerConnection] = []

    async def connection(down: ServerConnection) -> None:
        index = len(downstream)
        downstream.append(down)
        async with connect(upstream, max_size=None) as up:

            async def to_server() -> None:
                async for message in down:
                    await up.send(message)

            async def to_client() -> None:
                async for message in up:
                    await forward(index, str(message), downstream)

            tasks = [asyncio.create_task(to_server()), asyncio.create_task(to_client())]
            with contextlib.suppress(ConnectionClosed):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async with serve(connection, "127.0.0.1", 0, max_size=None) as proxy:
        port = proxy.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/realtime"


@asynccontextmanager
async def injecting_proxy(upstream: str) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A relay that copies the first session's first transcript into the second session."""
    injected = asyncio.Event()

    async def forward(index: int, message: str, downstream: list[ServerConnection]) -> None:
        await downstream[index].send(message)
        event: dict[str, Any] = json.loads(message)
        transcript = event["type"] == "conversation.item.input_audio_transcription.completed"
        if index == 0 and transcript and len(downstream) > 1 and not injected.is_set():
            with contextlib.suppress(ConnectionClosed):
                await downstream[1].send(message)
                injected.set()

    async with relay(upstream, forward) as url:
        yield url, injected


def test_load_script_fails_on_an_event_from_another_session(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server:
            async with injecting_proxy(f"ws://127.0.0.1:{server.port}/v1/realtime") as (url, injected):
                argv = ["--url", url, "--sessions", "2", "--turns", "2", *QUICK]
                report = await run_async(parse_args([*argv, "--speech-cache", str(tmp_path)]))
        assert injected.is_set(), "the proxy found no moment to inject"
        assert report["ok"] is False
        assert report["counts"]["foreign_events"] == 1
        (failure,) = [f for f in report["failures"] if f["kind"] == "foreign_events"]
        assert failure["session"] == 1
        assert "conversation.item.input_audio_transcription.completed" in failure["detail"]
        assert "session 0's" in failure["detail"]
        # The foreign event changed nothing else: every turn still got its own answer.
        assert report["counts"]["turns_answered"] == 4

    run(scenario(), timeout=60)


def test_load_script_counts_rejections_when_the_pool_is_full(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            argv = ["--url", f"ws://127.0.0.1:{server.port}/v1/realtime", "--sessions", "2", "--turns", "1"]
            argv += [*QUICK, "--ramp-s", "0", "--speech-cache", str(tmp_path)]
            report = await run_async(parse_args(argv))
        assert report["counts"]["rejections"] == 1
        assert report["counts"]["turns_answered"] == 1
        assert report["ok"] is False

    run(scenario(), timeout=60)


def test_load_script_counts_questions_cut_off_in_their_pause(tmp_path: Path) -> None:
    """Paused questions (0.7-1.0 s mid-sentence): 300 ms of silence ends every turn in its pause; 1.5 s never does."""

    def cut_off(*turn_detection: str) -> dict[str, Any]:
        out = tmp_path / "report.json"
        argv = [sys.executable, str(ROOT / "bin" / "s2s-rt-load"), "--spawn", "--stack", "fake", "--paused"]
        argv += ["--sessions", "1", "--turns", "2", "--json", str(out), "--speech-cache", str(tmp_path / "speech")]
        argv += [*QUICK, *turn_detection]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        report: dict[str, Any] = json.loads(out.read_text())
        assert report["settings"]["paused_speech"] is True
        assert report["counts"]["turns_answered"] == 2
        return report

    eager = cut_off()
    assert eager["cut_off_turns"] == 2
    patient = cut_off("--silence-ms", "1500")
    assert patient["cut_off_turns"] == 0
    semantic = cut_off("--turn-detection", "semantic_vad", "--eagerness", "high")
    assert semantic["settings"]["turn_detection"] == "semantic_vad"
    # The fake model finds every pause a finished question: semantic_vad ends each turn at its shortest wait.
    assert semantic["cut_off_turns"] == 2


def test_load_script_hears_the_silence_inside_an_answer(tmp_path: Path) -> None:
    """A relay holds each answer's second audio delta until 0.3 s after the first delta's audio has played out:
    a listener hears 0.3 s of silence inside every answer, and the report says so."""
    hold_s = 0.3
    held: list[float] = []
    deltas = 0
    first = (0.0, 0.0)  # the answer's first delta: its audio's seconds, when it was passed on

    async def forward(index: int, message: str, downstream: list[ServerConnection]) -> None:
        nonlocal deltas, first
        event: dict[str, Any] = json.loads(message)
        if event["type"] == "response.created":
            deltas = 0
        elif event["type"] == "response.output_audio.delta":
            deltas += 1
            if deltas == 1:
                # base64 of 16-bit samples at 24 kHz
                first = (len(event["delta"]) * 3 / 4 / 2 / 24_000, time.perf_counter())
            elif deltas == 2:
                seconds, at = first
                await asyncio.sleep(max(0.0, at + seconds + hold_s - time.perf_counter()))
                held.append(seconds)
        await downstream[index].send(message)

    async def scenario() -> dict[str, Any]:
        async with live_server(pool_size=1) as server:
            async with relay(f"ws://127.0.0.1:{server.port}/v1/realtime", forward) as url:
                argv = ["--url", url, "--sessions", "1", "--turns", "2", *QUICK]
                return await run_async(parse_args([*argv, "--speech-cache", str(tmp_path)]))

    report = run(scenario(), timeout=60)
    assert len(held) == 2, "each answer should come in more than one audio delta"
    assert report["counts"]["turns_answered"] == 2
    gaps = report["answer_gaps"]
    assert gaps["turns"] == gaps["turns_with_a_gap"] == 2
    for turn in report["turns"]:
        assert turn["answer_gaps"] >= 1
        assert hold_s - 0.05 <= turn["answer_gap_s"] <= hold_s + 0.25, turn["answer_gap_s"]


def test_load_script_sends_slower_than_real_time_and_the_server_decides_the_same(tmp_path: Path) -> None:
    """``--slower 3``: the same audio, three times slower. The turn ends at the same sample (the fake recogniser
    says how much it heard), and the wall time from the end of speech to the turn's end is about three times."""

    def talk(slower: str) -> dict[str, Any]:
        out = tmp_path / f"report-{slower}.json"
        argv = [sys.executable, str(ROOT / "bin" / "s2s-rt-load"), "--spawn", "--stack", "fake", "--slower", slower]
        argv += ["--sessions", "1", "--turns", "1", "--json", str(out), "--speech-cache", str(tmp_path / "speech")]
        # Silence before the question for the prefix padding to take whole at both paces (the pause is wall time).
        argv += [*QUICK, "--pause-s", "1.5"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        report: dict[str, Any] = json.loads(out.read_text())
        assert report["settings"]["slower"] == float(slower)
        [turn] = report["turns"]
        return turn

    real, slow = talk("1"), talk("3")
    # "heard 1340 ms crc ...": as much audio heard (where the question falls among the chunks can differ).
    assert real["transcript"].split(" crc ")[0] == slow["transcript"].split(" crc ")[0], (real, slow)
    waited = [t["intervals_s"]["end of speech → speech_stopped"] for t in (real, slow)]
    assert 2.0 < waited[1] / waited[0] < 4.0, waited


def test_transports_mode_measures_a_phone_call_beside_websocket_and_webrtc(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(ROOT / "bin" / "s2s-rt-load"), "--mode", "transports", "--spawn", "--stack", "fake"]
    argv += ["--turns", "2", "--sessions", "2", "--step-s", "2", "--json", str(out)]
    argv += ["--speech-cache", str(tmp_path / "speech"), *QUICK]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    kinds = [t["transport"] for t in report["turns"]]
    assert sorted(kinds) == ["sip", "sip", "webrtc", "webrtc", "websocket", "websocket"]
    for kind in ("websocket", "webrtc", "sip"):
        latency = report[kind]["eos_to_first_audio_s"]
        # Heard after the end of speech, past the turn's silence (300 ms) and before a second has gone by.
        assert latency["n"] == 2 and 0.3 <= latency["p50"] < 1.5, (kind, latency)
        idle = report[kind]["idle_server_cores_per_session"]
        assert len(idle) == 2 and all(v is not None and v > 0 for v in idle), (kind, idle)


def test_listen_mode_over_webrtc_probes_each_calls_vad_delay(tmp_path: Path) -> None:
    """Calls per process are measured as listening sessions are: silent calls ramped up, each probing its
    VAD decision delay over the data channel."""
    out = tmp_path / "report.json"
    argv = [sys.executable, str(ROOT / "bin" / "s2s-rt-load"), "--mode", "listen", "--transport", "webrtc"]
    argv += ["--spawn", "--stack", "fake", "--steps", "2,4", "--step-s", "3", "--warmup-s", "1"]
    argv += ["--probe-every-s", "0.3", "--json", str(out), "--speech-cache", str(tmp_path / "speech"), *QUICK]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["settings"]["transport"] == "webrtc", report["counts"]
    assert [s["sessions"] for s in report["steps"]] == [2, 4]
    for step in report["steps"]:
        probes = step["probe_delay_s"]
        # About one probe per call every 0.3 s over 3 s, each answered after the call's audio before it is heard.
        assert probes["n"] >= 3 * step["sessions"], probes
        assert 0 < probes["p50"] < 0.5, probes
        assert step["failures"] == 0 and step["server"]["cpu_cores_busy"] > 0, step
