"""Cancellation scopes: which work is still wanted.

Every session has a scope, and every response has one inside its session's.
Work made for a response carries the response's scope and is stale when
*that* response is cancelled or fails, or when its session ends; work made
for the session (speech events, transcripts) is stale when the session ends.
A response that finishes closes nothing: whatever it queued is still
delivered whole, even if a newer response has started meanwhile.

Closing a scope runs its ``on_close`` callbacks once (the pipeline uses them
to cancel the tasks doing the scope's work). Reading :attr:`Scope.stale` is a
couple of attribute reads, safe from executor threads under the GIL, so
engines can stop between pieces.

A scope is also the owner of the tasks doing its work: :meth:`Scope.spawn`
starts one only while the scope is open, cancels it when the scope closes,
and hands an exception it raises to the outermost scope's ``on_failure``
(the slot ends that session alone). No one starts work for a session in
another object's task group from outside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Scope:
    """One unit of wanted work: a session, or a response within it.

    Args:
        name: what it scopes, for logs and ``repr``.
        parent: the enclosing scope; closing it makes this one stale too.
    """

    __slots__ = ("_callbacks", "_tasks", "closed", "name", "on_failure", "parent", "reason")

    def __init__(self, name: str, parent: Scope | None = None) -> None:
        self.name = name
        self.parent = parent
        self.closed = False
        self.reason: str | None = None
        self._callbacks: list[Callable[[], object]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Told when a task of this scope (or of one inside it) raises, with this scope; set on a session's scope.
        #: It is given the scope rather than holding it: a handler that held its scope would make a cycle.
        self.on_failure: Callable[[BaseException, Scope], object] | None = None
        if parent is not None:
            parent.on_close(self._parent_closed)

    @property
    def stale(self) -> bool:
        """True once this scope or an enclosing one is closed."""
        return self.closed or (self.parent is not None and self.parent.stale)

    @property
    def outermost(self) -> Scope:
        """The session's scope, for a response's scope (itself for a session's)."""
        scope = self
        while scope.parent is not None:
            scope = scope.parent
        return scope

    def close(self, reason: str) -> None:
        """Make all work of this scope stale and run the close callbacks (once)."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_close(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the scope closes (at once if it already is)."""
        if self.stale:
            callback()
        else:
            self._callbacks.append(callback)

    def forget(self, callback: Callable[[], object]) -> None:
        """Drop a close callback that is no longer needed."""
        try:
            self._callbacks.remove(callback)
        except ValueError:
            pass

    def release(self) -> None:
        """The scope's work finished without being cancelled: stop following the parent.

        Its queued work stays wanted; only the parent no longer holds on to it.
        """
        if self.parent is not None and not self.closed:
            self.parent.forget(self._parent_closed)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T] | None:
        """Run ``coro`` as a task this scope owns; None (and ``coro`` closed) once the scope is stale.

        The task is cancelled when the scope closes. If it raises, the
        exception goes to the outermost scope's ``on_failure`` (logged when
        there is none): a failure in one session's work ends that session,
        never the loop or the task group that happened to be running.
        """
        if self.stale:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        self.on_close(task.cancel)
        task.add_done_callback(self._task_done)
        return task

    @property
    def tasks(self) -> int:
        """Tasks spawned in this scope that have not ended yet."""
        return len(self._tasks)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self.forget(task.cancel)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Report a failure of this scope's work to the outermost scope's ``on_failure``."""
        outermost = self.outermost
        handler = outermost.on_failure
        if handler is None:
            log.error("%s: work failed", self.name, exc_info=exc)
        else:
            handler(exc, outermost)

    def _parent_closed(self) -> None:
        self.close(f"{self.parent.name if self.parent else 'parent'} closed")

    def __repr__(self) -> str:
        return f"<Scope {self.name} {'closed: ' + str(self.reason) if self.closed else 'open'}>"
