"""The server's lifecycle: load the engines, build the pool, serve, drain, shut down.

Use it from the CLI (``s2s-rt serve``) or embed it::

    async with Server(Config(port=0)) as server:
        print(server.port)
        ...

or ``await Server(config).run()`` until SIGINT/SIGTERM or :meth:`Server.close`.
The connections (:mod:`s2s_rt.server.connection`) and the HTTP routes
(:mod:`s2s_rt.server.http`) see the server only as a
:class:`~s2s_rt.server.state.Serving`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import threading
import time
from typing import Any

from websockets.asyncio.server import serve

from s2s_rt.audio import PLANS
from s2s_rt.config import DEFAULT_SPECULATE_AFTER_MS, Config, mib
from s2s_rt.engines.base import KeepsPrefixes, Stack
from s2s_rt.inference import StagePool
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.listening.remote import hearing_for
from s2s_rt.memory import collect_as_before, collect_seldom
from s2s_rt.metrics import Metrics
from s2s_rt.server.calls import Calls
from s2s_rt.server.connection import Connections
from s2s_rt.server.direct import DirectConnection
from s2s_rt.server.handshake import select_subprotocol
from s2s_rt.server.http import Routes
from s2s_rt.server.pool import Pool
from s2s_rt.server.secrets import ClientSecrets
from s2s_rt.server.sip import Phones
from s2s_rt.server.stack import load_stack
from s2s_rt.server.teardown import Handlers, end_sessions
from s2s_rt.slot import Slot
from s2s_rt.supervise import supervise
from s2s_rt.turn import SemanticTurnEnd

log = logging.getLogger(__name__)


class Server:
    """An OpenAI-Realtime-compatible speech-to-speech server.

    Args:
        config: settings; ``port=0`` picks a free port (see :attr:`port`).
        stack: engines to use instead of loading the ones ``config.stack``
            names (tests pass their own).
    """

    def __init__(self, config: Config | None = None, *, stack: Stack | None = None) -> None:
        self.config = (config or Config()).validate()
        self.stack = stack
        self.port: int = self.config.port
        self.closing = False
        self.draining = False
        self.metrics = Metrics(
            self._slot_states, self._overdue_calls, self._held_bytes, self._llm_prefixes, self._listening
        )
        self.pool: Pool | None = None
        #: The WebRTC calls in progress (``POST /v1/realtime/calls``).
        self.calls: Calls | None = None
        #: The phone calls (SIP), when ``sip_port`` is set.
        self.phones: Phones | None = None
        self.pools: dict[str, StagePool] = {}
        self.clock: ListeningClock | None = None
        self._runner: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._stop = asyncio.Event()
        self._deadline: threading.Timer | None = None
        #: Start-up moved every object then alive out of the collector's reach (this server's among them).
        self._froze = False
        #: This server asked for seldom collections of cyclic garbage (see :func:`~s2s_rt.memory.collect_seldom`).
        self._seldom = False

    # --- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Load engines, build the pool and start listening; returns once it listens.

        Raises:
            Exception: whatever stopped start-up (a model that will not load,
                a port in use).
        """
        if self.stack is None:
            self.stack = await asyncio.to_thread(load_stack, self.config)
            # What is loaded now lives as long as the process (tokenizers' vocabularies, the
            # models' Python objects): out of the collector's full passes, which otherwise
            # walked all of it and stalled every session's audio for 15-35 ms at a time.
            gc.collect()
            gc.freeze()
            self._froze = True
        if not self._seldom:
            collect_seldom()
            self._seldom = True
        for line in self.stack.description:
            log.info("%s", line)
        self._runner = asyncio.create_task(self._main(), name="s2s-rt-server")
        started = asyncio.create_task(self._started.wait())
        await asyncio.wait({self._runner, started}, return_when=asyncio.FIRST_COMPLETED)
        if not self._started.is_set():
            started.cancel()
            await self._runner  # re-raises what went wrong

    async def run(self) -> None:
        """Serve until SIGINT/SIGTERM or :meth:`close`, then shut down gracefully.

        A signal ends the process within the grace period (and a second):
        if the graceful shutdown has not finished by then, whatever state
        any task or engine call is in, the process exits at once (status 1).
        """
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGINT: self._signalled, signal.SIGTERM: self._signalled, signal.SIGUSR1: self.drain}
        for sig, handler in handlers.items():
            try:
                loop.add_signal_handler(sig, handler)
            except (NotImplementedError, RuntimeError):  # not the main thread, or not Unix
                pass
        await self.start()
        assert self._runner is not None
        try:
            await self._runner
        finally:
            if self._deadline is not None:
                self._deadline.cancel()

    def _signalled(self) -> None:
        self._stop.set()
        if self._deadline is None:
            # A thread, not the loop: it fires even if the loop or a task group is wedged.
            loop = asyncio.get_running_loop()
            self._deadline = threading.Timer(self.config.grace_period_s + SHUTDOWN_MARGIN_S, _exit_now, (loop,))
            self._deadline.daemon = True
            self._deadline.start()

    async def close(self) -> None:
        """Stop accepting, let running turns finish (grace period), close the rest with 1001."""
        self._stop.set()
        if self._runner is not None:
            await self._runner

    async def _main(self) -> None:
        cfg = self.config
        assert self.stack is not None
        self.pools = {
            "vad": StagePool("vad", 1, self.metrics, cfg.vad_timeout_s),
            "stt": StagePool("stt", cfg.stage_workers, self.metrics, cfg.stt_timeout_s, nice=cfg.engine_nice),
            "llm": StagePool("llm", cfg.stage_workers, self.metrics, cfg.llm_timeout_s, nice=cfg.engine_nice),
            "tts": StagePool("tts", cfg.stage_workers, self.metrics, cfg.tts_timeout_s, nice=cfg.engine_nice),
        }
        clock = self.clock = ListeningClock(
            self.stack.vad,
            self.pools["vad"],
            self.metrics,
            tick_s=cfg.listen_tick_ms / 1000,
            listen_s_per_tick=cfg.listen_s_per_tick,
            max_backlog_s=cfg.max_audio_backlog_s,
            shed_after_s=cfg.shed_after_ms / 1000,
            max_load=cfg.max_listening_load,
        )
        slots = [
            Slot(
                i,
                self.stack,
                self.pools,
                clock,
                self.metrics,
                queue_size=cfg.queue_size,
                drain_timeout_s=cfg.drain_deadline_s,
                max_input_buffer_s=cfg.max_input_buffer_s,
                send_timeout_s=cfg.send_timeout_s,
                speculate_after_ms=(
                    cfg.speculate_after_ms
                    if cfg.speculate_after_ms is not None
                    else (DEFAULT_SPECULATE_AFTER_MS if self.stack.name == "default" else 0)
                ),
                first_clause_words=cfg.first_clause_words,
                semantic=SemanticTurnEnd(
                    min_silence_ms=cfg.semantic_min_silence_ms, unknown_ms=cfg.semantic_unknown_ms
                ),
                max_output_bytes=mib(cfg.max_output_mib),
                max_input_queue_bytes=mib(cfg.max_input_queue_mib),
            )
            for i in range(cfg.pool_size)
        ]
        for slot in slots:
            slot.log_content = cfg.log_content
        self.pool = Pool(slots)
        connections = Connections(
            cfg, self.metrics, self, self.pool, self.stack, ClientSecrets(cfg.max_client_secret_s)
        )
        calls = self.calls = Calls(cfg, connections)
        phones = self.phones = Phones(cfg, connections) if cfg.sip_port is not None else None
        routes = Routes(cfg, self.metrics, self, self.pool, self.stack, connections, calls, phones)
        tasks: list[asyncio.Task[Any]] = []
        hearing_process = None
        try:
            # The clock hears in a process of its own where the stack's VAD can be built there again.
            clock.hearing, hearing_process = await asyncio.to_thread(
                hearing_for, self.stack.vad, self.stack.noise, cfg.hearing_process, cfg.vad_timeout_s * 0.8
            )
            cost = await clock.calibrate()
            log.info(
                "hearing costs %.0f µs per tick and %.2f ms per second of a session's audio (measured at start;"
                " remeasured as sessions stream, and each minute while listening is not busy):"
                " about %.0f listening sessions under a load of %g",
                cost.overhead_s * 1e6,
                cost.prior * 1000,
                min(clock.capacity(), cfg.pool_size),
                cfg.max_listening_load,
            )
            async with asyncio.TaskGroup() as tg:
                # Every process-wide task is supervised: a crash is logged and restarted, never left to end
                # the group (and with it every session); one that keeps crashing stops the server.
                tasks += [
                    tg.create_task(supervise(f"slot {s.index}", s.run, self.metrics), name=f"slot{s.index}")
                    for s in slots
                ]
                tasks.append(
                    tg.create_task(supervise("listening clock", clock.run, self.metrics), name="listening-clock")
                )
                tasks.append(
                    tg.create_task(supervise("listening cost", clock.remeasure, self.metrics), name="listening-cost")
                )
                tasks.append(tg.create_task(supervise("loop-lag", self._watch_loop_lag, self.metrics), name="loop-lag"))
                tasks.append(
                    tg.create_task(supervise("call sockets", calls.sockets.run, self.metrics), name="call-sockets")
                )
                handle = connections.handle
                if phones is not None:
                    handle = functools.partial(connections.handle, phone_calls=phones.watch)
                handlers = Handlers(handle)
                async with serve(
                    handlers,
                    cfg.host,
                    cfg.port,
                    process_request=routes.process_request,
                    select_subprotocol=select_subprotocol,
                    max_size=int(cfg.max_message_mib * 1024 * 1024),
                    compression="deflate" if cfg.compression else None,
                    open_timeout=cfg.open_timeout_s,
                    ping_interval=cfg.ping_interval_s,
                    ping_timeout=cfg.ping_timeout_s,
                    server_header="s2s-rt",
                    create_connection=(connection_class := DirectConnection.answering(routes.answer_post)),
                ) as ws_server:
                    self.port = ws_server.sockets[0].getsockname()[1]
                    if phones is not None:
                        await phones.start()
                        tasks.append(tg.create_task(supervise("sip sweep", phones.sweep, self.metrics), name="sip"))
                    log.info(
                        "s2s-rt listening on ws://%s:%d/v1/realtime (pool of %d, %s stack)",
                        cfg.host,
                        self.port,
                        cfg.pool_size,
                        self.stack.name,
                    )
                    self._started.set()
                    await self._stop.wait()
                    await self._drain_for_shutdown()
                    connection_class.refuse_unread("the server is shutting down")
                    ws_server.close()
                    await end_sessions(
                        [ws_server.wait_closed(), calls.close(), *([phones.close()] if phones else [])],
                        handlers,
                        [calls.tasks, *([phones.tasks] if phones else [])],
                        connection_class.abort_all,
                    )
                for task in tasks:
                    task.cancel()
        finally:
            for pool in self.pools.values():
                pool.shutdown()
            if hearing_process is not None:
                hearing_process.close()
            if self._froze:
                # Frozen, this server and its engines would outlive it, closed or failed to start: a process
                # that starts another (a test, an application embedding servers) would keep every stack.
                self._froze = False
                gc.unfreeze()
            if self._seldom:
                self._seldom = False
                collect_as_before()
            log.info("s2s-rt stopped")

    async def _drain_for_shutdown(self) -> None:
        """Refuse new sessions at once; give running responses the grace period."""
        self.closing = True
        assert self.pool is not None
        log.info("shutting down: waiting up to %g s for running turns", self.config.grace_period_s)
        deadline = time.monotonic() + self.config.grace_period_s

        def busy() -> bool:
            assert self.pool is not None
            return any(s.session is not None and s.session.response is not None for s in self.pool.slots)

        while busy():
            self.pool.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    await self.pool.changed.wait()
            except TimeoutError:
                break

    async def _watch_loop_lag(self) -> None:
        # A ticker: how late the loop wakes it is how long something blocked the loop.
        interval = 0.05
        while True:
            before = time.perf_counter()
            await asyncio.sleep(interval)
            self.metrics.loop_lag.observe(max(0.0, time.perf_counter() - before - interval))

    def _listening(self) -> dict[str, float]:
        clock = self.clock
        if clock is None or self.pool is None:
            return {}
        return {
            "cost": clock.cost.value_at(time.monotonic()),
            "load": clock.load(self.pool.active()),
            "lag_seconds": clock.lag_s,
        }

    def admits(self) -> bool:
        """Whether listening can take one more session (:meth:`ListeningClock.admits`)."""
        assert self.pool is not None
        return self.clock is None or self.clock.admits(self.pool.active())

    def drain(self) -> None:
        """Stop taking new sessions (``/readyz`` 503); running sessions carry on."""
        if not self.draining:
            self.draining = True
            log.info("draining: no new sessions; %d running", self.pool.busy() if self.pool else 0)

    def undrain(self) -> None:
        """Take new sessions again after :meth:`drain` (not after shutdown began)."""
        if self.draining:
            self.draining = False
            log.info("taking new sessions again")

    def _slot_states(self) -> dict[str, int]:
        return self.pool.states() if self.pool is not None else {}

    def _llm_prefixes(self) -> dict[str, int]:
        llm = self.stack.llm if self.stack is not None else None
        if not isinstance(llm, KeepsPrefixes):
            return {}
        return {
            "prefix_tokens": llm.prefixes.held_tokens,
            "prefixes": len(llm.prefixes),
            "reloads": llm.reloads,
            "answers_resumed": llm.turns.resumed,
            "answers_paused": llm.turns.held,
            "pauses_run_out": llm.turns.held_out,
            "answer_calls": llm.lanes.answer_calls,
            "answers_together": llm.lanes.answers_together,
        }

    def _held_bytes(self) -> dict[str, int]:
        held = {"output": 0, "input_audio": 0, "conversation": 0}
        for slot in self.pool.slots if self.pool is not None else ():
            for where, size in slot.held_bytes().items():
                held[where] += size
        # The resampling plans are the process's, shared by every session's resamplers (bounded as a whole).
        return held | {"resampler_cache": PLANS.bytes}

    def _overdue_calls(self) -> int:
        return sum(p.overdue for p in self.pools.values())


#: A signalled shutdown that has not ended this long after the grace period ends the process at once.
SHUTDOWN_MARGIN_S = 0.75


def still_running(loop: asyncio.AbstractEventLoop) -> list[str]:
    """The tasks of ``loop`` not done, each as its name and where its coroutine waits (read from another
    thread: a set that changes meanwhile is read again, three times at most)."""
    for _ in range(3):
        try:
            tasks = list(asyncio.all_tasks(loop))
            break
        except RuntimeError:
            continue
    else:
        return []
    out = []
    for task in tasks:
        frame = getattr(task.get_coro(), "cr_frame", None)
        where = f" ({frame.f_code.co_qualname} line {frame.f_lineno})" if frame is not None else ""
        out.append(f"{task.get_name()}{where}")
    return sorted(out)


def _exit_now(loop: asyncio.AbstractEventLoop) -> None:
    running = still_running(loop)
    log.error(
        "shutdown did not finish within the grace period; exiting now (%d task(s) still running: %s)",
        len(running),
        "; ".join(running[:20]),
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)
