"""Several s2s-rt processes on one host (``s2s-rt serve --workers N``).

The launcher runs in a child process of the test, as the CLI would run it;
it and its workers are stopped by PID when each test ends, pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RealtimeClient, requires, run
from test_haproxy import HAPROXY, HAPROXY_CFG, PortTaken, free_ports, http_get, server_block, stop, wait_for
from websockets.asyncio.client import connect

from s2s_rt.workers import haproxy_server_lines, run_workers, worker_argv, worker_devices

#: What ``s2s-rt serve --workers N`` runs, as a script for ``python -c``.
LAUNCH = (
    "import sys; from s2s_rt.workers import run_workers; "
    "sys.exit(run_workers({n}, {argv!r}, {port}, '127.0.0.1', {devices!r}, pool_size={pool}))"
)


# --- the pieces ------------------------------------------------------------------


def test_each_worker_gets_its_own_port_host_and_device_and_every_other_flag_as_given() -> None:
    given = ["--stack", "fake", "--port", "9000", "--pool-size", "3", "--work=4", "--host", "0.0.0.0", "--device=cuda"]
    argv = worker_argv(given, host="0.0.0.0", port=9002, device="cuda:2")
    assert argv[:4] == [sys.executable, "-m", "s2s_rt", "serve"]
    assert " ".join(argv[4:]) == "--stack fake --pool-size 3 --host 0.0.0.0 --port 9002 --device cuda:2"
    assert "--device" not in worker_argv(["--pool-size", "3"], host="h", port=1, device=None)


def test_device_cuda_means_one_gpu_per_worker_and_a_list_is_used_in_turn() -> None:
    assert worker_devices(None, 3) is None and worker_devices("auto", 3) is None
    assert worker_devices("cuda", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert worker_devices("cuda:0,cuda:1", 4) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert worker_devices("cpu", 2) == ["cpu", "cpu"]


def test_haproxy_lines_give_each_worker_maxconn_equal_to_its_pool_size() -> None:
    assert haproxy_server_lines("0.0.0.0", 8000, 2, 6) == [
        "    server s2s-0 127.0.0.1:8000 maxconn 6",
        "    server s2s-1 127.0.0.1:8001 maxconn 6",
    ]
    assert haproxy_server_lines("::1", 9000, 1, 2) == ["    server s2s-0 [::1]:9000 maxconn 2"]


def test_port_0_is_refused_because_the_balancer_must_know_the_ports(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_workers(2, [], 0, "127.0.0.1", None, pool_size=2) == 2
    assert "--port" in capsys.readouterr().err


# --- a running launcher ---------------------------------------------------------


@dataclass
class Launcher:
    proc: subprocess.Popen[bytes]
    base_port: int
    stdout: Path
    stderr: Path

    def worker_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"worker \d+: pid (\d+)", self.stderr.read_text())]


def start_launcher(log_dir: Path) -> Launcher:
    """``serve --workers 2`` with pools of 2, on two free consecutive ports, until both answer."""
    base = free_ports(2)
    stdout, stderr = log_dir / "stdout", log_dir / "stderr"
    serve = ["--stack", "fake", "--pool-size", "2", "--grace-period", "1"]
    code = LAUNCH.format(n=2, argv=serve, port=base, devices=None, pool=2)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    return Launcher(proc, base, stdout, stderr)


def stop_launcher(setup: Launcher) -> None:
    pids = setup.worker_pids()
    stop(setup.proc)
    for pid in pids:  # the launcher stops them; make sure, by PID
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    for attempt in range(3):
        log_dir = tmp_path / f"attempt-{attempt}"
        log_dir.mkdir()
        setup = start_launcher(log_dir)
        try:
            wait_for(functools.partial(all_healthy, setup), setup.proc, setup.stderr)
            if "already in use" in setup.stderr.read_text().lower():
                raise PortTaken  # one worker lost its port to someone else
        except PortTaken:
            stop_launcher(setup)
            continue
        except BaseException:
            stop_launcher(setup)
            raise
        try:
            yield setup
        finally:
            stop_launcher(setup)
        return
    raise AssertionError("loopback ports kept being taken by someone else")


def all_healthy(setup: Launcher) -> bool:
    if "already in use" in setup.stderr.read_text().lower():
        raise PortTaken
    return all(http_get(setup.base_port + i, "/healthz")[0] == 200 for i in range(2))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it is only waiting for its parent to reap it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


async def talk(port: int) -> str:
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
        client = RealtimeClient(ws)
        await client.until("session.created")
        return str((await client.say_text("hello"))["response"]["status"])


def test_workers_listen_on_consecutive_ports_and_the_printed_lines_describe_them(launcher: Launcher) -> None:
    async def scenario() -> None:
        assert await asyncio.gather(*(talk(launcher.base_port + i) for i in range(2))) == ["completed"] * 2

    run(scenario(), timeout=20)
    lines = launcher.stdout.read_text().splitlines()
    assert lines[1:] == haproxy_server_lines("127.0.0.1", launcher.base_port, 2, 2)
    assert len(launcher.worker_pids()) == 2


def test_sigusr1_drains_every_worker_and_sigterm_stops_them_all_cleanly(launcher: Launcher) -> None:
    launcher.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while any(http_get(launcher.base_port + i, "/readyz")[0] != 503 for i in range(2)):
        assert time.monotonic() < deadline, "workers did not drain"
        time.sleep(0.05)
    assert all(http_get(launcher.base_port + i, "/healthz")[0] == 200 for i in range(2))

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(10) == 0
    assert not any(alive(pid) for pid in launcher.worker_pids())


def test_a_killed_worker_leaves_the_others_serving_and_sets_the_exit_status(launcher: Launcher) -> None:
    first, second = launcher.worker_pids()
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while "exited with 137" not in launcher.stderr.read_text():
        assert time.monotonic() < deadline, launcher.stderr.read_text()
        time.sleep(0.05)
    assert launcher.proc.poll() is None
    assert run(talk(launcher.base_port + 1), timeout=10) == "completed"

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(10) == 128 + signal.SIGKILL
    assert not alive(second)


def test_workers_die_with_a_killed_launcher(launcher: Launcher) -> None:
    pids = launcher.worker_pids()
    launcher.proc.kill()
    launcher.proc.wait(5)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived their launcher"
        time.sleep(0.05)


@requires(HAPROXY, "haproxy is not installed (apt-get install -y haproxy)")
def test_printed_lines_make_a_valid_haproxy_cfg(launcher: Launcher, tmp_path: Path) -> None:
    printed = [line for line in launcher.stdout.read_text().splitlines() if line.startswith("    server ")]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(server_block(HAPROXY_CFG.read_text(), printed))
    assert HAPROXY is not None
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=10)
    assert check.returncode == 0, check.stdout + check.stderr


def test_workers_auto_is_one_process_per_core() -> None:
    from s2s_rt.cli import worker_count

    assert worker_count("auto") == len(os.sched_getaffinity(0))
    assert worker_count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        worker_count("0")
