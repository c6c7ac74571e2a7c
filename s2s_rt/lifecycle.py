"""Lifecycles as tables: ``(state, event) → state``, and nothing else moves a state.

A slot, a response and a speculation each have one :class:`Lifecycle`; the
code that owns the state says which event happened (:meth:`Lifecycle.step`)
and the table alone says where that leads. A pair the table does not hold is
a server bug and raises :class:`LifecycleError`, never a client's doing.

The owner keeps its state behind a read-only property whose only writer is
its step method: a hand assignment (``slot.state = SlotState.IDLE``) raises
``AttributeError`` at once, instead of moving the state around its table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class LifecycleError(RuntimeError):
    """An event the state's table does not allow in that state (a server bug, never a client's)."""


class Lifecycle(Generic[S, E]):
    """One state table.

    Args:
        name: what moves through it, for errors.
        table: every allowed ``(state, event)`` and the state it leads to.
    """

    def __init__(self, name: str, table: Mapping[tuple[S, E], S]) -> None:
        self.name = name
        self.table = dict(table)

    def step(self, state: S, event: E, who: object = "") -> S:
        """The state ``event`` leads to from ``state``.

        Raises:
            LifecycleError: the table has no such move.
        """
        nxt = self.table.get((state, event))
        if nxt is None:
            label = f"{self.name} {who}".rstrip()
            raise LifecycleError(f"{label}: {event.value} is not allowed when {state.value}")
        return nxt

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self.table
