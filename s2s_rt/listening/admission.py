"""Admission: what hearing costs the listening clock, measured, and so how many sessions it can take."""

from __future__ import annotations

import functools
import math

from s2s_rt.audio import AudioFormat
from s2s_rt.engines.base import PIPELINE_RATE, VAD
from s2s_rt.inference import StagePool
from s2s_rt.listening.hearing import AudioBytes, Hearing, SessionAudio, hear, timed
from s2s_rt.scope import Scope

#: Hearing a session costs the clock about this many times more while sessions stream than
#: :func:`calibrate` measures alone at start: the hearing thread then waits for the GIL
#: while the loop receives every session's appends. Measured on the 2-core machine at 100-200 listening
#: sessions: 3.4-4.4 ms of the clock's time per second of a session's audio, against 2.0-2.4 ms at start.
CONTENTION = 1.7


class ListeningCost:
    """What hearing costs the clock, measured: a fixed part per tick and a part per second of audio.

    A tick of ``A`` seconds of audio (all sessions together) keeps the
    clock busy about ``overhead_s + value × A`` seconds: the hearing in the
    executor (its waits for the GIL included) and the loop's handling of
    what was heard. ``overhead_s`` is measured once at start
    (:func:`calibrate`), and so is ``prior``, the first
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

    def rebase(self, prior: float, overhead_s: float) -> None:
        """A new measurement of the fixed part and of the cost to return to (:meth:`ListeningClock.remeasure`);
        what ticks have measured is kept."""
        self.prior = prior
        self.overhead_s = overhead_s

    def busy_fraction(self, now: float) -> float:
        """About what fraction of the time the clock has lately spent hearing (the fixed part left out)."""
        self._decay(now)
        return self._busy / self.window_s

    def value_at(self, now: float) -> float:
        """Busy seconds per second of one session's audio, as measured up to ``now``."""
        self._decay(now)
        return (max(0.0, self._busy) + self.prior * self.prior_weight_s) / (self._heard + self.prior_weight_s)


async def calibrate(
    vad: VAD,
    pool: StagePool,
    tick_s: float,
    sessions: int = 64,
    windows: int = 4,
    hearing: Hearing | None = None,
) -> ListeningCost:
    """Measure what hearing costs before any session has been heard.

    Synthetic sessions of silence at 24 kHz, first one and then
    ``sessions``, are heard a tick's worth of audio at a time, as
    ticks would, until each has had ``windows`` VAD windows. The two
    give the fixed part per tick and the first cost per second of
    audio (times :data:`CONTENTION`); real ticks then replace the latter.
    ``hearing`` is how the clock hears (:func:`hear` with ``vad`` when None).
    """
    hearing = hearing or functools.partial(hear, vad)
    fmt = AudioFormat()
    per_tick = int(fmt.rate * tick_s)
    ticks = -(-windows * vad.chunk_samples * fmt.rate // PIPELINE_RATE // per_tick)
    data = bytes(per_tick * fmt.bytes_per_sample)
    scope = Scope("calibration")
    took = {1: math.inf, sessions: math.inf}
    # Each size three times, the least kept: the first passes warm up (first engine calls are slow), and a
    # stall of the machine during one pass must not set the figure.
    for n in (1, sessions) * 3:
        states = [SessionAudio(scope, vad.new_state(), fmt) for _ in range(n)]
        spent = 0.0
        for _ in range(ticks):
            batch = [(audio, [AudioBytes(scope, data, fmt)], True) for audio in states]
            spent += (await pool.call(timed, hearing, batch))[1]
        took[n] = min(took[n], spent / ticks)
    per_session = max(0.0, took[sessions] - took[1]) / (sessions - 1)
    return ListeningCost(prior=CONTENTION * per_session / tick_s, overhead_s=max(0.0, took[1] - per_session))
