"""Byte budgets: how much one session may hold in one place at a time.

A producer that would go over its budget waits until the consumer has
released enough: a client that sends faster than its audio is scored, or
asks for more than it reads, is slowed down alone (its socket stops being
read), and nothing queued for it can grow without bound. One item larger
than the whole budget still passes, alone, so no legal request is refused.
"""

from __future__ import annotations

import asyncio


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
