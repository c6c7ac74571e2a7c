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
      │               │                │
      │               │                └──drain_late──► QUARANTINED ──drained (stuck work ended)──► IDLE
      │               └─crashed_out─► CRASHED ◄─crashed_out─ DRAINING, QUARANTINED
      │                   (its session is ended)  ──drained──► RESTING ──rested (cool-down over)──► IDLE
      └──crashed_out (stages crashed 5× in a minute)─────────► RESTING

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

from s2s_rt.config import DEFAULTS, mib
from s2s_rt.engines.base import Stack, ms_to_samples
from s2s_rt.inference import StagePool
from s2s_rt.lifecycle import Lifecycle
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.memory import release_freed_memory
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.dispatch import Dispatcher
from s2s_rt.pipeline.listener import Listener
from s2s_rt.pipeline.outbox import Outbox
from s2s_rt.pipeline.ports import close_quickly, say_and_close
from s2s_rt.pipeline.responding import Responder
from s2s_rt.pipeline.speaking import Speaker
from s2s_rt.pipeline.stage import StageContext
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import SessionEnd
from s2s_rt.protocol.errors import ProtocolError, RealtimeError, ServerFault
from s2s_rt.protocol.server_events import ServerEvent, encode_event
from s2s_rt.protocol.session import Session
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd

if TYPE_CHECKING:
    from s2s_rt.audio import AudioFormat
    from s2s_rt.pipeline.ports import Channel

log = logging.getLogger(__name__)


class SlotState(enum.Enum):
    IDLE = "idle"
    ACTIVE = "active"
    DRAINING = "draining"
    #: Its drain was late: out of service until its stuck work ends.
    QUARANTINED = "quarantined"
    #: Its stages crashed out while it held a session: the session is ended, then the slot rests.
    CRASHED = "crashed"
    #: Out of service for a cool-down after its stages crashed out.
    RESTING = "resting"


class SlotEvent(enum.Enum):
    #: A session claimed the slot.
    CLAIM = "claim"
    #: The session ended (the client left, or the server ended it): teardown begins.
    END = "end"
    #: The session's ``SessionEnd`` reached the send loop: nothing of it is left.
    DRAINED = "drained"
    #: The drain deadline passed first.
    DRAIN_LATE = "drain_late"
    #: Its stages crashed :data:`CRASH_LIMIT` times within a minute: it rests (once it holds no session).
    CRASHED_OUT = "crashed_out"
    #: The rest after crashing out is over.
    RESTED = "rested"


#: The slot's lifecycle: every allowed (state, event) and where it leads. Anything else is a bug.
TRANSITIONS: dict[tuple[SlotState, SlotEvent], SlotState] = {
    (SlotState.IDLE, SlotEvent.CLAIM): SlotState.ACTIVE,
    (SlotState.IDLE, SlotEvent.CRASHED_OUT): SlotState.RESTING,
    (SlotState.ACTIVE, SlotEvent.END): SlotState.DRAINING,
    (SlotState.ACTIVE, SlotEvent.CRASHED_OUT): SlotState.CRASHED,
    (SlotState.DRAINING, SlotEvent.DRAINED): SlotState.IDLE,
    (SlotState.DRAINING, SlotEvent.DRAIN_LATE): SlotState.QUARANTINED,
    (SlotState.DRAINING, SlotEvent.CRASHED_OUT): SlotState.CRASHED,
    # A late drain finished after all: the stuck work has ended.
    (SlotState.QUARANTINED, SlotEvent.DRAINED): SlotState.IDLE,
    (SlotState.QUARANTINED, SlotEvent.CRASHED_OUT): SlotState.CRASHED,
    # Crashed out with a session: its teardown runs (however long), then the slot rests.
    (SlotState.CRASHED, SlotEvent.END): SlotState.CRASHED,
    (SlotState.CRASHED, SlotEvent.DRAIN_LATE): SlotState.CRASHED,
    (SlotState.CRASHED, SlotEvent.CRASHED_OUT): SlotState.CRASHED,
    (SlotState.CRASHED, SlotEvent.DRAINED): SlotState.RESTING,
    (SlotState.RESTING, SlotEvent.CRASHED_OUT): SlotState.RESTING,
    (SlotState.RESTING, SlotEvent.RESTED): SlotState.IDLE,
}
#: The states of a slot out of service: each says why in :attr:`Slot.quarantine_reason`.
OUT_OF_SERVICE = frozenset({SlotState.QUARANTINED, SlotState.CRASHED, SlotState.RESTING})
LIFECYCLE = Lifecycle("slot", TRANSITIONS)


NEVER = 0  #: ``speculate_after_ms`` for a slot that never works ahead in a turn's closing silence.
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
        speculate_after_ms: silence after which a turn is transcribed ahead of its end (:data:`NEVER`: never; the
            server's default depends on the stack, see ``Config.speculate_after_ms``).
        semantic: the waits of ``semantic_vad`` turn detection.
        first_clause_words: an answer's first clause is cut after this many words, or a few more.
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
        queue_size: int = DEFAULTS.queue_size,
        drain_timeout_s: float = DEFAULTS.drain_deadline_s,
        max_input_buffer_s: float = DEFAULTS.max_input_buffer_s,
        send_timeout_s: float = DEFAULTS.send_timeout_s,
        speculate_after_ms: int = NEVER,
        first_clause_words: int = DEFAULTS.first_clause_words,
        semantic: SemanticTurnEnd | None = None,
        max_output_bytes: int = mib(DEFAULTS.max_output_mib),
        max_input_queue_bytes: int = mib(DEFAULTS.max_input_queue_mib),
    ) -> None:
        self.index = index
        self.stack = stack
        self.pools = pools
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.send_timeout_s = send_timeout_s
        self._state = SlotState.IDLE
        self.state_since = time.monotonic()
        self._ctx: SessionContext | None = None
        self.sessions_served = 0
        self.quarantine_reason: str | None = None
        self.stt_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.llm_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.tts_q: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self._outbox = Outbox(index, metrics, queue_size, send_timeout_s, max_output_bytes)
        #: Most bytes of a session's raw audio waiting to be heard: a client that sends faster than it is heard waits.
        self.max_input_queue_bytes = max_input_queue_bytes
        self._outbox.on_session_end = self._session_ended
        self._outbox.on_response_done = self._notify
        # The stages see only this, their queues, and the callbacks wired here: never the slot.
        self.stage = StageContext(index, stack, pools, metrics, self._outbox, self.fail, first_clause_words)
        serving = self.serving
        self.listener = Listener(
            self.stage,
            serving,
            clock,
            self.stt_q.put_nowait,
            self.close_now,
            ms_to_samples(max_input_buffer_s * 1000),
            speculate_after_ms,
            semantic,
        )
        responder = Responder(self.stage, serving, self.llm_q, self.tts_q)
        self._dispatch = Dispatcher(self.stage, serving, self.listener, clock.max_backlog_s, responder.read_ahead)
        self._stages: tuple[Transcriber, Responder, Speaker] = (
            Transcriber(self.stage, serving, self.stt_q, self.llm_q),
            responder,
            Speaker(self.stage, serving, self.tts_q, self.listener.answered, responder.read_ahead),
        )
        #: Owns the slot's own short tasks (closing a failed session's socket); never closed.
        self.scope = Scope(f"slot {index}")
        self._drained = asyncio.Event()
        self._crashes: list[float] = []
        #: Called when a session or a response ends (the server's shutdown waits on it).
        self.on_change: list[Callable[[], None]] = []

    def serving(self) -> SessionContext | None:
        """The session the slot serves now (None between sessions)."""
        return self._ctx

    @property
    def session(self) -> Session | None:
        """The session served now (None between sessions): read it, never change it from outside."""
        return self._ctx.session if self._ctx is not None else None

    @property
    def client(self) -> str | None:
        """The address of the client served now."""
        return self._ctx.client if self._ctx is not None else None

    @property
    def channel_open(self) -> bool:
        """The channel of the session served now is open (False between sessions)."""
        return self._ctx is not None and self._ctx.channel.is_open

    @property
    def log_content(self) -> bool:
        return self._outbox.log_content

    @log_content.setter
    def log_content(self, value: bool) -> None:
        self._outbox.log_content = value

    def held_bytes(self) -> dict[str, int]:
        """Bytes the slot's session holds now, by where (for the memory report; nothing between sessions)."""
        ctx = self._ctx
        return {
            "output": self._outbox.budget.used,
            "input_audio": ctx.audio.waiting_bytes if ctx is not None else 0,
            "conversation": ctx.session.conversation.bytes if ctx is not None else 0,
        }

    # --- lifecycle ------------------------------------------------------

    @property
    def state(self) -> SlotState:
        """Where the slot is in its lifecycle: read-only, moved by :meth:`step` alone, along its table."""
        return self._state

    def step(self, event: SlotEvent, reason: str | None = None) -> None:
        """Move the slot along its table (:data:`TRANSITIONS`); ``reason`` says why it goes out of service."""
        old, new = self._state, LIFECYCLE.step(self._state, event, self.index)
        self._state = new
        self.state_since = time.monotonic()
        if new in OUT_OF_SERVICE:
            if new is not old:
                self.quarantine_reason = reason or self.quarantine_reason
                log.error("slot %d %s: %s", self.index, new.value, reason)
        elif self.quarantine_reason is not None:
            log.warning("slot %d back in service (was quarantined: %s)", self.index, self.quarantine_reason)
            self.quarantine_reason = None

    async def attach(self, channel: Channel, session: Session, client: str) -> SessionPort:
        """Bind a claimed slot to a new session on ``channel`` (a WebSocket, a call) and greet the client.

        Returns:
            The one thing the server holds of the session from now on (:class:`SessionPort`).
        """
        assert self.state is SlotState.ACTIVE and self._ctx is None
        self._ctx = SessionContext(
            channel,
            session,
            client,
            self.stack.vad.new_state(),
            self.listener.semantic,
            self.listener.speculator_for,
            self.max_input_queue_bytes,
        )
        # A task of this session that raises ends this session, and only it.
        session.scope.on_failure = lambda exc, scope: self.fail(exc, "a task of the session", scope)
        self._outbox.attach(channel, session, client, self._ctx.timings)
        self.sessions_served += 1
        self._drained.clear()
        port = SessionPort(self, self._ctx)
        await self._outbox.emit(session.created_events(), session.scope)
        self._dispatch.read_ahead(self._ctx)  # the instructions its first answer will begin with
        return port

    def close_now(self, exc: RealtimeError | None, close_code: int) -> None:
        """End the session from code that cannot wait (the listening clock): error if it fits, then close."""
        ctx = self._ctx
        if ctx is None or ctx.session.scope.stale:
            return
        if exc is not None:
            self.metrics.errors.inc(code=exc.code)
            self._outbox.emit_nowait([ctx.session.error(exc)], ctx.session.scope)
        reason = exc.code.replace("_", " ") if exc is not None else "client is not reading its events"
        # The send loop closes after what is queued; if it cannot take the request, close at once.
        if not self._outbox.close_nowait(ctx.session.scope, close_code, reason):
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
        ctx = self._ctx
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
            events += session.fail_response(session.response, ServerFault("session_failed", message))
        events.append(session.error(ServerFault("session_failed", message)))
        data = [encode_event(e) for e in events]
        ctx.end()
        self._notify()
        self.scope.spawn(say_and_close(ctx.channel, data, 1011, "internal error"), f"slot{self.index}-failed")

    async def end_session(self) -> bool:
        """Three-phase teardown. Returns False if the slot was quarantined."""
        self.step(SlotEvent.END)
        ctx = self._ctx
        if ctx is None:  # attach never happened
            self._finish_drain()
            return True
        # Phase 1: everything this session asked for is stale from now on,
        # and the work in flight for it is cancelled.
        ctx.end()
        self._flush()
        # Phase 2: the sentinel enters at the head and passes every stage.
        self.stt_q.put_nowait(SessionEnd(ctx.session.id))
        # Phase 3: the send loop marks the slot idle when the sentinel arrives.
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                await self._drained.wait()
            return True
        except TimeoutError:
            if self.state in (SlotState.DRAINING, SlotState.CRASHED):
                self.step(SlotEvent.DRAIN_LATE, f"drain did not finish within {self.drain_timeout_s:g} s")
            return False

    def _flush(self) -> None:
        dropped = self._outbox.flush()
        if self._ctx is not None:
            dropped += self._ctx.audio.drop_all()
        for q in (self.stt_q, self.llm_q, self.tts_q):
            while not q.empty():
                q.get_nowait()
                dropped += 1
        if dropped:
            self.metrics.dropped_stale.inc(dropped, stage="teardown")

    def _session_ended(self, session_id: str) -> None:
        ctx = self._ctx
        if ctx is None or ctx.session.id != session_id:
            return  # a copy re-sent after a restart, for a session already gone
        self._finish_drain()

    def _finish_drain(self) -> None:
        self._ctx = None
        self._outbox.detach()
        release_freed_memory(background=True)
        if self.state in (SlotState.DRAINING, SlotState.QUARANTINED, SlotState.CRASHED):
            # Quarantined: the stuck work that made the drain late has ended after all. Crashed: it rests now.
            crashed = self.state is SlotState.CRASHED
            self.step(SlotEvent.DRAINED)
            if crashed:
                self._rest()
        self._drained.set()
        self._notify()

    def _rest(self) -> None:
        asyncio.get_running_loop().call_later(CRASH_COOL_DOWN_S, self._rested)

    def _rested(self) -> None:
        self._crashes.clear()
        if self.state is SlotState.RESTING:
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
                    tg.create_task(self._outbox.run(), name=f"slot{self.index}-send")
            except* Exception as group:
                log.exception("slot %d: a stage crashed; restarting its stages", self.index, exc_info=group)
                self.metrics.stage_restarts.inc()
                await self._recover(group)

    async def _recover(self, group: BaseException) -> None:
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < 60] + [now]
        ctx, serving = self._ctx, self.state is SlotState.ACTIVE
        if len(self._crashes) >= CRASH_LIMIT:
            idle = self.state is SlotState.IDLE
            self.step(SlotEvent.CRASHED_OUT, f"stages crashed {CRASH_LIMIT} times within a minute")
            if idle:  # it rests now (holding a session, it rests once that has drained)
                self._rest()
        if ctx is not None and serving:
            # The crashed stage may have held this session's work: end it cleanly, and at once
            # (its scope closes now, so the listening clock starts nothing more for it).
            self.fail(group, "the pipeline")
        elif ctx is not None:
            # Draining: the crash may have swallowed the sentinel; send it again.
            self._flush()
            self.stt_q.put_nowait(SessionEnd(ctx.session.id))


class SessionPort:
    """What the server holds of a session served on a slot: the one way in, from :meth:`Slot.attach` until its end.

    The transports (a WebSocket's receive loop, a call's) give it the client's frames, audio and keypad
    presses, and ask it what they need to know; they never reach the slot's stages, queues, outbox or state.
    """

    def __init__(self, slot: Slot, ctx: SessionContext) -> None:
        self._slot = slot
        self._ctx = ctx
        #: The slot's position in the pool, and the client's address, for logs.
        self.index, self.client = slot.index, ctx.client

    async def receive(self, message: str | bytes) -> None:
        """One frame from the client, decoded and handled (see :class:`~s2s_rt.pipeline.dispatch.Dispatcher`)."""
        await self._slot._dispatch.receive(message)

    def receive_now(self, message: bytes | bytearray | memoryview) -> bool:
        """An audio append handled as its frame is parsed, if nothing about it needs waiting (False: not taken)."""
        return self._slot._dispatch.receive_now(message)

    def hear(self, fmt: AudioFormat, data: bytes) -> None:
        """Audio from a call's media track, in ``fmt``."""
        self._slot._dispatch.media_audio(self._ctx, fmt, data)

    def dtmf(self, digit: str) -> None:
        """A phone call's caller pressed a key: ``input_audio_buffer.dtmf_event_received``."""
        self._slot._outbox.dtmf(digit)

    def stuck_for(self) -> float:
        """Seconds the current send has waited for the client to read (0 when none waits)."""
        return self._slot._outbox.stuck_for()

    async def error(self, exc: ProtocolError) -> None:
        """Tell the client of a mistake of its own (the session goes on)."""
        await self._slot._outbox.error(exc)

    async def end_with_error(self, exc: RealtimeError, close_code: int) -> None:
        """Send ``exc`` as an error event, then close the channel with ``close_code`` after what is queued."""
        await self._slot._outbox.error(exc)
        await self._slot._outbox.close(self._ctx.session.scope, close_code, exc.code.replace("_", " "))

    async def end(self) -> bool:
        """The session is over: tear it down (three phases) and hand the slot back. False: quarantined."""
        return await self._slot.end_session()
