"""Dispatch: a client's frames in, decoded and routed to the session or the pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from s2s_rt.metrics import labels_key
from s2s_rt.pipeline.work import BufferCommand, ResponseRequest, SettingsChanged
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import ItemEvent

if TYPE_CHECKING:
    from s2s_rt.audio import AudioFormat
    from s2s_rt.pipeline.context import SessionContext
    from s2s_rt.pipeline.listener import Listener
    from s2s_rt.pipeline.stage import StageContext


_APPEND = labels_key(type="input_audio_buffer.append")
_BUFFER_COMMANDS = {
    ce.InputAudioBufferClear: ("clear", labels_key(type="input_audio_buffer.clear")),
    ce.InputAudioBufferCommit: ("commit", labels_key(type="input_audio_buffer.commit")),
}


class Dispatcher:
    """Feeds one slot with its client's frames.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        listener: the slot's listener (audio and buffer commands go to it, in order).
        max_wait_s: how long an append past the budget may wait for room before it is refused.
        read_ahead: reads what the session's next answer begins with into the LLM's kept state (its new
            instructions and tools, after a ``session.update``).
    """

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        listener: Listener,
        max_wait_s: float,
        read_ahead: Callable[[SessionContext], None] = lambda ctx: None,
    ) -> None:
        self.stage = stage
        self.serving = serving
        self.listener = listener
        self.max_wait_s = max_wait_s
        self.read_ahead = read_ahead

    async def receive(self, message: str | bytes) -> None:
        """Handle one frame from the client: decode, validate, dispatch.

        Every problem becomes an ``error`` event; nothing here raises for
        anything the client sent.
        """
        stage = self.stage
        if isinstance(message, bytes):
            await stage.outbox.error(
                ProtocolError("invalid_event", "Binary frames are not supported; send JSON events as text frames")
            )
            return
        try:
            event = ce.decode_client_event(message)
        except ProtocolError as exc:
            stage.metrics.events_in.inc(type="invalid")
            await stage.outbox.error(exc)
            return
        stage.metrics.events_in.inc(type=type(event).__struct_config__.tag)  # type: ignore[arg-type]
        try:
            await self._dispatch(event)
        except ProtocolError as exc:
            if exc.event_id is None:
                exc.event_id = event.event_id
            await stage.outbox.error(exc)

    def receive_now(self, message: bytes | bytearray | memoryview) -> bool:
        """Handle an audio append, commit or clear at once, if nothing about it needs waiting; else leave it (False).

        For the receive path's direct route: only a valid append whose audio
        is taken, and the buffer's commands that follow it to the listening
        clock (a probe's or a push-to-talk's ``clear`` and ``commit`` wait
        for no task to wake), go through here. Anything else, or anything that fails,
        returns False untouched, and :meth:`receive` handles it in full
        (decoding it again, reporting what is wrong). The frame's bytes are
        decoded as they are: JSON decoding checks their UTF-8.
        """
        try:
            event = ce.decode_client_event(message)
        except ProtocolError:
            return False
        ctx = self.serving()
        if ctx is None:
            return False
        if type(event) is not ce.InputAudioBufferAppend:
            command = _BUFFER_COMMANDS.get(type(event))
            if command is None:
                return False
            name, counted = command
            self.listener.command(ctx, BufferCommand(ctx.session.scope, name, event.event_id))
            self.stage.metrics.events_in.add(counted)
            return True
        try:
            if not self._append(ctx, event):
                return False
        except ProtocolError:
            return False
        self.stage.metrics.events_in.add(_APPEND)
        return True

    def media_audio(self, ctx: SessionContext, fmt: AudioFormat, data: bytes) -> None:
        """Audio from a call's media track, in ``fmt``: heard as an append's would be.

        It arrives in real time and cannot be asked to wait: past the session's
        limit of audio waiting to be heard (the listening clock is that far
        behind) it is dropped and counted.
        """
        if not self.listener.audio(ctx, data, fmt=fmt):
            self.stage.metrics.dropped_stale.inc(stage="call_audio")

    def _append(self, ctx: SessionContext, ev: ce.InputAudioBufferAppend) -> bool:
        """Queue an append's raw bytes for the listening clock; False when its session's limit is reached.

        Only the raw bytes are kept here; decoding, resampling and the VAD
        happen on the listening clock, for all sessions at once. Never waits:
        a receive loop that stopped reading would starve pings too.

        Raises:
            ProtocolError: the audio does not fit the session's format.
        """
        return self.listener.audio(ctx, ev.audio, ev.event_id)

    async def _dispatch(self, ev: ce.ClientEvent) -> None:
        stage = self.stage
        ctx = self.serving()
        assert ctx is not None
        session = ctx.session
        scope = session.scope
        listener = self.listener
        match ev:
            case ce.InputAudioBufferAppend():
                if not self._append(ctx, ev) and not await listener.audio_when_heard(
                    ctx, ev.audio, ev.event_id, self.max_wait_s
                ):
                    # Sent faster than it can be heard, past the session's budget, for longer than audio may
                    # wait: this append is refused (the client may send it again), the session stays.
                    raise ProtocolError(
                        "input_audio_buffer_full",
                        f"{ctx.audio.waiting_bytes} bytes of audio are still waiting to be heard (at most"
                        f" {ctx.audio.limit_bytes}); this append was not taken: send it again shortly",
                        param="audio",
                    )
            case ce.InputAudioBufferCommit():
                listener.command(ctx, BufferCommand(scope, "commit", ev.event_id))
            case ce.InputAudioBufferClear():
                listener.command(ctx, BufferCommand(scope, "clear", ev.event_id))
            case ce.SessionUpdate() | ce.TranscriptionSessionUpdate():
                events = session.handle(ev)
                await stage.outbox.emit(events, scope)
                # Turn detection changes reach the listener in order with the audio.
                listener.command(ctx, SettingsChanged(scope))
                self.read_ahead(ctx)
                ctx.mcp.list_new(stage.outbox.emit)
            case ce.ConversationItemCreate():
                events = session.handle(ev)
                await stage.outbox.emit(events, scope)
                if events and isinstance(events[0], ItemEvent):
                    ctx.mcp.answered(events[0].item.id, stage.outbox.emit)  # an MCP call approved runs now
            case ce.ResponseCreate():
                events = session.handle(ev)
                r = session.response
                assert r is not None
                ctx.timings.begin(r.id)
                await stage.outbox.emit(events, scope)
                # It travels behind the audio and transcriptions before it.
                listener.command(ctx, ResponseRequest(r.scope, r))
            case ce.OutputAudioBufferClear():
                cut = ctx.channel.playback.clear()
                if cut is None:
                    raise ProtocolError(
                        "invalid_request_error",
                        "output_audio_buffer.clear is for WebRTC calls: over a WebSocket the client holds the"
                        " audio it was sent (cancel the response, and truncate the item at what was played)",
                    )
                await stage.outbox.emit(session.cut_off(*cut), scope)  # nothing, if nothing plays
            case ce.ResponseCancel():
                events = session.handle(ev)
                stage.metrics.turns.inc(status="cancelled")
                await stage.outbox.emit(events, scope)
            case _:
                await stage.outbox.emit(session.handle(ev), scope)
