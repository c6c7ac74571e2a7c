"""The load script (``bin/s2s-rt-load``, ``s2s-rt bench``): latency, capacity and memory.

Five modes, each one command:

``talk`` (default)
    N concurrent sessions each speak M questions at real-time pace (PCM16
    24 kHz in 20 ms appends, like a microphone: silence, a question, silence
    while the answer comes) and wait for each answer. Per turn it records the
    end of the user's speech (when the append holding the last voiced sample
    was sent), ``speech_stopped``, the transcription's ``completed``,
    ``response.created``, the first audio delta and ``response.done``, and
    prints p50/p95/p99 of every interval.

``listen``
    Sessions that mostly listen: audio streams continuously, a question now
    and then (by default transcribed but not answered). Ramps the number of
    sessions up step by step and reports, per step, the delay from an audio
    chunk's arrival to its VAD decision; the knee is the last step whose p99
    stays under ``--target-ms``. The client cannot see the server's
    per-chunk decision, so it measures it through the protocol: after an
    append it sends ``input_audio_buffer.clear`` (only in silence, far from
    any turn), which the server handles in the session's VAD stage after
    every earlier chunk has been scored; the time until
    ``input_audio_buffer.cleared`` arrives is the chunk-to-decision delay
    plus the trip back. ``speech_started``/``speech_stopped`` of the rare
    turns give a second, independent measure (time from sending the chunk
    that completes the deciding 32 ms VAD window to the event).

``memory``
    Starts the server once per ``--pool-sizes`` value, fills every slot with
    a listening session, and reports RSS idle and with all slots active: the
    cost of one extra slot.

``copies``
    Loads the default stack ``--copies`` times in this process and reports
    RSS after each: what a slot would cost with its own models
    (``bin/s2s-rt-model-copies``).

``suite``
    Every benchmark of BENCHMARKS.md, each in its own process, into
    ``--out`` (JSON, tables, ``summary.md``): what ``make bench`` runs.

Every mode checks what it hears: an event naming a session, item or
response id that belongs to another session (or that this session never
saw introduced) is a *foreign* event and fails the run, as does a turn whose
expected events do not all arrive (*lost*), an ``error`` event, or a
rejection (``session_limit_reached``). Exit status 0 means none of these
happened.

With ``--spawn`` it starts the server itself (``python -m s2s_rt serve``)
and reads the process's CPU time and RSS from ``/proc/PID``; with ``--url``
it uses a running one (``--pid`` for its ``/proc`` figures). It always reads
the server's ``/metrics`` before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from s2s_rt.speech_cache import RATE, Clip, load_questions
from s2s_rt.wer import word_error_rate

#: One Silero (and fake energy) VAD window: 512 samples at 16 kHz.
VAD_CHUNK_MS = 32
INSTRUCTIONS = "You are a helpful voice assistant. Answer in one short sentence."

_json = msgspec.json.Decoder()


# --- statistics ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p95, p99, max and mean of ``values`` (seconds)."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
        "mean": sum(values) / len(values) if values else None,
    }


# --- the server: spawned or attached, /metrics and /proc --------------------------------


@dataclass
class ProcSample:
    """What ``/proc/PID`` says about a process at one moment."""

    cpu_s: float
    rss_mb: float
    hwm_mb: float
    threads: int
    #: The main thread (the event loop's): CPU seconds, and seconds it was
    #: runnable but waiting for a core (other processes or its own threads had them).
    main_cpu_s: float = 0.0
    main_wait_s: float = 0.0


def read_proc(pid: int) -> ProcSample | None:
    """CPU seconds (user+system, all threads), RSS and peak RSS of ``pid``; None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    kv = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def mb(key: str) -> float:
        return int(kv.get(key, "0 kB").split()[0]) / 1024

    main_cpu = main_wait = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        run_ns, wait_ns = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
        main_cpu, main_wait = int(run_ns) / 1e9, int(wait_ns) / 1e9
    return ProcSample(cpu, mb("VmRSS"), mb("VmHWM"), int(kv.get("Threads", "0").strip()), main_cpu, main_wait)


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used since boot (from ``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Usage:
    """CPU use over a window: the machine, this client process, the server process."""

    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.t0 = time.perf_counter()
        self.machine0 = machine_busy_s()
        self.client0 = read_proc(os.getpid())
        self.server0 = server.proc()

    def figures(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self.t0
        machine = (machine_busy_s() - self.machine0) / seconds
        client1, server1 = read_proc(os.getpid()), self.server.proc()
        out: dict[str, Any] = {"machine_cores_busy": machine}
        if self.client0 and client1:
            out["client_cores_busy"] = (client1.cpu_s - self.client0.cpu_s) / seconds
            out["client_loop_thread_waiting_for_cpu_share"] = (client1.main_wait_s - self.client0.main_wait_s) / seconds
        if self.server0 and server1:
            out["server_cores_busy"] = (server1.cpu_s - self.server0.cpu_s) / seconds
        out["other_processes_cores_busy"] = (
            machine - out.get("client_cores_busy", 0.0) - out.get("server_cores_busy", 0.0)
        )
        return out


Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """Prometheus text format to ``{(name, sorted labels): value}``."""
    out: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


class MetricsDelta:
    """The difference between two ``/metrics`` scrapes."""

    def __init__(self, before: dict[tuple[str, Labels], float], after: dict[tuple[str, Labels], float]) -> None:
        self.values = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def total(self, name: str, **match: str) -> float:
        """Sum of a counter's increase over every label set containing ``match``."""
        return sum(
            v
            for (n, labels), v in self.values.items()
            if n == name and all((k, val) in labels for k, val in match.items())
        )

    def histogram(self, name: str, **match: str) -> dict[str, Any]:
        """Count, mean, p50/p95/p99 (interpolated inside buckets) and share ≤ each bound."""
        buckets: dict[float, float] = {}
        for (n, labels), v in self.values.items():
            if n != f"{name}_bucket":
                continue
            d = dict(labels)
            if any(d.get(k) != val for k, val in match.items()):
                continue
            le = math.inf if d["le"] == "+Inf" else float(d["le"])
            buckets[le] = buckets.get(le, 0.0) + v
        count = buckets.get(math.inf, 0.0)
        total = self.total(f"{name}_sum", **match)
        bounds = sorted(buckets)
        result: dict[str, Any] = {"count": int(count), "mean": total / count if count else None}
        for q in (50, 95, 99):
            result[f"p{q}"] = _bucket_quantile(bounds, buckets, q / 100)
        result["share_le"] = {f"{b:g}": (buckets[b] / count if count else None) for b in bounds if b != math.inf}
        return result


def _bucket_quantile(bounds: list[float], cumulative: dict[float, float], q: float) -> float | None:
    count = cumulative.get(math.inf, 0.0)
    if not count:
        return None
    rank = q * count
    prev_bound, prev_cum = 0.0, 0.0
    for b in bounds:
        cum = cumulative[b]
        if cum >= rank:
            if b == math.inf:
                return prev_bound  # above the last finite bound: report that bound
            if cum == prev_cum:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_cum) / (cum - prev_cum)
        prev_bound, prev_cum = b, cum
    return None


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


_TURN_LINE = re.compile(r"\bturn slot=\d+ .*\bfrom=end_of_speech\b")
_MS_FIELD = re.compile(r"\b(transcribed_ms|first_token_ms|first_audio_ms|done_ms)=(\d+)")


def turn_log_breakdown(log_path: Path | None, since: int = 0) -> dict[str, Any] | None:
    """The server's own per-turn log lines (``turn slot=… from=end_of_speech transcribed_ms=…``), summarised.

    Times count from the server's speech_stopped decision. Returns None when
    there is no log (a server this script did not start).
    """
    if log_path is None:
        return None
    try:
        text = log_path.read_text(errors="replace")[since:]
    except OSError:
        return None
    fields: dict[str, list[float]] = {}
    for line in text.splitlines():
        if _TURN_LINE.search(line):
            for name, value in _MS_FIELD.findall(line):
                fields.setdefault(name.removesuffix("_ms"), []).append(int(value) / 1000)
    return {name: summarize(values) for name, values in fields.items()}


def server_figures(
    delta: MetricsDelta, proc0: ProcSample | None, proc1: ProcSample | None, seconds: float
) -> dict[str, Any]:
    """Server-side resource and latency figures over one measured window."""
    events_in = delta.total("s2s_events_in_total")
    events_out = delta.total("s2s_events_out_total")
    out: dict[str, Any] = {
        "window_s": seconds,
        "events_in": int(events_in),
        "events_out": int(events_out),
        "messages_per_s": (events_in + events_out) / seconds if seconds > 0 else None,
        "loop_lag": delta.histogram("s2s_event_loop_lag_seconds"),
        "stage_seconds": {s: delta.histogram("s2s_stage_seconds", stage=s) for s in ("vad", "stt", "llm", "tts")},
        "turn_first_audio": delta.histogram("s2s_turn_first_audio_seconds"),
        "errors": {dict(k[1]).get("code", ""): v for k, v in delta.values.items() if k[0] == "s2s_errors_total" and v},
        "rejections": delta.total("s2s_rejections_total"),
        "speculative_transcriptions": {
            dict(k[1]).get("outcome", ""): v
            for k, v in delta.values.items()
            if k[0] == "s2s_speculative_stt_total" and v
        },
    }
    if proc0 and proc1:
        cpu = proc1.cpu_s - proc0.cpu_s
        out |= {
            "cpu_s": cpu,
            "cpu_cores_busy": cpu / seconds if seconds > 0 else None,
            "rss_mb_before": proc0.rss_mb,
            "rss_mb_after": proc1.rss_mb,
            "rss_mb_peak": proc1.hwm_mb,
            "threads": proc1.threads,
            "loop_thread_cpu_share": (proc1.main_cpu_s - proc0.main_cpu_s) / seconds if seconds > 0 else None,
            "loop_thread_waiting_for_cpu_share": (proc1.main_wait_s - proc0.main_wait_s) / seconds
            if seconds > 0
            else None,
        }
        if events_in:
            # The event loop's own CPU per client event: what bounds messages per second.
            out["loop_thread_cpu_us_per_event_in"] = (proc1.main_cpu_s - proc0.main_cpu_s) / events_in * 1e6
            out["process_cpu_us_per_event_in"] = cpu / events_in * 1e6
    return out


# --- the client side: microphone, metronome, ownership -----------------------------------


def append_message(pcm: bytes) -> str:
    """A pre-encoded ``input_audio_buffer.append`` carrying ``pcm``."""
    return '{"type":"input_audio_buffer.append","audio":"' + base64.b64encode(pcm).decode("ascii") + '"}'


CLEAR_MESSAGE = '{"type":"input_audio_buffer.clear"}'


class Microphone:
    """One session's uplink at real-time pace: silence, or a clip while one plays.

    Chunk ``k`` (audio ``[k·c, (k+1)·c)``) is sent at ``start + (k+1)·c``, as a
    microphone that sends each chunk once it is recorded. Send times of recent
    chunks are kept so an audio position can be mapped to when it left.
    """

    RING = 8192  # chunks of send times kept (164 s at 20 ms)
    #: Bytes waiting in the socket's send buffer beyond which the server is not keeping up.
    MAX_BUFFERED = 32 * 1024

    def __init__(self, ws: ClientConnection, chunk_s: float, silence: str) -> None:
        self.ws = ws
        self.chunk_s = chunk_s
        self.silence = silence
        self.start = 0.0
        self.sent = 0
        self.closed = False
        self._times = array("d", bytes(8 * self.RING))
        self._clip: deque[str] = deque()
        self._turn: Turn | None = None
        self._clip_done: asyncio.Future[None] | None = None
        self.probe_wanted = False
        self.probes: deque[float] = deque()
        self.stalls = 0

    def sent_at(self, index: int) -> float | None:
        """When chunk ``index`` was sent (None if not sent or forgotten)."""
        if index < 0 or index >= self.sent or self.sent - index > self.RING:
            return None
        return self._times[index % self.RING]

    def play(self, messages: Sequence[str], turn: Turn) -> asyncio.Future[None]:
        """Queue a clip; stamps ``turn.speech_sent`` and ``turn.eos`` as its first and last chunks leave."""
        assert self._clip_done is None, "a clip is already playing"
        self._clip.extend(messages)
        self._turn = turn
        self._clip_done = asyncio.get_running_loop().create_future()
        return self._clip_done

    async def pump(self, now: float, lateness: list[float]) -> None:
        """Send every chunk due by ``now`` (more than one when the client fell behind).

        Never waits for a server that is not reading: when this socket's send
        buffer is full the chunks stay due (as a microphone's would) and go
        out in a burst once the server reads again, so one stalled session
        cannot hold up the others sharing the metronome.
        """
        due = int((now - self.start) / self.chunk_s)
        transport = self.ws.transport
        while self.sent < due:
            if transport.get_write_buffer_size() > self.MAX_BUFFERED:
                self.stalls += 1
                return
            clip = bool(self._clip)
            await self.ws.send(self._clip.popleft() if clip else self.silence)
            t = time.perf_counter()
            k = self.sent
            self._times[k % self.RING] = t
            self.sent = k + 1
            lateness.append(t - (self.start + (k + 1) * self.chunk_s))
            if clip and self._turn is not None:
                if self._turn.speech_sent is None:
                    self._turn.speech_sent = t
                if not self._clip:
                    # This chunk holds the clip's last voiced sample: the end of the user's speech.
                    self._turn.eos, self._turn.eos_index = t, k
                    done, self._clip_done, self._turn = self._clip_done, None, None
                    if done is not None and not done.done():
                        done.set_result(None)
        if self.probe_wanted and not self._clip and transport.get_write_buffer_size() <= self.MAX_BUFFERED:
            self.probe_wanted = False
            await self.ws.send(CLEAR_MESSAGE)
            self.probes.append(time.perf_counter())


class Metronome:
    """One task that paces every microphone, in ``phases`` groups spread over a chunk.

    A single ticker costs far less than one sleeping task per session, and
    the phase groups keep sessions from all sending in the same instant.
    """

    def __init__(self, chunk_s: float, phases: int = 4) -> None:
        self.period = chunk_s
        self.phases = phases
        self.groups: list[list[Microphone]] = [[] for _ in range(phases)]
        self.t0 = time.perf_counter()
        self.tick = 0
        self.lateness: list[float] = []
        self.every: list[Microphone] = []

    def add(self, mic: Microphone) -> None:
        g = min(range(self.phases), key=lambda i: len(self.groups[i]))
        k = self.tick + 1
        k += (g - k) % self.phases
        mic.start = self.t0 + k * self.period / self.phases - self.period
        self.groups[g].append(mic)
        self.every.append(mic)

    def remove(self, mic: Microphone) -> None:
        for group in self.groups:
            if mic in group:
                group.remove(mic)

    async def run(self) -> None:
        step = self.period / self.phases
        while True:
            self.tick += 1
            delay = self.t0 + self.tick * step - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
            now = time.perf_counter()
            for mic in tuple(self.groups[self.tick % self.phases]):
                try:
                    await mic.pump(now, self.lateness)
                except ConnectionClosed:
                    mic.closed = True
                    self.remove(mic)


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


# --- turns and sessions ------------------------------------------------------------------

#: Event types that may name a new item id for the session.
_INTRODUCES_ITEM = frozenset(
    {
        "input_audio_buffer.speech_started",
        "input_audio_buffer.committed",
        "input_audio_buffer.timeout_triggered",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
    }
)

INTERVALS: tuple[tuple[str, str, str], ...] = (
    ("end of speech → speech_stopped", "eos", "speech_stopped"),
    ("speech_stopped → transcription completed", "speech_stopped", "transcribed"),
    ("transcription completed → response.created", "transcribed", "response_created"),
    ("response.created → first audio delta", "response_created", "first_audio"),
    ("first audio delta → response.done", "first_audio", "response_done"),
    ("END OF SPEECH → FIRST AUDIO DELTA", "eos", "first_audio"),
    ("end of speech → response.done", "eos", "response_done"),
)


@dataclass
class Turn:
    """One spoken question and what came back (times are ``perf_counter()`` seconds)."""

    session: int
    index: int
    question: str
    respond: bool
    speech_sent: float | None = None  # first chunk of the clip sent
    eos: float | None = None  # chunk holding the last voiced sample sent
    eos_index: int = -1
    speech_started: float | None = None
    speech_stopped: float | None = None
    committed: float | None = None
    transcribed: float | None = None
    response_created: float | None = None
    first_audio: float | None = None
    response_done: float | None = None
    transcript: str | None = None
    answer: str | None = None
    status: str | None = None
    answer_audio_s: float = 0.0
    segments: int = 0
    cancelled: int = 0
    started_decision: float | None = None
    stopped_decision: float | None = None
    final_item: str | None = None
    response_id: str | None = None
    failure: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self) -> dict[str, Any]:
        base = self.eos or 0.0

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - base, 4)

        times = {
            name: rel(getattr(self, name))
            for name in (
                "speech_sent",
                "speech_started",
                "speech_stopped",
                "committed",
                "transcribed",
                "response_created",
                "first_audio",
                "response_done",
            )
        }
        return {
            "session": self.session,
            "turn": self.index,
            "question": self.question,
            "transcript": self.transcript,
            "transcript_wer": None
            if self.transcript is None
            else round(word_error_rate(self.question, self.transcript), 3),
            "answer": self.answer,
            "status": self.status,
            "answer_audio_s": round(self.answer_audio_s, 3),
            "segments": self.segments,
            "cancelled_responses": self.cancelled,
            "failure": self.failure,
            "times_from_end_of_speech_s": times,
            "vad_decision_s": {"speech_started": self.started_decision, "speech_stopped": self.stopped_decision},
            "intervals_s": {label: self.interval(a, b) for label, a, b in INTERVALS},
        }

    def interval(self, a: str, b: str) -> float | None:
        ta, tb = getattr(self, a), getattr(self, b)
        return None if ta is None or tb is None else tb - ta

    def missing(self) -> list[str]:
        """Events this turn should have produced and did not."""
        need = [
            ("speech_started", "input_audio_buffer.speech_started"),
            ("speech_stopped", "input_audio_buffer.speech_stopped"),
            ("committed", "input_audio_buffer.committed"),
            ("transcribed", "conversation.item.input_audio_transcription.completed"),
        ]
        if self.respond:
            need += [
                ("response_created", "response.created"),
                ("first_audio", "response.output_audio.delta"),
                ("response_done", "response.done"),
            ]
        return [event for attr, event in need if getattr(self, attr) is None]


class Run:
    """What every session of one run shares: settings, counters, failures."""

    def __init__(self, opts: argparse.Namespace, clips: list[Clip]) -> None:
        self.opts = opts
        self.clips = clips
        chunk_bytes = int(RATE * opts.chunk_ms / 1000) * 2
        self.chunk_s = opts.chunk_ms / 1000
        self.silence = append_message(bytes(chunk_bytes))
        self.clip_messages = [
            [
                append_message(c.pcm[i : i + chunk_bytes].ljust(chunk_bytes, b"\0"))
                for i in range(0, len(c.pcm), chunk_bytes)
            ]
            for c in clips
        ]
        self.metronome = Metronome(self.chunk_s)
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


class SessionClient:
    """One Realtime session of the load: connects, configures, speaks, and checks every event."""

    def __init__(self, run: Run, index: int, *, respond: bool) -> None:
        self.run = run
        self.index = index
        self.respond = respond
        self.session_id: str | None = None
        self.items: set[str] = set()
        self.responses: set[str] = set()
        self.turn: Turn | None = None
        self.mic: Microphone | None = None
        self.ready = asyncio.Event()
        self.updated = asyncio.Event()
        self.rejected = False
        self.ws: ClientConnection | None = None
        self.reader: asyncio.Task[None] | None = None
        self.closing = False

    # --- the event checker -------------------------------------------------------

    def on_event(self, ev: dict[str, Any], now: float) -> None:
        """Check one server event belongs here, then account it to the session or its turn."""
        run = self.run
        kind = ev.get("type", "")
        if kind == "error":
            err = ev.get("error") or {}
            code = str(err.get("code"))
            if code == "session_limit_reached" and self.session_id is None:
                self.rejected = True
                run.counts["rejections"] += 1
                self.ready.set()
                return
            run.errors[code] = run.errors.get(code, 0) + 1
            run.fail("error_events", self.index, f"error {code}: {err.get('message')}")
            return
        foreign = self._foreign(kind, ev)
        if foreign:
            run.fail("foreign_events", self.index, f"{kind}: {foreign}")
            return
        if kind == "session.created":
            self.ready.set()
            return
        if kind == "session.updated":
            self.updated.set()
            return
        if kind == "input_audio_buffer.cleared":
            if self.mic is not None and self.mic.probes:
                sent = self.mic.probes.popleft()
                run.probes.append((sent, now - sent))
            else:
                run.fail("unexpected_events", self.index, "input_audio_buffer.cleared without a clear sent")
            return
        if kind in ("response.created", "response.done"):
            self._response_event(kind, ev, now)
            return
        if kind == "response.output_audio.delta":
            turn = self.turn
            rid = ev.get("response_id")
            if turn is not None and rid == turn.response_id:
                if turn.first_audio is None:
                    turn.first_audio = now
                turn.answer_audio_s += len(ev.get("delta", "")) * 3 / 4 / 2 / RATE
            return
        turn = self.turn
        if kind == "input_audio_buffer.speech_started":
            if turn is None or turn.speech_sent is None:
                run.fail("unexpected_events", self.index, "speech_started while the client was silent")
                return
            turn.segments += 1
            if turn.speech_started is None:
                turn.speech_started = now
                start_ms = int(ev.get("audio_start_ms", 0))
                if start_ms > 0:  # else clamped at 0, and the deciding chunk is unknown
                    turn.started_decision = self._decision_delay(
                        start_ms + run.opts.prefix_padding_ms + VAD_CHUNK_MS, now
                    )
            return
        if kind == "input_audio_buffer.speech_stopped":
            if turn is None or turn.speech_started is None:
                run.fail("unexpected_events", self.index, "speech_stopped with no speech_started")
                return
            turn.speech_stopped = now
            turn.final_item = ev.get("item_id")
            end_ms = int(ev.get("audio_end_ms", 0))
            turn.stopped_decision = self._decision_delay(math.ceil(end_ms / VAD_CHUNK_MS) * VAD_CHUNK_MS, now)
            return
        if kind == "input_audio_buffer.committed":
            if turn is not None and ev.get("item_id") == turn.final_item:
                turn.committed = now
            return
        if kind == "conversation.item.input_audio_transcription.completed":
            if turn is not None and ev.get("item_id") == turn.final_item:
                turn.transcribed = now
                turn.transcript = ev.get("transcript")
                if not self.respond and self._final_segment(turn):
                    turn.done.set()
            return
        if kind == "conversation.item.input_audio_transcription.failed":
            run.fail("error_events", self.index, f"transcription failed: {ev.get('error')}")
            return

    def _response_event(self, kind: str, ev: dict[str, Any], now: float) -> None:
        r = ev.get("response") or {}
        rid = r.get("id")
        turn = self.turn
        if not self.respond:
            self.run.fail("unexpected_events", self.index, f"{kind} with create_response off")
            return
        if turn is None or turn.speech_stopped is None:
            self.run.fail("unexpected_events", self.index, f"{kind} outside a turn")
            return
        if kind == "response.created":
            # A turn's answer is the response created after its last speech_stopped.
            turn.response_id = rid
            turn.response_created = now
            turn.first_audio = None
            turn.answer_audio_s = 0.0
            return
        if rid != turn.response_id:
            return
        status = r.get("status")
        if not self._final_segment(turn):
            # The VAD cut the question in two and answered the first piece; the
            # rest of the question cancels that answer (barge-in) and gets its own.
            turn.cancelled += status == "cancelled"
            turn.response_id = turn.response_created = turn.first_audio = None
            return
        turn.response_done = now
        turn.status = status
        with contextlib.suppress(IndexError, KeyError, TypeError):
            turn.answer = (r.get("output") or [])[0]["content"][0].get("transcript")
        turn.done.set()

    @staticmethod
    def _final_segment(turn: Turn) -> bool:
        """Whether the turn's last speech_stopped came after the whole question was sent."""
        return turn.eos is not None and turn.speech_stopped is not None and turn.speech_stopped >= turn.eos

    def _foreign(self, kind: str, ev: dict[str, Any]) -> str | None:
        """Why ``ev`` does not belong to this session, or None when it does."""
        own = self.run.ownership
        if kind in ("session.created", "session.updated"):
            sid = (ev.get("session") or {}).get("id")
            if sid is None:
                return None
            if self.session_id is None and kind == "session.created":
                other = own.claim(sid, self.index)
                if other is not None:
                    return f"session id {sid} belongs to session {other}"
                self.session_id = sid
                return None
            return None if sid == self.session_id else f"session id {sid} is not this session's ({self.session_id})"
        items: list[str] = []
        if isinstance(ev.get("item_id"), str):
            items.append(ev["item_id"])
        item = ev.get("item")
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            items.append(item["id"])
        prev = ev.get("previous_item_id")
        responses: list[str] = []
        if isinstance(ev.get("response_id"), str):
            responses.append(ev["response_id"])
        if kind in ("response.created", "response.done"):
            rid = (ev.get("response") or {}).get("id")
            if isinstance(rid, str):
                if kind == "response.created":
                    other = own.claim(rid, self.index)
                    if other is not None:
                        return f"response {rid} belongs to session {other}"
                    self.responses.add(rid)
                else:
                    responses.append(rid)
        for rid in responses:
            if rid not in self.responses:
                other = own.owner.get(rid)
                return f"response {rid} was never created in this session" + (
                    f" (it is session {other}'s)" if other is not None else ""
                )
        if isinstance(prev, str) and prev not in self.items:
            return f"previous_item_id {prev} is not an item of this session"
        for iid in items:
            if iid in self.items:
                continue
            if kind in _INTRODUCES_ITEM:
                other = own.claim(iid, self.index)
                if other is not None:
                    return f"item {iid} belongs to session {other}"
                self.items.add(iid)
            else:
                other = own.owner.get(iid)
                return f"item {iid} was never introduced in this session" + (
                    f" (it is session {other}'s)" if other is not None else ""
                )
        return None

    def _decision_delay(self, audio_ms: float, now: float) -> float | None:
        """Seconds from sending the chunk that completes audio up to ``audio_ms`` to ``now``."""
        if self.mic is None or audio_ms <= 0:
            return None
        index = math.ceil(audio_ms / (self.run.chunk_s * 1000)) - 1
        sent = self.mic.sent_at(index)
        return None if sent is None else now - sent

    # --- connection --------------------------------------------------------------

    async def open(self, url: str) -> bool:
        """Connect, wait for ``session.created`` and configure the session. False if refused or failed."""
        run = self.run
        try:
            ws = await connect(
                url,
                max_size=16 * 1024 * 1024,
                compression=None,
                ping_interval=None,
                open_timeout=run.opts.open_timeout_s,
                close_timeout=5,
            )
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            run.fail("connect_failures", self.index, f"connect failed: {exc!r}")
            return False
        self.ws = ws
        self.reader = asyncio.create_task(self._read(ws), name=f"bench-read-{self.index}")
        try:
            await asyncio.wait_for(self.ready.wait(), run.opts.open_timeout_s)
        except TimeoutError:
            run.fail("lost_events", self.index, "no session.created")
            return False
        if self.rejected or self.session_id is None:
            return False
        run.counts["sessions_opened"] += 1
        td = {
            "type": "server_vad",
            "threshold": run.opts.threshold,
            "prefix_padding_ms": run.opts.prefix_padding_ms,
            "silence_duration_ms": run.opts.silence_ms,
            "create_response": self.respond,
            "interrupt_response": True,
        }
        session: dict[str, Any] = {
            "type": "realtime",
            "instructions": run.opts.instructions,
            "temperature": run.opts.temperature,
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": td},
                "output": {"format": {"type": "audio/pcm", "rate": RATE}},
            },
        }
        if run.opts.language:
            session["audio"]["input"]["transcription"] = {"model": "whisper-1", "language": run.opts.language}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        try:
            await asyncio.wait_for(self.updated.wait(), run.opts.open_timeout_s)
        except TimeoutError:
            run.fail("lost_events", self.index, "no session.updated")
            return False
        self.mic = Microphone(ws, run.chunk_s, run.silence)
        run.metronome.add(self.mic)
        return True

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for message in ws:
                now = time.perf_counter()
                try:
                    ev = _json.decode(message)
                except msgspec.DecodeError:
                    self.run.fail("unexpected_events", self.index, "a frame that is not JSON")
                    continue
                if not isinstance(ev, dict):
                    self.run.fail("unexpected_events", self.index, "a JSON frame that is not an object")
                    continue
                self.on_event(ev, now)
        except ConnectionClosed:
            pass
        finally:
            if self.ws is not None and not self.closing and not self.rejected:
                code = ws.close_code
                self.run.fail("closed_by_server", self.index, f"the server closed the session ({code})")
            if self.turn is not None:
                self.turn.done.set()
            self.ready.set()

    async def close(self) -> None:
        self.closing = True
        if self.mic is not None:
            self.run.metronome.remove(self.mic)
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
            if self.reader is not None:
                with contextlib.suppress(Exception):
                    await self.reader

    # --- speaking ------------------------------------------------------------------

    async def speak(self, number: int, clip_index: int) -> Turn:
        """Play one question and wait for its transcription (and answer, when responding)."""
        run = self.run
        assert self.mic is not None
        clip = run.clips[clip_index]
        turn = Turn(self.index, number, clip.text, self.respond)
        run.turns.append(turn)
        self.turn = turn
        await self.mic.play(run.clip_messages[clip_index], turn)
        try:
            await asyncio.wait_for(turn.done.wait(), run.opts.turn_timeout_s)
        except TimeoutError:
            turn.failure = f"unanswered after {run.opts.turn_timeout_s:g} s"
            run.fail("unanswered_turns", self.index, f"turn {number}: {turn.failure}")
        if turn.failure is None:
            missing = turn.missing()
            if self.respond and turn.status not in (None, "completed"):
                turn.failure = f"response {turn.status}"
                run.fail("lost_events", self.index, f"turn {number}: response ended {turn.status}")
            elif missing:
                turn.failure = "lost " + ", ".join(missing)
                run.counts["lost_events"] += len(missing) - 1
                run.fail("lost_events", self.index, f"turn {number}: {turn.failure}")
        self.turn = None
        return turn


# --- modes ----------------------------------------------------------------------------------


async def _pause(run: Run, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(run.stop.wait(), seconds)


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
            await _pause(run, opts.pause_s * rng.uniform(0.5, 1.5) + opts.prefix_padding_ms / 1000)
            if run.stop.is_set() or client.ws is None or client.mic is None or client.mic.closed:
                break
            turn = await client.speak(m, (index + m) % len(run.clips))
            if turn.failure and turn.failure.startswith("unanswered"):
                break  # the session's state is unknown now: later events could not be attributed
    finally:
        if client is not None:
            await client.close()


async def _progress(started: float, status: Callable[[], str], quiet: bool) -> None:
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


def _listen_status(run: Run) -> str:
    recent = [d for s, d in run.probes[-2000:]]
    p99 = percentile(recent, 99)
    c = run.counts
    return (
        f"sessions {c['sessions_opened']} probes {len(run.probes)}"
        + ("" if p99 is None else f" recent probe p99 {p99 * 1000:.0f} ms")
        + f" turns {run.answered} errors {c['error_events']} foreign {c['foreign_events']}"
    )


async def run_talk(opts: argparse.Namespace, server: ServerHandle, clips: list[Clip]) -> dict[str, Any]:
    """Talk mode: returns the report."""
    run = Run(opts, clips)
    tasks = [asyncio.create_task(run.metronome.run(), name="metronome")]
    lag = LoopLag()
    tasks.append(asyncio.create_task(lag.run(), name="client-lag"))
    m0, p0, c0 = await server.metrics(), server.proc(), time.process_time()
    usage = Usage(server)
    started = time.perf_counter()
    total = opts.sessions * opts.turns
    tasks.append(asyncio.create_task(_progress(started, lambda: _talk_status(run, total), opts.quiet)))
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
    report = _base_report(opts, run, server, seconds)
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


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": round(mem, 1) if mem else None,
        "loadavg": os.getloadavg(),
        "python": sys.version.split()[0],
    }


def _base_report(opts: argparse.Namespace, run: Run, server: ServerHandle, seconds: float) -> dict[str, Any]:
    ok = not any(
        run.counts[k]
        for k in (
            "rejections",
            "foreign_events",
            "lost_events",
            "unanswered_turns",
            "unexpected_events",
            "error_events",
            "connect_failures",
            "closed_by_server",
        )
    )
    return {
        "tool": "s2s-rt bench",
        "mode": opts.mode,
        "ok": ok,
        "argv": opts.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": seconds,
        "machine": machine_info(),
        "settings": {
            "url": server.url,
            "spawned": server.process is not None,
            "stack": opts.stack if server.process is not None else None,
            "pool_size": opts.pool_size if server.process is not None else None,
            "sessions": opts.sessions,
            "turns_per_session": opts.turns,
            "turns_per_connection": opts.turns_per_connection or opts.turns,
            "silence_duration_ms": opts.silence_ms,
            "prefix_padding_ms": opts.prefix_padding_ms,
            "threshold": opts.threshold,
            "chunk_ms": opts.chunk_ms,
            "speech": opts.speech,
            "pause_s": opts.pause_s,
            "ramp_s": opts.ramp_s,
            "language": opts.language,
            "temperature": opts.temperature,
            "server_env": opts.server_env,
        },
        "counts": dict(run.counts)
        | {"turns_planned": opts.sessions * opts.turns if opts.mode == "talk" else None}
        | {"turns_answered": run.answered},
        "errors_by_code": run.errors,
        "failures": run.failures,
    }


# --- listening capacity ---------------------------------------------------------------------


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
            await _pause(run, max(0.0, wait))
            if time.perf_counter() < next_turn - quiet_margin and client.turn is None:
                client.mic.probe_wanted = True
    finally:
        await client.close()


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
    background.append(asyncio.create_task(_progress(started, lambda: _listen_status(run), opts.quiet)))
    target = opts.target_ms / 1000
    rng = random.Random(opts.seed)
    failed_in_a_row = 0
    for n in opts.steps:
        add = n - len(sessions)
        opened = [asyncio.Event() for _ in range(add)]
        for k in range(add):
            idx = len(sessions)
            sessions.append(
                asyncio.create_task(listen_session(run, server.url, idx, rng.uniform(0, opts.ramp_s), opened[k]))
            )
        if opened:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), opts.ramp_s + 60)
        if not opts.quiet:
            print(
                f"step {n}: {run.counts['sessions_opened']} sessions open; warming up {opts.warmup_s:g} s",
                file=sys.stderr,
            )
        await _pause(run, opts.warmup_s)
        m0, p0, c0, t0 = await server.metrics(), server.proc(), time.process_time(), time.perf_counter()
        usage = Usage(server)
        turns_before = len(run.turns)
        failures_before = sum(run.counts.values()) - run.counts["sessions_opened"]
        await _pause(run, opts.step_s)
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
    report = _base_report(opts, run, server, time.perf_counter() - started)
    report["settings"] |= {
        "steps": opts.steps,
        "step_s": opts.step_s,
        "warmup_s": opts.warmup_s,
        "turn_every_s": opts.turn_every_s,
        "probe_every_s": opts.probe_every_s,
        "respond": opts.respond,
        "target_ms": opts.target_ms,
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
        f"  {step['sessions']:4d} sessions: probe p50 {_ms(pr['p50'])} p99 {_ms(pr['p99'])} (n={pr['n']}),"
        f" speech_started p99 {_ms(step['speech_started_decision_s']['p99'])},"
        f" server loop lag p99 {_ms(lag['p99'])}, server CPU {cpu if cpu is None else f'{cpu:.2f}'} cores,"
        f" failures {step['failures']} → {'ok' if step['passed'] else 'OVER'}"
    )


# --- memory ------------------------------------------------------------------------------------


async def run_memory(opts: argparse.Namespace, clips: list[Clip]) -> dict[str, Any]:
    """Start the server per pool size, fill every slot, report RSS idle and active."""
    results = []
    run: Run | None = None
    for pool in opts.pool_sizes:
        server = await asyncio.to_thread(
            ServerHandle.spawn, opts.stack, pool, env=_server_env(opts), extra=opts.server_arg
        )
        try:
            await asyncio.sleep(1.0)
            idle = server.proc()
            run = Run(opts, clips)
            metronome = asyncio.create_task(run.metronome.run())
            # One answered turn first, so every engine has run once (arenas and caches allocated).
            warm = SessionClient(run, 0, respond=True)
            if await warm.open(server.url):
                await warm.speak(0, 0)
            await warm.close()
            warmed = server.proc()
            clients = [SessionClient(run, i + 1, respond=False) for i in range(pool)]
            opened = await asyncio.gather(*(c.open(server.url) for c in clients))
            # Every slot hears one question (VAD, buffers, STT) while all are connected; a few at a
            # time, so the engines' queues stay short (this measures memory, not capacity).
            gate = asyncio.Semaphore(opts.memory_turns_at_once)

            async def one_turn(i: int, client: SessionClient, gate: asyncio.Semaphore = gate) -> None:
                async with gate:
                    await client.speak(1, i % len(clips))

            await asyncio.gather(*(one_turn(i, c) for i, c in enumerate(clients) if opened[i]), return_exceptions=True)
            await asyncio.sleep(opts.hold_s)
            active = server.proc()
            for c in clients:
                await c.close()
            metronome.cancel()
            await asyncio.gather(metronome, return_exceptions=True)
            await asyncio.sleep(1.0)
            after = server.proc()
            results.append(
                {
                    "pool_size": pool,
                    "sessions_active": sum(opened),
                    "rss_mb_idle": idle.rss_mb if idle else None,
                    "rss_mb_warm": warmed.rss_mb if warmed else None,
                    "rss_mb_all_slots_active": active.rss_mb if active else None,
                    "rss_mb_after_sessions_closed": after.rss_mb if after else None,
                    "rss_mb_peak": after.hwm_mb if after else None,
                    "failures": list(run.failures),
                }
            )
            if not opts.quiet:
                r = results[-1]
                print(
                    f"pool {pool}: RSS idle {r['rss_mb_idle']:.1f} MB, warm {r['rss_mb_warm']:.1f} MB,"
                    f" {r['sessions_active']} active {r['rss_mb_all_slots_active']:.1f} MB,"
                    f" peak {r['rss_mb_peak']:.1f} MB",
                    file=sys.stderr,
                )
        finally:
            await asyncio.to_thread(server.stop)
    per_slot: dict[str, Any] = {}
    if len(results) >= 2:
        a, b = results[0], results[-1]
        extra = b["pool_size"] - a["pool_size"]
        for key in ("rss_mb_idle", "rss_mb_all_slots_active", "rss_mb_peak"):
            if a[key] is not None and b[key] is not None and extra:
                per_slot[key] = (b[key] - a[key]) / extra
    assert run is not None
    report = _base_report(opts, run, ServerHandle("(spawned per pool size)"), 0.0)
    report["settings"] |= {"pool_sizes": opts.pool_sizes, "hold_s": opts.hold_s, "stack": opts.stack}
    report["memory"] = results
    report["per_extra_slot_mb"] = per_slot
    report["ok"] = all(not r["failures"] for r in results)
    return report


# --- one model copy per slot ------------------------------------------------------------------


def run_copies(opts: argparse.Namespace) -> dict[str, Any]:
    """Load the default stack ``opts.copies`` times in this process; RSS after each copy.

    Each copy runs every engine once (a VAD batch, a transcription, a few LLM
    tokens, a sentence of speech) so buffers allocated on first use count
    too. The increment per copy is what a slot would cost if slots held
    their own models.
    """
    import numpy as np

    from s2s_rt.audio import pcm16_to_float, resample
    from s2s_rt.config import Config
    from s2s_rt.engines.base import PIPELINE_RATE, ChatMessage, LLMUsage, Stack
    from s2s_rt.server import load_stack

    def exercise(stack: Stack, speech: Any) -> None:
        chunks = np.zeros((4, stack.vad.chunk_samples), np.float32)
        stack.vad.speech_probabilities(chunks, [stack.vad.new_state() for _ in range(4)])
        stack.stt.transcribe(speech, language="en")
        chat = [ChatMessage("system", "Answer in one short sentence."), ChatMessage("user", "What do bees make?")]
        usage = LLMUsage()
        for _ in stack.llm.stream(chat, max_tokens=8, temperature=0.0, should_stop=lambda: False, usage=usage):
            pass
        for _ in stack.tts.synthesize("Bees make honey.", voice=None, should_stop=lambda: False):
            pass

    clip = load_questions("piper", directory=opts.speech_cache)[0]
    speech = resample(pcm16_to_float(clip.pcm), RATE, PIPELINE_RATE)
    me = os.getpid()
    base = read_proc(me)
    assert base is not None
    rows: list[dict[str, float]] = [{"copies": 0, "rss_mb": base.rss_mb, "load_s": 0.0}]
    stacks = []
    for k in range(1, opts.copies + 1):
        t = time.perf_counter()
        stack = load_stack(Config(stack="default"))
        exercise(stack, speech)
        stacks.append(stack)  # every copy stays alive, as it would in its slot
        now = read_proc(me)
        assert now is not None
        rows.append({"copies": k, "rss_mb": now.rss_mb, "load_s": time.perf_counter() - t})
        if not opts.quiet:
            print(f"copy {k}: RSS {now.rss_mb:.1f} MB (+{now.rss_mb - rows[-2]['rss_mb']:.1f})", file=sys.stderr)
    increments = [b["rss_mb"] - a["rss_mb"] for a, b in itertools.pairwise(rows[1:])]
    return {
        "tool": "s2s-rt bench",
        "mode": "copies",
        "ok": True,
        "argv": opts.argv,
        "machine": machine_info(),
        "rows": rows,
        "first_copy_mb": rows[1]["rss_mb"] - rows[0]["rss_mb"] if len(rows) > 1 else None,
        "per_extra_copy_mb": sum(increments) / len(increments) if increments else None,
    }


# --- the whole suite (``make bench``) -------------------------------------------------------------

#: name, what it shows, arguments, and what ``--quick`` changes (shorter runs, same setup).
SUITE: tuple[tuple[str, str, list[str], list[str]], ...] = tuple(
    (name, what, args.split(), quick.split())
    for name, what, args, quick in (
        (
            "single",
            "1 session, default stack, 20 turns",
            "--spawn --stack default --sessions 1 --turns 20",
            "--turns 3",
        ),
        (
            "single-fresh",
            "1 session at a time, default stack, 20 one-question conversations (no history)",
            "--spawn --stack default --sessions 1 --turns 20 --turns-per-connection 1",
            "--turns 3",
        ),
        (
            "talk2",
            "2 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 2 --turns 10 --turns-per-connection 1",
            "--turns 2",
        ),
        (
            "talk4",
            "4 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 4 --turns 5 --turns-per-connection 1",
            "--turns 1",
        ),
        (
            "talk8",
            "8 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 8 --turns 5 --turns-per-connection 1",
            "--turns 1",
        ),
        (
            "listen",
            "listening capacity, default stack (Silero VAD)",
            "--spawn --stack default --mode listen --steps 10,25,50,75,100,125,150,200,300 --step-s 20",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "listen-rare",
            "listening capacity, default stack, a question every ~10 minutes per session",
            "--spawn --stack default --mode listen --steps 25,50,75,100,150,200,300 --step-s 20 --turn-every-s 600",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "fake100",
            "100 sessions, fake stack",
            "--spawn --stack fake --sessions 100 --turns 5 --ramp-s 5 --max-duration-s 300",
            "--sessions 20 --turns 2",
        ),
        (
            "fake500",
            "500 sessions, fake stack",
            "--spawn --stack fake --sessions 500 --turns 5 --ramp-s 10 --max-duration-s 300",
            "--sessions 50 --turns 2",
        ),
        (
            "fake500-100ms",
            "500 sessions, fake stack, 100 ms appends (a fifth of the messages)",
            "--spawn --stack fake --sessions 500 --turns 5 --ramp-s 10 --max-duration-s 300 --chunk-ms 100",
            "--sessions 50 --turns 2",
        ),
        (
            "listen-100ms",
            "listening capacity, default stack, 100 ms appends",
            "--spawn --stack default --mode listen --steps 25,50,75,100,125,150,200,300 --step-s 20 --chunk-ms 100",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "memory",
            "RSS with pool 1 and pool 64, default stack",
            "--mode memory --stack default --pool-sizes 1,64",
            "--pool-sizes 1,4",
        ),
        (
            "copies",
            "one model copy per slot: 4 default stacks in one process",
            "--mode copies --copies 4",
            "--copies 2",
        ),
    )
)

#: How much the RSS of two starts of the same server may differ (measured: up to ~6 MB).
RSS_NOISE_MB = 6.0

_BOOT = "import sys; from s2s_rt.bench import main; sys.exit(main(sys.argv[1:]))"


def run_suite(opts: argparse.Namespace) -> dict[str, Any]:
    """Run every benchmark of :data:`SUITE` in its own process; write JSON, tables and ``summary.md``."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {n for n in (opts.only or "").split(",") if n}
    results: dict[str, Any] = {}
    for name, what, args, quick in SUITE:
        if only and name not in only:
            continue
        argv = [*args, *(quick if opts.quick else []), "--json", str(out / f"{name}.json"), "--quiet"]
        if opts.speech_cache:
            argv += ["--speech-cache", opts.speech_cache]
        load = os.getloadavg()[0]
        print(f"== {name}: {what} (load {load:.2f})\n   s2s-rt bench {' '.join(argv)}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _BOOT, *argv], capture_output=True, text=True)
        (out / f"{name}.txt").write_text(done.stdout + ("\n" + done.stderr if done.returncode else ""))
        print(done.stdout, file=sys.stderr)
        if done.returncode not in (0, 1):
            print(done.stderr[-3000:], file=sys.stderr)
        report: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            report = json.loads((out / f"{name}.json").read_text())
        results[name] = {
            "what": what,
            "command": "s2s-rt bench " + " ".join(a for a in argv if a != "--quiet"),
            "exit": done.returncode,
            "seconds": time.perf_counter() - started,
            "load_before": load,
            "load_after": os.getloadavg()[0],
            "report": report,
        }
    summary = suite_summary(results)
    (out / "summary.md").write_text(summary)
    return {
        "tool": "s2s-rt bench",
        "mode": "suite",
        "ok": all(r["exit"] == 0 for r in results.values()),
        "summary": summary,
        "machine": machine_info(),
    }


def _f(v: float | None, scale: float = 1000.0, unit: str = " ms", digits: int = 0) -> str:
    return "—" if v is None else f"{v * scale:.{digits}f}{unit}"


def suite_summary(results: dict[str, Any]) -> str:
    """Markdown tables of a suite run (what BENCHMARKS.md shows)."""
    m = machine_info()
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}.", ""]
    talk: list[str] = [
        n for n in ("single", "single-fresh", "talk2", "talk4", "talk8") if n in results and results[n]["report"]
    ]
    if talk:
        lines += [
            "| run | sessions × turns | answered | eos → speech_stopped p50 | eos → first audio p50 | p95 | p99"
            " | STT (stopped → transcript) p50 | created → first audio p50 | turns overlapping another's inference"
            " | server CPU s/turn | other processes (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n in talk:
            r = results[n]["report"]
            iv = r["intervals_s"]
            head = iv["END OF SPEECH → FIRST AUDIO DELTA"]
            con = r["contention"]
            st = r["settings"]
            lines.append(
                f"| {n} | {st['sessions']} × {st['turns_per_session']} | {r['counts']['turns_answered']}"
                f" | {_f(iv['end of speech → speech_stopped']['p50'])} | **{_f(head['p50'])}** | {_f(head['p95'])}"
                f" | {_f(head['p99'])} | {_f(iv['speech_stopped → transcription completed']['p50'])}"
                f" | {_f(iv['response.created → first audio delta']['p50'])}"
                f" | {con['turns_overlapping_another_sessions_inference']} of"
                f" {con['turns_overlapping_another_sessions_inference'] + con['turns_alone']}"
                f" | {_f(r['server'].get('cpu_s_per_turn'), 1, ' s', 2)}"
                f" | {_f(r.get('cpu', {}).get('other_processes_cores_busy'), 1, '', 2)} |"
            )
        lines.append("")
    for name in ("listen", "listen-100ms", "listen-rare"):
        if name not in results or not results[name]["report"]:
            continue
        r = results[name]["report"]
        lines += [
            f"`{name}`: {r['settings']['chunk_ms']} ms appends, a question every ~{r['settings']['turn_every_s']:g} s"
            f" per session ({'answered' if r['settings']['respond'] else 'transcribed, not answered'}).",
            "",
            "| sessions | probe p50 | probe p95 | probe p99 | probes | speech_started p99 | speech_stopped p99"
            " | server loop lag p99 | VAD call p99 (histogram) | VAD chunks per call | server CPU (cores)"
            " | loop thread µs per client event | other processes (cores) | ≤ target |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in r["steps"]:
            pr = s["probe_delay_s"]
            lines.append(
                f"| {s['sessions']} | {_f(pr['p50'])} | {_f(pr['p95'])} | {_f(pr['p99'])} | {pr['n']}"
                f" | {_f(s['speech_started_decision_s']['p99'])} | {_f(s['speech_stopped_decision_s']['p99'])}"
                f" | {_f(s['server']['loop_lag']['p99'])} | {_f(s['server']['stage_seconds']['vad']['p99'])}"
                f" | {_f(s.get('vad_chunks_per_call'), 1, '', 1)} | {_f(s['server'].get('cpu_cores_busy'), 1, '', 2)}"
                f" | {_f(s['server'].get('loop_thread_cpu_us_per_event_in'), 1, '', 0)}"
                f" | {_f(s['cpu'].get('other_processes_cores_busy'), 1, '', 2)} | {'yes' if s['passed'] else 'no'} |"
            )
        lines += ["", f"Knee: {r['knee_sessions']} sessions (p99 ≤ {r['settings']['target_ms']:g} ms).", ""]
    fake: list[str] = [n for n in ("fake100", "fake500", "fake500-100ms") if n in results and results[n]["report"]]
    if fake:
        lines += [
            "| run | sessions | appends | answered | server loop lag p99 | ticks ≤ 20 ms | messages/s (in+out)"
            " | server CPU (cores) | server CPU per session | eos → first audio p50 / p99 | client CPU (cores)"
            " | client append lateness p99 | loop thread µs per client event | other processes (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n in fake:
            r = results[n]["report"]
            srv = r["server"]
            lag = srv["loop_lag"]
            share = lag["share_le"].get("0.02")
            head = r["intervals_s"]["END OF SPEECH → FIRST AUDIO DELTA"]
            per = srv.get("cpu_s_per_session_second")
            lines.append(
                f"| {n} | {r['counts']['sessions_opened']} | {r['settings']['chunk_ms']} ms"
                f" | {r['counts']['turns_answered']}/{r['counts']['turns_planned']}"
                f" | {_f(lag['p99'])} | {_f(share, 100, ' %', 1)}"
                f" | {srv['messages_per_s']:.0f} | {_f(srv.get('cpu_cores_busy'), 1, '', 2)}"
                f" | {_f(per, 100, ' % of a core', 2)} | {_f(head['p50'])} / {_f(head['p99'])}"
                f" | {r['client']['cpu_cores_busy']:.2f} | {_f(r['client']['send_lateness_s']['p99'])}"
                f" | {_f(srv.get('loop_thread_cpu_us_per_event_in'), 1, '', 0)}"
                f" | {_f(r.get('cpu', {}).get('other_processes_cores_busy'), 1, '', 2)} |"
            )
        lines.append("")
    if "memory" in results and results["memory"]["report"]:
        r = results["memory"]["report"]
        lines += [
            "| pool size | RSS idle | RSS after one answered turn | RSS, every slot in a session | peak |",
            "|---|---|---|---|---|",
        ]
        for row in r["memory"]:
            lines.append(
                f"| {row['pool_size']} | {row['rss_mb_idle']:.1f} MB | {row['rss_mb_warm']:.1f} MB"
                f" | {row['rss_mb_all_slots_active']:.1f} MB | {row['rss_mb_peak']:.1f} MB |"
            )
        per = r["per_extra_slot_mb"]
        lines += ["", "Per extra slot: " + ", ".join(f"{k} {v:.2f} MB" for k, v in per.items()), ""]
        copies = results.get("copies", {}).get("report")
        if copies and copies.get("per_extra_copy_mb") and "rss_mb_all_slots_active" in per:
            pools = [row["pool_size"] for row in r["memory"]]
            # Two starts of the same server differ by a few MB of RSS: below this, a slot's cost is noise.
            floor = RSS_NOISE_MB / max(1, max(pools) - min(pools))
            slot = per["rss_mb_all_slots_active"]
            copy = copies["per_extra_copy_mb"]
            shared = f"{slot:.2f} MB" if slot > floor else f"under {floor:.2f} MB (the RSS noise floor)"
            lines.append(
                f"One model copy per slot: {copy:.1f} MB per extra copy; a shared-model slot: {shared}"
                f" → about {copy / max(slot, floor):.0f}× less per slot."
            )
            lines.append("")
    for n, res in results.items():
        lines.append(f"- `{n}`: `{res['command']}` (exit {res['exit']}, {res['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"


# --- output -------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables."""
    if report["mode"] == "suite":
        return str(report["summary"])
    lines: list[str] = []
    m = report["machine"]
    lines.append(
        f"s2s-rt bench — mode {report['mode']}, {m['cpu']} × {m['cores']} cores, load {m['loadavg'][0]:.2f} at the end"
    )
    if report["mode"] == "copies":
        lines.append(f"{'copies':>6} {'RSS MB':>9} {'+MB':>8} {'load+run s':>11}")
        prev = None
        for r in report["rows"]:
            grew = "" if prev is None else f"{r['rss_mb'] - prev:.1f}"
            lines.append(f"{r['copies']:>6} {r['rss_mb']:>9.1f} {grew:>8} {r['load_s']:>11.1f}")
            prev = r["rss_mb"]
        lines.append(
            f"first copy {report['first_copy_mb']:.1f} MB; each further copy {report['per_extra_copy_mb']:.1f} MB"
        )
        return "\n".join(lines)
    if report["mode"] == "memory":
        lines.append(f"{'pool':>6} {'idle MB':>9} {'warm MB':>9} {'all active MB':>14} {'peak MB':>9}")
        for r in report["memory"]:
            lines.append(
                f"{r['pool_size']:>6} {r['rss_mb_idle']:>9.1f} {r['rss_mb_warm']:>9.1f}"
                f" {r['rss_mb_all_slots_active']:>14.1f} {r['rss_mb_peak']:>9.1f}"
            )
        for k, v in report["per_extra_slot_mb"].items():
            lines.append(f"per extra slot ({k}): {v:.2f} MB")
        return "\n".join(lines)
    st = report["settings"]
    lines.append(
        f"server {st['url']} (stack {st['stack'] or '?'}, pool {st['pool_size'] or '?'}),"
        f" silence_duration_ms {st['silence_duration_ms']}, {st['chunk_ms']} ms appends, speech: {st['speech']}"
    )
    if report["mode"] == "talk":
        c = report["counts"]
        lines.append(
            f"{st['sessions']} sessions × {st['turns_per_session']} turns: {c['turns_answered']}/{c['turns_planned']}"
            f" answered in {report['duration_s']:.1f} s"
        )
        lines.append(f"{'interval':<52} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
        for label, s in report["intervals_s"].items():
            lines.append(
                f"{label:<52} {s['n']:>4} {_ms(s['p50']):>8} {_ms(s['p95']):>8} {_ms(s['p99']):>8} {_ms(s['max']):>8}"
            )
        con = report["contention"]
        lines.append(
            f"turns whose inference overlapped another session's: {con['turns_overlapping_another_sessions_inference']}"
            f" (eos→audio p50 {_ms(con['end_of_speech_to_first_audio_overlapped']['p50'])}),"
            f" alone: {con['turns_alone']} (p50 {_ms(con['end_of_speech_to_first_audio_alone']['p50'])})"
        )
    else:
        lines.append(
            f"{'sessions':>8} {'probe p50':>10} {'p95':>8} {'p99':>8} {'n':>6} {'started p99':>12}"
            f" {'stopped p99':>12} {'loop lag p99':>13} {'srv CPU':>8} {'cli CPU':>8}  result"
        )
        for s in report["steps"]:
            pr = s["probe_delay_s"]
            cpu = s["server"].get("cpu_cores_busy")
            lines.append(
                f"{s['sessions']:>8} {_ms(pr['p50']):>10} {_ms(pr['p95']):>8} {_ms(pr['p99']):>8} {pr['n']:>6}"
                f" {_ms(s['speech_started_decision_s']['p99']):>12} {_ms(s['speech_stopped_decision_s']['p99']):>12}"
                f" {_ms(s['server']['loop_lag']['p99']):>13} {'—' if cpu is None else f'{cpu:.2f}':>8}"
                f" {s['client']['cpu_cores_busy']:>8.2f}  {'ok' if s['passed'] else 'over target'}"
            )
        lines.append(f"knee: {report['knee_sessions']} sessions with p99 ≤ {st.get('target_ms')} ms")
    srv = report.get("server")
    if srv:
        lag = srv["loop_lag"]
        lines.append(
            f"server: event-loop lag p50 {_ms(lag['p50'])} p99 {_ms(lag['p99'])}"
            f" (share ≤ 20 ms: {_share(lag, '0.02')}); {srv['messages_per_s'] or 0:.0f} messages/s"
            f" ({srv['events_in']} in, {srv['events_out']} out)"
        )
        if "cpu_s" in srv:
            lines.append(
                f"server: CPU {srv['cpu_s']:.1f} s ({srv['cpu_cores_busy']:.2f} cores busy),"
                f" {srv.get('cpu_s_per_turn') or 0:.3f} s per turn,"
                f" {srv.get('cpu_s_per_session_second', 0) * 1000:.2f} ms per session-second;"
                f" RSS {srv['rss_mb_before']:.0f} → {srv['rss_mb_after']:.0f} MB (peak {srv['rss_mb_peak']:.0f})"
            )
            lines.append(
                f"server event-loop thread: on a CPU {srv['loop_thread_cpu_share'] * 100:.0f} % of the time,"
                f" runnable but waiting for a CPU {srv['loop_thread_waiting_for_cpu_share'] * 100:.0f} %;"
                f" {srv.get('loop_thread_cpu_us_per_event_in', 0):.0f} µs of its CPU per client event"
            )
        breakdown = report.get("server_turn_log_s")
        if breakdown:
            lines.append(
                "server turn log (from its speech_stopped decision), p50: "
                + ", ".join(f"{k} {_ms(v['p50'])}" for k, v in breakdown.items())
            )
        tfa = srv["turn_first_audio"]
        if tfa["count"]:
            lines.append(f"server-side speech_stopped → first audio sent: p50 {_ms(tfa['p50'])} p99 {_ms(tfa['p99'])}")
    cli = report.get("client")
    if cli:
        lines.append(
            f"client: CPU {cli['cpu_cores_busy']:.2f} cores, loop lag p99 {_ms(cli['loop_lag_s']['p99'])},"
            f" append lateness p99 {_ms(cli['send_lateness_s']['p99'])}"
        )
    cpu = report.get("cpu")
    if cpu:
        lines.append(_cpu_line(cpu))
    c = report["counts"]
    lines.append(
        f"sessions {c['sessions_opened']}, rejections {c['rejections']}, error events {c['error_events']},"
        f" foreign events {c['foreign_events']}, lost events {c['lost_events']}, unanswered {c['unanswered_turns']},"
        f" unexpected {c['unexpected_events']} → {'OK' if report['ok'] else 'FAILED'}"
    )
    for f in report["failures"][:10]:
        lines.append(f"  ! {f.get('at_s', 0):7.1f} s, session {f['session']}: {f['kind']}: {f['detail']}")
    return "\n".join(lines)


def _cpu_line(cpu: dict[str, Any]) -> str:
    def cores(key: str) -> str:
        v = cpu.get(key)
        return "?" if v is None else f"{v:.2f}"

    return (
        f"machine CPU: {cores('machine_cores_busy')} cores busy (server {cores('server_cores_busy')},"
        f" this client {cores('client_cores_busy')}, other processes {cores('other_processes_cores_busy')})"
    )


def _share(hist: dict[str, Any], bound: str) -> str:
    v = hist.get("share_le", {}).get(bound)
    return "—" if v is None else f"{v * 100:.1f} %"


# --- command line -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="s2s-rt bench",
        description="Load a Realtime server with spoken sessions; report latency per turn, capacity and memory.",
    )
    p.add_argument("--mode", choices=["talk", "listen", "memory", "copies", "suite"], default="talk")
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
    load.add_argument("--pause-s", type=float, default=1.0, help="silence between an answer and the next question")
    load.add_argument("--ramp-s", type=float, default=2.0, help="sessions start at random moments within this")
    load.add_argument("--speech", choices=["piper", "tone"], default="piper", help="who speaks the questions")
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


def _server_env(opts: argparse.Namespace) -> dict[str, str]:
    env = {}
    for kv in opts.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def run_async(opts: argparse.Namespace) -> dict[str, Any]:
    """Run what ``opts`` asks for; returns the report (printing nothing)."""
    clips = await asyncio.to_thread(
        load_questions,
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
        server = await asyncio.to_thread(
            ServerHandle.spawn, opts.stack, opts.pool_size, env=_server_env(opts), extra=opts.server_arg, log_path=log
        )
        if not opts.quiet:
            print(f"spawned server pid {server.pid} at {server.url} (log {server.log_path})", file=sys.stderr)
    else:
        server = ServerHandle(opts.url, opts.pid)
    try:
        if opts.mode == "listen":
            return await run_listen(opts, server, clips)
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


if __name__ == "__main__":
    sys.exit(main())
