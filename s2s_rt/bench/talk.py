"""Talk mode (the default): sessions speak questions and wait for each answer; latency per turn."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from s2s_rt.bench.metrics import MetricsDelta, server_figures
from s2s_rt.bench.procfs import Usage
from s2s_rt.bench.report import base_report
from s2s_rt.bench.run import LoopLag, Run, pause, progress
from s2s_rt.bench.server import ServerHandle, turn_log_breakdown
from s2s_rt.bench.session import SessionClient
from s2s_rt.bench.stats import percentile, summarize
from s2s_rt.bench.turn import INTERVALS, Turn
from s2s_rt.speech_cache import Clip
from s2s_rt.wer import word_error_rate


async def talk_session(run: Run, url: str, index: int, start_delay: float) -> None:
    opts = run.opts
    await asyncio.sleep(start_delay)
    rng = random.Random(opts.seed * 1000 + index)
    per_connection = opts.turns_per_connection or opts.turns
    client: SessionClient | None = None
    try:
        for m in range(opts.turns):
            if client is None or m % per_connection == 0:
                if client is not None:
                    await client.close()
                client = SessionClient(run, index, respond=True)
                if not await client.open(url):
                    return
            await pause(run, opts.pause_s * rng.uniform(0.5, 1.5) + opts.prefix_padding_ms / 1000)
            if run.stop.is_set() or client.ws is None or client.mic is None or client.mic.closed:
                break
            turn = await client.speak(m, (index + m) % len(run.clips))
            if turn.failure and turn.failure.startswith("unanswered"):
                break  # the session's state is unknown now: later events could not be attributed
    finally:
        if client is not None:
            await client.close()


def _talk_status(run: Run, total: int) -> str:
    lat = [t.first_audio - t.eos for t in run.turns if t.first_audio and t.eos and t.failure is None]
    p50 = percentile(lat, 50)
    c = run.counts
    return (
        f"sessions {c['sessions_opened']} turns {run.answered}/{total}"
        + ("" if p50 is None else f" eos→audio p50 {p50 * 1000:.0f} ms")
        + f" rejected {c['rejections']} errors {c['error_events']} foreign {c['foreign_events']}"
        f" lost {c['lost_events'] + c['unanswered_turns']}"
    )


async def run_talk(opts: argparse.Namespace, server: ServerHandle, clips: list[Clip]) -> dict[str, Any]:
    """Talk mode: returns the report."""
    run = Run(opts, clips)
    tasks = [asyncio.create_task(run.metronome.run(), name="metronome")]
    lag = LoopLag()
    tasks.append(asyncio.create_task(lag.run(), name="client-lag"))
    m0, p0, c0 = await server.metrics(), server.proc(), time.process_time()
    usage = Usage(server.proc)
    started = time.perf_counter()
    total = opts.sessions * opts.turns
    tasks.append(asyncio.create_task(progress(started, lambda: _talk_status(run, total), opts.quiet)))
    rng = random.Random(opts.seed)
    sessions = [
        asyncio.create_task(talk_session(run, server.url, i, rng.uniform(0, opts.ramp_s))) for i in range(opts.sessions)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*sessions), opts.max_duration_s)
    except TimeoutError:
        run.stop.set()
        run.fail("unanswered_turns", -1, f"the run exceeded --max-duration-s {opts.max_duration_s:g}")
        for s in sessions:
            s.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
    ended = time.perf_counter()
    m1, p1, c1 = await server.metrics(), server.proc(), time.process_time()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if not opts.quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    seconds = ended - started
    report = base_report(opts, run, server, seconds)
    good = [t for t in run.turns if t.failure is None and t.done.is_set()]
    intervals = {
        label: summarize([v for t in good if (v := t.interval(a, b)) is not None]) for label, a, b in INTERVALS
    }
    intervals["VAD decision: speech_started (chunk sent → event)"] = summarize(
        [t.started_decision for t in good if t.started_decision is not None]
    )
    intervals["VAD decision: speech_stopped (chunk sent → event)"] = summarize(
        [t.stopped_decision for t in good if t.stopped_decision is not None]
    )
    report["intervals_s"] = intervals
    report["turns"] = [t.record() for t in run.turns]
    wers = [word_error_rate(t.question, t.transcript) for t in good if t.transcript is not None]
    report["transcript_wer_mean"] = sum(wers) / len(wers) if wers else None
    # Latency by position in the conversation: the LLM re-reads a longer history every turn.
    per_connection = opts.turns_per_connection or opts.turns
    by_position: dict[int, list[float]] = {}
    for turn in good:
        if turn.first_audio is not None and turn.eos is not None:
            by_position.setdefault(turn.index % per_connection, []).append(turn.first_audio - turn.eos)
    report["end_of_speech_to_first_audio_by_turn_in_conversation"] = {
        str(k + 1): summarize(v) for k, v in sorted(by_position.items())
    }
    report["contention"] = _contention(good)
    # A question cut in two: the turn ended in its pause (a second speech_started within it).
    report["cut_off_turns"] = sum(1 for t in run.turns if t.segments > 1)
    # Silences a listener hears inside an answer: its audio ran out before more came.
    heard = [t for t in good if t.first_audio is not None]
    report["answer_gaps"] = {
        "turns": len(heard),
        "turns_with_a_gap": sum(1 for t in heard if t.gaps),
        "gaps": sum(t.gaps for t in heard),
        "gap_s_per_turn": summarize([t.gap_s for t in heard]),
    }
    srv = server_figures(MetricsDelta(m0, m1), p0, p1, seconds)
    if "cpu_s" in srv:
        srv["cpu_s_per_turn"] = srv["cpu_s"] / len(good) if good else None
        srv["cpu_s_per_session_second"] = srv["cpu_s"] / seconds / max(1, run.counts["sessions_opened"])
    report["server"] = srv
    report["client"] = _client_figures(run, lag, c1 - c0, started, ended)
    report["cpu"] = usage.figures()
    report["server_turn_log_s"] = turn_log_breakdown(server.log_path)
    return report


def _contention(turns: list[Turn]) -> dict[str, Any]:
    """Did turns of different sessions have inference in flight at the same time?

    A turn's inference window runs from its ``speech_stopped`` (STT starts)
    to its ``response.done`` (the last TTS piece). With one copy of each
    model and a few cores, overlapping windows share the cores: a turn whose
    window overlaps another's waited, at least in part, for that inference.
    """
    windows = [
        (t.session, t.speech_stopped, t.response_done)
        for t in turns
        if t.speech_stopped is not None and t.response_done is not None
    ]
    overlapped: list[float] = []
    alone: list[float] = []
    for t in turns:
        if t.speech_stopped is None or t.response_done is None or t.first_audio is None or t.eos is None:
            continue
        a, b = t.speech_stopped, t.first_audio
        hit = any(s != t.session and ws_ < b and we > a for s, ws_, we in windows)
        (overlapped if hit else alone).append(t.first_audio - t.eos)
    return {
        "turns_overlapping_another_sessions_inference": len(overlapped),
        "turns_alone": len(alone),
        "end_of_speech_to_first_audio_overlapped": summarize(overlapped),
        "end_of_speech_to_first_audio_alone": summarize(alone),
    }


def _client_figures(run: Run, lag: LoopLag, cpu_s: float, t0: float, t1: float) -> dict[str, Any]:
    lateness = run.metronome.lateness
    return {
        "cpu_s": cpu_s,
        "cpu_cores_busy": cpu_s / (t1 - t0) if t1 > t0 else None,
        "loop_lag_s": summarize(lag.between(t0, t1)),
        "send_lateness_s": summarize(lateness[-200_000:]),
        "appends_sent": len(lateness),
        # Sessions whose socket stopped draining (the server did not read their audio in time).
        "sessions_stalled_by_server": sum(1 for m in run.metronome.every if m.stalls),
        "stalled_ticks": sum(m.stalls for m in run.metronome.every),
    }
