"""What every session of one run shares (settings, metronome, id ownership, counters, failures), and its pacing."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

from s2s_rt.bench.microphone import Metronome, append_message
from s2s_rt.bench.turn import Turn
from s2s_rt.speech_cache import RATE, Clip


class Ownership:
    """Which session first saw each session, item and response id."""

    def __init__(self) -> None:
        self.owner: dict[str, int] = {}

    def claim(self, ident: str, session: int) -> int | None:
        """Record ``ident`` for ``session``; returns the other owner if another session has it."""
        other = self.owner.setdefault(ident, session)
        return None if other == session else other


class LoopLag:
    """The client's own event-loop lag (a 50 ms ticker), to show the client is not the bottleneck."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.05)
            now = time.perf_counter()
            self.samples.append((now, max(0.0, now - before - 0.05)))

    def between(self, t0: float, t1: float) -> list[float]:
        return [v for t, v in self.samples if t0 <= t <= t1]


class Run:
    """What every session of one run shares: settings, counters, failures."""

    def __init__(self, opts: argparse.Namespace, clips: list[Clip]) -> None:
        self.opts = opts
        self.clips = clips
        chunk_bytes = int(RATE * opts.chunk_ms / 1000) * 2
        self.chunk_s = opts.chunk_ms / 1000
        #: Wall seconds between two appends (``--slower`` times the audio each carries).
        self.period_s = self.chunk_s * opts.slower
        self.silence = append_message(bytes(chunk_bytes))
        self.clip_messages = [
            [
                append_message(c.pcm[i : i + chunk_bytes].ljust(chunk_bytes, b"\0"))
                for i in range(0, len(c.pcm), chunk_bytes)
            ]
            for c in clips
        ]
        self.metronome = Metronome(self.period_s)
        self.ownership = Ownership()
        self.turns: list[Turn] = []
        self.failures: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {
            "sessions_opened": 0,
            "rejections": 0,
            "foreign_events": 0,
            "lost_events": 0,
            "unanswered_turns": 0,
            "unexpected_events": 0,
            "error_events": 0,
            "connect_failures": 0,
            "closed_by_server": 0,
        }
        self.errors: dict[str, int] = {}
        self.probes: list[tuple[float, float]] = []  # (sent at, delay)
        self.stop = asyncio.Event()
        self.started = time.perf_counter()

    def fail(self, kind: str, session: int, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.failures) < 200:
            at = round(time.perf_counter() - self.started, 2)
            self.failures.append({"kind": kind, "session": session, "detail": detail, "at_s": at})

    @property
    def answered(self) -> int:
        return sum(1 for t in self.turns if t.failure is None and t.done.is_set())


async def pause(run: Run, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(run.stop.wait(), seconds)


async def progress(started: float, status: Callable[[], str], quiet: bool) -> None:
    """A progress line on stderr every second (every 5 s when stderr is not a terminal)."""
    tty = sys.stderr.isatty()
    last_print = 0.0
    while True:
        await asyncio.sleep(1.0)
        now = time.perf_counter()
        if quiet or (not tty and now - last_print < 5):
            continue
        last_print = now
        line = f"[{now - started:6.1f} s] {status()}"
        print(("\r" + line + "   ") if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
