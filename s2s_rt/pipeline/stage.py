"""What a stage of a slot sees: a narrow, frozen context, and the loop that feeds it its queue.

A stage (transcribing, responding, speaking, the listener, dispatch) is
built with a :class:`StageContext` and the queues or callbacks of its
neighbours, wired in :class:`~s2s_rt.slot.Slot`; it never sees the slot.
So a stage can be built and driven in a test without a server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from s2s_rt.engines.base import Stack
from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.clauses import FIRST_CLAUSE_WORDS
from s2s_rt.pipeline.outbox import Outbox
from s2s_rt.scope import Scope

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StageContext:
    """What every stage of one slot shares: the same for every session the slot serves.

    Attributes:
        index: the slot's position in the pool (for logs and task names).
        stack: the process's shared engines.
        pools: the shared executors, by stage kind (``"vad"``, ``"stt"``, ``"llm"``, ``"tts"``).
        metrics: where counts and timings go.
        outbox: the slot's send queue to the client of the session served now.
        fail: ends the session a failed piece of work belongs to, alone (``fail(exc, where, scope)``).
        first_clause_words: an answer's first clause is cut after this many words or a few more, where a pause fits.
    """

    index: int
    stack: Stack
    pools: Mapping[str, StagePool]
    metrics: Metrics
    outbox: Outbox
    fail: Callable[[BaseException, str, Scope | None], None]
    first_clause_words: int = FIRST_CLAUSE_WORDS

    def voice(self, name: str) -> str | None:
        """The TTS engine's voice for a session's ``voice`` (None: the engine's own, for a name it lacks)."""
        return name if name in self.stack.tts.voices else None

    def spawn(self, scope: Scope, coro: Coroutine[Any, Any, T], what: str) -> asyncio.Task[T] | None:
        """Start ``coro`` as work of ``scope`` (cancelled with it; None if it is closing), named for this slot."""
        return scope.spawn(coro, f"slot{self.index}-{what}")


async def serve(
    stage: StageContext, queue: asyncio.Queue[Any], handle: Callable[[Any], Awaitable[None]], name: str
) -> None:
    """A stage's loop: one item at a time; an item that raises ends its own session, not the stage."""
    while True:
        # One call per item: nothing of a session stays referenced while the stage waits.
        item = await queue.get()
        try:
            await handle(item)
        except Exception as exc:
            stage.fail(exc, f"the {name} stage", getattr(item, "scope", None))
        del item
