"""Listening: input audio through the VAD into turns, and when to transcribe ahead.

The receive path only parses a client's frame and puts the raw audio (or a
buffer command, a settings change, a response request) in its session's
inbox: no decoding, no task switch per append. One :class:`ListeningClock`
for the whole process then works on a short clock: it takes the audio that
every session has in its inbox, decodes, resamples and scores it with the
VAD in one executor call (all sessions' windows of one step in one batched
inference), and back on the loop feeds each session's turn detector and
handles its commands, in the order they came. Only the clock touches a
session's listening state, so nothing it reads changes under it.

Sessions whose audio waits longer than ``max_backlog_s`` are told
(``audio_backlog_exceeded``) and closed alone; when the clock itself falls
behind, the server stops admitting sessions (see :attr:`ListeningClock.overloaded`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from s2s_rt.audio import AudioFormat, AudioFormatError, Resampler
from s2s_rt.engines.base import PIPELINE_RATE, VAD, ChatMessage, Float32Array, Transcript
from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.anticipation import AnswerKey, Anticipation, can_anticipate
from s2s_rt.pipeline.responding import ClauseSplitter
from s2s_rt.pipeline.speaking import tts_voice
from s2s_rt.pipeline.work import (
    AudioBytes,
    BufferCommand,
    ResponseRequest,
    SettingsChanged,
    Transcribe,
    ms_to_samples,
    samples_to_ms,
)
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import ServerEvent, new_id
from s2s_rt.scope import Scope
from s2s_rt.spoken_answer import with_answer_context
from s2s_rt.toolcalls import offered_tools
from s2s_rt.turn import SemanticTurnEnd, SpeechStart, SpeechStop, TurnDetector

if TYPE_CHECKING:
    from s2s_rt.pipeline.context import SessionContext
    from s2s_rt.protocol.response import ResponseParams
    from s2s_rt.slot import Slot

log = logging.getLogger("s2s_rt.slot")
T = TypeVar("T")

#: ``semantic_vad``: what the LLM reads to judge whether the user has finished (besides their words).
JUDGE_SYSTEM = "You are a helpful voice assistant."
JUDGED_ANSWER_CHARS = 200

#: A transcription session's words are transcribed this often while the user speaks (live captions).
CAPTION_EVERY_MS = 1000


@dataclass
class InputBuffer:
    """The session's uncommitted input audio at ``PIPELINE_RATE``, clocked from session start.

    Arrays put in are never changed afterwards, so a view of them may be
    handed to a worker thread without a copy.
    """

    start_sample: int = 0
    chunks: list[Float32Array] = field(default_factory=list)
    samples: int = 0

    @property
    def end_sample(self) -> int:
        return self.start_sample + self.samples

    def append(self, x: Float32Array) -> None:
        self.chunks.append(x)
        self.samples += len(x)

    def audio(self) -> Float32Array:
        if len(self.chunks) != 1:
            joined = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
            self.chunks = [joined]
        return self.chunks[0]

    def between(self, start: int, end: int) -> tuple[tuple[Float32Array, ...], int, int]:
        """The chunks holding audio in [start, end), with where it begins and ends in them joined: no copy."""
        return tuple(self.chunks), max(0, start - self.start_sample), max(0, end - self.start_sample)

    def drop_before(self, sample: int) -> None:
        """Forget audio before ``sample``: whole chunks are let go, the first kept one is sliced (no copy)."""
        cut = sample - self.start_sample
        if cut <= 0:
            return
        cut = min(cut, self.samples)
        chunks = self.chunks
        dropped = 0
        i = 0
        while i < len(chunks) and dropped + len(chunks[i]) <= cut:
            dropped += len(chunks[i])
            i += 1
        del chunks[:i]
        if cut > dropped:
            chunks[0] = chunks[0][cut - dropped :]
        self.samples -= cut
        self.start_sample += cut

    def take(self, start: int, end: int) -> Float32Array:
        """Audio in [start, end) (session sample clock); drops everything before ``end``."""
        a = self.audio()
        clip = a[max(0, start - self.start_sample) : max(0, end - self.start_sample)].copy()
        self.drop_before(min(end, self.end_sample))
        return clip

    def clear(self) -> None:
        self.start_sample = self.end_sample
        self.chunks, self.samples = [], 0


@dataclass
class Speculation:
    """A transcription of a turn started during its closing silence."""

    task: asyncio.Task[Transcript | BaseException]
    #: Set by the worker thread when the engine call really starts.
    started: threading.Event
    #: ``semantic_vad``: the probability that the words transcribed end the turn, once judged.
    finished: float | None = None


class ListeningState:
    """What the listening clock keeps about one session. Only the clock touches it."""

    def __init__(
        self, vad_state: Any, turn_detection: Any, input_format: AudioFormat, semantic: SemanticTurnEnd | None = None
    ) -> None:
        self.vad_state = vad_state
        #: Raw audio and commands in arrival order, waiting for the clock.
        self.inbox: collections.deque[Any] = collections.deque()
        #: Bytes of raw audio in the inbox.
        self.inbox_bytes = 0
        #: Closed for falling behind: nothing more is heard.
        self.closing = False
        self.format = input_format
        self.resampler = Resampler(input_format.rate, PIPELINE_RATE)
        self.pending = np.zeros(0, np.float32)
        self.clock = 0  # samples of input audio fed to the VAD so far
        self.buffer = InputBuffer()
        self.detector = TurnDetector(turn_detection, semantic) if turn_detection is not None else None
        self.turn_item_id: str | None = None
        self.speculation: Speculation | None = None
        #: The answer to the speculative transcript, begun in the closing silence.
        self.anticipation: Anticipation | None = None
        #: A speculative engine call is running (wanted or not): no second one starts meanwhile.
        self.speculating = False
        self.idle_from = 0  # sample clock when idle time started counting
        #: Audio time of the last live-caption pass (transcription sessions).
        self.captioned_ms = 0.0
        #: The client was told the buffer is full; not again until it has room.
        self.buffer_full = False
        #: The ``event_id`` of the last append heard.
        self.heard_event_id: str | None = None

    def backlog_s(self, now: float) -> float:
        """How long the oldest audio not yet heard has waited."""
        for item in self.inbox:
            if isinstance(item, AudioBytes):
                return now - item.received
        return 0.0

    def inbox_audio_s(self) -> float:
        """Seconds of audio waiting in the inbox."""
        return sum(item.seconds() for item in self.inbox if isinstance(item, AudioBytes))


class EngineUnavailable(Exception):
    """The VAD call for a whole batch failed: not any one session's doing."""


@dataclass(slots=True)
class Heard:
    """What the worker made of one session's new audio."""

    samples: Float32Array
    probabilities: Float32Array
    error: Exception | None = None


def _join(chunks: tuple[Float32Array, ...], start: int, end: int) -> Float32Array:
    audio = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    return audio[start:end]


def _resample_each(ls: ListeningState, segments: list[AudioBytes]) -> Float32Array:
    """A session's new audio whose format changed within it: each piece with the resampler of its format."""
    parts = []
    for seg in segments:
        if seg.format != ls.format:
            ls.format = seg.format
            ls.resampler = Resampler(seg.format.rate, PIPELINE_RATE)
        parts.append(ls.resampler.process(seg.format.decode(seg.data)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NOTHING


_NOTHING = np.zeros(0, np.float32)


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took (in the thread that runs it)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def hear(vad: VAD, work: Sequence[tuple[ListeningState, list[AudioBytes], bool]]) -> list[Heard]:
    """Decode, resample and score every session's new audio (runs in the VAD worker thread).

    The work is done for groups of sessions, not one by one: sessions whose
    new audio has one format and length share one decode and one resampling
    product per phase; those whose unwindowed rest has one length share one
    cut into VAD windows; and all sessions' windows of one step go to the
    VAD in one batched call. A session's own windows are scored in order,
    since the model carries state from one to the next.
    """
    chunk = vad.chunk_samples
    heard: list[Heard | None] = [None] * len(work)
    samples: list[Float32Array] = [_NOTHING] * len(work)
    # 1. Decode and resample, a group of one format and byte length at a time.
    same: dict[tuple[AudioFormat, int], list[int]] = {}
    data: list[bytes | memoryview] = [b""] * len(work)
    for i, (ls, segments, _) in enumerate(work):
        fmt = ls.format
        if all(seg.format is fmt or seg.format == fmt for seg in segments):
            data[i] = segments[0].data if len(segments) == 1 else b"".join([seg.data for seg in segments])
            same.setdefault((fmt, len(data[i])), []).append(i)
            continue
        try:
            samples[i] = _resample_each(ls, segments)
        except AudioFormatError as exc:  # checked on arrival; a bug if it happens here
            heard[i] = Heard(_NOTHING, _NOTHING, exc)
    for (fmt, _), members in same.items():
        try:
            block = fmt.decode(b"".join([data[i] for i in members])).reshape(len(members), -1)
        except AudioFormatError as exc:  # checked on arrival; a bug if it happens here
            for i in members:
                heard[i] = Heard(_NOTHING, _NOTHING, exc)
            continue
        resampled = Resampler.process_block([work[i][0].resampler for i in members], block)
        for i, out in zip(members, resampled, strict=True):
            samples[i] = out
    # 2. Cut windows, a group of one rest length and one new length at a time.
    cuts: dict[tuple[int, int], list[int]] = {}
    for i, (ls, _, score) in enumerate(work):
        if heard[i] is not None:
            continue
        if not score:
            heard[i] = Heard(samples[i], _NOTHING)
            continue
        cuts.setdefault((len(ls.pending), len(samples[i])), []).append(i)
    steps: list[tuple[list[int], Float32Array]] = []  # members, their windows (G, n, chunk)
    for (rest, new), members in cuts.items():
        joined = np.stack([samples[i] for i in members])
        if rest:
            joined = np.concatenate([np.stack([work[i][0].pending for i in members]), joined], axis=1)
        n = (rest + new) // chunk
        probabilities = np.zeros((len(members), n), np.float32)
        for row, i in enumerate(members):
            work[i][0].pending = joined[row, n * chunk :]
            heard[i] = Heard(samples[i], probabilities[row])
        if n:
            steps.append((members, joined[:, : n * chunk].reshape(len(members), n, chunk)))
    # 3. Score: step k holds the k-th window of every session that has one. If a step fails, each of its
    # sessions is scored alone: a failure that one session's audio causes is that session's alone.
    failed: set[int] = set()
    for k in range(max((w.shape[1] for _, w in steps), default=0)):
        now = [(members, w) for members, w in steps if w.shape[1] > k]
        if failed:  # sessions whose audio failed are not scored again
            now = [(m, w[[r for r, i in enumerate(m) if i not in failed]]) for m, w in now]
            now = [([i for i in m if i not in failed], w) for m, w in now if len(w)]
            if not now:
                break
        rows = [i for members, _ in now for i in members]
        chunks = np.concatenate([w[:, k] for _, w in now])
        try:
            probs = vad.speech_probabilities(chunks, [work[i][0].vad_state for i in rows])
        except Exception:
            for j, i in enumerate(rows):
                try:
                    heard[i].probabilities[k] = vad.speech_probabilities(chunks[j : j + 1], [work[i][0].vad_state])[0]  # type: ignore[union-attr]
                except Exception as exc:
                    heard[i].error = exc  # type: ignore[union-attr]
                    failed.add(i)
            continue
        for i, p in zip(rows, probs.tolist(), strict=True):
            heard[i].probabilities[k] = p  # type: ignore[union-attr]
    return heard  # type: ignore[return-value]


#: Hearing a session costs the clock about this many times more while sessions stream than
#: :meth:`ListeningClock.calibrate` measures alone at start: the hearing thread then waits for the GIL
#: while the loop receives every session's appends. Measured on the 2-core machine at 100-200 listening
#: sessions: 3.4-4.4 ms of the clock's time per second of a session's audio, against 2.0-2.4 ms at start.
CONTENTION = 1.7


class ListeningCost:
    """What hearing costs the clock, measured: a fixed part per tick and a part per second of audio.

    A tick of ``A`` seconds of audio (all sessions together) keeps the
    clock busy about ``overhead_s + value × A`` seconds: the hearing in the
    executor (its waits for the GIL included) and the loop's handling of
    what was heard. ``overhead_s`` is measured once at start
    (:meth:`ListeningClock.calibrate`), and so is ``prior``, the first
    ``value``. Then each tick counts: ``value`` is the ratio of two sums
    over ticks, busy time less the overhead and audio heard, each
    decaying with ``window_s``, with ``prior`` counted as ``prior_weight_s``
    seconds of audio heard. So while many sessions stream it is what they
    cost now, and when few do (or none, after a slow spell) it returns to
    the prior instead of keeping a figure nobody remeasures.
    """

    def __init__(
        self, prior: float, overhead_s: float = 0.0, window_s: float = 2.0, prior_weight_s: float = 1.0
    ) -> None:
        self.prior = prior
        self.overhead_s = overhead_s
        self.window_s = window_s
        self.prior_weight_s = prior_weight_s
        self._busy = 0.0
        self._heard = 0.0
        self._at: float | None = None

    def add(self, busy_s: float, heard_s: float, now: float) -> None:
        """One tick: ``busy_s`` spent hearing ``heard_s`` of audio (all sessions together).

        A tick that heard nothing (commands only) is not counted: its time
        is the fixed part's, and less than it must not lower the cost.
        """
        if heard_s <= 0:
            return
        self._decay(now)
        self._busy += max(0.0, busy_s - self.overhead_s)
        self._heard += heard_s

    def _decay(self, now: float) -> None:
        if self._at is not None and now <= self._at:
            return  # a reading taken meanwhile was later: time does not run back
        if self._at is not None:
            keep = math.exp(-(now - self._at) / self.window_s)
            self._busy *= keep
            self._heard *= keep
        self._at = now

    def value_at(self, now: float) -> float:
        """Busy seconds per second of one session's audio, as measured up to ``now``."""
        self._decay(now)
        return (max(0.0, self._busy) + self.prior * self.prior_weight_s) / (self._heard + self.prior_weight_s)


class ListeningClock:
    """Hears every session's audio on a short clock, in one executor call per tick.

    Args:
        vad: the shared VAD engine.
        pool: the VAD executor.
        metrics: where counts go.
        tick_s: how long audio may wait for the next batch (a batch starts at
            once when the clock has been idle that long).
        listen_s_per_tick: most seconds of one session's audio in one batch.
        max_backlog_s: a session whose audio waits longer is closed alone.
        shed_after_s: past this backlog of the clock itself, no session is admitted.
        max_load: a session is admitted only while the clock, with every
            admitted session and the new one streaming in real time, would
            be busy at most this fraction of the time (:meth:`admits`).
    """

    def __init__(
        self,
        vad: VAD,
        pool: StagePool,
        metrics: Metrics,
        *,
        tick_s: float = 0.02,
        listen_s_per_tick: float = 1.0,
        max_backlog_s: float = 5.0,
        shed_after_s: float = 0.25,
        max_load: float = 0.55,
    ) -> None:
        self.vad = vad
        self.pool = pool
        self.metrics = metrics
        self.tick_s = tick_s
        self.listen_s_per_tick = listen_s_per_tick
        self.max_backlog_s = max_backlog_s
        self.shed_after_s = shed_after_s
        self.slots: list[Slot] = []
        self._ready: set[Slot] = set()
        self._wake = asyncio.Event()
        #: True while the clock is too far behind to take more sessions (hysteresis: back at half).
        self.overloaded = False
        #: Seconds the oldest audio of any session waited before its batch started, last tick.
        self.lag_s = 0.0
        self.max_load = max_load
        #: Busy seconds per second of a session's audio (measured; :meth:`calibrate` gives the first).
        self.cost = ListeningCost(prior=0.0)
        self._last_tick = -math.inf
        #: When work became ready for the next tick.
        self._woken_at: float | None = None

    def load(self, sessions: int) -> float:
        """The fraction of the time the clock would be busy with ``sessions`` streaming in real time.

        At most one tick per ``tick_s`` pays the fixed part; each second of
        audio costs :meth:`ListeningCost.value_at`.
        """
        return self.cost.overhead_s / self.tick_s + sessions * self.cost.value_at(time.monotonic())

    def capacity(self) -> float:
        """How many sessions streaming in real time keep :meth:`load` at ``max_load``, at the cost known now."""
        cost = self.cost.value_at(time.monotonic())
        room = self.max_load - self.cost.overhead_s / self.tick_s
        return room / cost if cost > 0 else math.inf

    def admits(self, sessions: int) -> bool:
        """Whether one more session may join ``sessions``: listening is not behind, nor predicted to be.

        The prediction counts every admitted session as streaming, those
        not yet sending too, so that a flood of connections is refused
        before its audio arrives, not after the admitted fall behind. The
        first session is always admitted: with none, nothing would ever be
        measured again, and a bad start would refuse everyone for good.
        """
        return sessions == 0 or (not self.overloaded and sessions + 1 <= self.capacity())

    async def calibrate(self, sessions: int = 64, windows: int = 4) -> ListeningCost:
        """Measure what hearing costs before any session has been heard.

        Synthetic sessions of silence at 24 kHz, first one and then
        ``sessions``, are heard a tick's worth of audio at a time, as
        ticks would, until each has had ``windows`` VAD windows. The two
        give the fixed part per tick and the first cost per second of
        audio (times :data:`CONTENTION`); real ticks then replace the latter.
        """
        fmt = AudioFormat()
        per_tick = int(fmt.rate * self.tick_s)
        ticks = -(-windows * self.vad.chunk_samples * fmt.rate // PIPELINE_RATE // per_tick)
        data = bytes(per_tick * fmt.bytes_per_sample)
        scope = Scope("calibration")
        took = {1: math.inf, sessions: math.inf}
        # Each size three times, the least kept: the first passes warm up (first engine calls are slow), and a
        # stall of the machine during one pass must not set the figure.
        for n in (1, sessions) * 3:
            states = [ListeningState(self.vad.new_state(), None, fmt) for _ in range(n)]
            spent = 0.0
            for _ in range(ticks):
                batch = [(ls, [AudioBytes(scope, data, fmt)], True) for ls in states]
                spent += (await self.pool.call(_timed, hear, self.vad, batch))[1]
            took[n] = min(took[n], spent / ticks)
        per_session = max(0.0, took[sessions] - took[1]) / (sessions - 1)
        self.cost = ListeningCost(
            prior=CONTENTION * per_session / self.tick_s,
            overhead_s=max(0.0, took[1] - per_session),
            window_s=self.cost.window_s,
        )
        return self.cost

    def wake(self, slot: Slot) -> None:
        """``slot`` has something in its inbox."""
        self._ready.add(slot)
        if self._woken_at is None:
            self._woken_at = time.monotonic()
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            if self.overloaded:
                # Idle while overloaded: look again soon, so that readiness comes back.
                try:
                    async with asyncio.timeout(self.tick_s * 5):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            else:
                await self._wake.wait()
            # Batches form on a short clock: what arrives within a tick shares one call.
            wait = last + self.tick_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            last = loop.time()
            try:
                await self.tick()
            except Exception:
                # Each session's share is guarded inside; this is the clock's own failure. It goes on.
                log.exception("listening: a tick failed")
                self.metrics.errors.inc(code="listening_tick_failed")

    async def tick(self) -> None:
        """One batch: every ready session's leading audio, then its commands.

        Each session's share is a fault boundary: whatever its audio or its
        commands make go wrong ends that session alone (:meth:`Slot.fail
        <s2s_rt.slot.Slot.fail>`), and the tick goes on with the others.
        """
        started = time.perf_counter()
        ready, self._ready = self._ready, set()
        now = time.monotonic()
        heard_total_s = 0.0
        work: list[tuple[Slot, SessionContext, ListeningState, list[AudioBytes], bool]] = []
        # A late tick is lateness too (the waits of uploads are not counted, and they keep every tick busy):
        # how long ready work waited past the batching wait.
        due = max(self._woken_at if self._woken_at is not None else now, self._last_tick + self.tick_s)
        lag = max(0.0, now - due)
        self._last_tick, self._woken_at = now, None
        for slot in ready:
            ctx = slot.ctx
            if ctx is None or ctx.session.scope.stale:
                continue
            ls = ctx.listening
            if ls.closing:
                continue
            try:
                taken = self._take(slot, ctx, ls, now)
            except Exception as exc:
                slot.fail(exc, "listening", ctx.session.scope)
                continue
            if taken is None:
                continue
            segments, heard_s, late_s = taken
            lag = max(lag, late_s)
            heard_total_s += heard_s
            work.append((slot, ctx, ls, segments, ls.detector is not None))
        self._shed(lag)
        batch = [(ls, segments, score) for _, _, ls, segments, score in work if segments]
        before = time.perf_counter()
        try:
            heard, hearing_s = await self.pool.call(_timed, hear, self.vad, batch) if batch else ([], 0.0)
        except Exception as exc:
            # The engine call as a whole failed (timed out, or its executor broke): no session caused it
            # alone, so each is told and goes on; what the batch held is not heard.
            log.error("listening: hearing a batch of %d sessions failed: %r", len(batch), exc)
            heard = [Heard(_NOTHING, _NOTHING, EngineUnavailable(exc)) for _ in batch]
            hearing_s = 0.0
        after = time.perf_counter()
        results = iter(heard)
        for slot, ctx, ls, segments, _ in work:
            got = next(results) if segments else None
            if slot.ctx is not ctx or ctx.session.scope.stale:
                continue  # the session ended meanwhile
            try:
                if segments:
                    size = sum(len(s.data) for s in segments)
                    ls.inbox_bytes -= size
                    slot.input_budget.release(size)
                    ls.heard_event_id = segments[-1].event_id
                if got is not None:
                    slot.listener.heard(ctx, got)
                slot.listener.commands(ctx)
            except Exception as exc:
                slot.fail(exc, "listening", ctx.session.scope)
                continue
            if ls.inbox:
                self.wake(slot)
        # The clock's own work: not the wait for the executor (the loop's other work, handshakes among it).
        self.cost.add(before - started + hearing_s + time.perf_counter() - after, heard_total_s, now)

    def _take(
        self, slot: Slot, ctx: SessionContext, ls: ListeningState, now: float
    ) -> tuple[list[AudioBytes], float, float] | None:
        """A session's audio for this batch, seconds of it, and how late it is heard (None: it fell behind).

        At most ``listen_s_per_tick`` of a session's audio per batch (ten
        times that while turn detection is off: nothing is scored then),
        and an append larger than that is cut: one session's flood or upload
        makes no batch slow for the others; its own backlog grows instead.
        A session with more audio waiting than one batch takes sends faster
        than real time (an upload): it gets its full share every batch, so
        its wait is not the clock's lateness, and it is never closed for it.
        One streaming in real time whose audio waits past ``max_backlog_s``
        is told and closed.
        """
        allowance = self.listen_s_per_tick * (1 if ls.detector is not None else 10)
        backlog = ls.backlog_s(now)
        if backlog > self.tick_s and ls.inbox_audio_s() > allowance:
            backlog = 0.0  # an upload: heard as fast as the batches allow
        if backlog > self.max_backlog_s:
            slot.listener.fall_behind(ctx, backlog)
            return None
        segments: list[AudioBytes] = []
        heard_s = 0.0
        while ls.inbox and isinstance(ls.inbox[0], AudioBytes) and heard_s < allowance:
            seg = ls.inbox.popleft()
            seconds = seg.seconds()
            if heard_s + seconds > allowance:
                seg, rest = seg.split(allowance - heard_s)
                ls.inbox.appendleft(rest)
                seconds = seg.seconds()
            segments.append(seg)
            heard_s += seconds
        return segments, heard_s, backlog

    def _shed(self, lag: float) -> None:
        self.lag_s = lag
        if not self.overloaded and lag > self.shed_after_s:
            self.overloaded = True
            self.metrics.errors.inc(code="listening_overloaded")
            log.warning("listening is %.0f ms behind: not admitting sessions until it catches up", lag * 1000)
        elif self.overloaded and lag < self.shed_after_s / 2:
            self.overloaded = False
            log.info("listening caught up: admitting sessions again")


class Listener:
    """One slot's listening logic, run by the :class:`ListeningClock` (never awaits)."""

    def __init__(
        self, slot: Slot, max_input_samples: int, speculate_after_ms: int, semantic: SemanticTurnEnd | None = None
    ) -> None:
        self.slot = slot
        self.max_input_samples = max_input_samples
        self.speculate_after_ms = speculate_after_ms
        self.semantic = semantic or SemanticTurnEnd()
        self.chunk = slot.stack.vad.chunk_samples

    # --- arrival (the receive path) -------------------------------------------

    def audio(self, ctx: SessionContext, data: bytes, event_id: str | None = None) -> None:
        """Raw audio from the client, in the format the session has now.

        Raises:
            ProtocolError: the byte count does not fit the format.
        """
        fmt = ctx.session.config.input_format
        if len(data) % fmt.bytes_per_sample:
            raise ProtocolError(
                "invalid_audio_length",
                f"{fmt.type} audio must have a multiple of {fmt.bytes_per_sample} bytes, got {len(data)}",
                param="audio",
            )
        ls = ctx.listening
        ls.inbox.append(AudioBytes(ctx.session.scope, data, fmt, event_id=event_id))
        ls.inbox_bytes += len(data)
        self.slot.clock.wake(self.slot)

    def command(self, ctx: SessionContext, item: BufferCommand | SettingsChanged | ResponseRequest) -> None:
        """A command that must follow the audio before it."""
        ctx.listening.inbox.append(item)
        self.slot.clock.wake(self.slot)

    # --- the clock's results ------------------------------------------------------

    def heard(self, ctx: SessionContext, got: Heard) -> None:
        slot = self.slot
        ls = ctx.listening
        if got.error is not None:
            if not isinstance(got.error, EngineUnavailable):
                raise got.error  # this session's audio alone failed: the clock ends this session
            log.warning("slot %d: VAD failed: %r", slot.index, got.error)
            self._error(
                ctx, ProtocolError("vad_failed", f"Voice activity detection failed: {got.error}", type="server_error")
            )
        samples = got.samples
        room = self.max_input_samples - ls.buffer.samples
        if len(samples) > room:
            # Keep what fits; refuse the rest, telling the client once (not once per slice of a large append)
            # until the buffer has room again.
            if room > 0:
                ls.buffer.append(samples[:room])
                ls.clock += room
            if not ls.buffer_full:
                ls.buffer_full = True
                self._error(
                    ctx,
                    ProtocolError(
                        "input_audio_buffer_full",
                        f"The input audio buffer holds at most {self.max_input_samples // PIPELINE_RATE} s;"
                        " commit or clear it before appending more (audio past that was dropped)",
                        param="audio",
                        event_id=ls.heard_event_id,
                    ),
                )
            return
        ls.buffer_full = False
        ls.buffer.append(samples)
        detector = ls.detector
        if detector is None:
            ls.clock += len(samples)
            return
        chunk = self.chunk
        for prob in got.probabilities:
            start = ls.clock
            ls.clock += chunk
            if detector.finished is None and ls.speculation is not None:
                detector.finished = ls.speculation.finished
            turn = detector.feed(float(prob), samples_to_ms(start), samples_to_ms(ls.clock))
            if isinstance(turn, SpeechStart):
                self._speech_started(ctx, turn)
            elif isinstance(turn, SpeechStop):
                self._speech_stopped(ctx, turn)
            elif not detector.speaking:
                self._idle_check(ctx)
            else:
                self._speculate(ctx)
        if not detector.speaking:
            # Keep only what a coming turn's prefix padding may need.
            ls.buffer.drop_before(ls.clock - ms_to_samples(detector.settings.prefix_padding_ms) - chunk)

    def commands(self, ctx: SessionContext) -> None:
        """Handle the commands at the head of the inbox (up to the next audio)."""
        ls = ctx.listening
        while ls.inbox and not isinstance(ls.inbox[0], AudioBytes):
            item = ls.inbox.popleft()
            if isinstance(item, BufferCommand):
                self._buffer_command(ctx, item)
            elif isinstance(item, SettingsChanged):
                self._apply_settings(ctx)
            elif isinstance(item, ResponseRequest):
                if not item.scope.stale:
                    self._to_stt(ctx, item)

    def fall_behind(self, ctx: SessionContext, backlog_s: float) -> None:
        """The session's audio waits too long, or too much of it: tell it and close it, alone."""
        slot = self.slot
        ls = ctx.listening
        if ls.closing:
            return
        ls.closing = True
        waiting = ls.inbox_bytes
        log.warning(
            "slot %d: %.1f s (%d bytes) of audio not yet heard; closing the session", slot.index, backlog_s, waiting
        )
        ls.inbox.clear()
        slot.input_budget.reset()
        ls.inbox_bytes = 0
        exc = ProtocolError(
            "audio_backlog_exceeded",
            f"This session's audio is not being heard in time ({backlog_s:.1f} s and {waiting} bytes waiting; at most"
            f" {slot.clock.max_backlog_s:g} s and {slot.input_budget.limit} bytes); closing it",
            type="server_error",
        )
        slot.close_now(exc, 1013)

    # --- what the results mean ------------------------------------------------------

    def _emit(self, ctx: SessionContext, events: list[ServerEvent]) -> None:
        if events and not self.slot.outbox.emit_nowait(events, ctx.session.scope):
            self.slot.close_now(None, 1008)

    def _error(self, ctx: SessionContext, exc: ProtocolError) -> None:
        self.slot.metrics.errors.inc(code=exc.code)
        self._emit(ctx, [ctx.session.error(exc)])

    def _to_stt(self, ctx: SessionContext, item: Transcribe | ResponseRequest) -> None:
        try:
            self.slot.stt_q.put_nowait(item)
        except asyncio.QueueFull:
            self.slot.close_now(
                ProtocolError("session_backlog_exceeded", "Too much work is waiting for this session; closing it"),
                1013,
            )

    def _apply_settings(self, ctx: SessionContext) -> None:
        ls = ctx.listening
        td = ctx.session.config.turn_detection
        if td is None:
            ls.detector = None
            self._drop_speculation(ls)
        elif ls.detector is None:
            ls.detector = TurnDetector(td, self.semantic)
        else:
            ls.detector.settings = td

    def _speech_started(self, ctx: SessionContext, turn: SpeechStart) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        self._drop_speculation(ls)
        ls.turn_item_id = new_id("item")
        events: list[ServerEvent] = [session.speech_started(int(turn.audio_start_ms), ls.turn_item_id)]
        td = ls.detector.settings if ls.detector else None
        if session.response is not None and td is not None and td.interrupt_response:
            # Barge-in: the answer being spoken is cancelled at once.
            events += session.cancel_response("turn_detected")
            slot.metrics.turns.inc(status="cancelled")
        self._emit(ctx, events)

    def _speech_stopped(self, ctx: SessionContext, turn: SpeechStop) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        assert ls.detector is not None
        item_id = ls.turn_item_id or new_id("item")
        ls.turn_item_id = None
        speech_end = time.perf_counter()
        start = ms_to_samples(ls.detector.start_ms)
        audio = ls.buffer.take(start, ms_to_samples(turn.audio_end_ms))
        ls.idle_from = ls.clock
        td = ls.detector.settings
        events = [session.speech_stopped(int(turn.audio_end_ms), item_id)]
        events += session.commit_audio(item_id)
        self._emit(ctx, events)
        speculation, ls.speculation = ls.speculation, None
        anticipation, ls.anticipation = ls.anticipation, None
        if speculation is not None:
            slot.metrics.speculations.inc(outcome="used")
        self._to_stt(
            ctx,
            Transcribe(
                session.scope,
                item_id,
                audio,
                td.create_response and not session.transcription_only,
                speech_end,
                speculation.task if speculation else None,
                anticipation,
            ),
        )

    def _drop_speculation(self, ls: ListeningState) -> None:
        """Speech came back (or the turn was cleared): the guess is stale; stop it if it has not begun."""
        if ls.speculation is not None:
            ls.speculation.task.cancel()
            ls.speculation = None
            self.slot.metrics.speculations.inc(outcome="discarded")
        if ls.anticipation is not None:
            ls.anticipation.drop("speech resumed")
            ls.anticipation = None
            self.slot.metrics.speculative_responses.inc(outcome="discarded")

    def _speculate(self, ctx: SessionContext) -> None:
        """While a turn's closing silence runs, transcribe what was said so far.

        If the silence lasts, the turn ends with this transcript already made
        (or nearly); if speech returns, the guess is dropped — cancelled if
        its engine call has not begun, else left to finish unread, and no
        other speculation starts until it has: speculation never costs more
        than one engine call at a time per session. In a transcription
        session the words are also transcribed every second while the user
        speaks, and the new ones streamed as deltas (live captions).
        """
        ls = ctx.listening
        detector = ls.detector
        if detector is None:
            return
        silence_ms = samples_to_ms(ls.clock) - detector.last_voice_ms
        if silence_ms == 0 and ctx.session.transcription_only:
            self._caption(ctx)
        judge = detector.settings.type == "semantic_vad"
        after_ms = self.speculate_after_ms
        if judge:  # semantic_vad needs the words to judge them
            after_ms = min(after_ms, self.semantic.speculate_ms) if after_ms else self.semantic.speculate_ms
        if not after_ms:
            return
        if ls.speculation is not None:
            if silence_ms == 0:
                self._drop_speculation(ls)
            return
        if silence_ms < after_ms or ls.speculating:
            return

        async def guess(heard: Transcript) -> Transcript:
            # The conversation as the turn's answer will read it, once for the judgement and the answer.
            conversation = ctx.session.next_prompt()
            if judge:
                await self._judge(ctx, heard.text.strip(), speculation, conversation[0])
            self._anticipate(ctx, heard, speculation, conversation)
            return heard

        begun = self._transcribe_ahead(ctx, guess, "speculation")
        if begun is not None:
            speculation = ls.speculation = Speculation(*begun)

    def _caption(self, ctx: SessionContext) -> None:
        """A transcription session: transcribe the turn so far each second of speech, and stream the new words."""
        ls = ctx.listening
        detector = ls.detector
        item_id = ls.turn_item_id
        now_ms = samples_to_ms(ls.clock)
        if (
            detector is None
            or item_id is None
            or ls.speculating
            or not ctx.session.transcribing
            or now_ms - max(detector.start_ms, ls.captioned_ms) < CAPTION_EVERY_MS
        ):
            return
        ls.captioned_ms = now_ms

        async def caption(heard: Transcript) -> Transcript:
            if ls.turn_item_id == item_id:  # the turn is still being spoken
                self._emit(ctx, ctx.session.partly_heard(item_id, heard.text.strip()))
            return heard

        self._transcribe_ahead(ctx, caption, "caption")

    def _transcribe_ahead(
        self, ctx: SessionContext, then: Callable[[Transcript], Awaitable[Transcript]], what: str
    ) -> tuple[asyncio.Task[Transcript | BaseException], threading.Event] | None:
        """Transcribe the turn so far in the STT pool, then ``then`` on the loop; one such call at a time.

        The task is the session's (its scope's :meth:`~s2s_rt.scope.Scope.spawn`):
        cancelled with it, and never started once it is closing (None). It
        never raises (a failure is its result); ``speculating`` is set until
        its engine call ends.
        """
        ls = ctx.listening
        assert ls.detector is not None
        # Up to the chunk just judged, not all the audio this tick brought: the words transcribed depend on
        # the audio alone, never on how it was batched.
        chunks, start, end = ls.buffer.between(ms_to_samples(ls.detector.start_ms), ls.clock)
        tr = ctx.session.config.transcription
        stt = self.slot.stack.stt
        started = threading.Event()
        loop = asyncio.get_running_loop()

        def done_running() -> None:
            ls.speculating = False

        def transcribe() -> Transcript:
            started.set()
            try:
                return stt.transcribe(
                    _join(chunks, start, end), language=tr.language if tr else None, prompt=tr.prompt if tr else None
                )
            finally:
                loop.call_soon_threadsafe(done_running)

        async def run() -> Transcript | BaseException:
            # Never raises: its outcome is read by the STT stage, or nobody wants it.
            try:
                heard = await self.slot.pools["stt"].call(transcribe)
            except Exception as exc:
                return exc
            return await then(heard)

        task = ctx.session.scope.spawn(run(), f"slot{self.slot.index}-{what}")
        if task is None:
            return None  # the session is closing
        ls.speculating = True

        def finished(t: asyncio.Task[Any]) -> None:
            if not started.is_set():  # dropped before its engine call began
                ls.speculating = False

        task.add_done_callback(finished)
        return task, started

    async def _judge(
        self, ctx: SessionContext, text: str, speculation: Speculation, messages: list[ChatMessage]
    ) -> None:
        """``semantic_vad``: how likely the words so far end the user's turn (the chat LLM judges).

        Left unknown if the model cannot judge (a remote LLM) or fails: the
        turn then ends after :attr:`SemanticTurnEnd.unknown_ms` of silence.
        """
        if not text:  # nothing was said: no words to wait for
            speculation.finished = 1.0
            return
        judge = getattr(self.slot.stack.llm, "turn_end_probability", None)
        if judge is None:
            return
        answer = next((m for m in reversed(messages) if m.role == "assistant"), None)
        # The conversation's last answer (its end) gives the words their context; the instructions are left
        # out: this is read three times within the silence, so it is kept short.
        context = [ChatMessage("assistant", answer.content[-JUDGED_ANSWER_CHARS:])] if answer else []
        judged = [ChatMessage("system", JUDGE_SYSTEM), *context, ChatMessage("user", text)]
        try:
            speculation.finished = await self.slot.pools["llm"].call(judge, judged)
            log.debug("slot %d: %r sounds finished with probability %.4g", self.slot.index, text, speculation.finished)
        except Exception as exc:
            log.warning("slot %d: judging the end of the turn failed: %r", self.slot.index, exc)

    def _anticipate(
        self,
        ctx: SessionContext,
        heard: Transcript,
        speculation: Speculation,
        conversation: tuple[list[ChatMessage], ResponseParams],
    ) -> None:
        """Begin answering the words transcribed in the closing silence, before the turn ends.

        Only for a turn that will be answered (``create_response``, no
        response running), and for ``semantic_vad`` only when the words
        sounded finished (the turn is about to end). The answer is asked
        exactly as the turn's response will ask it, so that it can adopt it.
        """
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        detector = ls.detector
        text = heard.text.strip()
        if (
            ls.speculation is not speculation
            or ls.anticipation is not None
            or detector is None
            or not text
            or not detector.settings.create_response
            or session.transcription_only
            or session.response is not None
            or session.scope.stale
            or not can_anticipate(slot.stack.llm)
        ):
            return
        td = detector.settings
        if td.type == "semantic_vad" and (
            speculation.finished is None
            or detector.semantic.wait_ms(speculation.finished, td.eagerness) > detector.semantic.min_silence_ms
        ):
            return
        messages, params = conversation
        tools, must_call = offered_tools(params.tools, params.tool_choice)
        language = heard.language or ctx.language
        messages = with_answer_context([*messages, ChatMessage("user", text)], language=language, tools=bool(tools))
        key = AnswerKey.of(
            messages, tools, must_call, params.temperature, params.token_limit, params.speed, params.voice
        )
        ahead = ls.anticipation = Anticipation(key, Scope("anticipation", parent=session.scope))
        speak = "audio" in params.modalities and not tools
        ahead.start(
            slot,
            messages,
            ClauseSplitter(first_words=slot.first_clause_words) if speak else None,
            tts_voice(slot.stack, params.voice),
        )

    def _idle_check(self, ctx: SessionContext) -> None:
        session = ctx.session
        ls = ctx.listening
        td = ls.detector.settings if ls.detector else None
        if td is None or td.idle_timeout_ms is None or session.response is not None:
            ls.idle_from = ls.clock if session.response is not None else ls.idle_from
            return
        if ls.clock - ls.idle_from < ms_to_samples(td.idle_timeout_ms):
            return
        item_id = new_id("item")
        start_ms = int(samples_to_ms(ls.buffer.start_sample))
        audio = ls.buffer.take(ls.buffer.start_sample, ls.clock)
        ls.idle_from = ls.clock
        events = session.timeout_triggered(start_ms, int(samples_to_ms(ls.clock)), item_id)
        events += session.commit_audio(item_id)
        self._emit(ctx, events)
        self._to_stt(ctx, Transcribe(session.scope, item_id, audio, not session.transcription_only, None))

    def _buffer_command(self, ctx: SessionContext, cmd: BufferCommand) -> None:
        session = ctx.session
        ls = ctx.listening
        if cmd.kind == "clear":
            ls.buffer.clear()
            self._drop_speculation(ls)
            if ls.detector is not None:
                ls.detector.reset()
            self._emit(ctx, [session.buffer_cleared()])
            return
        ms = samples_to_ms(ls.buffer.samples)
        if ms < 100:
            self._error(
                ctx,
                ProtocolError(
                    "input_audio_buffer_commit_empty",
                    f"Cannot commit: the input audio buffer holds {ms:.0f} ms; at least 100 ms is needed",
                    event_id=cmd.event_id,
                ),
            )
            return
        item_id = ls.turn_item_id or new_id("item")
        ls.turn_item_id = None
        self._drop_speculation(ls)
        audio = ls.buffer.take(ls.buffer.start_sample, ls.buffer.end_sample)
        if ls.detector is not None:
            ls.detector.reset()
        self._emit(ctx, session.commit_audio(item_id))
        self._to_stt(ctx, Transcribe(session.scope, item_id, audio, False, time.perf_counter()))
