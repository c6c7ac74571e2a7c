"""The fixed pool of slots built at start-up, and the claim that hands one out."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from s2s_rt.slot import Slot, SlotEvent, SlotState


class Pool:
    """All slots of the process.

    Args:
        slots: built once at start-up; the pool never grows or shrinks.
    """

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        #: Set when a session or a response of any slot ends.
        self.changed = asyncio.Event()
        for slot in slots:
            slot.on_change.append(self.changed.set)

    async def claim(
        self, admits: Callable[[], bool], wait_s: float, refusing: Callable[[], bool] = lambda: False
    ) -> Slot | None:
        """A free slot, or one about to be free; None when there is none, or listening cannot take one more.

        A load balancer counts a session as gone when its TCP connection
        closes, a moment before the slot has drained. A client sent in that
        gap waits (up to ``wait_s``) for the draining slot instead of being
        refused. ``admits`` is asked again after such a wait (others may
        have been admitted meanwhile); once ``refusing`` (the server stops
        taking sessions), nothing is waited for.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            if not admits():
                return None
            slot = self.take_idle()
            # A slot whose client has closed (the server has not ended its session yet) is about to drain.
            if slot is not None or not self.freeing() or refusing():
                return slot
            self.changed.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self.changed.wait()
            except TimeoutError:
                return self.take_idle() if admits() else None

    def take_idle(self) -> Slot | None:
        """Take the first idle slot, or None when every slot is busy.

        There is no ``await`` between finding the slot and marking it active,
        so two connections can never claim the same slot.
        """
        for slot in self.slots:
            if slot.state is SlotState.IDLE:
                slot.step(SlotEvent.CLAIM)
                return slot
        return None

    @property
    def free(self) -> int:
        return sum(1 for s in self.slots if s.state is SlotState.IDLE)

    def states(self) -> dict[str, int]:
        counts = Counter(s.state.value for s in self.slots)
        return {state.value: counts.get(state.value, 0) for state in SlotState}

    def draining(self) -> int:
        return sum(1 for s in self.slots if s.state is SlotState.DRAINING)

    def freeing(self) -> int:
        """Slots about to be free: draining, or serving a session whose socket is already closing."""
        return sum(
            1
            for s in self.slots
            if s.state is SlotState.DRAINING
            or (s.state is SlotState.ACTIVE and s.session is not None and not s.channel_open)
        )

    def active(self) -> int:
        """Slots serving a session (not those draining one that ended)."""
        return sum(1 for s in self.slots if s.state is SlotState.ACTIVE)

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.state in (SlotState.ACTIVE, SlotState.DRAINING))

    def describe(self) -> dict[str, Any]:
        """The pool as ``/v1/pool`` shows it."""
        now = time.monotonic()
        return {
            "size": len(self.slots),
            "free": self.free,
            "states": self.states(),
            "slots": [
                {
                    "index": s.index,
                    "state": s.state.value,
                    "for_s": round(now - s.state_since, 3),
                    "session_id": s.session.id if s.session is not None else None,
                    "client": s.client,
                    "sessions_served": s.sessions_served,
                    "quarantine_reason": s.quarantine_reason,
                }
                for s in self.slots
            ],
        }
