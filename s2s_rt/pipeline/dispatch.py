"""Dispatch: a client's frames in, decoded and routed to the session or the pipeline."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from s2s_rt.audio import AudioFormat, AudioFormatError, Resampler
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array
from s2s_rt.pipeline.work import AudioIn, BufferCommand, ResponseRequest, SettingsChanged, TurnTiming
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from s2s_rt.pipeline.context import SessionContext
    from s2s_rt.slot import Slot

#: Appends longer than this (base64-decoded bytes) are converted off the loop.
_LONG_APPEND = 96_000


class Dispatcher:
    """Feeds one slot with its client's frames."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    async def receive(self, message: str | bytes) -> None:
        """Handle one frame from the client: decode, validate, dispatch.

        Every problem becomes an ``error`` event; nothing here raises for
        anything the client sent.
        """
        slot = self.slot
        if isinstance(message, bytes):
            await slot.outbox.error(
                ProtocolError("invalid_event", "Binary frames are not supported; send JSON events as text frames")
            )
            return
        try:
            event = ce.decode_client_event(message)
        except ProtocolError as exc:
            slot.metrics.events_in.inc(type="invalid")
            await slot.outbox.error(exc)
            return
        slot.metrics.events_in.inc(type=type(event).__struct_config__.tag)  # type: ignore[arg-type]
        try:
            await self._dispatch(event)
        except ProtocolError as exc:
            if exc.event_id is None:
                exc.event_id = event.event_id
            await slot.outbox.error(exc)

    async def _dispatch(self, ev: ce.ClientEvent) -> None:
        slot = self.slot
        ctx = slot.ctx
        assert ctx is not None
        session = ctx.session
        scope = session.scope
        match ev:
            case ce.InputAudioBufferAppend():
                samples = await self._decode_audio(ctx, ev)
                await slot.input_budget.take(samples.nbytes)
                await slot.vad_q.put(AudioIn(scope, samples))
            case ce.InputAudioBufferCommit():
                await slot.vad_q.put(BufferCommand(scope, "commit", ev.event_id))
            case ce.InputAudioBufferClear():
                await slot.vad_q.put(BufferCommand(scope, "clear", ev.event_id))
            case ce.SessionUpdate():
                events = session.handle(ev)
                fmt = session.config.input_format
                if fmt != ctx.input_format:
                    ctx.input_format = fmt
                    ctx.resampler = Resampler(fmt.rate, PIPELINE_RATE)
                await slot.outbox.emit(events, scope)
                # Turn detection changes reach the VAD stage in order with the audio.
                await slot.vad_q.put(SettingsChanged(scope))
            case ce.ResponseCreate():
                events = session.handle(ev)
                r = session.response
                assert r is not None
                slot.outbox.timings[r.id] = TurnTiming()
                await slot.outbox.emit(events, scope)
                await slot.vad_q.put(ResponseRequest(r.scope, r))
            case ce.ResponseCancel():
                events = session.handle(ev)
                slot.metrics.turns.inc(status="cancelled")
                await slot.outbox.emit(events, scope)
            case _:
                await slot.outbox.emit(session.handle(ev), scope)

    async def _decode_audio(self, ctx: SessionContext, ev: ce.InputAudioBufferAppend) -> Float32Array:
        fmt = ctx.input_format
        resampler = ctx.resampler
        try:
            if len(ev.audio) > _LONG_APPEND:
                # A long append would hold the loop for a while: convert it off the loop.
                return await asyncio.to_thread(_convert, resampler, fmt, ev.audio)
            return _convert(resampler, fmt, ev.audio)
        except AudioFormatError as exc:
            raise ProtocolError("invalid_audio_length", str(exc), param="audio") from None


def _convert(resampler: Resampler, fmt: AudioFormat, data: bytes) -> Float32Array:
    return resampler.process(fmt.decode(data))
