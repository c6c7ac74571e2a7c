"""A seeded protocol fuzzer: hostile and calm Realtime sessions against one live server.

:func:`fuzz` starts a :class:`~s2s_rt.Server` on a free loopback port and
runs, for a few seconds, two kinds of clients over real sockets:

- **hostile** sessions, each driven by its own ``random.Random`` seeded from
  the run's seed, send random sequences of valid and invalid client events
  (every event type; ids the server announced reused; format, session-type
  and turn-detection switches; truncate/delete/retrieve of random ids; large
  and empty appends; garbage frames), stop reading for a while, close or
  abort at random moments and come back as new sessions;
- **calm** sessions do ordinary text and spoken turns throughout, and each
  turn must complete (``response.done`` with status ``completed``, its own
  words echoed) within :data:`CALM_TURN_S`.

Every event any session receives is checked as it arrives: it validates
against the official ``openai`` types (:func:`conformance.validate_server_event`);
each response has one ``response.created``, exactly one ``response.done``
and nothing of it after that; no id and no calm session's words reach
another session; the server never closes a session with 1011. After the run:
every slot is idle again, ``/healthz`` answers, a new client is served, no
stage crashed (``s2s_stage_restarts_total``), nothing unexpected was logged
at error level, and the process's RSS grew by at most :data:`RSS_GROWTH_MB`
besides the conversation state the local LLM keeps by design (bounded by
``llm_prefix_cache_tokens``, counted by the LLM in tokens).

With :func:`flaky_fake_stack` the fake engines get seeded random delays, and
work marked with :data:`FLAKY` (hostile sessions put it in their instructions,
transcription prompts and words) fails at random, so that calm sessions'
work never fails on purpose. Half the seeds hear every session in a child
process, as the default stack does (``hearing_process``), and :func:`child_fates`
kills it, stops it past its reply timeout or pauses it a moment, a few times a
run: the ``vad_failed`` each session is then sent, a calm spoken turn the
failed batch took (the calm client starts a new session), and the server's own
log of it are the fate's, not findings; a hearing process left alive or
unreaped once the server has stopped is one.

A run returns a :class:`FuzzReport`; :meth:`FuzzReport.describe` prints the
seed and, for each finding, the events the session sent (audio elided), so a
failure can be replayed (``FUZZ_SEED=…``) or written down as a regression test.

:func:`surface_fuzzing.surface_fuzz` does the same for the other ways in, against the server as
a process of its own: mutated SDP offers, multipart forms and JSON bodies,
preflights and posts from foreign origins, hangups of any id, offers in bursts
from one address, and real WebRTC calls that never connect, drop mid-answer,
vanish or overfill their data channel, beside calm sessions and a calm call;
then a SIGTERM at a random moment. Each finding lists the requests in flight
around it, saved to files that ``python tests/surface_fuzzing.py replay FILE PORT``
sends again (:mod:`surface_fuzzing`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import gc
import json
import logging
import os
import random
import re
import signal
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from conformance import validate_server_event
from mcp_host import McpHost
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from s2s_rt import Config, Server
from s2s_rt.audio import AudioFormat
from s2s_rt.engines.base import (
    ChatMessage,
    Float32Array,
    KeepsPrefixes,
    LLMRequest,
    LLMUsage,
    Stack,
    StopCheck,
    Transcript,
)
from s2s_rt.engines.fake import EnergyVAD, load_fake_stack
from s2s_rt.engines.prompt_cache import DEFAULT_MODEL_STATE_BYTES_PER_TOKEN
from s2s_rt.listening.remote import HearingProcess

#: The word that marks a hostile session's work: only work carrying it fails on purpose.
FLAKY = "flaky"
#: Longest a calm session's turn may take, from its last input to its response.done.
CALM_TURN_S = 10.0
#: How long a hostile session still open at the end waits for its responses to finish.
SETTLE_S = 15.0
#: Most the process's resident memory may grow over one run, besides the LLM's kept conversation state.
RSS_GROWTH_MB = 400.0
#: The kept conversation state of a token of the default LLM. It grows by design up to
#: ``llm_prefix_cache_tokens`` (6000, about 1 GB): a 6 s run of the default stack kept 1,450-1,700 tokens of it
#: (240-280 MB) in three seeds.
KEPT_STATE_MB_PER_TOKEN = DEFAULT_MODEL_STATE_BYTES_PER_TOKEN / 2**20
#: Patterns a run can be told to avoid (``FUZZ_AVOID``), to look past a known bug for others.
AVOIDABLE = frozenset(
    {
        "reuse_speech_id",  # conversation.item.create with the item id speech_started announced
        "transcription_switch",  # session.update / transcription_session.update to a transcription session
        "transcription_intent",  # connecting with ?intent=transcription
        "huge_append",  # appends above 256 KiB
        "stop_reading",  # clients that stop reading for a while
        "abort",  # connections dropped without a closing handshake
        "engine_faults",  # injected engine failures
        "long_prompts",  # instructions of thousands of characters
        "mcp",  # MCP tools (a real MCP server on loopback, a dead one, refused ones) and approval answers
        "hearing_process",  # hearing in a child process, killed, hung and paused at random
    }
)
#: What a run may do to the server's hearing process (the child that hears every session's audio), when it
#: hears in one: kill it, stop it past its reply timeout, or pause it for less.
CHILD_FATES = ("kill", "hang", "pause")
#: Fates per run at most: each kill or hang costs one of the five restarts the server allows.
CHILD_FATES_PER_RUN = 3
#: A calm session's ``vad_failed`` or lost turn this soon after a fate is the fate's: the batch it failed held
#: every session's audio, and the sessions heard until a new child is ready start from fresh state.
CHILD_FATE_S = 6.0
#: The server's VAD timeout where the run hears in a child (the child's reply timeout is 0.8 of it).
CHILD_VAD_TIMEOUT_S = 2.0
#: The shape of an id the server makes (``new_id``): no two sessions can hold the same one.
SERVER_ID = re.compile(r"^[a-z]+_[0-9a-f]{20}$")
#: Close codes a hostile session may get: normal, going away, no status, abnormal (an abort),
#: policy (not reading, flooding), too big, try again later (full, backlog).
ACCEPTED_CLOSE_CODES = frozenset({1000, 1001, 1005, 1006, 1008, 1009, 1013})

#: An MCP server URL the fuzzed server allows, where nothing listens (port 9, discard: closed on loopback).
DEAD_MCP_URL = "http://127.0.0.1:9/mcp"

CORPUS = sorted((Path(__file__).parent / "fuzz_corpus").glob("*.json"))


# --- engines with seeded delays and failures --------------------------------------------------


class InjectedFault(RuntimeError):
    """A failure the fuzzer's engines raise on purpose."""


class Chaos:
    """Seeded random delays and failures shared by the wrapped engines (thread-safe).

    Args:
        seed: the run's seed.
        fail_rate: chance that one call on work marked :data:`FLAKY` fails.
        delay_ms: the longest random delay of one call or piece.
    """

    def __init__(self, seed: int, *, fail_rate: float = 0.3, delay_ms: float = 20.0) -> None:
        self._rng = random.Random(f"{seed}:engines")
        self._lock = threading.Lock()
        self.fail_rate = fail_rate
        self.delay_ms = delay_ms
        self.failures = 0

    def sleep(self, scale: float = 1.0) -> None:
        with self._lock:
            delay = self._rng.random() * self.delay_ms * scale / 1000
        time.sleep(delay)

    def fails(self, marked: bool) -> bool:
        if not marked or not self.fail_rate:
            return False
        with self._lock:
            hit = self._rng.random() < self.fail_rate
            self.failures += hit
        return hit

    def pick(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(max(1, n))


class FlakyVAD:
    """The fake VAD; rarely a few milliseconds late (it runs on the listening clock every session shares)."""

    def __init__(self, inner: Any, chaos: Chaos) -> None:
        self.inner, self.chaos = inner, chaos
        self.chunk_samples = inner.chunk_samples

    def new_state(self) -> Any:
        return self.inner.new_state()

    def hearing_recipe(self) -> type[EnergyVAD]:
        """The fake VAD in the hearing process, where the run hears in one (without the delays)."""
        return EnergyVAD

    def speech_probabilities(self, chunks: Float32Array, states: Sequence[Any]) -> Float32Array:
        if self.chaos.pick(50) == 0:
            self.chaos.sleep(0.1)
        result: Float32Array = self.inner.speech_probabilities(chunks, states)
        return result


class FlakySTT:
    """The fake STT, late at random; fails at random when the transcription prompt is marked."""

    def __init__(self, inner: Any, chaos: Chaos) -> None:
        self.inner, self.chaos = inner, chaos

    def transcribe(self, audio: Float32Array, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        self.chaos.sleep(3)
        if self.chaos.fails(bool(prompt) and FLAKY in (prompt or "")):
            raise InjectedFault("injected STT failure")
        result: Transcript = self.inner.transcribe(audio, language=language, prompt=prompt)
        return result


class FlakyLLM:
    """The fake LLM, late at random per token; fails mid-stream at random when the conversation is marked."""

    def __init__(self, inner: Any, chaos: Chaos) -> None:
        self.inner, self.chaos = inner, chaos

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float:
        self.chaos.sleep()
        return float(self.chaos.pick(100)) / 100

    def stream(self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage) -> Iterator[str]:
        self.chaos.sleep(2)
        marked = any(FLAKY in m.content for m in request.messages)
        fail_at = self.chaos.pick(6) if self.chaos.fails(marked) else -1
        pieces = self.inner.stream(request, should_stop=should_stop, usage=usage)
        for i, piece in enumerate(pieces):
            if i == fail_at:
                raise InjectedFault("injected LLM failure")
            self.chaos.sleep(0.5)
            yield piece


class FlakyTTS:
    """The fake TTS, late at random per word; fails at random on marked text."""

    def __init__(self, inner: Any, chaos: Chaos) -> None:
        self.inner, self.chaos = inner, chaos
        self.sample_rate = inner.sample_rate
        self.voices = inner.voices

    def synthesize(
        self, text: str, *, voice: str | None, should_stop: StopCheck, speed: float = 1.0
    ) -> Iterator[Float32Array]:
        fail = self.chaos.fails(FLAKY in text)
        for i, piece in enumerate(self.inner.synthesize(text, voice=voice, should_stop=should_stop, speed=speed)):
            if fail and i == 1:
                raise InjectedFault("injected TTS failure")
            self.chaos.sleep(0.5)
            yield piece


def flaky_fake_stack(seed: int, *, faults: bool = True) -> tuple[Stack, Chaos]:
    """The fake stack behind seeded random delays (and, with ``faults``, failures of marked work)."""
    inner = load_fake_stack()
    chaos = Chaos(seed, fail_rate=0.3 if faults else 0.0)
    stack = Stack(
        name="fake",
        vad=FlakyVAD(inner.vad, chaos),
        stt=FlakySTT(inner.stt, chaos),
        llm=FlakyLLM(inner.llm, chaos),
        tts=FlakyTTS(inner.tts, chaos),
        description=[*inner.description, f"with seeded random delays{' and failures' if faults else ''}"],
    )
    return stack, chaos


# --- what a run found ---------------------------------------------------------------------------


@dataclass
class Finding:
    """One broken promise, with what the session sent and got before it."""

    who: str
    what: str
    sent: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)

    def kind(self) -> str:
        """The finding without its ids and numbers, to group the same bug seen several times."""
        return re.sub(r"(resp|item|sess|event|h\d+\.\d+-i)[_A-Za-z0-9.-]*|\d+(\.\d+)?", "#", self.what)


@dataclass
class FuzzReport:
    seed: int
    seconds: float
    stack: str
    findings: list[Finding] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    calm_latencies: list[float] = field(default_factory=list)
    rss_growth_mb: float = 0.0
    #: Of that growth, what the LLM's kept conversation state accounts for (:data:`KEPT_STATE_MB_PER_TOKEN`).
    kept_state_mb: float = 0.0
    #: The test whose ``FUZZ_SEED`` replays it.
    test: str = "tests/test_session_fuzz.py"

    def summary(self) -> str:
        worst = max(self.calm_latencies, default=0.0)
        top = ", ".join(f"{k} {v}" for k, v in sorted(self.stats.items()))
        kept = f" (the LLM keeping {self.kept_state_mb:+.0f} MB of conversations)" if self.kept_state_mb else ""
        return (
            f"seed {self.seed} ({self.stack} stack, {self.seconds:.0f} s): {len(self.findings)} finding(s); "
            f"calm turns {len(self.calm_latencies)} (slowest {worst:.2f} s); "
            f"RSS +{self.rss_growth_mb:.0f} MB{kept}; {top}"
        )

    def describe(self, sent_tail: int = 60, received_tail: int = 25) -> str:
        """The seed, how to replay it, and each distinct finding with its session's events."""
        lines = [self.summary(), f"replay: FUZZ_SEED={self.seed} .venv/bin/python -m pytest {self.test}"]
        seen: Counter[str] = Counter(f.kind() for f in self.findings)
        first = {f.kind(): f for f in reversed(self.findings)}
        lines += [f"  - [{f.who}] {f.what[:300]}  (seen {seen[kind]}x)" for kind, f in reversed(first.items())]
        for f in reversed(first.values()):
            lines.append(f"\n### [{f.who}] {f.what}")
            sent = f.sent
            if sent:
                lines.append(f"  sent (last {min(sent_tail, len(sent))}):")
                lines += [f"    {s}" for s in sent[-sent_tail:]]
            received = f.received
            if received:
                lines.append(f"  received (last {min(received_tail, len(received))}):")
                lines += [f"    {r}" for r in received[-received_tail:]]
        return "\n".join(lines)


class Trail:
    """The last frames one way of a session, a run of the same frame (appends, deltas) kept as one line."""

    def __init__(self, started: float, maxlen: int = 400) -> None:
        self.started = started
        self.entries: deque[list[Any]] = deque(maxlen=maxlen)  # [seconds, text, count]

    def add(self, text: str) -> None:
        if self.entries and self.entries[-1][1] == text:
            self.entries[-1][2] += 1
        else:
            self.entries.append([time.monotonic() - self.started, text, 1])

    def lines(self) -> list[str]:
        return [f"{t:7.3f} {text}" + (f"  (x{n})" if n > 1 else "") for t, text, n in self.entries]


class ErrorLog(logging.Handler):
    """Collects the server's error-level log records that no injected fault explains."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        #: Whether the run killed, hung or paused the hearing process lately (:meth:`Run.fated_since`, at a time).
        self.fated: Callable[[float], bool] = lambda now: False

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if _caused_by_injection(exc) or "injected" in record.getMessage():
            return
        if "the hearing process failed" in record.getMessage() and self.fated(time.monotonic()):
            return  # a fate's: the batch it failed, and the child started again
        text = record.getMessage()
        if exc is not None:
            text += f": {_last_frames(exc)}"
        self.records.append(f"{record.name}: {text}")


def _caused_by_injection(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, InjectedFault):
            return True
        if isinstance(exc, BaseExceptionGroup):
            return all(_caused_by_injection(e) for e in exc.exceptions)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


# --- one session of the fuzzer ----------------------------------------------------------------


def _shown(payload: dict[str, Any] | str | bytes) -> str:
    """One sent frame for the log: JSON with audio elided, or the raw frame cut short."""
    if isinstance(payload, bytes):
        return f"<binary frame, {len(payload)} bytes: {payload[:40]!r}>"
    if isinstance(payload, str):
        return payload if len(payload) < 200 else payload[:200] + f"…<{len(payload)} chars>"

    def elide(v: Any) -> Any:
        if isinstance(v, dict):
            return {
                k: (f"<{len(x)} b64 chars>" if k == "audio" and isinstance(x, str) else elide(x)) for k, x in v.items()
            }
        if isinstance(v, list):
            return [elide(x) for x in v]
        return v

    text = json.dumps(elide(payload))
    return text if len(text) < 400 else text[:400] + "…"


def _abort(ws: ClientConnection) -> None:
    try:
        ws.transport.abort()
    except AttributeError:
        pass  # already closed (CPython 3.11's transport, closed after a flush, has no loop left)


def _received_shown(event: dict[str, Any]) -> str:
    t = event.get("type")
    keys = ("item_id", "response_id", "previous_item_id")
    extra = {k: event[k] for k in keys if k in event}
    if isinstance(event.get("response"), dict):
        extra["response"] = {k: event["response"].get(k) for k in ("id", "status", "status_details")}
    if isinstance(event.get("item"), dict):
        extra["item"] = {k: event["item"].get(k) for k in ("id", "type", "role", "status")}
    if t == "error":
        extra["error"] = event.get("error")
    return f"{t} {json.dumps(extra)}" if extra else str(t)


class Session:
    """One WebSocket connection of the fuzzer: what it sent and got, and the checks on what it got."""

    def __init__(self, run: Run, label: str, ws: ClientConnection, *, beta: bool, calm: bool) -> None:
        self.run, self.label, self.ws, self.beta, self.calm = run, label, ws, beta, calm
        self.started = time.monotonic()
        self.sent = Trail(self.started)
        self.received = Trail(self.started, 200)
        self.response_log: dict[str, list[str]] = {}  # the events of each response not yet done
        self.items: list[str] = []  # every item id the server announced, in order
        self.speech_ids: list[str] = []  # item ids announced by speech_started
        self.approvals: list[str] = []  # mcp_approval_request items the server made
        self.responses: list[str] = []
        self.created: set[str] = set()
        self.done: set[str] = set()
        self.dones: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.errors: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.reading = asyncio.Event()
        self.reading.set()
        self.first = asyncio.get_running_loop().create_future()
        self.closed_by_client = False
        self.close_code: int | None = None
        self.close_reason = ""
        self.format = AudioFormat()
        self.ids = 0
        self.reader = asyncio.create_task(self._read(), name=f"fuzz-reader-{label}")

    # what it sends

    def new_id(self) -> str:
        self.ids += 1
        return f"{self.label}-i{self.ids}"

    async def send(self, payload: dict[str, Any] | str | bytes) -> None:
        self.sent.add(_shown(payload))
        self.run.report.stats["events sent"] += 1
        if isinstance(payload, dict):
            self.run.report.stats[f"sent {payload.get('type')}"] += 1
            payload = json.dumps(payload)
        try:
            await self.ws.send(payload)
        except AttributeError as exc:
            # CPython 3.11's transport, closed after a flush, has no loop left for websockets' abort().
            raise ConnectionClosed(None, None) from exc

    def note(self, text: str) -> None:
        self.sent.add(f"({text})")

    def find(self, what: str) -> None:
        self.run.find(self, what)

    @property
    def open_responses(self) -> set[str]:
        return self.created - self.done

    # what it gets

    async def _read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                raw = await self.ws.recv()
                self._got(raw)
        except ConnectionClosed as exc:
            if exc.rcvd is not None:
                self.close_code, self.close_reason = exc.rcvd.code, exc.rcvd.reason
            elif exc.sent is not None and self.closed_by_client:
                self.close_code = exc.sent.code
            else:
                self.close_code = 1006
        finally:
            if not self.first.done():
                self.first.set_result(None)
            self._check_close()

    def _check_close(self) -> None:
        code = self.close_code
        if self.closed_by_client:
            return
        if code == 1011:
            self.find(f"server closed the session with 1011 ({self.close_reason!r})")
        elif self.calm:
            self.find(f"server closed a calm session with {code} ({self.close_reason!r})")
        elif code not in ACCEPTED_CLOSE_CODES and code is not None:
            self.find(f"server closed the session with unexpected code {code} ({self.close_reason!r})")

    def _got(self, raw: str | bytes) -> None:
        run = self.run
        run.report.stats["events received"] += 1
        if isinstance(raw, bytes):
            self.find(f"binary frame from the server ({len(raw)} bytes)")
            return
        for marker in run.calm_marker.findall(raw):
            if marker != self.label:
                self.find(f"words of calm session {marker} reached this session")
        try:
            event = json.loads(raw)
        except ValueError:
            self.find(f"server sent invalid JSON: {raw[:200]!r}")
            return
        shown = _received_shown(event) if isinstance(event, dict) else repr(event)
        self.received.add(shown)
        try:
            validate_server_event(event, beta=self.beta)
        except AssertionError as exc:
            self.find(f"non-conformant event: {str(exc)[:600]}")
        if not isinstance(event, dict):
            return
        if not self.first.done():
            self.first.set_result(event)
        self._ledger(event)

    def _ledger(self, event: dict[str, Any]) -> None:
        t = str(event.get("type"))
        run = self.run
        if not self.calm:
            run.report.stats[f"got {t}"] += 1
        # Ids the server announced: reused by the hostile sessions, and never seen by another session.
        item = event.get("item")
        for iid in (event.get("item_id"), item.get("id") if isinstance(item, dict) else None):
            if isinstance(iid, str) and iid:
                if iid not in self.items:
                    self.items.append(iid)
                if not SERVER_ID.match(iid):
                    continue  # a client's own id: two clients may well choose the same
                owner = run.owners.setdefault(("item", iid), self.label)
                if owner != self.label:
                    self.find(f"{t} names item {iid} of session {owner}")
        if t == "input_audio_buffer.speech_started" and isinstance(event.get("item_id"), str):
            self.speech_ids.append(event["item_id"])
        if isinstance(item, dict) and item.get("type") == "mcp_approval_request" and t == "conversation.item.done":
            self.approvals.append(str(item.get("id")))
        if t == "error":
            run.report.stats[f"error {(event.get('error') or {}).get('code')}"] += 1
            code = (event.get("error") or {}).get("code")
            if self.calm and not (code == "vad_failed" and run.fated_since(time.monotonic())):
                self.find(f"a calm session got an error: {event.get('error')}")
            self.errors.put_nowait(event)
        response = event.get("response")
        rid = response.get("id") if isinstance(response, dict) else event.get("response_id")
        if not isinstance(rid, str):
            return
        owner = run.owners.setdefault(("response", rid), self.label)
        if owner != self.label:
            self.find(f"{t} names response {rid} of session {owner}")
        log = self.response_log.get(rid)
        if log is not None and len(log) < 60:
            log.append(f"{time.monotonic() - self.started:.3f} {t}")
        if t == "response.created":
            if rid in self.created:
                self.find(f"second response.created for {rid}")
            self.created.add(rid)
            self.responses.append(rid)
            self.response_log[rid] = [f"{time.monotonic() - self.started:.3f} response.created"]
            run.report.stats["responses"] += 1
        elif t == "response.done":
            if rid not in self.created:
                self.find(f"response.done for {rid}, which was never created")
            elif rid in self.done:
                self.find(f"second response.done for {rid}")
            self.done.add(rid)
            self.response_log.pop(rid, None)
            self.created.add(rid)
            status = response.get("status") if isinstance(response, dict) else None
            run.report.stats[f"response {status}"] += 1
            self.dones.put_nowait(event)
        elif rid in self.done:
            self.find(f"{t} of response {rid} after its response.done")
        elif rid not in self.created:
            self.find(f"{t} of response {rid} before its response.created")

    # ending

    async def settle(self, timeout: float) -> None:
        """Read again and wait until every response created so far is done (or the server closed)."""
        self.reading.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.open_responses and not self.reader.done() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.open_responses and not self.reader.done():
            stuck = sorted(self.open_responses)
            for rid in stuck:
                self.received.add(f"events of {rid}: " + " | ".join(self.response_log.get(rid, [])))
            self.find(f"response(s) {stuck} never got response.done ({timeout:.0f} s)")

    async def close(self, *, abort: bool = False) -> None:
        self.closed_by_client = True
        self.reading.set()
        if abort:
            self.note("abort")
            _abort(self.ws)
        else:
            try:
                await asyncio.wait_for(self.ws.close(), 5)
            except (TimeoutError, ConnectionClosed, OSError, AttributeError):
                _abort(self.ws)
        try:
            await asyncio.wait_for(self.reader, 5)
        except TimeoutError:
            self.reader.cancel()
            self.find("the connection did not end within 5 s of closing it")


# --- what hostile sessions send --------------------------------------------------------------

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()
#: A 4 x 4 PNG as a data URI (an ``input_image`` the server takes).
TINY_PNG = "data:image/png;base64," + (
    "iVBORw0KGgoAAAANSUhEUgAAAAQAAAAECAIAAAAmkwkpAAAAFElEQVR4nGPkTD7OAANMDEgANwcAPDwBOxWo/AIAAAAASUVORK5CYII="
)

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}
GARBAGE: tuple[str, ...] = (
    "{",
    "[]",
    "null",
    "42",
    '"text"',
    "{}",
    '{"type": 5}',
    '{"type": "nope"}',
    '{"type": "input_audio_buffer.append"}',
    '{"type": "input_audio_buffer.append", "audio": "%%%not base64"}',
    '{"type": "input_audio_buffer.append", "audio": "AAE="}',
    '{"type": "conversation.item.create", "item": 7}',
    '{"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": "soon"}',
    '{"type": "session.update", "session": {"audio": {"input": {"format": "wat"}}}}',
    '{"type": "response.create", "response": {"input": [{"type": "message"}]}}',
    '{"type": "session.update", "session": []}',
    "[" * 5000 + "]" * 5000,
    '{"type": "response.cancel", "event_id": "' + "e" * 5000 + '"}',
    "\u0000\ud7ff",
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


_BIG: dict[int, str] = {}


def big_audio(n_bytes: int) -> str:
    """Base64 of ``n_bytes`` of loud PCM noise (made once per size)."""
    if n_bytes not in _BIG:
        noise = (np.random.default_rng(n_bytes).standard_normal(n_bytes // 2) * 3000).astype("<i2").tobytes()
        _BIG[n_bytes] = _b64(noise)
    return _BIG[n_bytes]


def speech_like(fmt: AudioFormat, freq: float, seconds: float, silence_s: float) -> bytes:
    """A tone then silence, in the wire format the session was last asked to use."""
    t = np.arange(int(fmt.rate * seconds)) / fmt.rate
    samples = np.concatenate([0.3 * np.sin(2 * np.pi * freq * t), np.zeros(int(fmt.rate * silence_s))])
    return fmt.encode(samples.astype(np.float32))


class Hostile:
    """The random actions of one hostile session, all drawn from its own seeded generator."""

    def __init__(
        self, rng: random.Random, avoid: frozenset[str], speech: bytes | None, mcp_urls: tuple[str, ...] = ()
    ) -> None:
        self.rng = rng
        self.avoid = avoid
        self.speech = speech  # 24 kHz PCM16 that the stack's VAD hears as speech, when tones are not
        self.mcp_urls = mcp_urls  # the MCP servers the operator allowed: a live one, a dead one

    async def mcp(self, s: Session, eid: dict[str, str]) -> None:
        """MCP tools set alone (so that they are taken), then often a question naming one of the server's tools."""
        rng = self.rng
        tools = [self.mcp_tool() for _ in range(rng.choice([1, 1, 2]))] + rng.choice([[], [TOOL]])
        session = {"type": "realtime", "tools": tools, "tool_choice": rng.choice(["auto", "required"])}
        await s.send({"type": "session.update", "session": session} | eid)
        if rng.random() < 0.6:
            await asyncio.sleep(rng.choice([0.0, 0.3, 0.6]))  # often after the listing, so that the model sees them
            name = rng.choice(["get_weather", "get_weather", "slow_search", "book_table", "long_story", "lookup"])
            words = {"type": "input_text", "text": f"{name} {self.words()}"}
            await s.send(
                {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [words]}}
            )
            await s.send({"type": "response.create"})

    def mcp_tool(self) -> dict[str, Any]:
        """A ``type: "mcp"`` tool: allowed (live or dead), refused, or malformed; every address on loopback."""
        rng = self.rng
        if self.mcp_urls and rng.random() < 0.5:  # one that works: listed, and called when the model names it
            approval = rng.choice(["never", "never", "always"])
            return {
                "type": "mcp",
                "server_label": "weather",
                "server_url": self.mcp_urls[0],
                "require_approval": approval,
            }
        urls = [*self.mcp_urls, "http://127.0.0.1:9/other", "http://127.0.0.1:1@10.0.0.1/mcp", "file:///etc/passwd"]
        tool: dict[str, Any] = {"type": "mcp", "server_label": rng.choice(["weather", "w2", "", None])}
        tool["server_url"] = rng.choice([*urls, *self.mcp_urls, None, 7])
        if rng.random() < 0.5:
            tool["require_approval"] = rng.choice(["never", "always", {"never": {"tool_names": ["lookup"]}}, "maybe"])
        if rng.random() < 0.3:
            tool["allowed_tools"] = rng.choice([["lookup", "get_weather"], {"tool_names": ["get_weather"]}, "all"])
        if rng.random() < 0.3:
            tool["headers"] = rng.choice([{"X-A": "b"}, {"X-A": "b\r\nX-B: c"}, {"": "x"}, ["x"]])
        return tool

    # ids

    def some_item_id(self, s: Session) -> str | None:
        rng = self.rng
        pool = [i for i in s.items if "reuse_speech_id" not in self.avoid or i not in s.speech_ids]
        roll = rng.random()
        if pool and roll < 0.6:
            return rng.choice(pool[-8:] if rng.random() < 0.7 else pool)
        if roll < 0.75:
            return f"{s.label}-i{rng.randrange(1, s.ids + 2)}"
        return rng.choice(["", f"{s.label}-missing", f"{s.label}-" + "x" * 300, "root", None])

    def words(self) -> str:
        rng = self.rng
        words = [rng.choice(WORDS) for _ in range(rng.randrange(0, 8))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words) + 1), FLAKY)
        control = rng.random()
        if control < 0.15:
            words.append(f"[[slow {rng.randrange(0, 120)}]]")
        elif control < 0.22:
            words.append("[[fail]]")
        elif control < 0.28:
            words.append("[[tts-fail]]")
        elif control < 0.31:
            words.append(f"[[block {rng.randrange(0, 60)}]]")
        elif control < 0.34:
            words.append("lookup " + rng.choice(WORDS))
        return " ".join(words)

    # events

    def turn_detection(self) -> dict[str, Any] | None:
        rng = self.rng
        kind = rng.choice(["server_vad", "server_vad", "semantic_vad", None, "bogus"])
        if kind is None:
            return None
        td: dict[str, Any] = {"type": kind}
        if kind == "semantic_vad":
            if rng.random() < 0.7:
                td["eagerness"] = rng.choice(["low", "medium", "high", "auto", "frantic"])
        else:
            for key, values in (
                ("threshold", [0.0, 0.3, 0.5, 0.9, 1.5, -1]),
                ("silence_duration_ms", [0, 50, 200, 500, 1200, -5]),
                ("prefix_padding_ms", [0, 100, 300, 5000]),
                ("idle_timeout_ms", [None, 500, 2000, 10_000]),
            ):
                if rng.random() < 0.4:
                    td[key] = rng.choice(values)
        for key in ("create_response", "interrupt_response"):
            if rng.random() < 0.4:
                td[key] = rng.random() < 0.7
        return td

    def input_format(self, s: Session, beta_shape: bool) -> Any:
        rng = self.rng
        kind = rng.choice(["audio/pcm", "audio/pcm", "audio/pcmu", "audio/pcma", "audio/opus"])
        rate = rng.choice([None, 24_000, 24_000, 16_000, 48_000, 8000, 44_100]) if kind == "audio/pcm" else None
        try:
            s.format = AudioFormat.parse(kind, rate)
        except ValueError:
            pass
        if beta_shape:
            return {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}.get(kind, kind)
        return {"type": kind} | ({"rate": rate} if rate is not None else {})

    def session_update(self, s: Session) -> dict[str, Any]:
        rng = self.rng
        session: dict[str, Any] = {}
        beta_shape = rng.random() < 0.35
        if rng.random() < 0.35:
            kinds = ["realtime", "realtime", "transcription", "bogus"]
            if "transcription_switch" in self.avoid:
                kinds.remove("transcription")
            session["type"] = rng.choice(kinds)
        if rng.random() < 0.3:
            long = [] if "long_prompts" in self.avoid else ["x" * 2000]
            session["instructions"] = rng.choice(["Be brief.", f"Be {FLAKY}.", "", *long])
        transcription: Any = ...
        if rng.random() < 0.3:
            transcription = rng.choice(
                [None, {"model": "whisper-1"}, {"model": "whisper-1", "prompt": FLAKY}, {"language": "en"}]
            )
        td: Any = self.turn_detection() if rng.random() < 0.4 else ...
        fmt: Any = self.input_format(s, beta_shape) if rng.random() < 0.3 else ...
        if beta_shape:
            if transcription is not ...:
                session["input_audio_transcription"] = transcription
            if td is not ...:
                session["turn_detection"] = td
            if fmt is not ...:
                session["input_audio_format"] = fmt
            if rng.random() < 0.2:
                session["modalities"] = rng.choice([["text"], ["audio", "text"], ["video"]])
            if rng.random() < 0.2:
                session["voice"] = rng.choice(["tone", "tone-low", "nobody"])
        else:
            audio_in: dict[str, Any] = {}
            if transcription is not ...:
                audio_in["transcription"] = transcription
            if td is not ...:
                audio_in["turn_detection"] = td
            if fmt is not ...:
                audio_in["format"] = fmt
            audio: dict[str, Any] = {"input": audio_in} if audio_in else {}
            if rng.random() < 0.2:
                audio["output"] = {
                    "voice": rng.choice(["tone", "tone-low", "nobody"]),
                    "format": rng.choice([{"type": "audio/pcm", "rate": 48_000}, {"type": "audio/pcmu"}]),
                }
            if audio:
                session["audio"] = audio
            if rng.random() < 0.2:
                session["output_modalities"] = rng.choice([["text"], ["audio"], ["video"], []])
        if rng.random() < 0.15:
            session["max_output_tokens" if not beta_shape else "max_response_output_tokens"] = rng.choice(
                [1, 3, 20, "inf", 0, -4]
            )
        if rng.random() < 0.1:
            session["temperature"] = rng.choice([0.0, 0.8, 3.0, "hot"])
        if rng.random() < 0.1:
            session["tools"] = [TOOL]
            session["tool_choice"] = rng.choice(["auto", "required", "none"])
        if not beta_shape and "mcp" not in self.avoid and rng.random() < 0.2:
            session["tools"] = [self.mcp_tool() for _ in range(rng.choice([1, 1, 2]))] + rng.choice([[], [TOOL]])
            session["tool_choice"] = rng.choice(["auto", "required"])
        if rng.random() < 0.15:
            session["truncation"] = rng.choice(
                [
                    "auto",
                    "disabled",
                    {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 40}},
                    {"type": "retention_ratio", "retention_ratio": rng.choice([0.0, 1.0, 2.0])},
                    "sometimes",
                ]
            )
        if not beta_shape and rng.random() < 0.1:
            voice = rng.choice([{"id": "tone-low"}, {"id": "voice_1234"}, {"id": 7}, {}])
            session.setdefault("audio", {}).setdefault("output", {})["voice"] = voice
        return {"type": "session.update", "session": session}

    def transcription_session_update(self, s: Session) -> dict[str, Any]:
        rng = self.rng
        transcription = {"model": "whisper-1", "prompt": rng.choice(["", FLAKY])}
        session: dict[str, Any] = {"input_audio_transcription": transcription}
        if rng.random() < 0.5:
            session["turn_detection"] = self.turn_detection()
        if rng.random() < 0.3:
            session["input_audio_format"] = self.input_format(s, True)
        return {"type": "transcription_session.update", "session": session}

    def item(self, s: Session) -> dict[str, Any]:
        rng = self.rng
        kinds = ["user", "user", "user", "assistant", "system", "audio", "call", "output", "image", "bogus"]
        kind = rng.choice(kinds if "mcp" in self.avoid else [*kinds, "approval"])
        item: dict[str, Any]
        if kind == "user":
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.words()}]}
        elif kind == "assistant":
            item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": self.words()}]}
        elif kind == "system":
            item = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": self.words()}]}
        elif kind == "audio":
            pcm = speech_like(AudioFormat(), rng.uniform(200, 900), rng.uniform(0.0, 0.6), 0.1)
            item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": _b64(pcm)}]}
        elif kind == "image":
            url = rng.choice([TINY_PNG, TINY_PNG, "data:image/png;base64,AAAA", "http://127.0.0.1:9/x.png", "", None])
            part = {
                "type": "input_image",
                "image_url": url,
                "detail": rng.choice(["auto", "low", "high", "huge", None]),
            }
            item = {"type": "message", "role": "user", "content": [part, {"type": "input_text", "text": self.words()}]}
        elif kind == "call":
            item = {
                "type": "function_call",
                "call_id": f"call_{rng.randrange(4)}",
                "name": "lookup",
                "arguments": rng.choice(['{"word": "alpha"}', "{", ""]),
            }
        elif kind == "output":
            item = {"type": "function_call_output", "call_id": f"call_{rng.randrange(4)}", "output": self.words()}
        elif kind == "approval":
            asked = rng.choice([*s.approvals[-3:], self.some_item_id(s)]) if s.approvals else self.some_item_id(s)
            item = {
                "type": "mcp_approval_response",
                "approval_request_id": asked,
                "approve": rng.choice([1, 0, 0, "y"]) == 1,
            }
            if rng.random() < 0.2:
                item["approve"] = rng.choice(["yes", None])
        else:
            item = rng.choice(
                [{"type": "nonsense"}, {"type": "message", "role": "robot", "content": []}, {"type": "message"}, {}]
            )
        roll = rng.random()
        if roll < 0.35:
            item["id"] = self.some_item_id(s)
        elif roll < 0.6:
            item["id"] = s.new_id()
        return item

    def item_create(self, s: Session) -> dict[str, Any]:
        event: dict[str, Any] = {"type": "conversation.item.create", "item": self.item(s)}
        if self.rng.random() < 0.3:
            event["previous_item_id"] = self.some_item_id(s)
        return event

    def response_create(self, s: Session) -> dict[str, Any]:
        rng = self.rng
        if rng.random() < 0.4:
            return {"type": "response.create"}
        response: dict[str, Any] = {}
        if rng.random() < 0.3:
            response["conversation"] = rng.choice(["none", "auto", "bogus"])
        if rng.random() < 0.3:
            response["instructions"] = rng.choice(["Answer.", f"Be {FLAKY}.", ""])
        if rng.random() < 0.3:
            response["output_modalities"] = rng.choice([["text"], ["audio"], ["nothing"]])
        if rng.random() < 0.3:
            response["max_output_tokens"] = rng.choice([1, 2, 5, 50, "inf", 0])
        if rng.random() < 0.3:
            items: list[dict[str, Any]] = [self.item(s) for _ in range(rng.randrange(0, 3))]
            if s.items and rng.random() < 0.5:
                items.append({"type": "item_reference", "id": rng.choice(s.items)})
            response["input"] = items
        if rng.random() < 0.15:
            response["tools"] = [TOOL]
            response["tool_choice"] = rng.choice(["auto", "required", "none"])
        if rng.random() < 0.1:
            response["audio"] = {"output": {"voice": rng.choice(["tone", "tone-low", "nobody"])}}
        if rng.random() < 0.1:
            response["metadata"] = {"k": "v"}
        return {"type": "response.create", "response": response}

    def garbage(self) -> str | bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        if roll < 0.6 and CORPUS:
            frame = json.loads(rng.choice(CORPUS).read_text())
            keys = [k for k in frame if k != "type"]
            if keys:
                key = rng.choice(keys)
                if rng.random() < 0.5:
                    del frame[key]
                else:
                    frame[key] = rng.choice([None, 0, -1, "", [], {}, True, "x" * 100, 1e308])
            return json.dumps(frame)
        return rng.choice(GARBAGE)

    async def append(self, s: Session) -> None:
        """An append of some kind: speech, silence, empty, large, or broken."""
        rng = self.rng
        kind = rng.choice(["speech", "speech", "speech", "silence", "empty", "large", "bad"])
        if kind == "speech":
            if self.speech is not None and s.format == AudioFormat() and rng.random() < 0.5:
                pcm = self.speech
            else:
                pcm = speech_like(s.format, rng.uniform(200, 900), rng.uniform(0.1, 1.0), rng.uniform(0.0, 1.0))
            chunk = s.format.bytes_per_sample * int(s.format.rate * rng.choice([0.01, 0.02, 0.1, 0.5]))
            pace = rng.choice([0.0, 0.0, 0.01, 0.02])
            for i in range(0, len(pcm), chunk):
                await s.send({"type": "input_audio_buffer.append", "audio": _b64(pcm[i : i + chunk])})
                if pace:
                    await asyncio.sleep(pace)
        elif kind == "silence":
            quiet = bytes(rng.choice([2, 480, 9600, 48_000]))
            await s.send({"type": "input_audio_buffer.append", "audio": _b64(quiet)})
        elif kind == "empty":
            await s.send({"type": "input_audio_buffer.append", "audio": ""})
        elif kind == "large":
            sizes = [64 << 10, 256 << 10]
            if "huge_append" not in self.avoid:
                sizes += [1 << 20, 4 << 20, 11 << 20, 13 << 20]  # the last is above max_message_mib: 1009
            await s.send({"type": "input_audio_buffer.append", "audio": big_audio(rng.choice(sizes))})
        else:
            await s.send(
                rng.choice(
                    [
                        '{"type": "input_audio_buffer.append", "audio": "AAA"}',
                        '{"type": "input_audio_buffer.append", "audio": "AQ=="}',
                        '{"type": "input_audio_buffer.append", "audio": 12}',
                        '{"type": "input_audio_buffer.append", "audio": "@@@@"}',
                    ]
                )
            )

    async def step(self, s: Session) -> str:
        """Do one random thing; returns its name (``close``/``abort`` end the session)."""
        rng = self.rng
        actions = {
            "append": 24,
            "commit": 6,
            "clear": 3,
            "output.clear": 1,
            "session.update": 8,
            "transcription_session.update": 2,
            "item.create": 10,
            "item.retrieve": 3,
            "item.truncate": 4,
            "item.delete": 4,
            "response.create": 9,
            "response.cancel": 5,
            "garbage": 5,
            "burst": 1,
            "pause": 6,
            "stop_reading": 2,
            "close": 1,
            "abort": 1,
        }
        if self.mcp_urls:
            actions["mcp"] = 3
        if "transcription_switch" in self.avoid:
            actions.pop("transcription_session.update")
        for avoided in ("stop_reading", "abort"):
            if avoided in self.avoid:
                actions.pop(avoided)
        action = rng.choices(list(actions), weights=list(actions.values()))[0]
        s.run.report.stats[f"action {action}"] += 1
        eid = {"event_id": f"{s.label}-e{rng.randrange(10**6)}"} if rng.random() < 0.3 else {}
        if action == "append":
            await self.append(s)
        elif action == "commit":
            await s.send({"type": "input_audio_buffer.commit"} | eid)
        elif action == "clear":
            await s.send({"type": "input_audio_buffer.clear"} | eid)
        elif action == "output.clear":
            await s.send({"type": "output_audio_buffer.clear"} | eid)  # a call's event: refused over a WebSocket
        elif action == "session.update":
            await s.send(self.session_update(s) | eid)
        elif action == "mcp":
            await self.mcp(s, eid)
        elif action == "transcription_session.update":
            await s.send(self.transcription_session_update(s) | eid)
        elif action == "item.create":
            await s.send(self.item_create(s) | eid)
        elif action in ("item.retrieve", "item.delete"):
            await s.send({"type": f"conversation.{action}", "item_id": self.some_item_id(s)} | eid)
        elif action == "item.truncate":
            event = {
                "type": "conversation.item.truncate",
                "item_id": self.some_item_id(s),
                "content_index": rng.choice([0, 0, 1, -1, None, 7]),
                "audio_end_ms": rng.choice([0, 1, 50, 300, 1500, 60_000, -20, 10**12]),
            }
            await s.send(event | eid)
        elif action == "response.create":
            await s.send(self.response_create(s) | eid)
        elif action == "response.cancel":
            event = {"type": "response.cancel"}
            roll = rng.random()
            if roll < 0.4 and s.responses:
                event["response_id"] = rng.choice(s.responses[-4:])
            elif roll < 0.55:
                event["response_id"] = rng.choice(["resp_unknown", "", "x" * 200])
            await s.send(event | eid)
        elif action == "garbage":
            await s.send(self.garbage())
        elif action == "burst":
            kind = rng.choice(["commit", "clear", "cancel", "retrieve"])
            frame = json.dumps(
                {
                    "commit": {"type": "input_audio_buffer.commit"},
                    "clear": {"type": "input_audio_buffer.clear"},
                    "cancel": {"type": "response.cancel"},
                    "retrieve": {"type": "conversation.item.retrieve", "item_id": "nope"},
                }[kind]
            )
            s.note(f"burst of {kind}")
            for _ in range(rng.randrange(20, 300)):
                await s.send(frame)
        elif action == "pause":
            await asyncio.sleep(rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]))
        elif action == "stop_reading":
            pause = rng.uniform(0.3, 4.0)
            s.note(f"stops reading for {pause:.1f} s")
            s.reading.clear()
            asyncio.get_running_loop().call_later(pause, s.reading.set)
        return action


# --- the run ----------------------------------------------------------------------------------


class Run:
    """One fuzzing run against one live server."""

    def __init__(self, server: Any, report: FuzzReport, deadline: float, *, avoid: frozenset[str]) -> None:
        self.server = server  # anything with the port it listens on (a Server, a ServerProcess)
        self.report = report
        self.deadline = deadline
        self.avoid = avoid
        self.owners: dict[tuple[str, str], str] = {}
        self.calm_marker = re.compile(r"calmword(c\d+)x")
        self.live: set[Session] = set()
        #: Headers every session's handshake carries (an API key, when the server wants one).
        self.headers: dict[str, str] = {}
        #: The loopback address each session connects from (by label), for per-address limits; default 127.0.0.1.
        self.sources: dict[str, str] = {}
        #: MCP servers the server allows: a live one and a dead one (none where ``mcp`` is avoided).
        self.mcp_urls: tuple[str, ...] = ()
        #: When the run killed, hung or paused the server's hearing process (:func:`child_fates`).
        self.fates: list[float] = []

    def over(self) -> bool:
        return time.monotonic() >= self.deadline

    def fated_since(self, start: float) -> bool:
        """Whether a fate of the hearing process came after ``start`` or up to :data:`CHILD_FATE_S` before."""
        return any(t >= start - CHILD_FATE_S for t in self.fates)

    def find(self, s: Session | None, what: str) -> None:
        who = s.label if s is not None else "server"
        sent = s.sent.lines() if s is not None else []
        received = s.received.lines() if s is not None else []
        self.report.findings.append(Finding(who, what, sent, received))

    async def open(
        self, label: str, *, beta: bool = False, path: str = "/v1/realtime", calm: bool = False
    ) -> Session | None:
        headers = self.headers | ({"OpenAI-Beta": "realtime=v1"} if beta else {})
        source = self.sources.get(label)
        try:
            ws = await connect(
                f"ws://127.0.0.1:{self.server.port}{path}",
                additional_headers=headers,
                open_timeout=10,
                max_size=None,
                max_queue=4 if not calm else 64,
                **({"local_addr": (source, 0)} if source else {}),
            )
        except (InvalidHandshake, OSError, TimeoutError) as exc:
            self.report.stats[f"connect refused: {type(exc).__name__}"] += 1
            return None
        s = Session(self, label, ws, beta=beta, calm=calm)
        self.live.add(s)
        s.reader.add_done_callback(lambda _t: self.live.discard(s))
        self.report.stats["sessions"] += 1
        return s


def _transcript(done: dict[str, Any]) -> str:
    for out in done["response"].get("output") or []:
        for part in out.get("content") or []:
            text = part.get("transcript") or part.get("text")
            if text:
                return str(text)
    return ""


async def hostile_worker(run: Run, index: int, seed: int, speech: bytes | None) -> None:
    """Hostile sessions one after another until the run is over."""
    rng = random.Random(f"{seed}:hostile{index}")
    actor = Hostile(rng, run.avoid, speech, run.mcp_urls)
    generation = 0
    while not run.over():
        generation += 1
        beta = rng.random() < 0.3
        path = "/v1/realtime?intent=transcription" if rng.random() < 0.1 else "/v1/realtime"
        if {"transcription_switch", "transcription_intent"} & run.avoid:
            path = "/v1/realtime"
        s = await run.open(f"h{index}.{generation}", beta=beta, path=path)
        if s is None:
            await asyncio.sleep(0.2)
            continue
        ending = "settle"
        try:
            await asyncio.wait_for(s.first, 10)
            while not run.over() and not s.reader.done():
                action = await actor.step(s)
                if action in ("close", "abort"):
                    ending = action
                    break
            if ending == "settle":
                await s.settle(SETTLE_S)
        except ConnectionClosed:
            pass
        except TimeoutError:
            s.find("no first event within 10 s of connecting")
        finally:
            await s.close(abort=ending == "abort")


async def calm_worker(run: Run, index: int, seed: int, speech: bytes, *, fake: bool) -> None:
    """A well-behaved client: text and spoken turns, each of which must complete. A turn that a fate of the
    hearing process took (:func:`child_fates`) is not a finding: the client starts again with a new session."""
    rng = random.Random(f"{seed}:calm{index}")
    label = f"c{index}"
    turn: int | None = 0
    while turn is not None and not run.over():
        s = await _calm_session(run, label, fake=fake)
        if s is None:
            return
        try:
            turn = await _calm_turns(run, s, rng, index, turn, speech, fake=fake)
        except ConnectionClosed:
            return  # found by the reader's close check
        finally:
            await s.close()


async def _calm_session(run: Run, label: str, *, fake: bool) -> Session | None:
    """A calm session, once admitted (the listening admission may refuse one while the machine is busy)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 15
    s: Session | None = None
    while s is None:
        s = await run.open(label, calm=True)
        if s is not None:
            first = await asyncio.wait_for(s.first, 10)
            if first is None or first.get("type") == "error":
                await s.close()
                s = None
        if s is None:
            if loop.time() > give_up:
                run.find(None, f"calm session {label} was never admitted")
                return None
            await asyncio.sleep(0.3)
    await s.send(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {"input": {"transcription": {"model": "whisper-1", "prompt": "steady"}}},
                **({} if fake else {"max_output_tokens": 12, "temperature": 0.0}),
            },
        }
    )
    return s


async def _calm_turns(
    run: Run, s: Session, rng: random.Random, index: int, turn: int, speech: bytes, *, fake: bool
) -> int | None:
    """Turns until the run is over (None), or the turn a fate of the hearing process took (its number: the
    client starts again). A turn that fails otherwise is a finding (None)."""
    label = s.label
    while not run.over():
        turn += 1
        spoken = turn % 2 == 0
        word = f"calmword{label}x{turn}"
        asked = time.monotonic()
        if spoken:
            pcm = speech_like(AudioFormat(), 250 + 37 * index + 11 * (turn % 13), 0.5, 0.9) if fake else speech
            for i in range(0, len(pcm), 4800):
                await s.send({"type": "input_audio_buffer.append", "audio": _b64(pcm[i : i + 4800])})
        else:
            await s.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": f"please repeat {word}"}],
                    },
                }
            )
            await s.send({"type": "response.create"})
        t0 = time.monotonic()
        kind = "spoken" if spoken else "text"
        try:
            done = await asyncio.wait_for(s.dones.get(), CALM_TURN_S)
        except TimeoutError:
            done = None
        status = None if done is None else done["response"].get("status")
        if spoken and status != "completed" and run.fated_since(asked):
            run.report.stats["calm spoken turns a fate of the hearing process took"] += 1
            return turn
        if done is None:
            s.find(f"calm {kind} turn {turn} got no response.done within {CALM_TURN_S:.0f} s")
            return None
        run.report.calm_latencies.append(time.monotonic() - t0)
        if status != "completed":
            s.find(f"calm turn {turn} ended {status}: {done['response'].get('status_details')}")
        elif fake and not spoken and _transcript(done) != f"You said: please repeat {word}.":
            s.find(f"calm turn {turn} answered {_transcript(done)!r}")
        elif fake and spoken and not _transcript(done).startswith("You said: heard"):
            s.find(f"calm spoken turn {turn} answered {_transcript(done)!r}")
        await asyncio.sleep(rng.uniform(0.0, 0.3))
    return None


async def child_fates(run: Run, seed: int) -> None:
    """At seeded moments, the server's hearing process is killed, hung past its reply timeout or paused for
    less: a batch of every session's audio fails (or is late), and the server must carry on."""
    clock = getattr(run.server, "clock", None)
    hearing = getattr(clock, "hearing", None)
    if not isinstance(hearing, HearingProcess):
        return
    rng = random.Random(f"{seed}:child")
    for _ in range(CHILD_FATES_PER_RUN):
        await asyncio.sleep(rng.uniform(2.0, 8.0))
        pid = hearing.pid
        if run.over() or pid is None:  # over, or a new child is starting
            continue
        fate = rng.choice(CHILD_FATES)
        run.fates.append(time.monotonic())
        run.report.stats[f"hearing process: {fate}"] += 1
        if fate == "kill":
            os.kill(pid, signal.SIGKILL)
            continue
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(2 * CHILD_VAD_TIMEOUT_S if fate == "hang" else rng.uniform(0.02, 0.3))
        run.fates.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def hearing_children() -> list[str]:
    """This process's hearing processes still alive or not reaped: ``pid state`` each."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and b"s2s_rt.listening.remote" in (stat.parent / "cmdline").read_bytes():
                found.append(f"{stat.parent.name} {fields[0]}")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


async def _warm_up(server: Server) -> None:
    """One answer before the clock starts: a real model's first call is slower than any other."""
    async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime") as ws:
        await ws.send(
            json.dumps({"type": "response.create", "response": {"instructions": "Say hi.", "max_output_tokens": 4}})
        )
        async with asyncio.timeout(60):
            while json.loads(await ws.recv()).get("type") != "response.done":
                pass


def _rss_mb() -> float:
    """The process's resident memory once what is free has been handed back.

    The server runs in the test process, whose heap also holds what earlier
    tests freed: glibc keeps freed memory in its arenas, so a bare VmRSS
    moved by 115-405 MB for the same seed alone and in the whole suite.
    Collected and trimmed first, it counts what is still held.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _kept_tokens(server: Server) -> int:
    """Tokens of conversation state the server's local LLM keeps now (0 for an LLM that keeps none)."""
    llm = server.stack.llm if server.stack is not None else None
    return llm.prefixes.held_tokens if isinstance(llm, KeepsPrefixes) else 0


async def _http(server: Server, path: str) -> tuple[int, str]:
    from conftest import http_get

    return await http_get(server, path)


async def _after_checks(run: Run, server: Server, pool_size: int, speech: bytes, fake: bool) -> None:
    """The server survived: slots idle, healthy, serves a new client, nothing crashed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    pool: dict[str, Any] = {}
    while loop.time() < deadline:
        pool = json.loads((await _http(server, "/v1/pool"))[1])
        if pool["states"].get("idle") == pool_size:
            break
        await asyncio.sleep(0.1)
    else:
        stuck = [s for s in pool.get("slots", []) if s["state"] != "idle"]
        run.find(None, f"slots not idle 15 s after every client left: {stuck}")
    status, _ = await _http(server, "/healthz")
    if status != 200:
        run.find(None, f"/healthz answered {status}")
    metrics = (await _http(server, "/metrics"))[1]
    restarts = re.search(r"^s2s_stage_restarts_total (\d+)", metrics, re.M)
    if restarts and int(restarts.group(1)):
        run.find(None, f"{restarts.group(1)} slot stage crash(es) (s2s_stage_restarts_total)")
    # A new client is served whole: a text turn and a spoken one.
    s = await run.open("after", calm=True)
    if s is None:
        run.find(None, "a new client could not connect after the run")
        return
    try:
        first = await asyncio.wait_for(s.first, 10)
        if first is None or first.get("type") != "session.created":
            s.find(f"a new client after the run got {first}")
            return
        await s.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "after"}]},
            }
        )
        await s.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        pcm = speech_like(AudioFormat(), 440, 0.5, 0.9) if fake else speech
        for turn in ("text", "spoken"):
            if turn == "spoken":
                for i in range(0, len(pcm), 4800):
                    await s.send({"type": "input_audio_buffer.append", "audio": _b64(pcm[i : i + 4800])})
            try:
                done = await asyncio.wait_for(s.dones.get(), CALM_TURN_S)
            except TimeoutError:
                s.find(f"a new client's {turn} turn after the run got no response.done")
                return
            if done["response"].get("status") != "completed":
                s.find(f"a new client's {turn} turn after the run ended {done['response'].get('status')}")
    except (ConnectionClosed, TimeoutError) as exc:
        s.find(f"a new client after the run failed: {exc!r}")
    finally:
        await s.close()


async def fuzz(
    seed: int,
    seconds: float,
    *,
    hostile: int = 4,
    calm: int = 2,
    stack: str = "fake",
    avoid: frozenset[str] = frozenset(),
    speech: Callable[[Server], bytes] | None = None,
    **config: Any,
) -> FuzzReport:
    """One seeded run: ``hostile`` + ``calm`` sessions for ``seconds``, then the checks.

    Args:
        seed: drives every session's generator and the engines' delays and failures.
        seconds: how long the sessions fuzz (settling and the checks come on top).
        hostile: hostile sessions at any time (each comes back after it closes).
        calm: well-behaved sessions, whose every turn must complete.
        stack: ``fake`` (with seeded delays and failures) or ``default`` (the real models).
        avoid: patterns of :data:`AVOIDABLE` not to send (to look past a known bug).
        speech: makes 24 kHz PCM16 that the stack's VAD hears as speech (the default
            stack's VAD hears no tones); default a tone.
        config: more :class:`Config` fields.

    Returns:
        The report; its ``findings`` are empty when every check held.
    """
    report = FuzzReport(seed, seconds, stack)
    pool_size = hostile + calm + 2
    settings: dict[str, Any] = {
        "port": 0,
        "stack": stack,
        "pool_size": pool_size,
        "drain_timeout_s": 3.0,
        "grace_period_s": 2.0,
        "send_timeout_s": 2.0,
    } | config
    engines = None
    chaos = None
    if stack == "fake":
        engines, chaos = flaky_fake_stack(seed, faults="engine_faults" not in avoid)
        # Half the runs hear in a child (as the default stack does), and that child meets its fates.
        in_child = "hearing_process" not in avoid and random.Random(f"{seed}:hearing").random() < 0.5
        child = {"hearing_process": in_child} | ({"vad_timeout_s": CHILD_VAD_TIMEOUT_S} if in_child else {})
        settings = child | settings
        report.stats[f"heard in {'a child' if in_child else 'the server'}"] += 1
    errors = ErrorLog()
    logger = logging.getLogger("s2s_rt")
    logger.addHandler(errors)
    mcp: contextlib.AbstractContextManager[McpHost | None] = (
        contextlib.nullcontext(None) if "mcp" in avoid else McpHost()
    )
    try:
        with mcp as host:
            if host is not None:
                # A live MCP server and a dead port, both allowed; the generator adds refused and malformed ones.
                settings |= {"mcp_servers": [host.url, DEAD_MCP_URL], "mcp_timeout_s": 2.0}
            async with Server(Config(**settings), stack=engines) as server:
                pcm = speech(server) if speech is not None else speech_like(AudioFormat(), 440, 0.6, 0.9)
                if stack != "fake":
                    await _warm_up(server)
                rss_before, kept_before = _rss_mb(), _kept_tokens(server)  # the models are loaded by now
                run = Run(server, report, time.monotonic() + seconds, avoid=avoid)
                errors.fated = run.fated_since
                if host is not None:
                    run.mcp_urls = (host.url, DEAD_MCP_URL)
                tasks = [
                    *(hostile_worker(run, i, seed, pcm if stack != "fake" else None) for i in range(hostile)),
                    *(calm_worker(run, i, seed, pcm, fake=stack == "fake") for i in range(calm)),
                    *([child_fates(run, seed)] if stack == "fake" else []),
                ]
                await asyncio.gather(*tasks)
                if run.live:
                    run.find(None, f"sessions still open after the workers ended: {[s.label for s in run.live]}")
                await _after_checks(run, server, pool_size, pcm, stack == "fake")
                report.rss_growth_mb = _rss_mb() - rss_before
                report.kept_state_mb = (_kept_tokens(server) - kept_before) * KEPT_STATE_MB_PER_TOKEN
                if report.rss_growth_mb - report.kept_state_mb > RSS_GROWTH_MB:
                    run.find(
                        None,
                        f"RSS grew by {report.rss_growth_mb:.0f} MB, {report.kept_state_mb:.0f} MB of it the LLM's kept"
                        f" conversations (more than {RSS_GROWTH_MB:.0f} MB besides)",
                    )
    except Exception as exc:  # the server itself failed (its close re-raises what ended its main task)
        report.findings.append(Finding("server", f"the server failed: {_last_frames(exc)}"))
    finally:
        logger.removeHandler(errors)
    left = hearing_children()
    if left:
        report.findings.append(Finding("server", f"hearing processes left after the server stopped: {left}"))
    for record in errors.records:
        report.findings.append(Finding("server log", record))
    if chaos is not None:
        report.stats["injected engine failures"] = chaos.failures
    return report


def _last_frames(exc: BaseException) -> str:
    """An exception (the leaves of a group) with the frames it was raised from, briefly."""
    if isinstance(exc, BaseExceptionGroup):
        return " | ".join(_last_frames(e) for e in exc.exceptions)
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc} (at {where})"


def avoided_from_env() -> frozenset[str]:
    """``FUZZ_AVOID=a,b``: patterns of :data:`AVOIDABLE` the run leaves out."""
    names = frozenset(n.strip() for n in os.environ.get("FUZZ_AVOID", "").split(",") if n.strip())
    unknown = names - AVOIDABLE
    assert not unknown, f"FUZZ_AVOID names unknown patterns {sorted(unknown)}; known: {sorted(AVOIDABLE)}"
    return names


def seeds(fuzz_seconds: float, run_seconds: float) -> list[int]:
    """``FUZZ_SEED``'s seeds; else fixed ones for a bounded run (at most 60 s), fresh ones for a long one."""
    given = os.environ.get("FUZZ_SEED")
    if given:
        return [int(s) for s in given.split(",")]
    if fuzz_seconds <= 60:
        return list(range(1, 1 + max(1, round(fuzz_seconds / run_seconds))))
    first = random.SystemRandom().randrange(10**6)
    return list(range(first, first + 10_000))


def check_reports(reports: list[FuzzReport]) -> None:
    """Fail with every finding of every report (each with its seed, to replay it)."""
    failed = [r for r in reports if r.findings]
    assert not failed, "\n\n".join(r.describe() for r in failed)
