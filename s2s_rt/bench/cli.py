"""``s2s-rt bench``: the command line, and which mode runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from s2s_rt.bench.copies import run_copies
from s2s_rt.bench.listen import run_listen
from s2s_rt.bench.memory import run_memory
from s2s_rt.bench.report import format_report
from s2s_rt.bench.server import ServerHandle, server_env
from s2s_rt.bench.suite import SUITE, run_suite
from s2s_rt.bench.talk import run_talk
from s2s_rt.speech_cache import load_paused_questions, load_questions

INSTRUCTIONS = "You are a helpful voice assistant. Answer in one short sentence."


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="s2s-rt bench",
        description="Load a Realtime server with spoken sessions; report latency per turn, capacity and memory.",
    )
    p.add_argument("--mode", choices=["talk", "listen", "memory", "copies", "suite", "transports"], default="talk")
    target = p.add_argument_group("server")
    target.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="a running server")
    target.add_argument("--pid", type=int, help="the running server's PID, for CPU and RSS from /proc")
    target.add_argument("--spawn", action="store_true", help="start the server here (python -m s2s_rt serve)")
    target.add_argument("--stack", choices=["default", "fake"], default="default", help="with --spawn")
    target.add_argument("--pool-size", type=int, help="with --spawn (default: enough for every session)")
    target.add_argument(
        "--server-env", action="append", default=[], metavar="K=V", help="environment for the spawned server"
    )
    target.add_argument("--server-arg", action="append", default=[], help="extra argument to `serve`")
    target.add_argument("--server-log", help="where the spawned server's log goes (default: a temp file)")
    target.add_argument(
        "--sip-port", type=int, help="the server's SIP port, for phone calls in transports mode (with --spawn: chosen)"
    )
    load = p.add_argument_group("load")
    load.add_argument("--sessions", type=int, default=1, help="concurrent sessions (talk)")
    load.add_argument("--turns", type=int, default=20, help="spoken turns per session (talk)")
    load.add_argument(
        "--turns-per-connection",
        type=int,
        help="reconnect (a new conversation) after this many turns; default: all turns in one conversation",
    )
    load.add_argument("--silence-ms", type=int, default=500, help="server_vad silence_duration_ms")
    load.add_argument("--prefix-padding-ms", type=int, default=300)
    load.add_argument("--threshold", type=float, default=0.5)
    load.add_argument("--chunk-ms", type=int, default=20, help="audio per append")
    load.add_argument(
        "--slower",
        type=float,
        default=1.0,
        help="send the audio this many times slower than real time: the server's decisions (turn ends, transcripts)"
        " as a machine this much faster makes them, on a slow one; its latencies are then not a user's",
    )
    load.add_argument("--pause-s", type=float, default=1.0, help="silence between an answer and the next question")
    load.add_argument("--ramp-s", type=float, default=2.0, help="sessions start at random moments within this")
    load.add_argument(
        "--speech", default="piper", help="who speaks the questions: piper, tone, flite:NAME or espeak-ng:NAME"
    )
    load.add_argument(
        "--paused", action="store_true", help="questions with a 0.7-1.0 s pause mid-sentence (counts cut-offs)"
    )
    load.add_argument("--turn-detection", choices=["server_vad", "semantic_vad"], default="server_vad")
    load.add_argument("--eagerness", choices=["low", "medium", "high", "auto"], default="auto", help="semantic_vad")
    load.add_argument("--instructions", default=INSTRUCTIONS)
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy, the same answers every run")
    load.add_argument("--language", default="en", help="transcription language ('' to let the server detect)")
    load.add_argument("--turn-timeout-s", type=float, default=60.0)
    load.add_argument("--open-timeout-s", type=float, default=30.0)
    load.add_argument("--max-duration-s", type=float, default=3600.0)
    load.add_argument("--seed", type=int, default=1)
    lis = p.add_argument_group("listen mode")
    lis.add_argument("--steps", default="10,25,50,75,100,150,200,300", help="session counts to ramp through")
    lis.add_argument("--step-s", type=float, default=20.0, help="measured seconds per step")
    lis.add_argument("--warmup-s", type=float, default=5.0, help="seconds after a step's sessions open")
    lis.add_argument("--turn-every-s", type=float, default=30.0, help="mean seconds between a session's questions")
    lis.add_argument("--probe-every-s", type=float, default=1.0, help="mean seconds between VAD delay probes")
    lis.add_argument("--respond", action="store_true", help="answer the questions too (default: transcribe only)")
    lis.add_argument(
        "--transport",
        choices=["websocket", "webrtc"],
        default="websocket",
        help="listen mode: WebSocket sessions, or WebRTC calls (which only listen: silence and probes, no questions)",
    )
    p.add_argument(
        "--caller-dtx",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="WebRTC callers send Opus DTX while silent when the server's answer asks (usedtx=1), as browsers do",
    )
    lis.add_argument("--target-ms", type=float, default=50.0, help="p99 chunk-to-decision delay to stay under")
    lis.add_argument("--keep-going", action="store_true", help="run every step even past the target")
    lis.add_argument(
        "--stop-after-failed-steps",
        type=int,
        default=2,
        help="stop the ramp after this many steps over target in a row",
    )
    mem = p.add_argument_group("memory mode")
    mem.add_argument("--pool-sizes", default="1,64")
    mem.add_argument("--hold-s", type=float, default=5.0, help="seconds all slots stay active before reading RSS")
    mem.add_argument("--memory-turns-at-once", type=int, default=2, help="memory mode: questions in flight at once")
    mem.add_argument("--copies", type=int, default=4, help="copies mode: default stacks to load in one process")
    out = p.add_argument_group("output")
    out.add_argument("--json", help="write the full report (every turn) here")
    out.add_argument("--quiet", action="store_true", help="no progress line")
    out.add_argument("--speech-cache", help="where synthesised questions are kept")
    sui = p.add_argument_group("suite mode (make bench)")
    sui.add_argument("--out", default="bench-results", help="directory for every benchmark's JSON and summary.md")
    sui.add_argument("--only", help="comma-separated benchmarks: " + ",".join(n for n, *_ in SUITE))
    sui.add_argument("--quick", action="store_true", help="shortened runs, to check the suite works")
    opts = p.parse_args(list(argv))
    opts.argv = list(argv)
    opts.steps = sorted({int(s) for s in opts.steps.split(",") if s.strip()})
    opts.pool_sizes = [int(s) for s in opts.pool_sizes.split(",") if s.strip()]
    if opts.mode == "memory":
        opts.spawn = True
    if opts.mode == "listen" and opts.respond is False:
        opts.turn_timeout_s = min(opts.turn_timeout_s, 60.0)
    if opts.pool_size is None:
        opts.pool_size = max(opts.sessions, max(opts.steps) if opts.mode == "listen" else 1)
    return opts


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def run_async(opts: argparse.Namespace) -> dict[str, Any]:
    """Run what ``opts`` asks for; returns the report (printing nothing)."""
    clips = await asyncio.to_thread(
        load_paused_questions if opts.paused else load_questions,
        opts.speech,
        directory=opts.speech_cache,
        progress=(lambda line: None) if opts.quiet else (lambda line: print(line, file=sys.stderr)),
    )
    if opts.mode == "memory":
        return await run_memory(opts, clips)
    if opts.mode == "copies":
        return await asyncio.to_thread(run_copies, opts)
    if opts.mode == "suite":
        return await asyncio.to_thread(run_suite, opts)
    server: ServerHandle
    if opts.spawn:
        log = Path(opts.server_log) if opts.server_log else None
        extra = list(opts.server_arg)
        if opts.mode == "transports" and opts.sip_port is None:
            from s2s_rt.bench.phone import free_port

            # Phone calls ring at the load script's webhook, which accepts each with the turn's settings.
            opts.sip_port, opts.sip_webhook_port = free_port("127.0.0.1"), free_port("127.0.0.1")
            hook = f"http://127.0.0.1:{opts.sip_webhook_port}/incoming"
            extra += ["--sip-port", str(opts.sip_port), "--sip-webhook", hook]
        server = await asyncio.to_thread(
            ServerHandle.spawn, opts.stack, opts.pool_size, env=server_env(opts), extra=extra, log_path=log
        )
        if not opts.quiet:
            print(f"spawned server pid {server.pid} at {server.url} (log {server.log_path})", file=sys.stderr)
    else:
        server = ServerHandle(opts.url, opts.pid)
    try:
        if opts.mode == "listen":
            return await run_listen(opts, server, clips)
        if opts.mode == "transports":
            from s2s_rt.bench.transports import run_transports

            return await run_transports(opts, server, clips)
        return await run_talk(opts, server, clips)
    finally:
        await asyncio.to_thread(server.stop)


def main(argv: list[str] | None = None) -> int:
    """``s2s-rt bench``: returns 0 when every turn was answered and nothing foreign or lost was seen."""
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    _raise_fd_limit()
    try:
        report = asyncio.run(run_async(opts))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"s2s-rt bench: {exc}", file=sys.stderr)
        return 2
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(format_report(report))
    return 0 if report["ok"] else 1
