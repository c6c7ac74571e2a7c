"""The listening clock: one per process, it hears every session's audio on a short clock.

The receive path only parses a client's frame and puts the raw audio (or a
buffer command, a settings change, a response request) in its session's
inbox (:class:`~s2s_rt.listening.hearing.SessionAudio`): no decoding, no
task switch per append. The clock then takes the audio that every ready
session has waiting, decodes, resamples and scores it with the VAD in one
executor call (:func:`~s2s_rt.listening.hearing.hear`), and back on the loop
hands each session's share to its :class:`Listening` (a slot's listener),
which feeds its turn detector and handles its commands, in the order they
came. Only the clock calls a listener's results, so nothing they read
changes under them.

Sessions whose audio waits longer than ``max_backlog_s`` are told and closed
alone (:meth:`Listening.fall_behind`); when the clock itself falls behind,
the server stops admitting sessions (:attr:`ListeningClock.overloaded`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from typing import Protocol

from s2s_rt.config import DEFAULTS
from s2s_rt.engines.base import VAD
from s2s_rt.inference import StagePool
from s2s_rt.listening.admission import ListeningCost, calibrate
from s2s_rt.listening.hearing import NOTHING, AudioBytes, EngineUnavailable, Heard, Hearing, SessionAudio, hear, timed
from s2s_rt.metrics import Metrics
from s2s_rt.scope import Scope

log = logging.getLogger(__name__)

#: How often the cost of hearing is measured again while the clock is not busy (:meth:`ListeningClock.remeasure`),
#: and how many measurements the least is taken of (the one at start among them, until it is pushed out).
REMEASURE_S = 60.0
REMEASURED = 5


class Listening(Protocol):
    """What the clock drives for one slot: the audio of the session it serves now, and what becomes of it."""

    def listening(self) -> SessionAudio | None:
        """The audio of the session being served now (None between sessions)."""
        ...

    def heard(self, segments: list[AudioBytes], got: Heard | None) -> None:
        """``segments`` were taken from the inbox and heard as ``got`` (None: no audio this tick); then the
        commands that follow them in the inbox."""
        ...

    def fall_behind(self, backlog_s: float) -> None:
        """The session's audio waited too long to be heard: tell it and close it, alone."""
        ...

    def fail(self, exc: BaseException, where: str, scope: Scope | None = None) -> None:
        """The session's share of a tick raised: end that session alone."""
        ...


class ListeningClock:
    """Hears every session's audio on a short clock, in one executor call per tick.

    Each parameter after ``metrics`` defaults to its setting's default in
    :data:`s2s_rt.config.DEFAULTS` (``listen_tick_ms``, ``listen_s_per_tick``,
    ``max_audio_backlog_s``, ``shed_after_ms``, ``max_listening_load``).

    Args:
        vad: the shared VAD engine.
        pool: the VAD executor.
        metrics: where counts go.
        hearing: how a batch is heard (:func:`hear` with ``vad`` in this process when None; the server sets the
            hearing process, :mod:`.remote`, before it calibrates).
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
        hearing: Hearing | None = None,
        *,
        tick_s: float = DEFAULTS.listen_tick_ms / 1000,
        listen_s_per_tick: float = DEFAULTS.listen_s_per_tick,
        max_backlog_s: float = DEFAULTS.max_audio_backlog_s,
        shed_after_s: float = DEFAULTS.shed_after_ms / 1000,
        max_load: float = DEFAULTS.max_listening_load,
    ) -> None:
        self.vad = vad
        #: How a batch is heard: :func:`hear` with ``vad`` here, or in the hearing process.
        self.hearing: Hearing = hearing or functools.partial(hear, vad)
        self.pool = pool
        self.metrics = metrics
        self.tick_s = tick_s
        self.listen_s_per_tick = listen_s_per_tick
        self.max_backlog_s = max_backlog_s
        self.shed_after_s = shed_after_s
        self._ready: set[Listening] = set()
        self._wake = asyncio.Event()
        #: True while the clock is too far behind to take more sessions (hysteresis: back at half).
        self.overloaded = False
        #: Seconds the oldest audio of any session waited before its batch started, last tick.
        self.lag_s = 0.0
        self.max_load = max_load
        #: Busy seconds per second of a session's audio (measured; :meth:`calibrate` gives the first).
        self.cost = ListeningCost(prior=0.0)
        #: The latest measurements of :meth:`calibrate` and :meth:`remeasure`.
        self._measured: collections.deque[ListeningCost] = collections.deque(maxlen=REMEASURED)
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
        """Measure what hearing costs before any session has been heard (see :func:`.admission.calibrate`)."""
        cost = await calibrate(self.vad, self.pool, self.tick_s, sessions, windows, self.hearing)
        cost.window_s = self.cost.window_s
        self.cost = cost
        self._measured.append(cost)
        return cost

    async def remeasure(self, every_s: float = REMEASURE_S) -> None:
        """Measure again what hearing costs, every ``every_s`` while the clock is less than half as busy as it may
        be, for as long as the server runs (a supervised task).

        What ticks measure replaces the calibrated cost while many sessions
        stream; what it returns to when few do, and the fixed part per tick,
        come from :meth:`calibrate`. Measured once, at start, a moment's
        contention there (a server started while the machine was busy) would
        halve what the server admits for good. So it is measured again, and
        the least of the last :data:`REMEASURED` measurements counts: what
        hearing costs on this machine when nothing else holds it up, as a
        slow moment of one measurement cannot raise it and a lasting change
        is seen within a few minutes.
        """
        while True:
            await asyncio.sleep(every_s)
            if self.cost.busy_fraction(time.monotonic()) > self.max_load / 2:
                continue  # measuring would take time from the sessions; the ticks measure meanwhile
            before = self.capacity()
            try:
                self._measured.append(await calibrate(self.vad, self.pool, self.tick_s, hearing=self.hearing))
            except Exception as exc:
                # Not a failure of the server: the measurements it has stand (a failing VAD is the sessions'
                # to report), and the next minute measures again.
                log.warning("hearing could not be measured again (%r); keeping what was measured", exc)
                continue
            self.cost.rebase(min(c.prior for c in self._measured), min(c.overhead_s for c in self._measured))
            after = self.capacity()
            ratio = after / before if 0 < before < math.inf else math.inf
            if not 0.8 <= ratio <= 1.25:
                log.info(
                    "hearing measured again: %.0f µs per tick and %.2f ms per second of audio at least;"
                    " about %.0f listening sessions now, %.0f before",
                    self.cost.overhead_s * 1e6,
                    self.cost.prior * 1000,
                    after,
                    before,
                )

    def wake(self, listener: Listening) -> None:
        """``listener`` has something in its session's inbox."""
        self._ready.add(listener)
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
        commands make go wrong ends that session alone (:meth:`Listening.fail`),
        and the tick goes on with the others.
        """
        started = time.perf_counter()
        ready, self._ready = self._ready, set()
        now = time.monotonic()
        heard_total_s = 0.0
        work: list[tuple[Listening, SessionAudio, list[AudioBytes]]] = []
        # A late tick is lateness too (the waits of uploads are not counted, and they keep every tick busy):
        # how long ready work waited past the batching wait.
        due = max(self._woken_at if self._woken_at is not None else now, self._last_tick + self.tick_s)
        lag = max(0.0, now - due)
        self._last_tick, self._woken_at = now, None
        for listener in ready:
            audio = listener.listening()
            if audio is None or audio.closed:
                continue
            try:
                taken = self._take(listener, audio, now)
            except Exception as exc:
                listener.fail(exc, "listening", audio.scope)
                continue
            if taken is None:
                continue
            segments, heard_s, late_s = taken
            lag = max(lag, late_s)
            heard_total_s += heard_s
            work.append((listener, audio, segments))
        self._shed(lag)
        batch = [(audio, segments, audio.scoring) for _, audio, segments in work if segments]
        before = time.perf_counter()
        try:
            heard, hearing_s = await self.pool.call(timed, self.hearing, batch) if batch else ([], 0.0)
        except Exception as exc:
            # The engine call as a whole failed (timed out, or its executor broke): no session caused it
            # alone, so each is told and goes on; what the batch held is not heard.
            log.error("listening: hearing a batch of %d sessions failed: %r", len(batch), exc)
            heard = [Heard(NOTHING, NOTHING, EngineUnavailable(exc)) for _ in batch]
            hearing_s = 0.0
        after = time.perf_counter()
        results = iter(heard)
        for listener, audio, segments in work:
            got = next(results) if segments else None
            if listener.listening() is not audio or audio.closed:
                continue  # the session ended meanwhile
            try:
                listener.heard(segments, got)
            except Exception as exc:
                listener.fail(exc, "listening", audio.scope)
                continue
            if audio.waiting:
                self.wake(listener)
        # The clock's own work: not the wait for the executor (the loop's other work, handshakes among it).
        self.cost.add(before - started + hearing_s + time.perf_counter() - after, heard_total_s, now)

    def _take(
        self, listener: Listening, audio: SessionAudio, now: float
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
        allowance = self.listen_s_per_tick * (1 if audio.scoring else 10)
        backlog = audio.backlog_s(now)
        if backlog > self.tick_s and audio.inbox_audio_s() > allowance:
            backlog = 0.0  # an upload: heard as fast as the batches allow
        if backlog > self.max_backlog_s:
            listener.fall_behind(backlog)
            return None
        segments, heard_s = audio.take(allowance)
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
