"""Budgets: how much one session may hold in one place at a time, and how fast it may send.

A producer that would go over a byte budget (:class:`ByteBudget`) waits until the consumer has
released enough: a client that sends faster than its audio is scored, or
asks for more than it reads, is slowed down alone (its socket stops being
read), and nothing queued for it can grow without bound. One item larger
than the whole budget still passes, alone, so no legal request is refused.

What arrives faster than a rate budget allows (:class:`EventBudget`, a client's events;
:class:`PacketBudget`, a call's media datagrams) is refused or dropped as it comes, before
it costs more than the count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class ByteBudget:
    """A byte count with a limit that producers wait on.

    Args:
        name: what it bounds, for metrics and errors.
        limit: most bytes held at once.
    """

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.used = 0
        self._released = asyncio.Event()

    async def take(self, n: int) -> None:
        """Hold ``n`` more bytes; waits while that would pass the limit (unless nothing is held)."""
        while self.used > 0 and self.used + n > self.limit:
            self._released.clear()
            await self._released.wait()
        self.used += n

    def try_take(self, n: int) -> bool:
        """Hold ``n`` more bytes if that stays within the limit (or nothing is held); never waits."""
        if self.used > 0 and self.used + n > self.limit:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)
        self._released.set()

    def reset(self) -> None:
        """Everything held was dropped (a session ended): wake every waiter."""
        self.used = 0
        self._released.set()


class EventBudget:
    """A token bucket: ``rate`` events per second on average, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.last: float | None = None

    def give_back(self) -> None:
        """Return the token of an event taken but not handled here (it will be taken again)."""
        self.tokens = min(self.burst, self.tokens + 1.0)

    def take(self, now: float) -> bool:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Flood:
    """How long refusals have gone on: a second without one ends a flood, one let through now and then as a
    budget refills does not."""

    __slots__ = ("_last", "_since")

    def __init__(self) -> None:
        self._since: float | None = None
        self._last = 0.0

    def refused(self, now: float) -> None:
        self._last = now
        if self._since is None:
            self._since = now

    def accepted(self, now: float) -> None:
        if self._since is not None and now - self._last >= 1.0:
            self._since = None

    def lasted(self, now: float) -> float:
        """Seconds since the flood began (0 when there is none)."""
        return 0.0 if self._since is None else now - self._since

    def past(self, now: float, seconds: float) -> bool:
        """Whether a flood has gone on for ``seconds`` or more."""
        return self._since is not None and now - self._since >= seconds


#: A caller's media, per call: 20 ms packets come 50 a second (10 ms ones 100), RTCP a few more; a burst holds
#: what a network's stall of a second or two lets through at once.
MEDIA_PACKETS_PER_S = 150.0
MEDIA_BURST = 150
#: A call whose media has been dropped this long without a second's pause is ended.
MEDIA_FLOOD_S = 2.0


class PacketBudget:
    """One call's media datagrams: at most ``rate`` a second on average, ``burst`` at once; the rest are dropped
    before anything parses them (SRTP, RTP, the jitter buffer, the decoder: far more work than the drop).

    Each drop is counted (``dropped``); the first is logged. A caller whose datagrams were dropped without a
    second's pause for ``close_after_s`` is flooding: ``end`` is told once, with why. A datagram let through now
    and then, as the budget refills, does not end a flood.

    Args:
        call: what the log names (``call rtc_…``).
        dropped: called for each datagram dropped (a metric's count).
        end: ends the call.
    """

    __slots__ = ("_bucket", "_count", "_end", "_ended", "_flood", "call", "close_after_s", "dropped")

    def __init__(
        self,
        call: str,
        dropped: Callable[[], None],
        end: Callable[[str], None],
        *,
        rate: float = MEDIA_PACKETS_PER_S,
        burst: int = MEDIA_BURST,
        close_after_s: float = MEDIA_FLOOD_S,
    ) -> None:
        self.call = call
        self._count, self._end = dropped, end
        self._bucket = EventBudget(rate, burst)
        self.close_after_s = close_after_s
        #: Datagrams dropped so far.
        self.dropped = 0
        self._flood = Flood()
        self._ended = False

    def take(self, now: float) -> bool:
        """Whether a datagram arriving at ``now`` is let through (False: drop it)."""
        if self._bucket.take(now):
            self._flood.accepted(now)
            return True
        self.dropped += 1
        self._count()
        self._flood.refused(now)
        if self.dropped == 1:
            log.info("%s: media past %g packets a second is dropped", self.call, self._bucket.rate)
        if not self._ended and self._flood.past(now, self.close_after_s):
            self._ended = True
            log.warning("%s: %d media packets dropped; ending it", self.call, self.dropped)
            self._end("flooded the call with media")
        return False
