"""What ``/proc`` says: a process's CPU time, RSS and event-loop thread, the machine's busy time."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_rt.cpuinfo import cpu_name


@dataclass
class ProcSample:
    """What ``/proc/PID`` says about a process at one moment."""

    cpu_s: float
    rss_mb: float
    hwm_mb: float
    threads: int
    #: The main thread (the event loop's): CPU seconds, and seconds it was
    #: runnable but waiting for a core (other processes or its own threads had them).
    main_cpu_s: float = 0.0
    main_wait_s: float = 0.0


def read_proc(pid: int, children: bool = True) -> ProcSample | None:
    """CPU seconds (user+system, all threads), RSS and peak RSS of ``pid``; None if unreadable.

    With ``children``, those of its child processes are added (the server's hearing process is part of the
    server: :mod:`s2s_rt.listening.remote`); the main thread's figures are the parent's alone.
    """
    sample = _read_one(pid)
    if sample is None or not children:
        return sample
    for child in _children(pid):
        more = _read_one(child)
        if more is not None:
            sample.cpu_s += more.cpu_s
            sample.rss_mb += more.rss_mb
            sample.hwm_mb += more.hwm_mb
            sample.threads += more.threads
    return sample


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (started by any of its threads)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _read_one(pid: int) -> ProcSample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    kv = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def mb(key: str) -> float:
        return int(kv.get(key, "0 kB").split()[0]) / 1024

    main_cpu = main_wait = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        run_ns, wait_ns = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
        main_cpu, main_wait = int(run_ns) / 1e9, int(wait_ns) / 1e9
    return ProcSample(cpu, mb("VmRSS"), mb("VmHWM"), int(kv.get("Threads", "0").strip()), main_cpu, main_wait)


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used since boot (from ``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Usage:
    """CPU use over a window: the machine, this client process, the server process."""

    def __init__(self, server: Callable[[], ProcSample | None]) -> None:
        """``server`` reads the server process's figures (None when it is not on this machine)."""
        self.server = server
        self.t0 = time.perf_counter()
        self.machine0 = machine_busy_s()
        self.client0 = read_proc(os.getpid(), children=False)
        self.server0 = server()

    def figures(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self.t0
        machine = (machine_busy_s() - self.machine0) / seconds
        client1, server1 = read_proc(os.getpid(), children=False), self.server()
        out: dict[str, Any] = {"machine_cores_busy": machine}
        if self.client0 and client1:
            out["client_cores_busy"] = (client1.cpu_s - self.client0.cpu_s) / seconds
            out["client_loop_thread_waiting_for_cpu_share"] = (client1.main_wait_s - self.client0.main_wait_s) / seconds
        if self.server0 and server1:
            out["server_cores_busy"] = (server1.cpu_s - self.server0.cpu_s) / seconds
        out["other_processes_cores_busy"] = (
            machine - out.get("client_cores_busy", 0.0) - out.get("server_cores_busy", 0.0)
        )
        return out


def machine_info() -> dict[str, Any]:
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": round(mem, 1) if mem else None,
        "loadavg": os.getloadavg(),
        "python": sys.version.split()[0],
    }
