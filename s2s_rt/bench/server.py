"""The server under test: spawned here (``python -m s2s_rt serve``) or a running one, and its turn log."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from s2s_rt.bench.metrics import Labels, parse_metrics
from s2s_rt.bench.procfs import ProcSample, read_proc
from s2s_rt.bench.stats import summarize
from s2s_rt.pipeline.work import WATERFALL_STEPS


class ServerHandle:
    """The server under test: its URL, its ``/metrics``, and (when known) its process."""

    def __init__(self, url: str, pid: int | None = None, process: subprocess.Popen[bytes] | None = None) -> None:
        self.url = url
        self.pid = pid
        self.process = process
        self.log_path: Path | None = None
        m = re.match(r"wss?://([^/]+)", url)
        self.http = f"http://{m.group(1) if m else '127.0.0.1:8000'}"

    @classmethod
    def spawn(
        cls,
        stack: str,
        pool_size: int,
        *,
        env: dict[str, str],
        extra: Sequence[str] = (),
        log_path: Path | None = None,
        timeout_s: float = 300.0,
    ) -> ServerHandle:
        """Start ``python -m s2s_rt serve`` on a free loopback port and wait until it listens.

        Raises:
            RuntimeError: it exited or did not listen within ``timeout_s``; the message holds its log's tail.
        """
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="s2s-rt-bench-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        argv = [sys.executable, "-m", "s2s_rt", "serve", "--host", "127.0.0.1", "--port", "0"]
        argv += ["--stack", stack, "--pool-size", str(pool_size), *extra]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env)
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(r"listening on (ws://[^/\s]+)/v1/realtime")
        while True:
            text = log_path.read_text(errors="replace")
            m = pattern.search(text)
            if m:
                handle = cls(f"{m.group(1)}/v1/realtime", process.pid, process)
                handle.log_path = log_path
                return handle
            if process.poll() is not None or time.monotonic() > deadline:
                if process.poll() is None:
                    process.kill()
                tail = "\n".join(text.splitlines()[-20:])
                raise RuntimeError(f"the server did not start (exit {process.poll()}); log {log_path}:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM a spawned server and wait for it (SIGKILL after 30 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def proc(self) -> ProcSample | None:
        return read_proc(self.pid) if self.pid else None

    async def metrics(self) -> dict[tuple[str, Labels], float]:
        """The server's ``/metrics`` (empty if it cannot be read)."""

        def get() -> str:
            try:
                with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as r:
                    return str(r.read().decode())
            except (OSError, urllib.error.URLError):
                return ""

        return parse_metrics(await asyncio.to_thread(get))


_TURN_LINE = re.compile(r"\bturn slot=\d+ .*\bfrom=last_word\b")
_FIELD = re.compile(r"\b([a-z_]+)=(-?\d+)\b")
#: The waterfall's steps as the turn log names them (``s2s_rt.pipeline.work.WATERFALL_STEPS``, then done).
WATERFALL = (*WATERFALL_STEPS, "done")
_TURN_COUNTS = ("clause_tokens", "ahead", "input_tokens", "cached_tokens")


def turn_log_breakdown(log_path: Path | None, since: int = 0) -> dict[str, Any] | None:
    """The server's own per-turn log lines (``turn slot=… from=last_word silence_ms=…``), summarised.

    Times count from the user's last word as the server heard it: each
    waterfall step's percentiles (``steps``), the median turn's whole
    waterfall (the turn whose first audio was sent at the median time:
    ``median_turn``), the turns answered ahead, and the prompt tokens read
    and reused. Returns None when there is no log (a server this script did
    not start).
    """
    if log_path is None:
        return None
    try:
        text = log_path.read_text(errors="replace")[since:]
    except OSError:
        return None
    turns = []
    for line in text.splitlines():
        if _TURN_LINE.search(line):
            turns.append({name: int(value) for name, value in _FIELD.findall(line)})
    steps = {
        step: summarize([t[f"{step}_ms"] / 1000 for t in turns if f"{step}_ms" in t])
        for step in WATERFALL
        if any(f"{step}_ms" in t for t in turns)
    }
    sent = sorted((t for t in turns if "audio_sent_ms" in t), key=lambda t: t["audio_sent_ms"])
    median = sent[(len(sent) - 1) // 2] if sent else None
    return {
        "turns": len(turns),
        "steps": steps,
        "median_turn": (
            {k: v for k, v in median.items() if k.endswith("_ms") or k in _TURN_COUNTS} if median else None
        ),
        "answered_ahead": sum(t.get("ahead", 0) for t in turns),
        "input_tokens": summarize([t["input_tokens"] for t in turns if "input_tokens" in t]),
        "cached_tokens": summarize([t["cached_tokens"] for t in turns if "cached_tokens" in t]),
        "turns_with_cached_tokens": sum(1 for t in turns if t.get("cached_tokens", 0) > 0),
    }


def server_env(opts: argparse.Namespace) -> dict[str, str]:
    env = {}
    for kv in opts.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env
