"""The ports the pipeline defines and its transports implement: a session's channel, and where a call plays audio.

A WebSocket connection and a WebRTC call (:mod:`s2s_rt.server`) each
implement :class:`Channel`; the pipeline sends through it and never imports
a transport. What the server uses of the pipeline is here and in the slot's
port (:class:`~s2s_rt.slot.SessionPort`), nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from websockets.exceptions import ConnectionClosed

if TYPE_CHECKING:
    from s2s_rt.audio import AudioFormat


class EventTooLarge(Exception):
    """What a channel's ``send`` raises for one event larger than its peer takes in one message.

    Args:
        size: the event's bytes.
        limit: the most the peer takes.
    """

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an event of {size} bytes is more than the peer takes in one message ({limit})")
        self.size = size
        self.limit = limit


#: Where a response's audio was cut off: the response that was playing, its item, and the ms of it heard.
Cut = tuple[str | None, str | None, float]


class Playback(Protocol):
    """Where a session's answers' audio is played, and what of it was heard: each transport implements it.

    A call plays the audio on its outgoing track (:attr:`takes_audio`): audio
    deltas go to :meth:`play` instead of being sent as events, and barge-in
    clears what has not played yet. Over a WebSocket the client plays what it
    is sent (:class:`ClientPlays`): nothing is played, or cleared, here.

    Attributes:
        takes_audio: audio deltas are played here, not sent as events.
        notify: told ``("started" | "stopped", response_id)`` as a response's audio begins and ends playing.
    """

    takes_audio: bool
    notify: Callable[[str, str], None]

    def play(self, response_id: str, item_id: str, data: bytes, fmt: AudioFormat) -> None:
        """Queue one audio delta of a response, in the session's output format (only when :attr:`takes_audio`)."""

    def finish(self, response_id: str) -> None:
        """A response's audio is all queued."""

    def clear(self) -> Cut | None:
        """Drop what has not played and say where it was cut (None: the client holds the audio it was sent)."""
        ...


def told_nobody(kind: str, response_id: str) -> None:
    """A playback's ``notify`` while no session listens: before one is attached, and once it is gone."""


class ClientPlays:
    """The playback of a channel whose client plays the audio it is sent (a WebSocket): nothing plays here."""

    takes_audio = False

    def __init__(self) -> None:
        self.notify: Callable[[str, str], None] = told_nobody

    def play(self, response_id: str, item_id: str, data: bytes, fmt: AudioFormat) -> None:
        raise AssertionError("the client plays the audio it is sent: nothing is played here")

    def finish(self, response_id: str) -> None:
        pass

    def clear(self) -> Cut | None:
        return None


class Channel(Protocol):
    """What carries one session's events to its client: a WebSocket connection, or a WebRTC call.

    Attributes:
        playback: where the answers' audio is played (:class:`Playback`).
        close_code: the close code, once closed.
    """

    @property
    def playback(self) -> Playback: ...

    @property
    def close_code(self) -> int | None: ...

    @property
    def is_open(self) -> bool: ...

    async def send(self, message: Any, *, text: bool | None = ...) -> None:
        """Send one event; raises ``ConnectionClosed`` when the client is gone, :class:`EventTooLarge`."""

    async def close(self, code: int = 1000, reason: str = "") -> None: ...

    def abort(self) -> None:
        """Drop the connection at once."""


async def close_quickly(ws: Channel, code: int, reason: str) -> None:
    """Send a close frame; if the peer does not answer within a second, drop the connection."""
    try:
        async with asyncio.timeout(1.0):
            await ws.close(code, reason)
    except TimeoutError:
        ws.abort()


async def say_and_close(ws: Channel, data: list[bytes], code: int, reason: str) -> None:
    """Send a failed session's last events and close its socket (within a second or two, whatever the client does)."""
    try:
        async with asyncio.timeout(1.0):
            for frame in data:
                await ws.send(frame, text=True)
    except (TimeoutError, ConnectionClosed):
        pass
    await close_quickly(ws, code, reason)
