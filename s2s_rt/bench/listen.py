"""Listen mode: mostly listening sessions (or WebRTC calls), ramped up step by step; chunk-to-VAD-decision delay
and the knee."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from typing import Any

from s2s_rt.bench.metrics import MetricsDelta, server_figures
from s2s_rt.bench.procfs import Usage
from s2s_rt.bench.report import base_report, ms
from s2s_rt.bench.run import LoopLag, Run, pause, progress
from s2s_rt.bench.server import ServerHandle
from s2s_rt.bench.session import VAD_CHUNK_MS, SessionClient
from s2s_rt.bench.stats import percentile, summarize
from s2s_rt.speech_cache import Clip


def _listen_status(run: Run) -> str:
    recent = [d for s, d in run.probes[-2000:]]
    p99 = percentile(recent, 99)
    c = run.counts
    return (
        f"sessions {c['sessions_opened']} probes {len(run.probes)}"
        + ("" if p99 is None else f" recent probe p99 {p99 * 1000:.0f} ms")
        + f" turns {run.answered} errors {c['error_events']} foreign {c['foreign_events']}"
    )


async def listen_session(run: Run, url: str, index: int, start_delay: float, started: asyncio.Event) -> None:
    """A session that streams audio, probes its VAD delay in silence, and speaks now and then."""
    opts = run.opts
    await asyncio.sleep(start_delay)
    client = SessionClient(run, index, respond=opts.respond)
    try:
        ok = await client.open(url)
        started.set()
        if not ok:
            return
        assert client.mic is not None
        rng = random.Random(opts.seed * 1000 + index)
        next_turn = time.perf_counter() + rng.uniform(2.0, max(2.0, opts.turn_every_s))
        number = 0
        quiet_margin = 0.6  # no probe this close before a turn (the clear drops the prefix padding)
        while not run.stop.is_set() and not client.mic.closed:
            now = time.perf_counter()
            if now >= next_turn:
                turn = await client.speak(number, rng.randrange(len(run.clips)))
                number += 1
                if turn.failure and turn.failure.startswith("unanswered"):
                    break
                next_turn = time.perf_counter() + opts.turn_every_s * rng.uniform(0.5, 1.5)
                continue
            wait = min(opts.probe_every_s * rng.uniform(0.5, 1.5), next_turn - now)
            await pause(run, max(0.0, wait))
            if time.perf_counter() < next_turn - quiet_margin and client.turn is None:
                client.mic.probe_wanted = True
    finally:
        await client.close()


async def listen_call(run: Run, base_url: str, index: int, start_delay: float, started: asyncio.Event) -> None:
    """A WebRTC call that listens only: its microphone sends silence as a browser's does (Opus, 20 ms packets),
    and it probes its VAD delay over the data channel (``input_audio_buffer.clear`` → ``cleared``)."""
    from openai import APIStatusError

    from s2s_rt.bench.call import CallClient

    opts = run.opts
    await asyncio.sleep(start_delay)
    try:
        call = await CallClient.open(base_url, "unused", timeout=opts.open_timeout_s, dtx=opts.caller_dtx)
    except APIStatusError as exc:
        run.counts["rejections" if exc.status_code == 503 else "connect_failures"] += 1
        started.set()
        return
    except Exception as exc:
        run.fail("connect_failures", index, repr(exc))
        started.set()
        return
    run.counts["sessions_opened"] += 1
    started.set()
    rng = random.Random(opts.seed * 1000 + index)
    try:
        await call.next_event("session.created", opts.open_timeout_s)
        while not run.stop.is_set():
            await pause(run, opts.probe_every_s * rng.uniform(0.5, 1.5))
            if run.stop.is_set():
                break
            sent = time.perf_counter()
            call.send({"type": "input_audio_buffer.clear"})
            try:
                cleared = await call.next_event(("input_audio_buffer.cleared", "error"), 10)
            except TimeoutError:
                run.fail("lost_events", index, "a probe's input_audio_buffer.cleared did not come within 10 s")
                break
            if cleared["type"] == "error":
                run.fail("error_events", index, f"error: {cleared.get('error')}")
                break
            run.probes.append((sent, cleared["_received"] - sent))
        if call.pc.connectionState in ("failed", "closed"):
            run.counts["closed_by_server"] += 1
    except TimeoutError:
        run.fail("lost_events", index, "no session.created")
    finally:
        await call.close()


async def run_listen(opts: argparse.Namespace, server: ServerHandle, clips: list[Clip]) -> dict[str, Any]:
    """Listening-capacity mode: ramp up sessions and find the knee."""
    run = Run(opts, clips)
    background = [asyncio.create_task(run.metronome.run(), name="metronome")]
    lag = LoopLag()
    background.append(asyncio.create_task(lag.run(), name="client-lag"))
    sessions: list[asyncio.Task[None]] = []
    steps_out: list[dict[str, Any]] = []
    knee: int | None = None
    started = time.perf_counter()
    background.append(asyncio.create_task(progress(started, lambda: _listen_status(run), opts.quiet)))
    target = opts.target_ms / 1000
    rng = random.Random(opts.seed)
    failed_in_a_row = 0
    for n in opts.steps:
        add = n - len(sessions)
        opened = [asyncio.Event() for _ in range(add)]
        for k in range(add):
            idx = len(sessions)
            delay = rng.uniform(0, opts.ramp_s)
            sessions.append(
                asyncio.create_task(
                    listen_call(run, f"{server.http}/v1", idx, delay, opened[k])
                    if opts.transport == "webrtc"
                    else listen_session(run, server.url, idx, delay, opened[k])
                )
            )
        if opened:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), opts.ramp_s + 60)
        if not opts.quiet:
            print(
                f"step {n}: {run.counts['sessions_opened']} sessions open; warming up {opts.warmup_s:g} s",
                file=sys.stderr,
            )
        await pause(run, opts.warmup_s)
        m0, p0, c0, t0 = await server.metrics(), server.proc(), time.process_time(), time.perf_counter()
        usage = Usage(server.proc)
        turns_before = len(run.turns)
        failures_before = sum(run.counts.values()) - run.counts["sessions_opened"]
        await pause(run, opts.step_s)
        m1, p1, c1, t1 = await server.metrics(), server.proc(), time.process_time(), time.perf_counter()
        probes = [d for s, d in run.probes if t0 <= s <= t1]
        step_turns = [t for t in run.turns[turns_before:] if t.eos is not None and t.eos <= t1]
        started_d = [t.started_decision for t in step_turns if t.started_decision is not None]
        stopped_d = [t.stopped_decision for t in step_turns if t.stopped_decision is not None]
        srv = server_figures(MetricsDelta(m0, m1), p0, p1, t1 - t0)
        failures = sum(run.counts.values()) - run.counts["sessions_opened"] - failures_before
        p99 = percentile(probes, 99)
        passed = p99 is not None and p99 <= target and failures == 0
        vad_calls = srv["stage_seconds"]["vad"]["count"]
        chunks_per_s = run.counts["sessions_opened"] * 1000 / VAD_CHUNK_MS
        step = {
            "sessions": run.counts["sessions_opened"],
            "vad_calls_per_s": vad_calls / (t1 - t0),
            "vad_chunks_per_call": chunks_per_s * (t1 - t0) / vad_calls if vad_calls else None,
            "target_sessions": n,
            "probe_delay_s": summarize(probes),
            "speech_started_decision_s": summarize(started_d),
            "speech_stopped_decision_s": summarize(stopped_d),
            "transcription_after_stop_s": summarize(
                [t.transcribed - t.speech_stopped for t in step_turns if t.transcribed and t.speech_stopped]
            ),
            "turns": len(step_turns),
            "failures": failures,
            "server": srv,
            "client": {
                "cpu_cores_busy": (c1 - c0) / (t1 - t0),
                "loop_lag_s": summarize(lag.between(t0, t1)),
            },
            "cpu": usage.figures(),
            "passed": passed,
        }
        steps_out.append(step)
        if not opts.quiet:
            print(_listen_step_line(step), file=sys.stderr)
        failed_in_a_row = 0 if passed else failed_in_a_row + 1
        if passed:
            knee = step["sessions"]
        elif failed_in_a_row >= opts.stop_after_failed_steps and not opts.keep_going:
            break
        if run.counts["rejections"] or run.counts["connect_failures"]:
            break
    run.stop.set()
    await asyncio.gather(*sessions, return_exceptions=True)
    for t in background:
        t.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    report = base_report(opts, run, server, time.perf_counter() - started)
    report["settings"] |= {
        "steps": opts.steps,
        "step_s": opts.step_s,
        "warmup_s": opts.warmup_s,
        "turn_every_s": opts.turn_every_s,
        "probe_every_s": opts.probe_every_s,
        "respond": opts.respond,
        "target_ms": opts.target_ms,
        "transport": opts.transport,
    }
    report["steps"] = steps_out
    report["knee_sessions"] = knee
    # A failed step is the measurement, not a failure of the run.
    report["ok"] = not any(
        run.counts[k] for k in ("foreign_events", "unexpected_events", "connect_failures", "rejections")
    )
    return report


def _listen_step_line(step: dict[str, Any]) -> str:
    pr = step["probe_delay_s"]
    lag = step["server"]["loop_lag"]
    cpu = step["server"].get("cpu_cores_busy")
    return (
        f"  {step['sessions']:4d} sessions: probe p50 {ms(pr['p50'])} p99 {ms(pr['p99'])} (n={pr['n']}),"
        f" speech_started p99 {ms(step['speech_started_decision_s']['p99'])},"
        f" server loop lag p99 {ms(lag['p99'])}, server CPU {cpu if cpu is None else f'{cpu:.2f}'} cores,"
        f" failures {step['failures']} → {'ok' if step['passed'] else 'OVER'}"
    )
