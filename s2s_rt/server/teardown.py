"""The end of a shutdown: every session closed within a bound, then whatever is still closing cut.

After the grace period every WebSocket gets its close (1001) and every call its end. A clean close
needs the client: its reply to the close frame, then its side of the TCP close. A client that never
replies (gone, hostile, or stopped reading) would hold its connection for websockets' whole
``close_timeout`` (10 s), and a session whose engine call is stuck would hold it for the slot's drain
deadline: either would outlast the process's own deadline, and the process would end with status 1
instead of 0. So the teardown has a bound of its own (:data:`TEARDOWN_S`); past it, each connection
still open is dropped (its socket aborted, a session's handler cancelled: WebSockets, and requests or
handshakes, which the listening socket's own close waits for too) and each call's task cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from websockets.asyncio.server import ServerConnection

log = logging.getLogger(__name__)

#: How long the sessions get to close once the running turns have ended or the grace period is over.
TEARDOWN_S = 0.4
#: How long what was cut gets to end.
CUT_S = 0.2


class Handlers:
    """The WebSocket handler ``handle``, keeping each connection it serves with its task until it returns."""

    def __init__(self, handle: Callable[[ServerConnection], Awaitable[None]]) -> None:
        self.handle = handle
        self.live: dict[ServerConnection, asyncio.Task[None]] = {}

    async def __call__(self, ws: ServerConnection) -> None:
        task = asyncio.current_task()
        assert task is not None
        address = ws.remote_address
        task.set_name(f"connection {address[0]}:{address[1]}" if address else "connection")
        self.live[ws] = task
        try:
            await self.handle(ws)
        finally:
            del self.live[ws]

    def cut(self) -> list[asyncio.Task[None]]:
        """Cancel every handler still serving a connection (its socket is dropped with the rest); their tasks."""
        tasks = list(self.live.values())
        for task in tasks:
            task.cancel()
        return tasks


async def end_sessions(
    closing: Iterable[Awaitable[object]],
    handlers: Handlers,
    task_sets: Iterable[set[asyncio.Task[None]]],
    abort_connections: Callable[[], int],
) -> int:
    """Await ``closing`` (the server's closes of its sessions) for :data:`TEARDOWN_S` at most; past that, cancel
    every handler of ``handlers`` and every task of ``task_sets`` (the calls'), drop every connection still open
    (``abort_connections``: sessions', and requests and handshakes, which the server's own close waits for too),
    and give ``closing`` :data:`CUT_S` more. Returns how many connections and tasks were cut."""
    waiting = asyncio.ensure_future(asyncio.gather(*closing))
    waiting.add_done_callback(_outcome)
    done, _ = await asyncio.wait({waiting}, timeout=TEARDOWN_S)
    if done:
        return 0
    cut = handlers.cut()
    for tasks in task_sets:
        for task in list(tasks):
            task.cancel()
            cut.append(task)
    dropped = abort_connections()
    log.warning(
        "still closing %g s after the running turns: %d connection(s) dropped, %d task(s) cancelled (%s)",
        TEARDOWN_S,
        dropped,
        len(cut),
        ", ".join(sorted(task.get_name() for task in cut)[:20]),
    )
    done, _ = await asyncio.wait({waiting}, timeout=CUT_S)
    if not done:
        log.warning("still closing %g s after the cut: no longer waited for", CUT_S)
        waiting.cancel()
    return dropped + len(cut)


def _outcome(closing: asyncio.Future[Any]) -> None:
    """A close that failed is logged, whether the teardown still waited for it or not."""
    if not closing.cancelled() and not isinstance(closing.exception(), (type(None), asyncio.CancelledError)):
        log.error("closing the sessions failed", exc_info=closing.exception())
