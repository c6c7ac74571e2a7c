"""A slot: everything one conversation needs, reused by one session after another.

A slot owns five stage coroutines joined by bounded queues::

    receive ─► vad_q ─► VAD ─► stt_q ─► STT ─► llm_q ─► LLM ─► tts_q ─► TTS ─► out_q ─► send

They run in one ``asyncio.TaskGroup`` for the life of the server. A stage
reads only its slot's queue, and only the send loop writes to the socket of
the session the slot serves now. Work carries a generation (see
:mod:`s2s_rt.generation`); every stage and the send loop drop stale work.

The slot's lifecycle, and the only transitions allowed::

    IDLE ──claim──► ACTIVE ──session ends──► DRAINING ──SESSION_END reaches send──► IDLE
                                                 └──drain deadline passes──► QUARANTINED

Teardown is three phases: (1) make all the session's work stale and flush
the queues; (2) put ``SESSION_END`` at the head of the pipeline; (3) the send
loop, on seeing it, marks the slot idle. A stage stuck in an engine call
keeps ``SESSION_END`` from arriving; past the deadline the slot is
quarantined and never handed out again.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from websockets.exceptions import ConnectionClosed

from s2s_rt.audio import AudioFormat, AudioFormatError, Resampler
from s2s_rt.engines.base import PIPELINE_RATE, ChatMessage, Float32Array, LLMUsage, Stack, Transcript
from s2s_rt.generation import Generation
from s2s_rt.inference import EngineTimeout, StagePool, VadBatcher
from s2s_rt.metrics import Metrics
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import ServerEvent, encode_event
from s2s_rt.protocol.session import ActiveResponse, Session, new_id
from s2s_rt.toolcalls import Call as CallPart
from s2s_rt.toolcalls import Text as TextPart
from s2s_rt.toolcalls import ToolCallError, ToolCallFilter, offered_tools, parse_call
from s2s_rt.turn import SpeechStart, SpeechStop, TurnDetector

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

log = logging.getLogger("s2s_rt.slot")


class SlotState(enum.Enum):
    IDLE = "idle"
    ACTIVE = "active"
    DRAINING = "draining"
    QUARANTINED = "quarantined"


TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.IDLE: frozenset({SlotState.ACTIVE}),
    SlotState.ACTIVE: frozenset({SlotState.DRAINING}),
    SlotState.DRAINING: frozenset({SlotState.IDLE, SlotState.QUARANTINED}),
    SlotState.QUARANTINED: frozenset(),
}


class _SessionEnd:
    def __repr__(self) -> str:
        return "SESSION_END"


#: Travels through every stage after a session ends; the send loop frees the slot on it.
SESSION_END = _SessionEnd()

#: Audio deltas are cut to this length.
DELTA_MS = 100


# --- work items -------------------------------------------------------------


@dataclass(slots=True)
class AudioIn:
    generation: int
    samples: Float32Array


@dataclass(slots=True)
class BufferCommand:
    generation: int
    kind: str  # "commit" | "clear"
    event_id: str | None


@dataclass(slots=True)
class ResponseRequest:
    """A response to produce; travels behind earlier transcriptions."""

    generation: int
    response: ActiveResponse
    #: perf_counter() at the end of the user's speech, for the turn latency metric.
    speech_end: float | None = None


@dataclass(slots=True)
class Transcribe:
    generation: int
    item_id: str
    audio: Float32Array
    respond: bool
    speech_end: float | None
    #: A transcription of this turn started during its closing silence, if any.
    speculation: asyncio.Task[Transcript] | None = None


@dataclass(slots=True)
class Speak:
    generation: int
    response: ActiveResponse
    text: str


@dataclass(slots=True)
class CallOut:
    """A validated function call, emitted in order with the speech around it."""

    generation: int
    response: ActiveResponse
    name: str
    arguments: str


@dataclass(slots=True)
class ResponseEnd:
    generation: int
    response: ActiveResponse
    usage: LLMUsage


@dataclass(slots=True)
class TurnTiming:
    """``perf_counter()`` times of one response's turn."""

    speech_end: float | None = None
    transcribed: float | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    first_audio: float | None = None
    user_text: str | None = None


@dataclass(slots=True)
class CloseRequest:
    """Close the socket once everything queued before it has been sent."""

    generation: int
    code: int
    reason: str


@dataclass(slots=True)
class Outgoing:
    generation: int
    response_bound: bool
    event: ServerEvent


def _response_bound(item: Any) -> bool:
    return isinstance(item, (ResponseRequest, Speak, CallOut, ResponseEnd)) or (
        isinstance(item, Outgoing) and item.response_bound
    )


# --- per-session context -----------------------------------------------------


@dataclass
class InputBuffer:
    """The session's uncommitted input audio at ``PIPELINE_RATE``, clocked from session start."""

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


def ms_to_samples(ms: float) -> int:
    return round(ms * PIPELINE_RATE / 1000)


def samples_to_ms(n: int) -> float:
    return n * 1000 / PIPELINE_RATE


class SessionContext:
    """What a slot keeps about the session it serves now."""

    def __init__(self, ws: ServerConnection, session: Session, vad_state: Any, client: str) -> None:
        self.ws = ws
        self.session = session
        self.client = client
        self.vad_state = vad_state
        self.input_format = session.config.input_format
        self.resampler = Resampler(self.input_format.rate, PIPELINE_RATE)
        self.pending = np.zeros(0, np.float32)
        self.clock = 0  # samples of input audio fed to the VAD so far
        self.buffer = InputBuffer()
        td = session.config.turn_detection
        self.detector = TurnDetector(td) if td is not None else None
        self.turn_item_id: str | None = None
        self.speculation: asyncio.Task[Transcript] | None = None
        self.idle_from = 0  # sample clock when idle time started counting


# --- the slot ----------------------------------------------------------------


class Slot:
    """One pipeline, serving one session at a time.

    Args:
        index: position in the pool.
        stack: the process's shared engines.
        pools: the shared executors per stage kind.
        vad: the shared VAD batcher.
        metrics: where counts and timings go.
        queue_size: bound of every queue between stages.
        drain_timeout_s: teardown deadline before quarantine.
        max_input_buffer_s: most uncommitted input audio per session.
        send_timeout_s: how long one send may wait for a client that does not read.
        speculate_after_ms: silence after which a turn is transcribed ahead of its end (0: never).
    """

    def __init__(
        self,
        index: int,
        stack: Stack,
        pools: dict[str, StagePool],
        vad: VadBatcher,
        metrics: Metrics,
        *,
        queue_size: int = 256,
        drain_timeout_s: float = 5.0,
        max_input_buffer_s: float = 900.0,
        send_timeout_s: float = 10.0,
        speculate_after_ms: int = 0,
    ) -> None:
        self.index = index
        self.stack = stack
        self.pools = pools
        self.vad = vad
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.send_timeout_s = send_timeout_s
        self.speculate_after_ms = speculate_after_ms
        self.max_input_samples = ms_to_samples(max_input_buffer_s * 1000)
        self.state = SlotState.IDLE
        self.state_since = time.monotonic()
        self.generation = Generation()
        self.ctx: SessionContext | None = None
        self.sessions_served = 0
        self.quarantine_reason: str | None = None
        self.vad_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.stt_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.llm_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.tts_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.out_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self._drained = asyncio.Event()
        # When each stage of a response's turn happened, for the turn log and metrics.
        self._timings: dict[str, TurnTiming] = {}
        self.log_content = False
        #: Called when a session or a response ends (the server's shutdown waits on it).
        self.on_change: list[Callable[[], None]] = []

    # --- lifecycle ------------------------------------------------------

    def transition(self, new: SlotState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"slot {self.index}: {self.state.value} → {new.value} is not allowed")
        self.state = new
        self.state_since = time.monotonic()

    def attach(self, ws: ServerConnection, session: Session, client: str) -> None:
        """Bind a claimed slot to a new session and greet the client."""
        assert self.state is SlotState.ACTIVE and self.ctx is None
        self.ctx = SessionContext(ws, session, self.stack.vad.new_state(), client)
        self.sessions_served += 1
        self._drained.clear()
        self.emit_now(session.created_events())

    async def end_session(self) -> bool:
        """Three-phase teardown. Returns False if the slot was quarantined."""
        self.transition(SlotState.DRAINING)
        # Phase 1: everything this session asked for is stale from now on.
        self.generation.new_session()
        if self.ctx is not None and self.ctx.speculation is not None:
            self.ctx.speculation.cancel()
        dropped = 0
        for q in (self.vad_q, self.stt_q, self.llm_q, self.tts_q, self.out_q):
            while not q.empty():
                q.get_nowait()
                dropped += 1
        if dropped:
            self.metrics.dropped_stale.inc(dropped, stage="teardown")
        # Phase 2: the sentinel enters at the head and passes every stage.
        self.vad_q.put_nowait(SESSION_END)
        # Phase 3: the send loop marks the slot idle when the sentinel arrives.
        try:
            await asyncio.wait_for(self._drained.wait(), self.drain_timeout_s)
            return True
        except TimeoutError:
            if self.state is SlotState.DRAINING:
                self.quarantine(f"drain did not finish within {self.drain_timeout_s:g} s")
            return False

    def quarantine(self, reason: str) -> None:
        self.transition(SlotState.QUARANTINED)
        self.quarantine_reason = reason
        log.error("slot %d quarantined: %s", self.index, reason)

    def _session_ended(self) -> None:
        self.ctx = None
        self._timings.clear()
        if self.state is SlotState.DRAINING:
            self.transition(SlotState.IDLE)
        self._drained.set()
        self._notify()

    def _notify(self) -> None:
        for callback in self.on_change:
            callback()

    # --- supervision --------------------------------------------------------

    async def run(self) -> None:
        """Run the stages; restart them together if one crashes."""
        crashes: list[float] = []
        while True:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._vad_stage(), name=f"slot{self.index}-vad")
                    tg.create_task(self._stt_stage(), name=f"slot{self.index}-stt")
                    tg.create_task(self._llm_stage(), name=f"slot{self.index}-llm")
                    tg.create_task(self._tts_stage(), name=f"slot{self.index}-tts")
                    tg.create_task(self._send_loop(), name=f"slot{self.index}-send")
            except* Exception as group:
                log.exception("slot %d: a stage crashed; restarting its stages", self.index, exc_info=group)
                self.metrics.stage_restarts.inc()
                now = time.monotonic()
                crashes = [t for t in crashes if now - t < 60] + [now]
                if self.ctx is not None:
                    # The crashed stage may have held this session's work: end it cleanly.
                    await self._close_session(1011, "internal error in the pipeline")
                if len(crashes) >= 5 and self.state is not SlotState.QUARANTINED:
                    self.state = SlotState.QUARANTINED
                    self.quarantine_reason = "stages crashed 5 times within a minute"
                    log.error("slot %d quarantined: %s", self.index, self.quarantine_reason)

    async def _close_session(self, code: int, reason: str) -> None:
        ctx = self.ctx
        if ctx is not None:
            try:
                await ctx.ws.close(code, reason)
            except Exception:  # the socket may already be gone
                log.debug("closing slot %d's socket failed", self.index, exc_info=True)

    # --- output ---------------------------------------------------------------

    def emit_now(self, events: list[ServerEvent]) -> None:
        """Queue session events without waiting (used where the queue has room by construction)."""
        gen = self.generation.current
        for event in events:
            self.out_q.put_nowait(Outgoing(gen, False, event))

    async def emit(self, events: list[ServerEvent], response_generation: int | None = None) -> None:
        """Queue events for the send loop.

        Args:
            events: in order.
            response_generation: the generation of the response they belong
                to; None for session events, which stay wanted until the
                session ends.
        """
        if response_generation is None:
            gen, bound = self.generation.current, False
        else:
            gen, bound = response_generation, True
        for event in events:
            await self.out_q.put(Outgoing(gen, bound, event))
            if event.type == "response.done":
                self._turn_done(event)
                self._notify()

    async def error(self, exc: ProtocolError) -> None:
        assert self.ctx is not None
        self.metrics.errors.inc(code=exc.code)
        await self.emit([self.ctx.session.error(exc)])

    def _turn_done(self, event: ServerEvent) -> None:
        """One log line per finished turn, with its latency breakdown."""
        response = event.response  # type: ignore[attr-defined]
        timing = self._timings.pop(response.id, None)
        if timing is None or self.ctx is None:
            return
        now = time.perf_counter()
        origin = timing.speech_end if timing.speech_end is not None else timing.created

        def ms(t: float | None) -> int | None:
            return None if t is None else round((t - origin) * 1000)

        fields: dict[str, Any] = {
            "slot": self.index,
            "session": self.ctx.session.id,
            "response": response.id,
            "status": response.status,
            "from": "end_of_speech" if timing.speech_end is not None else "response.create",
            "transcribed_ms": ms(timing.transcribed),
            "first_token_ms": ms(timing.first_token),
            "first_audio_ms": ms(timing.first_audio),
            "done_ms": ms(now),
        }
        if self.log_content:
            fields["user"] = timing.user_text
            output = response.output[0].content if response.output else None
            fields["assistant"] = (output[0].transcript or output[0].text) if output else None
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("user", "assistant"))
        if self.log_content:
            text += f" user={fields['user']!r} assistant={fields['assistant']!r}"
        log.info("turn %s", text, extra={"fields": {"event": "turn", **fields}})

    async def end_with_error(self, exc: ProtocolError, close_code: int) -> None:
        """Send ``exc`` as an error event, then close the socket with ``close_code``."""
        await self.error(exc)
        await self.out_q.put(CloseRequest(self.generation.current, close_code, exc.code.replace("_", " ")))

    def _stale(self, item: Any) -> bool:
        return self.generation.is_stale(item.generation, response=_response_bound(item))

    async def _send_loop(self) -> None:
        while True:
            item = await self.out_q.get()
            if item is SESSION_END:
                self._session_ended()
                continue
            if self._stale(item) or self.ctx is None:
                self.metrics.dropped_stale.inc(stage="send")
                continue
            ctx = self.ctx
            if isinstance(item, CloseRequest):
                await _close_quickly(ctx.ws, item.code, item.reason)
                continue
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await ctx.ws.send(encode_event(item.event), text=True)
            except ConnectionClosed:
                continue
            except TimeoutError:
                # The client stopped reading and its buffers are full: close it
                # (1008) rather than let its output pile up. Only this slot waits.
                self.metrics.errors.inc(code="client_not_reading")
                log.warning("slot %d: client %s stopped reading; closing it", self.index, ctx.client)
                await _close_quickly(ctx.ws, 1008, "client is not reading its events")
                continue
            self.metrics.events_out.inc(type=item.event.type)
            if item.event.type == "error":
                log.info("slot %d: sent error %s", self.index, item.event.error.code)

    # --- receiving --------------------------------------------------------------

    async def receive(self, message: str | bytes) -> None:
        """Handle one frame from the client: decode, validate, dispatch.

        Every problem becomes an ``error`` event; nothing here raises for
        anything the client sent.
        """
        if isinstance(message, bytes):
            await self.error(
                ProtocolError("invalid_event", "Binary frames are not supported; send JSON events as text frames")
            )
            return
        try:
            event = ce.decode_client_event(message)
        except ProtocolError as exc:
            self.metrics.events_in.inc(type="invalid")
            await self.error(exc)
            return
        self.metrics.events_in.inc(type=type(event).__struct_config__.tag)  # type: ignore[arg-type]
        try:
            await self._dispatch(event)
        except ProtocolError as exc:
            if exc.event_id is None:
                exc.event_id = event.event_id
            await self.error(exc)

    async def _dispatch(self, ev: ce.ClientEvent) -> None:
        ctx = self.ctx
        assert ctx is not None
        session = ctx.session
        gen = self.generation.current
        match ev:
            case ce.InputAudioBufferAppend():
                samples = await self._decode_audio(ctx, ev)
                await self.vad_q.put(AudioIn(gen, samples))
            case ce.InputAudioBufferCommit():
                await self.vad_q.put(BufferCommand(gen, "commit", ev.event_id))
            case ce.InputAudioBufferClear():
                await self.vad_q.put(BufferCommand(gen, "clear", ev.event_id))
            case ce.SessionUpdate():
                events = session.handle(ev, gen)
                self._apply_settings(ctx)
                await self.emit(events)
            case (
                ce.ConversationItemCreate()
                | ce.ConversationItemRetrieve()
                | ce.ConversationItemTruncate()
                | ce.ConversationItemDelete()
            ):
                await self.emit(session.handle(ev, gen))
            case ce.ResponseCreate():
                # The generation moves only if the response really starts.
                events = session.handle(ev, gen + 1)
                response_gen = self.generation.advance()
                assert session.response is not None
                self._timings[session.response.id] = TurnTiming()
                await self.emit(events)
                await self.vad_q.put(ResponseRequest(response_gen, session.response))
            case ce.ResponseCancel():
                events = session.handle(ev, gen)
                self.generation.advance()
                self.metrics.turns.inc(status="cancelled")
                await self.emit(events)

    async def _decode_audio(self, ctx: SessionContext, ev: ce.InputAudioBufferAppend) -> Float32Array:
        fmt = ctx.session.config.input_format
        try:
            if len(ev.audio) > 96_000:
                # A long append would hold the loop for a while: convert it off the loop.
                return await asyncio.to_thread(self._convert_input, ctx, fmt, ev.audio)
            return self._convert_input(ctx, fmt, ev.audio)
        except AudioFormatError as exc:
            raise ProtocolError("invalid_audio_length", str(exc), param="audio") from None

    @staticmethod
    def _convert_input(ctx: SessionContext, fmt: AudioFormat, data: bytes) -> Float32Array:
        return ctx.resampler.process(fmt.decode(data))

    def _apply_settings(self, ctx: SessionContext) -> None:
        cfg = ctx.session.config
        if cfg.input_format != ctx.input_format:
            ctx.input_format = cfg.input_format
            ctx.resampler = Resampler(cfg.input_format.rate, PIPELINE_RATE)
        if cfg.turn_detection is None:
            ctx.detector = None
        elif ctx.detector is None:
            ctx.detector = TurnDetector(cfg.turn_detection)
        else:
            ctx.detector.settings = cfg.turn_detection

    # --- stages -----------------------------------------------------------------

    async def _vad_stage(self) -> None:
        chunk = self.stack.vad.chunk_samples
        while True:
            item = await self.vad_q.get()
            if item is SESSION_END:
                await self.stt_q.put(item)
                continue
            if self._stale(item):
                self.metrics.dropped_stale.inc(stage="vad")
                continue
            ctx = self.ctx
            assert ctx is not None
            if isinstance(item, ResponseRequest):
                await self.stt_q.put(item)
            elif isinstance(item, BufferCommand):
                await self._buffer_command(ctx, item)
            else:
                await self._listen(ctx, item.samples, chunk)

    async def _listen(self, ctx: SessionContext, samples: Float32Array, chunk: int) -> None:
        if ctx.buffer.samples + len(samples) > self.max_input_samples:
            await self.error(
                ProtocolError(
                    "input_audio_buffer_full",
                    f"The input audio buffer holds at most {self.max_input_samples // PIPELINE_RATE} s;"
                    " commit or clear it before appending more",
                    param="audio",
                )
            )
            return
        ctx.buffer.append(samples)
        if ctx.detector is None:
            ctx.clock += len(samples)
            return
        ctx.pending = np.concatenate([ctx.pending, samples]) if len(ctx.pending) else samples
        while len(ctx.pending) >= chunk:
            piece, ctx.pending = ctx.pending[:chunk], ctx.pending[chunk:]
            start = ctx.clock
            ctx.clock += chunk
            try:
                prob = await self.vad.probability(piece, ctx.vad_state)
            except Exception as exc:
                # The turn goes on without this chunk's decision; say so once per failure.
                log.warning("slot %d: VAD failed: %r", self.index, exc)
                await self.error(
                    ProtocolError("vad_failed", f"Voice activity detection failed: {exc}", type="server_error")
                )
                prob = 0.0
            if ctx.detector is None:  # turned off by a session.update meanwhile
                break
            turn = ctx.detector.feed(prob, samples_to_ms(start), samples_to_ms(ctx.clock))
            if isinstance(turn, SpeechStart):
                await self._speech_started(ctx, turn)
            elif isinstance(turn, SpeechStop):
                await self._speech_stopped(ctx, turn)
            elif not ctx.detector.speaking:
                await self._idle_check(ctx)
            else:
                self._speculate(ctx)
        if not ctx.detector.speaking:
            td = ctx.detector.settings
            # Keep only what a coming turn's prefix padding may need.
            ctx.buffer.drop_before(ctx.clock - ms_to_samples(td.prefix_padding_ms) - chunk)

    async def _speech_started(self, ctx: SessionContext, turn: SpeechStart) -> None:
        session = ctx.session
        if ctx.speculation is not None:
            ctx.speculation.cancel()
            ctx.speculation = None
        td = ctx.detector.settings if ctx.detector else None
        ctx.turn_item_id = new_id("item")
        events: list[ServerEvent] = [session.speech_started(int(turn.audio_start_ms), ctx.turn_item_id)]
        if session.response is not None and td is not None and td.interrupt_response:
            # Barge-in: the answer being spoken is cancelled at once.
            events += session.cancel_response("turn_detected")
            self.generation.advance()
            self.metrics.turns.inc(status="cancelled")
        await self.emit(events)

    async def _speech_stopped(self, ctx: SessionContext, turn: SpeechStop) -> None:
        session = ctx.session
        item_id = ctx.turn_item_id or new_id("item")
        ctx.turn_item_id = None
        speech_end = time.perf_counter()
        start = ms_to_samples(ctx.detector.start_ms if ctx.detector else 0)
        end = ms_to_samples(turn.audio_end_ms)
        audio = ctx.buffer.take(start, end)
        ctx.idle_from = ctx.clock
        td = ctx.detector.settings if ctx.detector else None
        events = [session.speech_stopped(int(turn.audio_end_ms), item_id)]
        events += session.commit_audio(item_id)
        await self.emit(events)
        respond = bool(td and td.create_response)
        speculation, ctx.speculation = ctx.speculation, None
        if speculation is not None:
            self.metrics.speculations.inc(outcome="used")
        await self.stt_q.put(Transcribe(self.generation.current, item_id, audio, respond, speech_end, speculation))

    def _speculate(self, ctx: SessionContext) -> None:
        """While a turn's closing silence runs, transcribe what was said so far.

        If the silence lasts, the turn ends with this transcript already made
        (or nearly); if speech returns, the guess is dropped. The silence
        itself holds no words, so the transcript is the turn's.
        """
        detector = ctx.detector
        if detector is None or not self.speculate_after_ms:
            return
        silence_ms = samples_to_ms(ctx.clock) - detector.last_voice_ms
        if ctx.speculation is not None:
            if silence_ms == 0:  # speech came back: the guess is stale
                ctx.speculation.cancel()
                ctx.speculation = None
                self.metrics.speculations.inc(outcome="discarded")
            return
        if silence_ms < self.speculate_after_ms:
            return
        audio = ctx.buffer.audio()[max(0, ms_to_samples(detector.start_ms) - ctx.buffer.start_sample) :].copy()
        tr = ctx.session.config.transcription
        ctx.speculation = task = asyncio.create_task(
            self.pools["stt"].call(
                self.stack.stt.transcribe,
                audio,
                language=tr.language if tr else None,
                prompt=tr.prompt if tr else None,
            )
        )
        # Its outcome is read by the STT stage, or it is cancelled; never left unread.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _idle_check(self, ctx: SessionContext) -> None:
        td = ctx.detector.settings if ctx.detector else None
        if td is None or td.idle_timeout_ms is None or ctx.session.response is not None:
            ctx.idle_from = ctx.clock if ctx.session.response is not None else ctx.idle_from
            return
        if ctx.clock - ctx.idle_from < ms_to_samples(td.idle_timeout_ms):
            return
        session = ctx.session
        item_id = new_id("item")
        start_ms = int(samples_to_ms(ctx.buffer.start_sample))
        audio = ctx.buffer.take(ctx.buffer.start_sample, ctx.clock)
        ctx.idle_from = ctx.clock
        events = [session.timeout_triggered(start_ms, int(samples_to_ms(ctx.clock)), item_id)]
        events += session.commit_audio(item_id)
        await self.emit(events)
        await self.stt_q.put(Transcribe(self.generation.current, item_id, audio, True, None))

    async def _buffer_command(self, ctx: SessionContext, cmd: BufferCommand) -> None:
        session = ctx.session
        if cmd.kind == "clear":
            ctx.buffer.clear()
            if ctx.detector is not None:
                ctx.detector.reset()
            await self.emit([session.buffer_cleared()])
            return
        ms = samples_to_ms(ctx.buffer.samples)
        if ms < 100:
            raise_at = ProtocolError(
                "input_audio_buffer_commit_empty",
                f"Cannot commit: the input audio buffer holds {ms:.0f} ms; at least 100 ms is needed",
                event_id=cmd.event_id,
            )
            await self.error(raise_at)
            return
        item_id = ctx.turn_item_id or new_id("item")
        ctx.turn_item_id = None
        audio = ctx.buffer.take(ctx.buffer.start_sample, ctx.buffer.end_sample)
        if ctx.detector is not None:
            ctx.detector.reset()
        await self.emit(session.commit_audio(item_id))
        await self.stt_q.put(Transcribe(self.generation.current, item_id, audio, False, time.perf_counter()))

    async def _stt_stage(self) -> None:
        while True:
            item = await self.stt_q.get()
            if item is SESSION_END or (isinstance(item, ResponseRequest) and not self._stale(item)):
                await self.llm_q.put(item)
                continue
            if self._stale(item):
                self.metrics.dropped_stale.inc(stage="stt")
                continue
            ctx = self.ctx
            assert ctx is not None
            await self._transcribe(ctx, item)

    async def _transcribe(self, ctx: SessionContext, job: Transcribe) -> None:
        session = ctx.session
        tr = session.config.transcription
        try:
            if job.speculation is not None:
                result = await job.speculation
            else:
                result = await self.pools["stt"].call(
                    self.stack.stt.transcribe,
                    job.audio,
                    language=tr.language if tr else None,
                    prompt=tr.prompt if tr else None,
                )
        except Exception as exc:
            log.warning("slot %d: transcription failed: %r", self.index, exc)
            if not self._stale(job):
                self.metrics.errors.inc(code="transcription_failed")
                await self.emit(session.transcription_failed(job.item_id, f"Transcription failed: {exc}"))
            return
        if self._stale(job):
            self.metrics.dropped_stale.inc(stage="stt")
            return
        await self.emit(session.transcribed(job.item_id, result.text.strip(), len(job.audio) / PIPELINE_RATE))
        if job.respond and session.response is None:
            events = session.start_response(None, self.generation.current + 1)
            gen = self.generation.advance()
            assert session.response is not None
            self._timings[session.response.id] = TurnTiming(
                speech_end=job.speech_end, transcribed=time.perf_counter(), user_text=result.text.strip()
            )
            await self.emit(events)
            await self.llm_q.put(ResponseRequest(gen, session.response, job.speech_end))

    async def _llm_stage(self) -> None:
        while True:
            item = await self.llm_q.get()
            if item is SESSION_END:
                await self.tts_q.put(item)
                continue
            if self._stale(item):
                self.metrics.dropped_stale.inc(stage="llm")
                continue
            ctx = self.ctx
            assert ctx is not None
            await self._generate(ctx, item)

    async def _generate(self, ctx: SessionContext, req: ResponseRequest) -> None:
        session = ctx.session
        r = req.response
        gen = req.generation
        messages = session.prompt(r)
        tools, must_call = offered_tools(r.tools, r.tool_choice)
        usage = LLMUsage()

        def stale() -> bool:
            return self.generation.is_stale(gen, response=True)

        clauses = ClauseSplitter()
        spoke = False
        for attempt in range(2):
            calls: list[str] = []
            splitter = ToolCallFilter()
            try:
                async for piece in self.pools["llm"].stream(
                    functools.partial(
                        self.stack.llm.stream,
                        messages,
                        max_tokens=r.token_limit,
                        temperature=r.temperature,
                        should_stop=stale,
                        usage=usage,
                        tools=tools,
                        require_tool=must_call,
                    )
                ):
                    if stale():
                        break
                    timing = self._timings.get(r.id)
                    if timing is not None and timing.first_token is None:
                        timing.first_token = time.perf_counter()
                    for part in splitter.feed(piece):
                        spoke |= await self._say(session, r, gen, part, clauses, calls)
                for part in splitter.flush():
                    spoke |= await self._say(session, r, gen, part, clauses, calls)
            except Exception as exc:
                log.warning("slot %d: LLM failed: %r", self.index, exc)
                if not stale():
                    self.metrics.turns.inc(status="failed")
                    code = "llm_timeout" if isinstance(exc, EngineTimeout) else "llm_failed"
                    self.metrics.errors.inc(code=code)
                    await self.emit(session.fail_response(r, code, f"The language model failed: {exc}"))
                return
            if stale():
                self.metrics.dropped_stale.inc(stage="llm")
                return
            problems = []
            for raw in calls:
                try:
                    name, arguments = parse_call(raw, tools)
                except ToolCallError as exc:
                    problems.append((raw, str(exc)))
                    continue
                await self.tts_q.put(CallOut(gen, r, name, arguments))
            if not problems:
                break
            if attempt == 0 and not spoke and len(problems) == len(calls):
                # One retry, telling the model what was wrong with its call.
                raw, why = problems[0]
                messages = [
                    *messages,
                    ChatMessage("assistant", f"<tool_call>\n{raw}\n</tool_call>"),
                    ChatMessage("tool", f"Error: {why}. Call the function again with valid arguments."),
                ]
                continue
            # Still wrong: say so as an answer instead of sending a bad call.
            why = problems[0][1]
            spoke |= await self._say(
                session, r, gen, TextPart(f"Sorry, I could not make that call: {why}."), clauses, calls
            )
            break
        rest = clauses.flush()
        if rest and r.audio:
            await self.tts_q.put(Speak(gen, r, rest))
        await self.tts_q.put(ResponseEnd(gen, r, usage))

    async def _say(
        self,
        session: Session,
        r: ActiveResponse,
        gen: int,
        part: TextPart | CallPart,
        clauses: ClauseSplitter,
        calls: list[str],
    ) -> bool:
        """Route one piece of model output; returns whether it was speakable text."""
        if isinstance(part, CallPart):
            calls.append(part.raw)
            return False
        if not part.text:
            return False
        if not r.audio:
            await self.emit(session.text_delta(r, part.text), gen)
        else:
            for clause in clauses.feed(part.text):
                await self.tts_q.put(Speak(gen, r, clause))
        return bool(part.text.strip())

    async def _tts_stage(self) -> None:
        resampler: Resampler | None = None
        current: str | None = None
        while True:
            item = await self.tts_q.get()
            if item is SESSION_END:
                await self.out_q.put(item)
                continue
            if self._stale(item):
                self.metrics.dropped_stale.inc(stage="tts")
                continue
            ctx = self.ctx
            assert ctx is not None
            r = item.response
            if isinstance(item, CallOut):
                await self.emit(ctx.session.function_call(r, item.name, item.arguments), item.generation)
                continue
            if isinstance(item, ResponseEnd):
                r.input_tokens, r.output_tokens = item.usage.input_tokens, item.usage.output_tokens
                events = ctx.session.finish_response(r)
                if events:
                    self.metrics.turns.inc(status="completed")
                ctx.idle_from = ctx.clock
                await self.emit(events, item.generation)
                continue
            if current != r.id:
                current = r.id
                resampler = Resampler(self.stack.tts.sample_rate, r.output_format.rate)
            assert resampler is not None
            await self._speak(ctx, item, resampler)

    async def _speak(self, ctx: SessionContext, job: Speak, resampler: Resampler) -> None:
        r = job.response
        gen = job.generation

        def stale() -> bool:
            return self.generation.is_stale(gen, response=True)

        fmt = r.output_format
        pieces: list[Float32Array] = []
        try:
            async for audio in self.pools["tts"].stream(
                lambda: self.stack.tts.synthesize(job.text, voice=_voice(self.stack, r.voice), should_stop=stale)
            ):
                if stale():
                    break
                pieces.append(resampler.process(audio))
        except Exception as exc:
            log.warning("slot %d: TTS failed: %r", self.index, exc)
            if not stale():
                self.metrics.turns.inc(status="failed")
                code = "tts_timeout" if isinstance(exc, EngineTimeout) else "tts_failed"
                self.metrics.errors.inc(code=code)
                await self.emit(ctx.session.fail_response(r, code, f"Speech synthesis failed: {exc}"))
            return
        if stale():
            return
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        data = fmt.encode(samples)
        step = max(fmt.bytes_per_sample, int(fmt.rate * DELTA_MS / 1000) * fmt.bytes_per_sample)
        chunks = [data[i : i + step] for i in range(0, len(data), step)]
        ms = 1000 * len(samples) / fmt.rate
        timing = self._timings.get(r.id)
        if timing is not None and timing.first_audio is None:
            timing.first_audio = time.perf_counter()
            if timing.speech_end is not None:
                self.metrics.turn_latency.observe(timing.first_audio - timing.speech_end)
        await self.emit(ctx.session.audio_events(r, chunks, job.text, ms), gen)


async def _close_quickly(ws: ServerConnection, code: int, reason: str) -> None:
    """Send a close frame; if the peer does not answer within a second, drop the TCP connection."""
    try:
        async with asyncio.timeout(1.0):
            await ws.close(code, reason)
    except TimeoutError:
        ws.transport.abort()


def _voice(stack: Stack, voice: str) -> str | None:
    return voice if voice in stack.tts.voices else None


_CLAUSE_END = re.compile(r"(?<=[.!?;:])\s+|(?<=[,])\s+(?=\S{2,})")


class ClauseSplitter:
    """Cuts streamed text into clauses so speech can start before the answer ends.

    The first piece is cut at the first clause boundary (comma included), or
    after ``first_words`` words if no boundary comes sooner, to start
    speaking soon: a short answer is often one sentence, and waiting for its
    end would wait for the whole answer. Later pieces are cut at sentence
    ends, so the voice keeps a natural flow.
    """

    def __init__(self, first_min_chars: int = 12, min_chars: int = 20, first_words: int = 5) -> None:
        self.text = ""
        self.first = True
        self.first_min_chars = first_min_chars
        self.min_chars = min_chars
        self._first_words = re.compile(r"\s*(?:\S+\s+){" + str(first_words) + "}")

    def feed(self, piece: str) -> list[str]:
        self.text += piece
        out: list[str] = []
        while True:
            limit = self.first_min_chars if self.first else self.min_chars
            cut = None
            for m in _CLAUSE_END.finditer(self.text):
                is_sentence = self.text[m.start() - 1] in ".!?;:"
                if m.start() >= limit and (is_sentence or self.first):
                    cut = m
                    break
            if cut is None and self.first:
                cut = self._first_words.match(self.text)
            if cut is None:
                return out
            clause = self.text[: cut.end()].strip() if cut.re is self._first_words else self.text[: cut.start()].strip()
            self.text = self.text[cut.end() :]
            if clause:
                out.append(clause)
                self.first = False

    def flush(self) -> str:
        rest, self.text = self.text.strip(), ""
        return rest
