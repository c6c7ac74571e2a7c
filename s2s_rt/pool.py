"""The fixed pool of slots built at start-up, and the claim that hands one out."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from websockets.protocol import State

from s2s_rt.slot import Slot, SlotEvent, SlotState


class Pool:
    """All slots of the process.

    Args:
        slots: built once at start-up; the pool never grows or shrinks.
    """

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots

    def claim(self) -> Slot | None:
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
            or (s.state is SlotState.ACTIVE and s.ctx is not None and s.ctx.ws.state is not State.OPEN)
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
                    "session_id": s.ctx.session.id if s.ctx is not None else None,
                    "client": s.ctx.client if s.ctx is not None else None,
                    "sessions_served": s.sessions_served,
                    "quarantine_reason": s.quarantine_reason,
                }
                for s in self.slots
            ],
        }
