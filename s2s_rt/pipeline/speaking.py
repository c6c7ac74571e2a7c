"""Speaking: the TTS stage turns clauses into audio deltas, and closes each response in order."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from s2s_rt.audio import Resampler
from s2s_rt.engines.base import Float32Array
from s2s_rt.inference import EngineTimeout
from s2s_rt.pipeline.anticipation import SpokenAhead
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.mcp_runs import mcp_call_events
from s2s_rt.pipeline.stage import Stage, StageContext
from s2s_rt.pipeline.work import CallOut, ResponseEnd, SessionEnd, Speak
from s2s_rt.protocol.errors import ServerFault

log = logging.getLogger(__name__)

#: Audio deltas are cut to this length.
DELTA_MS = 100


class Speaker(Stage[SessionContext, Speak | CallOut | ResponseEnd]):
    """The TTS stage: speaks each clause as audio deltas, and sends a response's text, calls and end in order.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        inbox: its queue (clauses, calls, response ends, session ends); what it makes goes to the outbox.
        answered: called when a response ended (the listener counts idle time from then).
        read_ahead: called when an answer ended (the responding stage reads the conversation ahead).
    """

    name = "tts"

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        inbox: asyncio.Queue[Any],
        answered: Callable[[SessionContext], None],
        read_ahead: Callable[[SessionContext], None],
    ) -> None:
        super().__init__(stage, serving, inbox)
        self.answered = answered
        self.read_ahead = read_ahead
        self._resampler: Resampler | None = None
        self._resampling_for: str | None = None

    async def forward(self, end: SessionEnd) -> None:
        self._resampler = self._resampling_for = None
        await self.stage.outbox.end_session(end)

    def scoped(self, item: Speak | CallOut | ResponseEnd) -> bool:
        # Only speech is cancelled halfway: a call, a text and a response's end are queued whole, in order.
        return isinstance(item, Speak) and item.response.audio

    async def work(self, ctx: SessionContext, item: Speak | CallOut | ResponseEnd) -> None:
        stage = self.stage
        session = ctx.session
        r = item.response
        if isinstance(item, CallOut):
            server = session.mcp.server_of(item.name, r.params.tools)
            if server is None:
                await stage.outbox.emit(r.function_call(item.name, item.arguments), item.scope)
            else:
                await stage.outbox.emit(mcp_call_events(r, server, item.name, item.arguments), item.scope)
        elif isinstance(item, ResponseEnd):
            r.input_tokens, r.output_tokens = item.usage.input_tokens, item.usage.output_tokens
            r.cached_tokens = item.usage.cached_tokens
            events = session.finish_response(r)
            if events:
                stage.metrics.turns.inc(status="completed")
            self.answered(ctx)
            await stage.outbox.emit(events, item.scope)
            if events:
                ctx.mcp.run_calls(r, stage.outbox.emit)
                self.read_ahead(ctx)
        elif not r.audio:
            await stage.outbox.emit(r.text_delta(item.text), item.scope)
        else:
            await self._speak(ctx, item)

    def _resampler_for(self, job: Speak) -> Resampler:
        r = job.response
        if self._resampling_for != r.id or self._resampler is None:
            self._resampling_for = r.id
            self._resampler = Resampler(self.stage.stack.tts.sample_rate, r.params.output_format.rate)
        return self._resampler

    async def _speak(self, ctx: SessionContext, job: Speak) -> None:
        stage = self.stage
        r = job.response
        scope = job.scope
        resampler = self._resampler_for(job)
        fmt = r.params.output_format
        pieces: list[Float32Array] = []
        ahead = await _spoken_ahead(job)
        synthesised: float | None = None
        try:
            if ahead is not None:
                pieces = [resampler.process(audio) for audio in ahead.audio]
                synthesised = ahead.ready
            else:

                def speech() -> Iterator[Float32Array]:
                    # Resampled in the TTS thread, off the event loop (this slot's resampler, one job at a time).
                    for audio in stage.stack.tts.synthesize(
                        job.text,
                        voice=stage.voice(r.params.voice),
                        should_stop=lambda: scope.stale,
                        speed=r.params.speed,
                    ):
                        yield resampler.process(audio)

                async for audio in stage.pools["tts"].stream(speech):
                    if scope.stale:
                        return
                    pieces.append(audio)
        except Exception as exc:
            log.warning("slot %d: TTS failed: %r", stage.index, exc)
            if not scope.stale:
                stage.metrics.turns.inc(status="failed")
                code = "tts_timeout" if isinstance(exc, EngineTimeout) else "tts_failed"
                stage.metrics.errors.inc(code=code)
                await stage.outbox.emit(
                    ctx.session.fail_response(r, ServerFault(code, f"Speech synthesis failed: {exc}")),
                    ctx.session.scope,
                )
            return
        if scope.stale:
            return
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        data = fmt.encode(samples)
        step = max(fmt.bytes_per_sample, int(fmt.rate * DELTA_MS / 1000) * fmt.bytes_per_sample)
        chunks = [data[i : i + step] for i in range(0, len(data), step)]
        ms = 1000 * len(samples) / fmt.rate
        timing = ctx.timings.of(r.id)
        if timing is not None and timing.first_audio is None:
            timing.first_audio = time.perf_counter()
            timing.synthesised = synthesised or timing.first_audio
            if timing.speech_end is not None:
                stage.metrics.turn_latency.observe(timing.first_audio - timing.speech_end)
        await stage.outbox.emit(r.audio_segment(chunks, job.text, ms), scope)


async def _spoken_ahead(job: Speak) -> SpokenAhead | None:
    """The clause's speech if it was synthesised ahead of the turn's end (None: synthesise it now)."""
    task = job.ahead
    if task is None:
        return None
    await asyncio.wait((task,))
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()
