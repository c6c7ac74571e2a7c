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
"""

from __future__ import annotations

from collections.abc import Callable


class Scope:
    """One unit of wanted work: a session, or a response within it.

    Args:
        name: what it scopes, for logs and ``repr``.
        parent: the enclosing scope; closing it makes this one stale too.
    """

    __slots__ = ("_callbacks", "closed", "name", "parent", "reason")

    def __init__(self, name: str, parent: Scope | None = None) -> None:
        self.name = name
        self.parent = parent
        self.closed = False
        self.reason: str | None = None
        self._callbacks: list[Callable[[], object]] = []
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

    def _parent_closed(self) -> None:
        self.close(f"{self.parent.name if self.parent else 'parent'} closed")

    def __repr__(self) -> str:
        return f"<Scope {self.name} {'closed: ' + str(self.reason) if self.closed else 'open'}>"
