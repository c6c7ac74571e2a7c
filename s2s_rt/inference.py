"""Running blocking engine calls off the event loop.

Each stage kind (VAD, STT, LLM, TTS) has its own bounded thread pool, shared
by every slot: a long LLM stream can then never hold up another session's
VAD decision. :class:`VadBatcher` collects the VAD chunks that all sessions
have ready at the same moment and scores them in one batched call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from s2s_rt.engines.base import VAD, Float32Array
from s2s_rt.metrics import Metrics

T = TypeVar("T")

_DONE = object()


class StagePool:
    """A bounded executor for one stage kind, with timing into metrics.

    Args:
        stage: the stage's name in metrics (``vad``, ``stt``, ``llm``, ``tts``).
        workers: threads; calls beyond this wait their turn.
        metrics: where call durations go.
    """

    def __init__(self, stage: str, workers: int, metrics: Metrics) -> None:
        self.stage = stage
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"s2s-{stage}")
        self.in_flight = 0

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in this pool and await its result."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.in_flight += 1
        try:
            return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))
        finally:
            self.in_flight -= 1
            self.metrics.stage_latency.observe(time.perf_counter() - started, stage=self.stage)

    async def stream(self, make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
        """Iterate a blocking generator in this pool, yielding its pieces here.

        The generator runs in one worker thread and hands each piece to the
        loop as it is made. If the consumer stops early, the thread stops at
        the next piece; the engine's own stop check usually stops it sooner.
        """
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        closed = threading.Event()

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
        self.in_flight += 1
        future = loop.run_in_executor(self.executor, produce)
        try:
            while True:
                piece = await pieces.get()
                if piece is _DONE:
                    break
                if isinstance(piece, _Failure):
                    raise piece.exc
                yield piece
        finally:
            closed.set()
            self.in_flight -= 1
            self.metrics.stage_latency.observe(time.perf_counter() - started, stage=self.stage)
            # The thread's outcome was already delivered as a piece.
            future.add_done_callback(lambda f: f.exception())

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class VadBatcher:
    """Scores the VAD chunks of all sessions that are ready together in one call.

    A session's VAD stage awaits :meth:`probability`; requests that arrive
    while a batch is running form the next batch. Run :meth:`run` as a task
    owned by the server.
    """

    def __init__(self, vad: VAD, pool: StagePool) -> None:
        self.vad = vad
        self.pool = pool
        self._pending: list[tuple[Float32Array, Any, asyncio.Future[float]]] = []
        self._wake = asyncio.Event()
        self.batches = 0
        self.chunks = 0

    async def probability(self, chunk: Float32Array, state: Any) -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending.append((chunk, state, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            batch = [b for b in batch if not b[2].cancelled()]
            if not batch:
                continue
            chunks = np.stack([b[0] for b in batch])
            states = [b[1] for b in batch]
            try:
                probs = await self.pool.call(self.vad.speech_probabilities, chunks, states)
            except Exception as exc:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.chunks += len(batch)
            for (_, _, fut), p in zip(batch, probs, strict=True):
                if not fut.done():
                    fut.set_result(float(p))
