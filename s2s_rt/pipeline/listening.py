"""Listening: input audio through the VAD into turns, and when to transcribe ahead.

The VAD stage alone owns a session's listening state (buffer, clock, turn
detector, speculation): settings changes reach it through its queue, in
order with the audio, so nothing it reads can change under it during an
await.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array, Transcript
from s2s_rt.pipeline.work import (
    AudioIn,
    BufferCommand,
    ResponseRequest,
    SessionEnd,
    SettingsChanged,
    Transcribe,
    ms_to_samples,
    samples_to_ms,
)
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import ServerEvent, new_id
from s2s_rt.turn import SpeechStart, SpeechStop, TurnDetector

if TYPE_CHECKING:
    from s2s_rt.pipeline.context import SessionContext
    from s2s_rt.slot import Slot

log = logging.getLogger("s2s_rt.slot")


@dataclass
class InputBuffer:
    """The session's uncommitted input audio at ``PIPELINE_RATE``, clocked from session start.

    Arrays put in are never changed afterwards, so a view of them may be
    handed to a worker thread without a copy.
    """

    start_sample: int = 0
    chunks: list[Float32Array] = field(default_factory=list)
    samples: int = 0

    @property
    def end_sample(self) -> int:
        return self.start_sample + self.samples

    def append(self, x: Float32Array) -> None:
        self.chunks.append(x)
        self.samples += len(x)

    def audio(self) -> Float32Array:
        if len(self.chunks) != 1:
            joined = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
            self.chunks = [joined]
        return self.chunks[0]

    def since(self, sample: int) -> tuple[tuple[Float32Array, ...], int]:
        """The chunks holding audio from ``sample`` on, and the offset into the first: no copy."""
        return tuple(self.chunks), max(0, sample - self.start_sample)

    def drop_before(self, sample: int) -> None:
        cut = sample - self.start_sample
        if cut <= 0:
            return
        rest = self.audio()[cut:]
        self.chunks = [rest] if len(rest) else []
        self.samples = len(rest)
        self.start_sample = sample

    def take(self, start: int, end: int) -> Float32Array:
        """Audio in [start, end) (session sample clock); drops everything before ``end``."""
        a = self.audio()
        clip = a[max(0, start - self.start_sample) : max(0, end - self.start_sample)].copy()
        self.drop_before(min(end, self.end_sample))
        return clip

    def clear(self) -> None:
        self.start_sample = self.end_sample
        self.chunks, self.samples = [], 0


@dataclass
class Speculation:
    """A transcription of a turn started during its closing silence."""

    task: asyncio.Task[Transcript | BaseException]
    #: Set by the worker thread when the engine call really starts.
    started: threading.Event


class ListeningState:
    """What the VAD stage keeps about the session it serves."""

    def __init__(self, vad_state: Any, turn_detection: Any) -> None:
        self.vad_state = vad_state
        self.pending = np.zeros(0, np.float32)
        self.clock = 0  # samples of input audio fed to the VAD so far
        self.buffer = InputBuffer()
        self.detector = TurnDetector(turn_detection) if turn_detection is not None else None
        self.turn_item_id: str | None = None
        self.speculation: Speculation | None = None
        #: A speculative engine call is running (wanted or not): no second one starts meanwhile.
        self.speculating = False
        self.idle_from = 0  # sample clock when idle time started counting


def _join(chunks: tuple[Float32Array, ...], offset: int) -> Float32Array:
    audio = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    return audio[offset:]


class Listener:
    """The VAD stage of one slot."""

    def __init__(self, slot: Slot, max_input_samples: int, speculate_after_ms: int) -> None:
        self.slot = slot
        self.max_input_samples = max_input_samples
        self.speculate_after_ms = speculate_after_ms
        self.chunk = slot.stack.vad.chunk_samples

    async def run(self) -> None:
        while True:
            # One call per item: nothing of a session stays referenced while the stage waits.
            await self._handle(await self.slot.vad_q.get())

    async def _handle(self, item: Any) -> None:
        slot = self.slot
        if isinstance(item, SessionEnd):
            await slot.stt_q.put(item)
            return
        if item.scope.stale:
            slot.metrics.dropped_stale.inc(stage="vad")
            return
        ctx = slot.ctx
        assert ctx is not None
        if isinstance(item, ResponseRequest):
            await slot.stt_q.put(item)
        elif isinstance(item, AudioIn):
            try:
                await self._listen(ctx, item.samples)
            finally:
                slot.input_budget.release(item.samples.nbytes)
        elif isinstance(item, BufferCommand):
            await self._buffer_command(ctx, item)
        elif isinstance(item, SettingsChanged):
            self._apply_settings(ctx)

    def _apply_settings(self, ctx: SessionContext) -> None:
        ls = ctx.listening
        td = ctx.session.config.turn_detection
        if td is None:
            ls.detector = None
            self._drop_speculation(ls)
        elif ls.detector is None:
            ls.detector = TurnDetector(td)
        else:
            ls.detector.settings = td

    async def _listen(self, ctx: SessionContext, samples: Float32Array) -> None:
        slot = self.slot
        ls = ctx.listening
        chunk = self.chunk
        if ls.buffer.samples + len(samples) > self.max_input_samples:
            await slot.outbox.error(
                ProtocolError(
                    "input_audio_buffer_full",
                    f"The input audio buffer holds at most {self.max_input_samples // PIPELINE_RATE} s;"
                    " commit or clear it before appending more",
                    param="audio",
                )
            )
            return
        ls.buffer.append(samples)
        detector = ls.detector
        if detector is None:
            ls.clock += len(samples)
            return
        ls.pending = np.concatenate([ls.pending, samples]) if len(ls.pending) else samples
        while len(ls.pending) >= chunk:
            piece, ls.pending = ls.pending[:chunk], ls.pending[chunk:]
            start = ls.clock
            ls.clock += chunk
            try:
                prob = await slot.vad.probability(piece, ls.vad_state)
            except Exception as exc:
                # The turn goes on without this chunk's decision; say so once per failure.
                log.warning("slot %d: VAD failed: %r", slot.index, exc)
                await slot.outbox.error(
                    ProtocolError("vad_failed", f"Voice activity detection failed: {exc}", type="server_error")
                )
                prob = 0.0
            turn = detector.feed(prob, samples_to_ms(start), samples_to_ms(ls.clock))
            if isinstance(turn, SpeechStart):
                await self._speech_started(ctx, turn)
            elif isinstance(turn, SpeechStop):
                await self._speech_stopped(ctx, turn)
            elif not detector.speaking:
                await self._idle_check(ctx)
            else:
                self._speculate(ctx)
        if not detector.speaking:
            # Keep only what a coming turn's prefix padding may need.
            ls.buffer.drop_before(ls.clock - ms_to_samples(detector.settings.prefix_padding_ms) - chunk)

    async def _speech_started(self, ctx: SessionContext, turn: SpeechStart) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        self._drop_speculation(ls)
        ls.turn_item_id = new_id("item")
        events: list[ServerEvent] = [session.speech_started(int(turn.audio_start_ms), ls.turn_item_id)]
        td = ls.detector.settings if ls.detector else None
        if session.response is not None and td is not None and td.interrupt_response:
            # Barge-in: the answer being spoken is cancelled at once.
            events += session.cancel_response("turn_detected")
            slot.metrics.turns.inc(status="cancelled")
        await slot.outbox.emit(events, session.scope)

    async def _speech_stopped(self, ctx: SessionContext, turn: SpeechStop) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        assert ls.detector is not None
        item_id = ls.turn_item_id or new_id("item")
        ls.turn_item_id = None
        speech_end = time.perf_counter()
        start = ms_to_samples(ls.detector.start_ms)
        audio = ls.buffer.take(start, ms_to_samples(turn.audio_end_ms))
        ls.idle_from = ls.clock
        td = ls.detector.settings
        events = [session.speech_stopped(int(turn.audio_end_ms), item_id)]
        events += session.commit_audio(item_id)
        await slot.outbox.emit(events, session.scope)
        speculation, ls.speculation = ls.speculation, None
        if speculation is not None:
            slot.metrics.speculations.inc(outcome="used")
        await slot.stt_q.put(
            Transcribe(
                session.scope,
                item_id,
                audio,
                td.create_response,
                speech_end,
                speculation.task if speculation else None,
            )
        )

    def _drop_speculation(self, ls: ListeningState) -> None:
        """Speech came back (or the turn was cleared): the guess is stale; stop it if it has not begun."""
        if ls.speculation is not None:
            ls.speculation.task.cancel()
            ls.speculation = None
            self.slot.metrics.speculations.inc(outcome="discarded")

    def _speculate(self, ctx: SessionContext) -> None:
        """While a turn's closing silence runs, transcribe what was said so far.

        If the silence lasts, the turn ends with this transcript already made
        (or nearly); if speech returns, the guess is dropped — cancelled if
        its engine call has not begun, else left to finish unread, and no
        other speculation starts until it has: speculation never costs more
        than one engine call at a time per session.
        """
        ls = ctx.listening
        detector = ls.detector
        if detector is None or not self.speculate_after_ms:
            return
        silence_ms = samples_to_ms(ls.clock) - detector.last_voice_ms
        if ls.speculation is not None:
            if silence_ms == 0:
                self._drop_speculation(ls)
            return
        if silence_ms < self.speculate_after_ms or ls.speculating:
            return
        chunks, offset = ls.buffer.since(ms_to_samples(detector.start_ms))
        tr = ctx.session.config.transcription
        stt = self.slot.stack.stt
        started = threading.Event()
        loop = asyncio.get_running_loop()

        def done_running() -> None:
            ls.speculating = False

        def transcribe() -> Transcript:
            started.set()
            try:
                return stt.transcribe(
                    _join(chunks, offset), language=tr.language if tr else None, prompt=tr.prompt if tr else None
                )
            finally:
                loop.call_soon_threadsafe(done_running)

        async def guess() -> Transcript | BaseException:
            # Never raises: its outcome is read by the STT stage, or nobody wants it.
            try:
                return await self.slot.pools["stt"].call(transcribe)
            except Exception as exc:
                return exc

        ls.speculating = True
        task = self.slot.tg.create_task(guess(), name=f"slot{self.slot.index}-speculation")

        scope = ctx.session.scope

        def finished(t: asyncio.Task[Any]) -> None:
            scope.forget(t.cancel)
            if not started.is_set():  # dropped before its engine call began
                ls.speculating = False

        task.add_done_callback(finished)
        scope.on_close(task.cancel)
        ls.speculation = Speculation(task, started)

    async def _idle_check(self, ctx: SessionContext) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        td = ls.detector.settings if ls.detector else None
        if td is None or td.idle_timeout_ms is None or session.response is not None:
            ls.idle_from = ls.clock if session.response is not None else ls.idle_from
            return
        if ls.clock - ls.idle_from < ms_to_samples(td.idle_timeout_ms):
            return
        item_id = new_id("item")
        start_ms = int(samples_to_ms(ls.buffer.start_sample))
        audio = ls.buffer.take(ls.buffer.start_sample, ls.clock)
        ls.idle_from = ls.clock
        events = session.timeout_triggered(start_ms, int(samples_to_ms(ls.clock)), item_id)
        events += session.commit_audio(item_id)
        await slot.outbox.emit(events, session.scope)
        await slot.stt_q.put(Transcribe(session.scope, item_id, audio, True, None))

    async def _buffer_command(self, ctx: SessionContext, cmd: BufferCommand) -> None:
        slot = self.slot
        session = ctx.session
        ls = ctx.listening
        if cmd.kind == "clear":
            ls.buffer.clear()
            self._drop_speculation(ls)
            if ls.detector is not None:
                ls.detector.reset()
            await slot.outbox.emit([session.buffer_cleared()], session.scope)
            return
        ms = samples_to_ms(ls.buffer.samples)
        if ms < 100:
            await slot.outbox.error(
                ProtocolError(
                    "input_audio_buffer_commit_empty",
                    f"Cannot commit: the input audio buffer holds {ms:.0f} ms; at least 100 ms is needed",
                    event_id=cmd.event_id,
                )
            )
            return
        item_id = ls.turn_item_id or new_id("item")
        ls.turn_item_id = None
        self._drop_speculation(ls)
        audio = ls.buffer.take(ls.buffer.start_sample, ls.buffer.end_sample)
        if ls.detector is not None:
            ls.detector.reset()
        await slot.outbox.emit(session.commit_audio(item_id), session.scope)
        await slot.stt_q.put(Transcribe(session.scope, item_id, audio, False, time.perf_counter()))
