"""Running blocking engine calls off the event loop.

Each stage kind (VAD, STT, LLM, TTS) has its own bounded thread pool, shared
by every slot: a long LLM stream can then never hold up another session's
VAD decision (the listening clock scores all sessions' audio in one call
per tick: :mod:`s2s_rt.listening.clock`).

Listening comes first on a busy machine: the STT, LLM and TTS threads (the
pools' and the engines' own) run nicer than the event loop and the VAD, so
that when transcription and answers fill the cores they wait, not the VAD
decisions of every session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from s2s_rt.metrics import Metrics

T = TypeVar("T")

log = logging.getLogger(__name__)

_DONE = object()


def lower_this_thread(nice: int) -> None:
    """Make the calling thread, and every thread it starts from now on, ``nice`` steps nicer.

    Linux keeps a nice value per thread and a new thread inherits its
    creator's, so an engine loaded on a lowered thread computes on lowered
    threads (CTranslate2's replica threads and their OpenMP teams, ONNX
    Runtime's pools). Raising niceness needs no privilege; lowering it back
    does, so only threads that stay lowered call this.
    """
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: the priorities stay equal
        log.warning("could not lower the priority of an inference thread: %s", exc)


def call_lowered(fn: Callable[[], T], nice: int) -> T:
    """``fn()`` on a thread of its own, ``nice`` steps nicer, which ends with it (the caller waits).

    For loading an engine: the threads it starts inherit the lowered
    priority, while the caller's own priority is left as it was.
    """
    if nice <= 0:
        return fn()
    got: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        lower_this_thread(nice)
        try:
            got.append(fn())
        except BaseException as exc:  # re-raised in the caller
            failed.append(exc)

    thread = threading.Thread(target=run, name="s2s-load")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return got[0]


class EngineTimeout(Exception):
    """An engine call ran past its deadline; its thread may still be running."""


class StagePool:
    """A bounded executor for one stage kind, with deadlines and timing into metrics.

    A call that runs past its deadline fails for its caller at once. Its
    thread cannot be killed, so it is counted as overdue and the pool gets
    one extra thread until it returns: hung calls never shrink the capacity
    left to other sessions.

    Args:
        stage: the stage's name in metrics (``vad``, ``stt``, ``llm``, ``tts``).
        workers: threads; calls beyond this wait their turn.
        metrics: where call durations go.
        deadline_s: the default deadline of a call (of each piece, for streams).
        nice: how much nicer than the event loop its threads run (see :func:`lower_this_thread`).
    """

    def __init__(self, stage: str, workers: int, metrics: Metrics, deadline_s: float = 60.0, *, nice: int = 0) -> None:
        self.stage = stage
        self.metrics = metrics
        self.workers = workers
        self.deadline_s = deadline_s
        self.executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"s2s-{stage}", initializer=lower_this_thread, initargs=(nice,)
        )
        #: Calls still running on a thread after their caller gave up (deadline or cancellation).
        self.overdue = 0
        #: Engine calls and streams running on a thread now (overdue ones included).
        self.running = 0
        self._lock = threading.Lock()
        #: Who waits in :meth:`idle` (each on its loop), woken when :attr:`running` falls to 0.
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def _counted(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            self.running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            woken: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
            with self._lock:
                self.running -= 1
                if not self.running:
                    woken, self._idle_waiters = self._idle_waiters, []
            for loop, waiter in woken:
                with contextlib.suppress(RuntimeError):  # its loop is closed: a call that outlived the server
                    loop.call_soon_threadsafe(_wake, waiter)

    async def idle(self) -> None:
        """Wait until no engine call or stream runs on this pool's threads (:attr:`running` is 0)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if not self.running:
                    return
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle_waiters.append((loop, waiter))
            try:
                await waiter  # woken when it fell to 0; another call may have begun since: looked at again
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._idle_waiters.remove((loop, waiter))

    def _set_capacity(self) -> None:
        # ThreadPoolExecutor starts a new thread per submit while below
        # _max_workers; raising it is the only way to add room for stuck threads.
        self.executor._max_workers = self.workers + self.overdue

    def _release_thread(
        self, future: concurrent.futures.Future[Any], *, timed_out: bool, gate: OneAtATime | None = None
    ) -> None:
        """The caller gave up on a call that is already running: its thread no longer counts.

        The thread cannot be stopped, so the pool gets one extra thread until
        it returns; abandoned calls never shrink the capacity left to others.
        """
        with self._lock:
            self.overdue += 1
            self._set_capacity()
        if timed_out:
            self.metrics.errors.inc(code=f"{self.stage}_timeout")

        def returned(_: concurrent.futures.Future[Any]) -> None:
            # Runs in the worker thread: the count is shared with the loop thread.
            with self._lock:
                self.overdue -= 1
                self._set_capacity()

        future.add_done_callback(returned)
        if gate is not None:
            gate.abandoned(future)

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        deadline_s: float | None = None,
        gate: OneAtATime | None = None,
        **kwargs: Any,
    ) -> T:
        """Run ``fn(*args, **kwargs)`` in this pool and await its result.

        If the caller is cancelled, a call still waiting for a thread is
        dropped, and a running one is left to finish on a thread that no
        longer counts against the pool.

        Raises:
            EngineTimeout: the call took longer than its deadline.
        """
        started = time.perf_counter()
        deadline = deadline_s or self.deadline_s
        if gate is not None:
            await gate.enter()
        future = self.executor.submit(self._counted, fn, *args, **kwargs)
        try:
            async with asyncio.timeout(deadline):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            if not future.cancel():  # not started yet: cancelled, no thread held
                self._release_thread(future, timed_out=True, gate=gate)
            raise EngineTimeout(f"{self.stage} call exceeded {deadline:g} s") from None
        except asyncio.CancelledError:
            if not future.cancel():
                self._release_thread(future, timed_out=False, gate=gate)
            raise
        finally:
            self.metrics.stage_latency.observe(time.perf_counter() - started, stage=self.stage)

    async def stream(
        self, make: Callable[[], Iterator[T]], deadline_s: float | None = None, gate: OneAtATime | None = None
    ) -> AsyncIterator[T]:
        """Iterate a blocking generator in this pool, yielding its pieces here.

        The generator runs in one worker thread and hands each piece to the
        loop as it is made. If the consumer stops early or is cancelled, the
        thread stops at the next piece (the engine's own stop check usually
        stops it sooner) and no longer counts against the pool.

        Raises:
            EngineTimeout: no piece (or the end) arrived within the deadline.
        """
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        closed = threading.Event()
        deadline = deadline_s or self.deadline_s

        def produce() -> None:
            try:
                for piece in make():
                    if closed.is_set():
                        break
                    loop.call_soon_threadsafe(pieces.put_nowait, piece)
            except BaseException as exc:  # handed to the consumer, which re-raises
                loop.call_soon_threadsafe(pieces.put_nowait, _Failure(exc))
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, _DONE)

        started = time.perf_counter()
        if gate is not None:
            await gate.enter()
        future = self.executor.submit(self._counted, produce)
        finished = timed_out = False
        try:
            while True:
                try:
                    async with asyncio.timeout(deadline):
                        piece = await pieces.get()
                except TimeoutError:
                    timed_out = True
                    raise EngineTimeout(f"{self.stage} produced nothing for {deadline:g} s") from None
                if piece is _DONE:
                    finished = True
                    break
                if isinstance(piece, _Failure):
                    finished = True
                    raise piece.exc
                yield piece
        finally:
            closed.set()
            if not finished and not future.cancel() and not future.done():
                self._release_thread(future, timed_out=timed_out, gate=gate)
            self.metrics.stage_latency.observe(time.perf_counter() - started, stage=self.stage)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class OneAtATime:
    """One owner's abandoned engine calls: a new call waits until the one given up on has really ended.

    A call its caller gave up on (a cancelled answer) goes on in its thread
    until the engine returns, and an engine that runs one call at a time
    (CTranslate2's LLM) takes calls in order: a session that asked and
    cancelled again and again would queue call after call ahead of every
    other session's. With a gate per session, each has at most one such
    call in the engine. Calls that are still wanted do not wait for each
    other (an answer begun ahead and the reading of the conversation so far).
    """

    def __init__(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()

    async def enter(self) -> None:
        """Wait until no call this owner gave up on is still running."""
        await self._idle.wait()

    def abandoned(self, future: concurrent.futures.Future[Any]) -> None:
        """``future``'s caller gave up on it while it runs: close the gate until it is done."""
        self._idle.clear()
        loop = asyncio.get_running_loop()

        def done(_: concurrent.futures.Future[Any]) -> None:
            if not loop.is_closed():  # a call that outlived the server
                loop.call_soon_threadsafe(self._idle.set)

        future.add_done_callback(done)
