"""A slot: everything one conversation needs, reused by one session after another.

A slot wires five stages with bounded queues and supervises them::

    dispatch ─► inbox ─► (listening clock) ─► stt_q ─► transcribing ─► llm_q ─► responding
                                                                                  │
                               client ◄── send loop ◄── outbox ◄── speaking ◄── tts_q

Listening runs on the process's one :class:`~s2s_rt.listening.clock.ListeningClock`,
which hears every session's audio in batches; the other stages
(:mod:`s2s_rt.pipeline`) run in one ``asyncio.TaskGroup`` per slot for the
life of the server. A stage reads only its slot's queue, and only the send
loop writes to the socket of the session the slot serves now. Work carries
its scope (:mod:`s2s_rt.scope`); every stage and the send loop drop stale work.

The slot's lifecycle is one table (:data:`TRANSITIONS`), moved only by
:meth:`Slot.step` with the event that happened::

    IDLE ──claim──► ACTIVE ──end──► DRAINING ──drained──► IDLE
      │                                │
      │                                ├──drain_late──► QUARANTINED ──drained (stuck work ended)──► IDLE
      │                                └──crashed_out─► QUARANTINED ──rested (cool-down over)─────► IDLE
      └──crashed_out (stages crashed 5× in a minute)──► QUARANTINED

The stages are built here, each with the slot's
:class:`~s2s_rt.pipeline.stage.StageContext`, its queues, and callbacks to
its neighbours; they never see the slot.

Teardown is three phases: (1) close the session's scope (cancelling the
work in flight) and flush the queues; (2) put the session's ``SessionEnd``
at the head of the pipeline (after listening, which keeps nothing once its
inbox is emptied); (3) the send loop, on seeing it, marks the slot
idle. A slot quarantined because its drain was late returns to service when
that ``SessionEnd`` finally arrives.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from s2s_rt.budget import ByteBudget
from s2s_rt.engines.base import Stack, ms_to_samples
from s2s_rt.inference import StagePool
from s2s_rt.lifecycle import Lifecycle
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.memory import release_freed_memory
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.clauses import FIRST_CLAUSE_WORDS
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.dispatch import Dispatcher
from s2s_rt.pipeline.listener import Listener
from s2s_rt.pipeline.outbox import Outbox, close_quickly
from s2s_rt.pipeline.responding import Responder
from s2s_rt.pipeline.speaking import Speaker
from s2s_rt.pipeline.stage import StageContext
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import CloseRequest, SessionEnd
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import ServerEvent, encode_event
from s2s_rt.protocol.session import Session
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd

if TYPE_CHECKING:
    from s2s_rt.pipeline.outbox import Channel

log = logging.getLogger(__name__)


class SlotState(enum.Enum):
    IDLE = "idle"
    ACTIVE = "active"
    DRAINING = "draining"
    QUARANTINED = "quarantined"


class SlotEvent(enum.Enum):
    #: A session claimed the slot.
    CLAIM = "claim"
    #: The session ended (the client left, or the server ended it): teardown begins.
    END = "end"
    #: The session's ``SessionEnd`` reached the send loop: nothing of it is left.
    DRAINED = "drained"
    #: The drain deadline passed first.
    DRAIN_LATE = "drain_late"
    #: Its stages crashed :data:`CRASH_LIMIT` times within a minute: it rests (when it holds no session).
    CRASHED_OUT = "crashed_out"
    #: The rest after crashing out is over.
    RESTED = "rested"


#: The slot's lifecycle: every allowed (state, event) and where it leads. Anything else is a bug.
TRANSITIONS: dict[tuple[SlotState, SlotEvent], SlotState] = {
    (SlotState.IDLE, SlotEvent.CLAIM): SlotState.ACTIVE,
    (SlotState.IDLE, SlotEvent.CRASHED_OUT): SlotState.QUARANTINED,
    (SlotState.ACTIVE, SlotEvent.END): SlotState.DRAINING,
    (SlotState.DRAINING, SlotEvent.DRAINED): SlotState.IDLE,
    (SlotState.DRAINING, SlotEvent.DRAIN_LATE): SlotState.QUARANTINED,
    (SlotState.DRAINING, SlotEvent.CRASHED_OUT): SlotState.QUARANTINED,
    # A late drain finished after all: the stuck work has ended.
    (SlotState.QUARANTINED, SlotEvent.DRAINED): SlotState.IDLE,
    (SlotState.QUARANTINED, SlotEvent.CRASHED_OUT): SlotState.QUARANTINED,
    (SlotState.QUARANTINED, SlotEvent.RESTED): SlotState.IDLE,
}
LIFECYCLE = Lifecycle("slot", TRANSITIONS)


#: Crashes within a minute that quarantine a slot, and how long it then rests.
CRASH_LIMIT = 5
CRASH_COOL_DOWN_S = 60.0


class Slot:
    """One pipeline, serving one session at a time.

    Args:
        index: position in the pool.
        stack: the process's shared engines.
        pools: the shared executors per stage kind.
        clock: the process's listening clock.
        metrics: where counts and timings go.
        queue_size: bound of every queue between stages.
        drain_timeout_s: teardown deadline before quarantine.
        max_input_buffer_s: most uncommitted input audio per session.
        send_timeout_s: how long one send may wait for a client that does not read.
        speculate_after_ms: silence after which a turn is transcribed ahead of its end (0: never).
        semantic: the waits of ``semantic_vad`` turn detection.
        first_clause_words: an answer's first clause is cut after this many words or a few more, where a pause
            fits (sooner at a comma).
        max_output_bytes: most bytes of encoded events a session may have waiting to be sent.
        max_input_queue_bytes: most bytes of decoded input audio waiting for the VAD stage.
    """

    def __init__(
        self,
        index: int,
        stack: Stack,
        pools: dict[str, StagePool],
        clock: ListeningClock,
        metrics: Metrics,
        *,
        queue_size: int = 256,
        drain_timeout_s: float = 5.0,
        max_input_buffer_s: float = 900.0,
        send_timeout_s: float = 10.0,
        speculate_after_ms: int = 0,
        first_clause_words: int = FIRST_CLAUSE_WORDS,
        semantic: SemanticTurnEnd | None = None,
        max_output_bytes: int = 16 << 20,
        max_input_queue_bytes: int = 32 << 20,
    ) -> None:
        self.index = index
        self.stack = stack
        self.pools = pools
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.send_timeout_s = send_timeout_s
        self._state = SlotState.IDLE
        self.state_since = time.monotonic()
        self.ctx: SessionContext | None = None
        self.sessions_served = 0
        self.quarantine_reason: str | None = None
        self.stt_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.llm_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.tts_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.outbox = Outbox(index, metrics, queue_size, send_timeout_s, max_output_bytes)
        #: Decoded audio waiting for the VAD stage: a client that sends faster than it is heard waits.
        self.input_budget = ByteBudget("input audio", max_input_queue_bytes)
        self.outbox.on_session_end = self._session_ended
        self.outbox.on_response_done = self._notify
        # The stages see only this, their queues, and the callbacks wired here: never the slot.
        self.stage = StageContext(index, stack, pools, metrics, self.outbox, self.fail, first_clause_words)
        serving = self.serving
        self.listener = Listener(
            self.stage,
            serving,
            clock,
            self.stt_q.put_nowait,
            self.close_now,
            self.input_budget,
            ms_to_samples(max_input_buffer_s * 1000),
            speculate_after_ms,
            semantic,
        )
        responder = Responder(self.stage, serving, self.llm_q, self.tts_q)
        self.dispatch = Dispatcher(
            self.stage, serving, self.listener, self.input_budget, clock.max_backlog_s, responder.read_ahead
        )
        self._stages: tuple[Transcriber, Responder, Speaker] = (
            Transcriber(self.stage, serving, self.stt_q, self.llm_q),
            responder,
            Speaker(self.stage, serving, self.tts_q, self.listener.answered, responder.read_ahead),
        )
        #: Owns the slot's own short tasks (closing a failed session's socket); never closed.
        self.scope = Scope(f"slot {index}")
        self._drained = asyncio.Event()
        self._crashes: list[float] = []
        #: Its stages crashed too often: when it holds no session, it rests (:data:`CRASH_COOL_DOWN_S`).
        self.crashed_out = False
        #: Called when a session or a response ends (the server's shutdown waits on it).
        self.on_change: list[Callable[[], None]] = []

    def serving(self) -> SessionContext | None:
        """The session the slot serves now (None between sessions)."""
        return self.ctx

    @property
    def log_content(self) -> bool:
        return self.outbox.log_content

    @log_content.setter
    def log_content(self, value: bool) -> None:
        self.outbox.log_content = value

    # --- lifecycle ------------------------------------------------------

    @property
    def state(self) -> SlotState:
        """Where the slot is in its lifecycle: read-only, moved by :meth:`step` alone, along its table."""
        return self._state

    def step(self, event: SlotEvent, reason: str | None = None) -> None:
        """Move the slot along its table (:data:`TRANSITIONS`); ``reason`` says why it is quarantined."""
        new = LIFECYCLE.step(self._state, event, self.index)
        self._state = new
        self.state_since = time.monotonic()
        if new is SlotState.QUARANTINED:
            self.quarantine_reason = reason
            log.error("slot %d quarantined: %s", self.index, reason)
        elif self.quarantine_reason is not None:
            log.warning("slot %d back in service (was quarantined: %s)", self.index, self.quarantine_reason)
            self.quarantine_reason = None

    async def attach(self, channel: Channel, session: Session, client: str) -> None:
        """Bind a claimed slot to a new session on ``channel`` (a WebSocket, a call) and greet the client."""
        assert self.state is SlotState.ACTIVE and self.ctx is None
        self.ctx = SessionContext(
            channel, session, client, self.stack.vad.new_state(), self.listener.semantic, self.listener.speculator_for
        )
        # A task of this session that raises ends this session, and only it.
        session.scope.on_failure = lambda exc: self.fail(exc, "a task of the session", session.scope)
        self.outbox.channel, self.outbox.session, self.outbox.client = channel, session, client
        if channel.media is not None:
            media = channel.media

            def played(kind: str, response_id: str) -> None:
                # output_audio_buffer.started / stopped, from the call's track as it plays.
                if not session.scope.stale:
                    self.outbox.emit_nowait([session.output_audio_buffer(kind, response_id)], session.scope)

            media.notify = played
        self.sessions_served += 1
        self._drained.clear()
        await self.outbox.emit(session.created_events(), session.scope)
        self.dispatch.read_ahead(self.ctx)  # the instructions its first answer will begin with

    async def receive(self, message: str | bytes) -> None:
        """One frame from the client (see :class:`~s2s_rt.pipeline.dispatch.Dispatcher`)."""
        await self.dispatch.receive(message)

    async def error(self, exc: ProtocolError) -> None:
        await self.outbox.error(exc)

    def close_now(self, exc: ProtocolError | None, close_code: int) -> None:
        """End the session from code that cannot wait (the listening clock): error if it fits, then close."""
        ctx = self.ctx
        if ctx is None or ctx.session.scope.stale:
            return
        if exc is not None:
            self.metrics.errors.inc(code=exc.code)
            self.outbox.emit_nowait([ctx.session.error(exc)], ctx.session.scope)
        reason = exc.code.replace("_", " ") if exc is not None else "client is not reading its events"
        # The send loop closes after what is queued; if it cannot take the request, close at once.
        try:
            self.outbox.queue.put_nowait(CloseRequest(ctx.session.scope, close_code, reason))
        except asyncio.QueueFull:
            self.scope.spawn(close_quickly(ctx.channel, close_code, reason), f"slot{self.index}-close")

    def fail(self, exc: BaseException, where: str, scope: Scope | None = None) -> None:
        """The session's share of some work failed: end that session alone (error, close 1011, slot back).

        Its scope closes at once, so nothing more is heard, started or sent
        for it; the failed response (if any) ends with ``response.done``
        (``failed``), then an ``error`` and the close go straight to the
        socket. Other sessions, the stages and the listening clock go on.

        Args:
            exc: what went wrong (logged with its traceback).
            where: which work failed, for the log.
            scope: the failed work's scope; nothing happens unless it belongs to the session served now.
        """
        ctx = self.ctx
        if ctx is None or ctx.session.scope.stale:
            return
        session = ctx.session
        if scope is not None and scope.outermost is not session.scope:
            return
        log.error("slot %d: session %s failed in %s; ending it alone", self.index, session.id, where, exc_info=exc)
        self.metrics.errors.inc(code="session_failed")
        message = f"This session failed inside the server ({where}: {type(exc).__name__}); closing it"
        events: list[ServerEvent] = []
        if session.response is not None:
            events += session.fail_response(session.response, "session_failed", message)
        events.append(session.error(ProtocolError("session_failed", message, type="server_error")))
        data = [encode_event(e) for e in events]
        ctx.audio.closing = True
        session.end()
        self._notify()
        self.scope.spawn(_say_and_close(ctx.channel, data, 1011, "internal error"), f"slot{self.index}-failed")

    async def end_with_error(self, exc: ProtocolError, close_code: int) -> None:
        """Send ``exc`` as an error event, then close the socket with ``close_code``."""
        await self.outbox.error(exc)
        if self.ctx is not None:
            await self.outbox.close(self.ctx.session.scope, close_code, exc.code.replace("_", " "))

    async def end_session(self) -> bool:
        """Three-phase teardown. Returns False if the slot was quarantined."""
        self.step(SlotEvent.END)
        ctx = self.ctx
        if ctx is None:  # attach never happened
            self._finish_drain()
            return True
        # Phase 1: everything this session asked for is stale from now on,
        # and the work in flight for it is cancelled.
        ctx.session.end()
        self._flush()
        # Phase 2: the sentinel enters at the head and passes every stage.
        self.stt_q.put_nowait(SessionEnd(ctx.session.id))
        # Phase 3: the send loop marks the slot idle when the sentinel arrives.
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                await self._drained.wait()
            return True
        except TimeoutError:
            if self.state is SlotState.DRAINING:
                self.step(SlotEvent.DRAIN_LATE, f"drain did not finish within {self.drain_timeout_s:g} s")
            return False

    def _flush(self) -> None:
        dropped = self.outbox.flush()
        self.input_budget.reset()
        if self.ctx is not None:
            dropped += len(self.ctx.audio.inbox)
            self.ctx.audio.inbox.clear()
        for q in (self.stt_q, self.llm_q, self.tts_q):
            while not q.empty():
                q.get_nowait()
                dropped += 1
        if dropped:
            self.metrics.dropped_stale.inc(dropped, stage="teardown")

    def _session_ended(self, session_id: str) -> None:
        ctx = self.ctx
        if ctx is None or ctx.session.id != session_id:
            return  # a copy re-sent after a restart, for a session already gone
        self._finish_drain()

    def _finish_drain(self) -> None:
        self.ctx = None
        self.outbox.channel = self.outbox.session = None
        self.outbox.timings.clear()
        release_freed_memory(background=True)
        if self.state in (SlotState.DRAINING, SlotState.QUARANTINED):
            # Quarantined: the stuck work that made the drain late has ended after all.
            if self.crashed_out:
                self._rest_after_crashes()
            else:
                self.step(SlotEvent.DRAINED)
        self._drained.set()
        self._notify()

    def _rest_after_crashes(self) -> None:
        self.step(SlotEvent.CRASHED_OUT, f"stages crashed {CRASH_LIMIT} times within a minute")
        asyncio.get_running_loop().call_later(CRASH_COOL_DOWN_S, self._rested)

    def _rested(self) -> None:
        self.crashed_out = False
        self._crashes.clear()
        if self.state is SlotState.QUARANTINED and self.ctx is None:
            self.step(SlotEvent.RESTED)
            self._notify()

    def _notify(self) -> None:
        for callback in self.on_change:
            callback()

    # --- supervision --------------------------------------------------------

    async def run(self) -> None:
        """Run the stages; restart them together if one crashes."""
        while True:
            try:
                async with asyncio.TaskGroup() as tg:
                    transcriber, responder, speaker = self._stages
                    tg.create_task(transcriber.run(), name=f"slot{self.index}-stt")
                    tg.create_task(responder.run(), name=f"slot{self.index}-llm")
                    tg.create_task(speaker.run(), name=f"slot{self.index}-tts")
                    tg.create_task(self.outbox.run(), name=f"slot{self.index}-send")
            except* Exception as group:
                log.exception("slot %d: a stage crashed; restarting its stages", self.index, exc_info=group)
                self.metrics.stage_restarts.inc()
                await self._recover(group)

    async def _recover(self, group: BaseException) -> None:
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < 60] + [now]
        if len(self._crashes) >= CRASH_LIMIT:
            self.crashed_out = True
        ctx = self.ctx
        if ctx is not None and self.state is SlotState.ACTIVE:
            # The crashed stage may have held this session's work: end it cleanly, and at once
            # (its scope closes now, so the listening clock starts nothing more for it).
            self.fail(group, "the pipeline")
        elif ctx is not None:
            # Draining: the crash may have swallowed the sentinel; send it again.
            self._flush()
            self.stt_q.put_nowait(SessionEnd(ctx.session.id))
        elif self.crashed_out and self.state is SlotState.IDLE:
            self._rest_after_crashes()


async def _say_and_close(ws: Channel, data: list[bytes], code: int, reason: str) -> None:
    """Send a failed session's last events and close its socket (within a second or two, whatever the client does)."""
    try:
        async with asyncio.timeout(1.0):
            for frame in data:
                await ws.send(frame, text=True)
    except (TimeoutError, ConnectionClosed):
        pass
    await close_quickly(ws, code, reason)
