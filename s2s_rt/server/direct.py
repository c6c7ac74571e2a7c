"""The WebSocket connection, with a direct path for the frames that need no waiting.

``websockets`` hands each message to a task waiting in ``recv()``: a future
set, a task woken, an async generator stepped, per message. At 50 appends a
second per session that machinery was a large part of the event loop's time
per append. :class:`DirectConnection` offers each complete text frame, as it
is parsed, to a synchronous handler first; the handler takes what it can do
without waiting (an audio append, the buffer's clear and commit) and declines the rest, which goes the
usual way, to ``recv()``. Order is kept: a frame is offered only while no
earlier message waits in the queue or is still being handled there.

It also parses a client's bytes a bounded number of frames per turn of the
event loop. ``websockets`` parses everything one socket read brings at once:
a read is up to 256 KiB, some 37,000 one-byte frames of a flooding client,
about 0.3–0.4 s of parsing and refusing in one go, during which no other
session's turn moved (measured: turns stalled for seconds, loop lag 0.5 s).
And while the handler refuses a connection's events (see :meth:`refusing`),
its next frames wait a little: refusing must cost less than the abuse, and
a loop kept busy by one flood (even in small turns) starves the engines'
threads of the GIL, so the other sessions' turns still took several times longer.

Both reach past the public API of ``websockets``, which offers no way to know
whether a message waits for ``recv()`` without awaiting it, nor a hook for
when its queue has room again: :mod:`~s2s_rt.server.internals` lists what is
used, and a server refuses to start on a version that lacks it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame, Opcode
from websockets.protocol import Event, State

from s2s_rt.pipeline.ports import ClientPlays
from s2s_rt.server import internals, posts

log = logging.getLogger(__name__)

#: Frames parsed per turn of the event loop for one connection, at most (a slice may add a few).
#: At some 10 µs a frame (parsed and refused), a flooding client holds the loop well under a millisecond.
FRAMES_PER_TURN = 64
#: Bytes handed to the parser at once: a slice holds at most ~170 frames (6 bytes the smallest client frame),
#: and a large message costs only a few thousand cheap slices per megabyte.
SLICE_BYTES = 1024
#: After a turn in which events were refused, the connection's next frames wait this long: a flood
#: is then parsed at most FRAMES_PER_TURN / REFUSING_PAUSE_S frames a second (~3,200, a few % of a core).
REFUSING_PAUSE_S = 0.02


class DirectConnection(ServerConnection):
    """A server connection whose complete text frames may be handled as they arrive.

    Attributes:
        direct: takes a text message's bytes; returns True when it handled
            the message, False to leave it to ``recv()``. None: every
            message goes to ``recv()``.
        busy: True while the ``recv()`` side handles a message (see
            :meth:`handling`), so that nothing overtakes it.
    """

    #: Answers the requests with bodies (POST, OPTIONS) that arrive on the port (set by :meth:`answering`).
    answer_post: posts.Answer | None = None
    #: The tasks answering them, until they end.
    post_tasks: ClassVar[set[asyncio.Task[None]]] = set()
    #: The requests with bodies still being read (a client may send its body slowly, or never finish it).
    reading: ClassVar[weakref.WeakSet[posts.Exchange]] = weakref.WeakSet()
    #: Every connection whose socket is open: WebSockets, requests, handshakes (see :meth:`abort_all`).
    opened: ClassVar[weakref.WeakSet[DirectConnection]] = weakref.WeakSet()

    @functools.cached_property
    def playback(self) -> ClientPlays:
        """Where the answers' audio plays: the client plays what it is sent (see the Channel protocol)."""
        return ClientPlays()

    @classmethod
    def answering(cls, answer: posts.Answer) -> type[DirectConnection]:
        """This class, answering POST and OPTIONS requests with ``answer`` (one server's connections).

        Raises:
            RuntimeError: the installed websockets lacks what this class uses of it (see
                :func:`~s2s_rt.server.internals.require_websockets`); run in the server's event loop.
        """
        internals.require_websockets()
        attrs = {
            "answer_post": staticmethod(answer),
            "post_tasks": set(),
            "reading": weakref.WeakSet(),
            "opened": weakref.WeakSet(),
        }
        return type(cls.__name__, (cls,), attrs)

    @classmethod
    def refuse_unread(cls, why: str) -> None:
        """Answer 503 to every request whose body is still arriving, and close its connection (shutdown).

        Its client may never finish it: the server does not wait for that.
        """
        for exchange in list(cls.reading):
            exchange.refuse(why)

    @classmethod
    def abort_all(cls) -> int:
        """Drop every connection whose socket is still open, whatever it is doing (the end of a shutdown, past its
        bound: see :mod:`~s2s_rt.server.teardown`); how many."""
        dropped = list(cls.opened)
        for connection in dropped:
            connection.transport.abort()
        return len(dropped)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: The first bytes, until they tell whether h11 or the WebSocket library reads this connection.
        self._first: bytes | None = b""
        #: This connection's request with a body, when it is one.
        self._post: posts.Exchange | None = None
        self.direct: Callable[[bytes | bytearray | memoryview], bool] | None = None
        self.busy = False
        #: Frames parsed in the current feed (counted by process_event).
        self._parsed = 0
        #: Whether an event was refused since the last parse was scheduled (see :meth:`refusing`).
        self._refusing = False
        #: Bytes read but not yet parsed, from offset ``_at``; None when there are none.
        self._rest: bytes | None = None
        self._at = 0
        #: The scheduled parse of ``_rest`` on the loop's next turn.
        self._later: asyncio.Handle | asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.opened.add(self)
        # Reading resumes only when the queue has room AND no read bytes wait here: the
        # bytes in ``_rest`` come first, so the queue's resume restarts their parsing instead.
        self.recv_messages.resume = self._queue_has_room

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Around the handling of a message taken from ``recv()``: nothing overtakes it meanwhile."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def refusing(self) -> None:
        """Called when an event of this connection was refused (rate limit): its next frames wait a while."""
        self._refusing = True

    @property
    def is_open(self) -> bool:
        return self.state is State.OPEN

    def abort(self) -> None:
        """Drop the TCP connection at once."""
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._post is not None:
            self._post.feed(data)
            return
        if self._first is not None:
            # A request with a body is not a handshake: h11 reads it (see s2s_rt.server.posts).
            first = self._first + data
            verdict = posts.is_post(first) if self.answer_post is not None else False
            if verdict is None:
                self._first = first
                return
            self._first = None
            if verdict:
                assert self.answer_post is not None
                self._post = posts.Exchange(self.transport, self.answer_post, self.post_tasks)
                self.reading.add(self._post)
                self._post.feed(first)
                return
            data = first
        if self._rest is not None:
            # Reading was paused while bytes wait; whatever still came goes after them, in order.
            self._rest = self._rest[self._at :] + data
            self._at = 0
            self.transport.pause_reading()
            return
        self._rest, self._at = data, 0
        self._feed()

    def _feed(self) -> None:
        """Parse ``_rest`` in slices until done, FRAMES_PER_TURN frames, or a full queue; the rest waits."""
        self._later = None
        data = self._rest
        if data is None:
            return
        self._parsed = 0
        at, end = self._at, len(data)
        queue = self.recv_messages
        while at < end and self._parsed < FRAMES_PER_TURN and not queue.paused:
            super().data_received(data[at : at + SLICE_BYTES])
            at += SLICE_BYTES
        if at < end:
            self._at = at
            # No reading until these bytes are parsed: the client's socket buffer fills and
            # its sending slows down, at no cost to the loop.
            self.transport.pause_reading()
            if not queue.paused:  # a full queue restarts the parsing itself when recv() drains it
                self._feed_later()
            return
        self._rest = None
        if not queue.paused:
            self.transport.resume_reading()

    def _feed_later(self) -> None:
        """Parse the rest on the loop's next turn, or after REFUSING_PAUSE_S if events were refused meanwhile."""
        loop = asyncio.get_running_loop()
        if self._refusing:
            self._refusing = False
            self._later = loop.call_later(REFUSING_PAUSE_S, self._feed)
        else:
            self._later = loop.call_soon(self._feed)

    def _queue_has_room(self) -> None:
        if self._rest is None:
            self.transport.resume_reading()
        elif self._later is None:
            self._feed_later()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._post is not None:
            # A client may half-close after its body: the transport stays open for the answer.
            self._post.eof()
            return True
        # Reading is paused while bytes wait, so this should not happen then; if it does, they come first.
        if self._rest is not None:
            if self._later is not None:
                self._later.cancel()
                self._later = None
            rest, self._rest = self._rest[self._at :], None
            super().data_received(rest)
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        # The connection is gone: what it had sent and is not parsed yet is dropped.
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self._rest = None
        self.opened.discard(self)
        super().connection_lost(exc)

    def process_event(self, event: Event) -> None:
        self._parsed += 1
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
