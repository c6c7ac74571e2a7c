"""What a stage of a slot sees (a narrow, frozen context), and the one contract of the stages fed by a queue.

A stage (transcribing, responding, speaking, the listener, dispatch) is
built with a :class:`StageContext` and the queues or callbacks of its
neighbours, wired in :class:`~s2s_rt.slot.Slot`; it never sees the slot.
So a stage can be built and driven in a test without a server.

The three stages fed by a queue (transcribing, responding, speaking) are
each a :class:`Stage`: one queue in, one way out, and their work between.
What every one of them does with an item before its work (pass a session's
end on, drop stale work, find the session served, cancel the work with its
scope, and end only the item's session if it fails) is :class:`Stage`'s.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from s2s_rt.engines.base import Stack
from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.clauses import FIRST_CLAUSE_WORDS
from s2s_rt.pipeline.outbox import Outbox
from s2s_rt.pipeline.work import SessionEnd, run_scoped
from s2s_rt.scope import Scope

T = TypeVar("T")
#: What a stage knows of the session it serves: :class:`~s2s_rt.pipeline.context.SessionContext`, named by each
#: stage (that module imports this one, through the speculator: it is not imported back).
S = TypeVar("S")
#: The work a stage takes from its queue (besides a session's end).
W = TypeVar("W")


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


class Stage(abc.ABC, Generic[S, W]):
    """A stage of a slot fed by a queue: one queue in (:attr:`inbox`), one way out, and only its work between.

    Its loop (:meth:`run`) takes one item at a time and does what every
    stage does with it, in this order:

    1. a session's end (:class:`~s2s_rt.pipeline.work.SessionEnd`) is passed on (:meth:`forward`), behind
       everything the stage passed on before it;
    2. work whose scope is stale is dropped, counted in ``dropped_stale`` under :attr:`name`
       (:meth:`dropped` ends what dropping it must end besides);
    3. the rest is :meth:`work`, for the session the slot serves (there is one: its scope is live), as a
       task cancelled the moment the item's scope closes, unless :meth:`scoped` says it is done to its end.

    An item whose work raises ends its own session (``stage.fail``), never the stage.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        inbox: its queue (its work, and session ends).
    """

    #: Its name in metrics (``stt``, ``llm``, ``tts``); its failures name it in capitals ("the STT stage").
    name: ClassVar[str]

    def __init__(self, stage: StageContext, serving: Callable[[], S | None], inbox: asyncio.Queue[Any]) -> None:
        self.stage = stage
        self.serving = serving
        self.inbox = inbox

    async def run(self) -> None:
        """The stage's loop, until cancelled: one item at a time; an item that raises ends its own session only."""
        while True:
            # One call per item: nothing of a session stays referenced while the stage waits.
            item = await self.inbox.get()
            try:
                await self._handle(item)
            except Exception as exc:
                self.stage.fail(exc, f"the {self.name.upper()} stage", getattr(item, "scope", None))
            del item

    async def _handle(self, item: Any) -> None:
        if isinstance(item, SessionEnd):
            await self.forward(item)
            return
        if item.scope.stale:
            self.stage.metrics.dropped_stale.inc(stage=self.name)
            self.dropped(item)
            return
        ctx = self.serving()
        assert ctx is not None  # a live scope's session is the one served
        if self.scoped(item):
            await run_scoped(item.scope, self.work(ctx, item))
        else:
            await self.work(ctx, item)

    @abc.abstractmethod
    async def forward(self, end: SessionEnd) -> None:
        """Pass a session's end on, behind everything the stage passed on before it."""

    def dropped(self, item: W) -> None:
        """``item`` was dropped, its scope stale: end what it holds besides (nothing, unless a stage says)."""

    def scoped(self, item: W) -> bool:
        """Whether the work on ``item`` is cancelled the moment its scope closes (True unless a stage says).

        False for work that must finish once begun, in order: passing an item on, or queueing the events
        that close what the client saw opened.
        """
        return True

    @abc.abstractmethod
    async def work(self, ctx: S, item: W) -> None:
        """The stage's work on one item, for the session ``ctx`` (live when it began)."""
