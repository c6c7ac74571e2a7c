"""Lanes into the one LLM: a long prompt is read beside other sessions' answers, never in front of them.

CTranslate2 reads a prompt in one call that nothing can interrupt, and it
cannot go on from a kept state it did not make itself (a ``static_prompt``
is found only whole, and read from scratch when it is not), so a long
prompt cannot be read in pieces. It is read on a replica of its own
instead: the generator has one replica more than ordinary work uses, and
the replicas share the weights (the same resident memory with one or two)
and the kept states. Ordinary work goes through its lane in order, one
call at a time, as through one replica; long readings take the other lane,
one at a time. Another session's answer then waits for at most one
ordinary reading (at most :data:`LONG_READING_TOKENS`), and shares the
cores with the long one instead of waiting for all of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

from s2s_rt.engines.base import StopCheck

#: A reading of at least this many tokens (past the kept state) takes the long lane. Reading costs about
#: 1.4 ms a token on the 2-core Xeon (0.7 s for this many) and about 30 ms on a 2-core AMD EPYC without
#: AVX-512 (BENCHMARKS.md, "One client cannot stall the others"); an ordinary turn reads fewer: the default
#: instructions are about 190 tokens, and with a kept state only the new user turn is read.
LONG_READING_TOKENS = 512

#: How often a call waiting for its lane looks at its stop check.
_STOP_CHECK_S = 0.05


class Lanes:
    """Which of the model's replicas a call may take: ordinary calls in order, long readings beside them.

    Args:
        ordinary: calls of ordinary work that run at once (the engine's
            ``inter_threads``); the generator has one replica more, for
            long readings.
    """

    def __init__(self, ordinary: int = 1) -> None:
        self._changed = threading.Condition()
        self._width = {False: ordinary, True: 1}
        self._running = {False: 0, True: 0}
        self._waiting: dict[bool, deque[object]] = {False: deque(), True: deque()}
        #: Long readings that took the long lane.
        self.long_readings = 0

    def running(self, long: bool) -> int:
        """Calls in the lane now."""
        return self._running[long]

    def waiting(self, long: bool) -> int:
        """Calls waiting for a place in the lane now."""
        return len(self._waiting[long])

    @contextlib.contextmanager
    def take(self, long: bool, should_stop: StopCheck) -> Iterator[bool]:
        """Hold a place in the long or the ordinary lane for one call into the model.

        Waits, in order of arrival, for a free place. Yields True once one is
        held, or False when ``should_stop`` came true first (then no place is
        held, and the caller reads nothing).
        """
        ticket = object()
        waiting = self._waiting[long]
        got = False
        with self._changed:
            waiting.append(ticket)
            try:
                while not got and not should_stop():
                    got = waiting[0] is ticket and self._running[long] < self._width[long]
                    if not got:
                        self._changed.wait(_STOP_CHECK_S)
                if got:
                    self._running[long] += 1
                    self.long_readings += long
            finally:
                waiting.remove(ticket)
                self._changed.notify_all()  # the next in line may be first now
        if not got:
            yield False
            return
        try:
            yield True
        finally:
            with self._changed:
                self._running[long] -= 1
                self._changed.notify_all()


def never() -> bool:
    """A stop check for work that is never stopped (reading ahead, the turn-end judge)."""
    return False
