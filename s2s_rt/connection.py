"""The WebSocket connection, with a direct path for the frames that need no waiting.

``websockets`` hands each message to a task waiting in ``recv()``: a future
set, a task woken, an async generator stepped, per message. At 50 appends a
second per session that machinery was a large part of the event loop's time
per append. :class:`DirectConnection` offers each complete text frame, as it
is parsed, to a synchronous handler first; the handler takes what it can do
without waiting (an audio append) and declines the rest, which goes the
usual way, to ``recv()``. Order is kept: a frame is offered only while no
earlier message waits in the queue or is still being handled there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame, Opcode
from websockets.protocol import Event

log = logging.getLogger("s2s_rt.server")


class DirectConnection(ServerConnection):
    """A server connection whose complete text frames may be handled as they arrive.

    Attributes:
        direct: takes a text message's bytes; returns True when it handled
            the message, False to leave it to ``recv()``. None: every
            message goes to ``recv()``.
        busy: True while the ``recv()`` side handles a message (see
            :meth:`handling`), so that nothing overtakes it.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.direct: Callable[[bytes | bytearray | memoryview], bool] | None = None
        self.busy = False

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Around the handling of a message taken from ``recv()``: nothing overtakes it meanwhile."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def process_event(self, event: Event) -> None:
        handler = self.direct
        if (
            handler is not None
            and type(event) is Frame
            and event.opcode is Opcode.TEXT
            and event.fin
            and not self.busy
            and not self.recv_messages.frames.queue
        ):
            try:
                if handler(event.data):
                    return
            except Exception:
                # A bug here must not break the connection's reading: the usual way handles the frame.
                log.exception("the direct route failed on a frame; handing it to recv()")
        super().process_event(event)
