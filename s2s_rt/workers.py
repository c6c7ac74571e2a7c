"""Several s2s-rt processes on one host: ``s2s-rt serve --workers N``.

One process holds one pool of slots and one copy of the models. A big host
runs several, each on its own port (and, with ``--device``, its own GPU),
behind a load balancer that knows each one's pool size (``deploy/haproxy.cfg``).
This module starts them, prints the HAProxy ``server`` lines that describe
them, passes signals on, and waits. It does not balance anything itself.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TextIO

#: Options of ``serve`` that the launcher sets per worker; the user's values are dropped.
PER_WORKER_OPTIONS = ("--workers", "--port", "--host", "--device")
#: Signals passed on to every worker: stop (gracefully) and drain.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def worker_devices(spec: str | None, n: int) -> list[str] | None:
    """The device of each of ``n`` workers, from a ``--device`` value.

    Args:
        spec: ``None`` or ``"auto"`` (each worker picks for itself, as one
            server does), ``"cuda"`` (one GPU per worker: ``cuda:0`` …
            ``cuda:N-1``), or a comma-separated list such as
            ``"cuda:0,cuda:1"`` or ``"cpu"``, handed out in turn.
        n: number of workers.

    Returns:
        One device per worker, or None to pass no ``--device``.
    """
    if spec is None or spec == "auto":
        return None
    if spec == "cuda":
        return [f"cuda:{i}" for i in range(n)]
    listed = [d.strip() for d in spec.split(",") if d.strip()]
    return [listed[i % len(listed)] for i in range(n)] if listed else None


def worker_argv(serve_argv: Sequence[str], *, host: str, port: int, device: str | None) -> list[str]:
    """The command line of one worker: ``serve`` with its own host, port and device.

    Args:
        serve_argv: the arguments the user gave after ``serve``; any
            ``--workers``, ``--port``, ``--host`` and ``--device`` in them
            (also as ``--opt=value`` or an abbreviation argparse accepted)
            are replaced.
        host: address to listen on.
        port: this worker's port.
        device: this worker's device, or None.
    """
    kept: list[str] = []
    skip_value = False
    for arg in serve_argv:
        if skip_value:
            skip_value = False
            continue
        name, eq, _ = arg.partition("=")
        if _is_per_worker_option(name):
            skip_value = not eq
            continue
        kept.append(arg)
    argv = [sys.executable, "-m", "s2s_rt", "serve", *kept, "--host", host, "--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    return argv


def _is_per_worker_option(name: str) -> bool:
    # argparse accepts unambiguous prefixes ("--work 4"); the parse already
    # succeeded, so a prefix of one of ours can only mean that one.
    return len(name) > 3 and name.startswith("--") and any(opt.startswith(name) for opt in PER_WORKER_OPTIONS)


def haproxy_server_lines(host: str, base_port: int, n: int, pool_size: int) -> list[str]:
    """The ``server`` lines of ``deploy/haproxy.cfg``'s backend for ``n`` workers.

    ``maxconn`` is the pool size: HAProxy then never sends a worker more
    sessions than it has slots.
    """
    address = _reachable(host)
    return [f"    server s2s-{i} {address}:{base_port + i} maxconn {pool_size}" for i in range(n)]


def _reachable(host: str) -> str:
    # A wildcard listen address is reached on loopback from the same host.
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def run_workers(
    n: int,
    serve_argv: Sequence[str],
    base_port: int,
    host: str,
    devices: list[str] | None,
    *,
    pool_size: int,
    out: TextIO | None = None,
) -> int:
    """Start ``n`` servers on ports ``base_port`` … ``base_port + n - 1`` and wait for them.

    Prints the HAProxy backend lines for them on ``out`` (stdout), and one
    line per worker (pid, address) on stderr. SIGTERM and SIGINT (stop
    gracefully) and SIGUSR1 (drain) are passed on to every worker. A worker
    that dies is not restarted and the others keep serving (a load balancer
    routes around it); the launcher returns once every worker has exited.
    Workers are also sent SIGTERM if the launcher itself dies.

    Args:
        n: number of worker processes (at least 1).
        serve_argv: the user's arguments after ``serve``, passed on to each
            worker minus ``--workers``/``--port``/``--host``/``--device``.
        base_port: the first worker's port (not 0: the ports must be known
            to put them in the load balancer's configuration).
        host: address every worker listens on.
        devices: each worker's ``--device`` (see :func:`worker_devices`), or None.
        pool_size: each worker's pool size, for the ``maxconn`` of its line.
        out: where the HAProxy lines go (default stdout).

    Returns:
        The worst exit status among the workers (0 when all stopped
        cleanly; 128 + N for a worker killed by signal N), or 2 when the
        arguments cannot work.
    """
    out = out or sys.stdout
    if n < 1:
        print("s2s-rt: --workers must be at least 1", file=sys.stderr)
        return 2
    if base_port < 1 or base_port + n - 1 > 65535:
        last = base_port + n - 1
        print(
            f"s2s-rt: --workers {n} needs ports {base_port}..{last}; give a --port from 1 to {65536 - n}",
            file=sys.stderr,
        )
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if signum != signal.SIGUSR1:
            stopping = True
        for proc in procs:
            if proc.returncode is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    # Handlers go in before the first worker starts, so no signal falls between.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        for i in range(n):
            device = devices[i % len(devices)] if devices else None
            argv = worker_argv(serve_argv, host=host, port=base_port + i, device=device)
            try:
                proc = subprocess.Popen(argv, preexec_fn=_die_with_parent(os.getpid()))
            except OSError as exc:
                print(f"s2s-rt: cannot start worker {i}: {exc}", file=sys.stderr)
                forward(signal.SIGTERM, None)
                _reap_all(procs)
                return 1
            procs.append(proc)
            print(
                f"s2s-rt: worker {i}: pid {proc.pid}, ws://{_reachable(host)}:{base_port + i}/v1/realtime"
                + (f" on {device}" if device else ""),
                file=sys.stderr,
                flush=True,
            )
        print(f"# HAProxy backend for {n} s2s-rt workers (deploy/haproxy.cfg):", file=out)
        for line in haproxy_server_lines(host, base_port, n, pool_size):
            print(line, file=out)
        out.flush()
        for proc, index in _exits(procs):
            if not stopping:
                print(
                    f"s2s-rt: worker {index} (pid {proc.pid}, port {base_port + index}) exited with "
                    f"{_status(proc.returncode)}; the other workers keep serving",
                    file=sys.stderr,
                    flush=True,
                )
        return max(_status(p.returncode) for p in procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exits(procs: list[subprocess.Popen[bytes]]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Yield each worker (and its index) as it exits, until all have."""
    # One waiting thread per worker; the main thread blocks on the queue, whose
    # get() a signal interrupts, so the handlers above run at once.
    exited: queue.SimpleQueue[int] = queue.SimpleQueue()

    def wait(index: int) -> None:
        procs[index].wait()
        exited.put(index)

    for i in range(len(procs)):
        threading.Thread(target=wait, args=(i,), name=f"s2s-rt-worker-{i}", daemon=True).start()
    for _ in procs:
        i = exited.get()
        yield procs[i], i


def _reap_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.wait()


def _status(returncode: int | None) -> int:
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send the worker SIGTERM when the launcher dies."""
    if not sys.platform.startswith("linux"):
        return None

    def arrange() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange
