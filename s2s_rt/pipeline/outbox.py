"""The outbox: server events queued in order, and the send loop that delivers them.

Events are encoded when they are emitted, so a queued event is a snapshot
that nothing can change. The send loop writes only to the socket of the
session the slot serves now, drops events whose scope is stale, and frees
the slot when the session's ``SessionEnd`` reaches it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from s2s_rt.budget import ByteBudget
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.ports import Channel, EventTooLarge, close_quickly, told_nobody
from s2s_rt.pipeline.work import CloseRequest, Outgoing, ResponseTimings, SessionEnd, TurnTiming
from s2s_rt.protocol.errors import RealtimeError, ServerFault
from s2s_rt.protocol.server_events import AudioDelta, DtmfReceived, ServerEvent, encode_event
from s2s_rt.scope import Scope

if TYPE_CHECKING:
    from s2s_rt.protocol.session import Session

log = logging.getLogger(__name__)


class Outbox:
    """Queue and send one slot's server events.

    Args:
        index: the slot's index, for logs.
        metrics: where counts go.
        queue_size: bound of the queue.
        send_timeout_s: how long one send may wait for a client that does not read.
    """

    def __init__(
        self, index: int, metrics: Metrics, queue_size: int, send_timeout_s: float, max_bytes: int = 16 << 20
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.queue: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        #: Bytes of encoded events waiting to be sent: a client that reads slower than it asks waits alone.
        self.budget = ByteBudget("output", max_bytes)
        self.send_timeout_s = send_timeout_s
        self.log_content = False
        #: The channel, session, client address and response timings of the session served now (:meth:`attach`).
        self.channel: Channel | None = None
        self.session: Session | None = None
        self.client = ""
        self.timings = ResponseTimings()
        #: Called when a response ends (the server's shutdown waits on it).
        self.on_response_done: Callable[[], None] = lambda: None
        #: Called when a session's ``SessionEnd`` arrives, with the session's id.
        self.on_session_end: Callable[[str], None] = lambda session_id: None
        #: Since when a send has been waiting for the client (None: not waiting).
        self.sending_since: float | None = None

    def attach(self, channel: Channel, session: Session, client: str, timings: ResponseTimings) -> None:
        """Send the events of the session now served: to ``channel``; its responses' turns timed in ``timings``.

        Where the channel plays the answers' audio itself (a call's track), it
        tells when a response's audio starts and stops playing: sent as
        ``output_audio_buffer.started`` / ``stopped`` until :meth:`detach`.
        """
        self.channel, self.session, self.client, self.timings = channel, session, client, timings

        def played(kind: str, response_id: str) -> None:
            if not session.scope.stale:
                self.emit_nowait([session.output_audio_buffer(kind, response_id)], session.scope)

        channel.playback.notify = played

    def detach(self) -> None:
        """The session served is gone: nothing more is sent, and its channel (which may outlive it: a connection's
        objects can wait for the cyclic collector) tells it nothing more, nor holds it."""
        if self.channel is not None:
            self.channel.playback.notify = told_nobody
        self.channel = self.session = None
        self.timings = ResponseTimings()

    def _outgoing(self, event: ServerEvent, scope: Scope) -> Outgoing:
        sent: Callable[[], None] | None = None
        if event.type == "response.done":
            timing = self.timings.end(event.response.id)  # type: ignore[attr-defined]
            if timing is not None:
                sent = functools.partial(self._turn_done, event, timing)
            self.on_response_done()
            return Outgoing(scope, event.type, encode_event(event), sent, ends_audio_of=event.response.id)  # type: ignore[attr-defined]
        elif not event.type.endswith(".delta"):
            # What opens or closes an item, part or response goes out with its
            # session: a client never sees a close without its open. Only the
            # deltas of a response that is cancelled or fails meanwhile are dropped.
            scope = scope.outermost
        elif type(event) is AudioDelta:  # in either dialect's name
            timing = self.timings.of(event.response_id)
            if timing is not None and not timing.first_delta_queued:
                timing.first_delta_queued = True  # only the response's first delta is watched
                sent = functools.partial(_audio_sent, timing)
            channel = self.channel
            if channel is not None and channel.playback.takes_audio and self.session is not None:
                # Played here (a call's track): the event itself is never encoded or sent.
                play = (event.response_id, event.item_id, event.delta, self.session.config.output_format)
                return Outgoing(scope, event.type, b"", sent, play)
        return Outgoing(scope, event.type, encode_event(event), sent)

    async def emit(self, events: list[ServerEvent], scope: Scope) -> None:
        """Queue events, in order: deltas for as long as ``scope`` is wanted, the rest for the session.

        Waits while the session's queued output is over its byte budget.
        """
        for event in events:
            out = self._outgoing(event, scope)
            await self.budget.take(len(out.data))
            await self.queue.put(out)

    def emit_nowait(self, events: list[ServerEvent], scope: Scope) -> bool:
        """Queue events without waiting (for the listening clock, which serves every session).

        Small control events pass the byte budget; False (and nothing queued)
        when the queue itself has no room for them all: the client is hopelessly behind.
        """
        if self.queue.maxsize and self.queue.maxsize - self.queue.qsize() < len(events):
            return False
        for event in events:
            out = self._outgoing(event, scope)
            self.budget.used += len(out.data)
            self.queue.put_nowait(out)
        return True

    def dtmf(self, digit: str) -> None:
        """A phone call's caller pressed a key (``0``-``9``, ``*``, ``#``, ``A``-``D``)."""
        session = self.session
        if session is not None:
            event = DtmfReceived(
                type="input_audio_buffer.dtmf_event_received", event=digit, received_at=int(time.time())
            )
            self.emit_nowait([event], session.scope)

    async def error(self, exc: RealtimeError) -> None:
        """An ``error`` event for the session served now."""
        session = self.session
        if session is None:
            return
        self.metrics.errors.inc(code=exc.code)
        await self.emit([session.error(exc)], session.scope)

    async def close(self, scope: Scope, code: int, reason: str) -> None:
        """Close the socket once everything queued before has been sent."""
        await self.queue.put(CloseRequest(scope, code, reason))

    def close_nowait(self, scope: Scope, code: int, reason: str) -> bool:
        """:meth:`close` without waiting; False (nothing queued) when the queue has no room for it."""
        try:
            self.queue.put_nowait(CloseRequest(scope, code, reason))
        except asyncio.QueueFull:
            return False
        return True

    async def end_session(self, end: SessionEnd) -> None:
        """The session's last work is queued: once everything before ``end`` is sent, the slot is freed."""
        await self.queue.put(end)

    def flush(self) -> int:
        """Drop every queued event (a session's end marker stays); returns how many."""
        dropped = 0
        ends = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, SessionEnd):
                ends.append(item)  # the slot's teardown waits for it
            else:
                dropped += 1
        for end in ends:
            self.queue.put_nowait(end)
        self.budget.reset()
        return dropped

    def _turn_done(self, event: ServerEvent, timing: TurnTiming) -> None:
        """A response's ``response.done`` was sent: one log line for its turn, with its waterfall."""
        if self.session is None:
            return
        response = event.response  # type: ignore[attr-defined]
        waterfall = timing.waterfall()
        waterfall["done"] = time.perf_counter() - timing.origin
        if timing.speech_end is not None and response.status == "completed":
            for step, seconds in waterfall.items():
                self.metrics.turn_waterfall.observe(seconds, step=step)
        fields: dict[str, Any] = {
            "slot": self.index,
            "session": self.session.id,
            "response": response.id,
            "status": response.status,
            "from": (
                "last_word"
                if timing.last_voice is not None
                else "end_of_speech"
                if timing.speech_end is not None
                else "response.create"
            ),
            **{f"{step}_ms": round(1000 * seconds) for step, seconds in waterfall.items()},
            "clause_tokens": timing.tokens_to_first_clause,
            "ahead": int(timing.ahead is not None),
        }
        usage = response.usage
        if usage is not None:
            fields["input_tokens"] = usage.input_tokens
            fields["cached_tokens"] = usage.input_token_details.get("cached_tokens")
        if self.log_content:
            fields["user"] = timing.user_text
            output = response.output[-1].content if response.output else None
            fields["assistant"] = output[0].words if output else None
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("user", "assistant"))
        if self.log_content:
            text += f" user={fields['user']!r} assistant={fields['assistant']!r}"
        log.info("turn %s", text, extra={"fields": {"event": "turn", **fields}})

    async def run(self) -> None:
        """The send loop."""
        while True:
            # One call per item: nothing of a session stays referenced while the loop waits.
            await self._send(await self.queue.get())

    async def _send(self, item: Any) -> None:
        if isinstance(item, SessionEnd):
            self.on_session_end(item.session_id)
            return
        if isinstance(item, Outgoing):
            self.budget.release(len(item.data))
        ws = self.channel
        if item.scope.stale or ws is None:
            self.metrics.dropped_stale.inc(stage="send")
            return
        if isinstance(item, CloseRequest):
            await close_quickly(ws, item.code, item.reason)
            return
        playback = ws.playback
        if item.play is not None and playback.takes_audio:
            playback.play(*item.play)
            self.metrics.events_out.inc(type=item.type)
            if item.sent is not None:
                item.sent()
            return
        if item.ends_audio_of is not None:
            playback.finish(item.ends_audio_of)
        self.sending_since = time.monotonic()
        try:
            await ws.send(item.data, text=True)
        except ConnectionClosed:
            # The client is gone: its backlog is dropped at once, not sent into the void.
            self.flush()
            return
        except Exception as exc:
            # What the channel cannot carry ends this session, alone: the send loop serves the slot's next.
            await self._failed(ws, item, exc)
            return
        finally:
            self.sending_since = None
        self.metrics.events_out.inc(type=item.type)
        if item.sent is not None:
            item.sent()

    async def _failed(self, ws: Channel, item: Outgoing, exc: Exception) -> None:
        """A send failed other than by the client going away: tell the client why (if it can be told) and close."""
        if isinstance(exc, EventTooLarge):
            log.warning("slot %d: %s event not sent to %s: %s", self.index, item.type, self.client, exc)
            code, close_code = "event_too_large", 1009
            text = f"The {item.type} event ({exc.size} bytes) is more than this connection carries ({exc.limit})"
        else:
            log.error("slot %d: sending %s to %s failed", self.index, item.type, self.client, exc_info=exc)
            code, close_code, text = "send_failed", 1011, f"The {item.type} event could not be sent"
        self.flush()
        session = self.session
        if session is not None:
            self.metrics.errors.inc(code=code)
            notice = session.error(ServerFault(code, f"{text}; the session ends"))
            try:
                await ws.send(encode_event(notice), text=True)
            except Exception:
                pass  # the close below says it too
        await close_quickly(ws, close_code, code.replace("_", " "))

    def stuck_for(self) -> float:
        """Seconds the current send has waited for the client to read (0 when none waits)."""
        since = self.sending_since
        return 0.0 if since is None else time.monotonic() - since


def _audio_sent(timing: TurnTiming) -> None:
    timing.audio_sent = time.perf_counter()
