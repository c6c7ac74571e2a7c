"""The end of a shutdown: every session closed within a bound, then whatever is still closing cut.

After the grace period every WebSocket gets its close (1001) and every call its end. A clean close
needs the client: its reply to the close frame, then its side of the TCP close. A client that never
replies (gone, hostile, or stopped reading) would hold its connection for websockets' whole
``close_timeout`` (10 s), and a session whose engine call is stuck would hold it for the slot's drain
deadline: either would outlast the process's own deadline, and the process would end with status 1
instead of 0. So the teardown has a bound of its own (:data:`TEARDOWN_S`); past it, each connection
still open is dropped (its socket aborted, its handler cancelled) and each call's task cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

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
        """Drop every connection still served (its socket aborted, its handler cancelled); their tasks."""
        tasks = []
        for ws, task in list(self.live.items()):
            ws.transport.abort()
            task.cancel()
            tasks.append(task)
        return tasks


async def end_sessions(
    closing: Iterable[Awaitable[object]], handlers: Handlers, task_sets: Iterable[set[asyncio.Task[None]]]
) -> int:
    """Await ``closing`` (the server's closes of its sessions) for :data:`TEARDOWN_S` at most; past that,
    cut every connection of ``handlers`` and cancel every task of ``task_sets`` (the calls'), and give
    ``closing`` :data:`CUT_S` more. Returns how many connections and calls were cut."""
    waiting = asyncio.ensure_future(asyncio.gather(*closing))
    done, _ = await asyncio.wait({waiting}, timeout=TEARDOWN_S)
    if done:
        waiting.result()
        return 0
    cut = handlers.cut()
    for tasks in task_sets:
        for task in list(tasks):
            task.cancel()
            cut.append(task)
    log.warning(
        "%d session(s) still closing %g s after the running turns: cut (%s)",
        len(cut),
        TEARDOWN_S,
        ", ".join(sorted(task.get_name() for task in cut)[:20]),
    )
    done, _ = await asyncio.wait({waiting}, timeout=CUT_S)
    if done:
        waiting.result()
    else:
        waiting.cancel()
    return len(cut)
