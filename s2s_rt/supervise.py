"""Supervision of the process-wide tasks: a crash is logged and restarted, and never hangs the process.

Like an OTP supervisor: the listening clock, the slots' stage loops, the
loop-lag ticker and the calls' sockets each run under :func:`supervise`. A task that raises is
logged with its traceback and started again after a short pause; one that
keeps failing (``limit`` times within ``within_s``) cannot be trusted, so
:class:`SupervisionFailed` goes up and the server shuts down, the process
exiting non-zero for its own supervisor (systemd, Kubernetes) to restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from s2s_rt.metrics import Metrics

log = logging.getLogger(__name__)


class SupervisionFailed(Exception):
    """A process-wide task failed too often to be restarted again."""


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    metrics: Metrics,
    *,
    limit: int = 5,
    within_s: float = 60.0,
) -> None:
    """Run ``run()`` for the life of the process, restarting it when it raises or returns.

    Raises:
        SupervisionFailed: it failed ``limit`` times within ``within_s`` seconds.
    """
    failures: list[float] = []
    while True:
        try:
            await run()
            raise RuntimeError(f"{name} returned; it must run as long as the server")
        except Exception as exc:
            now = time.monotonic()
            failures = [t for t in failures if now - t < within_s] + [now]
            metrics.errors.inc(code="task_restarted")
            if len(failures) >= limit:
                log.critical("%s failed %d times within %g s; stopping the server", name, limit, within_s)
                raise SupervisionFailed(f"{name} failed {limit} times within {within_s:g} s") from exc
            log.exception("%s failed; restarting it", name)
            await asyncio.sleep(min(1.0, 0.05 * 2 ** len(failures)))
