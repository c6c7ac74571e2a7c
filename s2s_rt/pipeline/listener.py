"""The listener: what one slot makes of its session's heard audio — turns, commits, and speculation.

The process's listening clock (:class:`~s2s_rt.listening.clock.ListeningClock`)
hears every session's audio in batches and hands each slot's share to its
:class:`Listener` (which it knows only as a
:class:`~s2s_rt.listening.clock.Listening`). The listener never awaits: it
feeds the turn detector, emits the turn's events, hands finished turns to
the transcribing stage, and asks the session's
:class:`~s2s_rt.pipeline.speculation.Speculator` to work ahead in a turn's
closing silence.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from s2s_rt.audio import AudioFormat
from s2s_rt.engines.base import PIPELINE_RATE, ms_to_samples, samples_to_ms
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.listening.hearing import AudioBytes, EngineUnavailable, Heard, SessionAudio
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.speculation import Speculator
from s2s_rt.pipeline.stage import StageContext
from s2s_rt.pipeline.work import (
    BufferCommand,
    ResponseRequest,
    SettingsChanged,
    Transcribe,
)
from s2s_rt.protocol.errors import ProtocolError, RealtimeError, ServerFault
from s2s_rt.protocol.server_events import ServerEvent, new_id
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd, SpeechStart, SpeechStop, TurnDetector

log = logging.getLogger(__name__)


class Listener:
    """One slot's listening logic, run by the listening clock (never awaits).

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now (None between sessions).
        clock: the process's listening clock.
        to_stt: puts work on the transcribing stage's queue (raises ``asyncio.QueueFull``).
        close_now: ends the session from code that cannot wait (``close_now(error or None, close code)``).
        max_input_samples: most uncommitted input audio per session.
        speculate_after_ms: silence after which a turn is transcribed ahead of its end (0: never).
        semantic: the waits of ``semantic_vad``.
    """

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        clock: ListeningClock,
        to_stt: Callable[[Any], None],
        close_now: Callable[[RealtimeError | None, int], None],
        max_input_samples: int,
        speculate_after_ms: int,
        semantic: SemanticTurnEnd | None = None,
    ) -> None:
        self.stage = stage
        self.serving = serving
        self.clock = clock
        self.to_stt = to_stt
        self.close_now = close_now
        self.max_input_samples = max_input_samples
        self.speculate_after_ms = speculate_after_ms
        self.semantic = semantic or SemanticTurnEnd()
        self.chunk = stage.stack.vad.chunk_samples

    def speculator_for(self, ctx: SessionContext) -> Speculator:
        """The speculation of a session this slot takes on.

        The context owns its speculator; the speculator reaches the context
        only through a weak reference. Were each to hold the other, an ended
        session would be freed by the cyclic collector, not when its slot
        lets go of it.
        """
        context = weakref.ref(ctx)

        def language() -> str | None:
            c = context()
            return c.language if c is not None else None

        def emit(events: list[ServerEvent]) -> None:
            c = context()
            if c is not None:
                self._emit(c, events)

        return Speculator(self.stage, ctx.session, ctx.turns, language, emit, self.semantic, self.speculate_after_ms)

    # --- arrival (the receive path) -------------------------------------------

    def audio(
        self, ctx: SessionContext, data: bytes, event_id: str | None = None, fmt: AudioFormat | None = None
    ) -> bool:
        """Raw audio from the client, in ``fmt`` (None: the format the session has now), queued to be heard.

        Returns False (nothing queued) when the session's audio waiting to be heard is at its limit.

        Raises:
            ProtocolError: the byte count does not fit the format.
        """
        item = self._audio_bytes(ctx, data, event_id, fmt)
        if not ctx.audio.put_audio(item):
            return False
        self.clock.wake(self)
        return True

    async def audio_when_heard(self, ctx: SessionContext, data: bytes, event_id: str | None, wait_s: float) -> bool:
        """:meth:`audio`, waiting up to ``wait_s`` for the audio before it to be heard (this sender alone waits)."""
        if not await ctx.audio.put_audio_when_room(self._audio_bytes(ctx, data, event_id, None), wait_s):
            return False
        self.clock.wake(self)
        return True

    @staticmethod
    def _audio_bytes(ctx: SessionContext, data: bytes, event_id: str | None, fmt: AudioFormat | None) -> AudioBytes:
        fmt = ctx.session.config.input_format if fmt is None else fmt
        if len(data) % fmt.bytes_per_sample:
            raise ProtocolError(
                "invalid_audio_length",
                f"{fmt.type} audio must have a multiple of {fmt.bytes_per_sample} bytes, got {len(data)}",
                param="audio",
            )
        return AudioBytes(ctx.session.scope, data, fmt, event_id=event_id)

    def command(self, ctx: SessionContext, item: BufferCommand | SettingsChanged | ResponseRequest) -> None:
        """A command that must follow the audio before it."""
        ctx.audio.put_command(item)
        self.clock.wake(self)

    def answered(self, ctx: SessionContext) -> None:
        """A response ended: the session's idle time (``idle_timeout_ms``) counts from here."""
        ctx.turns.idle_from = ctx.turns.position

    # --- what the clock drives (:class:`~s2s_rt.listening.clock.Listening`) ------------

    def listening(self) -> SessionAudio | None:
        ctx = self.serving()
        return ctx.audio if ctx is not None else None

    def heard(self, segments: list[AudioBytes], got: Heard | None) -> None:
        ctx = self.serving()
        assert ctx is not None
        if segments:
            ctx.audio.heard(segments)
            ctx.turns.heard_event_id = segments[-1].event_id
        if got is not None:
            self._heard(ctx, got)
        self._commands(ctx)

    def fail(self, exc: BaseException, where: str, scope: Scope | None = None) -> None:
        self.stage.fail(exc, where, scope)

    def fall_behind(self, backlog_s: float) -> None:
        """The session's audio waits too long, or too much of it: tell it and close it, alone."""
        ctx = self.serving()
        if ctx is None or ctx.ending:
            return
        audio = ctx.audio
        waiting, limit = audio.waiting_bytes, audio.limit_bytes
        log.warning(
            "slot %d: %.1f s (%d bytes) of audio not yet heard; closing the session",
            self.stage.index,
            backlog_s,
            waiting,
        )
        ctx.stop_hearing()
        exc = ServerFault(
            "audio_backlog_exceeded",
            f"This session's audio is not being heard in time ({backlog_s:.1f} s and {waiting} bytes waiting; at most"
            f" {self.clock.max_backlog_s:g} s and {limit} bytes); closing it",
        )
        self.close_now(exc, 1013)

    # --- what the results mean ------------------------------------------------------

    def _heard(self, ctx: SessionContext, got: Heard) -> None:
        turns = ctx.turns
        if got.error is not None:
            if not isinstance(got.error, EngineUnavailable):
                raise got.error  # this session's audio alone failed: the clock ends this session
            log.warning("slot %d: VAD failed: %r", self.stage.index, got.error)
            self._error(ctx, ServerFault("vad_failed", f"Voice activity detection failed: {got.error}"))
        samples = got.samples
        room = self.max_input_samples - turns.buffer.samples
        if len(samples) > room:
            # Keep what fits; refuse the rest, telling the client once (not once per slice of a large append)
            # until the buffer has room again.
            if room > 0:
                turns.buffer.append(samples[:room])
                turns.position += room
            if not turns.buffer_full:
                turns.buffer_full = True
                self._error(
                    ctx,
                    ProtocolError(
                        "input_audio_buffer_full",
                        f"The input audio buffer holds at most {self.max_input_samples // PIPELINE_RATE} s;"
                        " commit or clear it before appending more (audio past that was dropped)",
                        param="audio",
                        event_id=turns.heard_event_id,
                    ),
                )
            return
        turns.buffer_full = False
        turns.buffer.append(samples)
        detector = turns.detector
        if detector is None:
            turns.position += len(samples)
            return
        chunk = self.chunk
        speculator = ctx.speculator
        for prob in got.probabilities:
            start = turns.position
            turns.position += chunk
            if detector.finished is None:
                detector.finished = speculator.finished
            end_ms = samples_to_ms(turns.position)
            turn = detector.feed(float(prob), samples_to_ms(start), end_ms)
            if detector.speaking and detector.last_voice_ms == end_ms:
                turns.voice_heard = time.perf_counter()  # the waterfall's origin, if this is the last word
            if isinstance(turn, SpeechStart):
                self._speech_started(ctx, turn)
            elif isinstance(turn, SpeechStop):
                self._speech_stopped(ctx, turn)
            elif not detector.speaking:
                self._idle_check(ctx)
            else:
                speculator.on_voice()
        if not detector.speaking:
            # Keep only what a coming turn's prefix padding may need.
            turns.buffer.drop_before(turns.position - ms_to_samples(detector.settings.prefix_padding_ms) - chunk)

    def _commands(self, ctx: SessionContext) -> None:
        """Handle the commands at the head of the inbox (up to the next audio)."""
        for item in ctx.audio.commands():
            if isinstance(item, BufferCommand):
                self._buffer_command(ctx, item)
            elif isinstance(item, SettingsChanged):
                self._apply_settings(ctx)
            elif isinstance(item, ResponseRequest):
                if not item.scope.stale:
                    self._to_stt(item)

    def _emit(self, ctx: SessionContext, events: list[ServerEvent]) -> None:
        if events and not self.stage.outbox.emit_nowait(events, ctx.session.scope):
            self.close_now(None, 1008)

    def _error(self, ctx: SessionContext, exc: RealtimeError) -> None:
        self.stage.metrics.errors.inc(code=exc.code)
        self._emit(ctx, [ctx.session.error(exc)])

    def _to_stt(self, item: Transcribe | ResponseRequest) -> None:
        try:
            self.to_stt(item)
        except asyncio.QueueFull:
            self.close_now(
                ProtocolError("session_backlog_exceeded", "Too much work is waiting for this session; closing it"),
                1013,
            )

    def _apply_settings(self, ctx: SessionContext) -> None:
        turns = ctx.turns
        td = ctx.session.config.turn_detection
        if td is None:
            turns.detector = None
            ctx.speculator.drop()
        elif turns.detector is None:
            turns.detector = TurnDetector(td, self.semantic)
        else:
            turns.detector.settings = td
        ctx.audio.scoring = turns.detector is not None
        self._apply_noise_reduction(ctx)

    def _apply_noise_reduction(self, ctx: SessionContext) -> None:
        """The session's audio is denoised while it asks (by whoever hears it: the model is loaded there, when
        first used, and the session's stream keeps its state while it still asks)."""
        asked = ctx.session.config.noise_reduction is not None
        noise = self.stage.stack.noise
        if asked and noise is None:
            ctx.session.config.noise_reduction = None
            self._error(ctx, ServerFault("noise_reduction_unavailable", "This server has no noise reduction installed"))
            return
        ctx.audio.noise = noise if asked else None

    def _speech_started(self, ctx: SessionContext, turn: SpeechStart) -> None:
        session = ctx.session
        turns = ctx.turns
        ctx.speculator.drop()
        turns.turn_item_id = new_id("item")
        events: list[ServerEvent] = [session.speech_started(int(turn.audio_start_ms), turns.turn_item_id)]
        td = turns.detector.settings if turns.detector else None
        if td is not None and td.interrupt_response:
            # Barge-in: the answer being spoken is cancelled at once.
            if session.response is not None:
                events += session.cancel_response("turn_detected")
                self.stage.metrics.turns.inc(status="cancelled")
            cut = ctx.channel.playback.clear()
            if cut is not None:
                # The audio is played here (a call): what is not yet heard is dropped, the item truncated at what was.
                events += session.cut_off(*cut)
        self._emit(ctx, events)

    def _speech_stopped(self, ctx: SessionContext, turn: SpeechStop) -> None:
        session = ctx.session
        turns = ctx.turns
        assert turns.detector is not None
        item_id = turns.turn_item_id or new_id("item")
        turns.turn_item_id = None
        start = max(ms_to_samples(turns.detector.start_ms), turns.buffer.start_sample)
        audio = turns.buffer.take(start, ms_to_samples(turn.audio_end_ms))
        turns.idle_from = turns.position
        td = turns.detector.settings
        events = [session.speech_stopped(int(turn.audio_end_ms), item_id)]
        events += session.commit_audio(item_id)
        self._emit(ctx, events)
        transcript, anticipation, timing = ctx.speculator.take()
        timing.last_voice, timing.speech_end = turns.voice_heard, time.perf_counter()
        self._to_stt(
            Transcribe(
                session.scope,
                item_id,
                audio,
                td.create_response and not session.transcription_only,
                timing,
                transcript,
                anticipation,
                start,
                tuple(turns.detector.pauses),
            )
        )

    def _idle_check(self, ctx: SessionContext) -> None:
        session = ctx.session
        turns = ctx.turns
        td = turns.detector.settings if turns.detector else None
        if td is None or td.idle_timeout_ms is None or session.response is not None:
            turns.idle_from = turns.position if session.response is not None else turns.idle_from
            return
        if turns.position - turns.idle_from < ms_to_samples(td.idle_timeout_ms):
            return
        item_id = new_id("item")
        start_ms = int(samples_to_ms(turns.buffer.start_sample))
        audio = turns.buffer.take(turns.buffer.start_sample, turns.position)
        turns.idle_from = turns.position
        events = session.timeout_triggered(start_ms, int(samples_to_ms(turns.position)), item_id)
        events += session.commit_audio(item_id)
        self._emit(ctx, events)
        self._to_stt(Transcribe(session.scope, item_id, audio, not session.transcription_only, None))

    def _buffer_command(self, ctx: SessionContext, cmd: BufferCommand) -> None:
        session = ctx.session
        turns = ctx.turns
        if cmd.kind == "clear":
            turns.buffer.clear()
            ctx.speculator.drop()
            if turns.detector is not None:
                turns.detector.reset()
            self._emit(ctx, [session.buffer_cleared()])
            return
        ms = samples_to_ms(turns.buffer.samples)
        if ms < 100:
            self._error(
                ctx,
                ProtocolError(
                    "input_audio_buffer_commit_empty",
                    f"Cannot commit: the input audio buffer holds {ms:.0f} ms; at least 100 ms is needed",
                    event_id=cmd.event_id,
                ),
            )
            return
        item_id = turns.turn_item_id or new_id("item")
        turns.turn_item_id = None
        ctx.speculator.drop()
        audio = turns.buffer.take(turns.buffer.start_sample, turns.buffer.end_sample)
        if turns.detector is not None:
            turns.detector.reset()
        self._emit(ctx, session.commit_audio(item_id))
        self._to_stt(Transcribe(session.scope, item_id, audio, False, None))
