"""HAProxy in front of two s2s-rt processes, as a client sees it.

Each test starts, on loopback, two ``s2s-rt serve --stack fake --pool-size 2``
processes and Debian's ``haproxy`` running ``deploy/haproxy.cfg`` as shipped,
with only its server lines replaced by the ones ``s2s-rt serve --workers``
prints for these two processes. Every process is stopped by its PID when the
test ends, pass or fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import functools
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RealtimeClient, eventually, requires, run
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from s2s_rt.workers import haproxy_server_lines

HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
pytestmark = requires(HAPROXY, "haproxy is not installed (apt-get install -y haproxy)")

REPO = Path(__file__).resolve().parent.parent
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"
SERVERS_BEGIN = "# --- servers:"
SERVERS_END = "# --- end of servers"
POOL_SIZE = 2


# --- processes ---------------------------------------------------------------


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base: int = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, timeout: float = 5.0) -> None:
    """Stop one process we started, by its PID: ``sig``, then SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def http_get(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def healthy(port: int) -> bool:
    return http_get(port, "/healthz")[0] == 200


async def aget(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    return await asyncio.to_thread(http_get, port, path, method, headers)


#: What an operator sends to drain a process (see README: operator endpoints).
DRAIN = {"method": "POST", "headers": {"S2S-Operator": "1"}}


async def sessions_active(port: int) -> int:
    """``s2s_sessions_active`` from a process's ``/metrics``."""
    status, body = await aget(port, "/metrics")
    assert status == 200, f"/metrics on {port}: {status}"
    match = re.search(r"^s2s_sessions_active (\d+)", body, re.M)
    assert match, body
    return int(match.group(1))


async def session_ids(port: int) -> set[str]:
    """Ids of the sessions a process is serving, from ``/v1/pool``."""
    status, body = await aget(port, "/v1/pool")
    assert status == 200
    return {s["session_id"] for s in json.loads(body)["slots"] if s["session_id"]}


@dataclass
class Backend:
    port: int
    proc: subprocess.Popen[bytes]


@dataclass
class Balanced:
    """Two s2s-rt processes behind HAProxy."""

    backends: list[Backend]
    haproxy: subprocess.Popen[bytes]
    port: int
    stats_port: int

    def states(self) -> dict[int, str]:
        """HAProxy's view of each backend (UP, DOWN, …), from its stats CSV, keyed by port."""
        status, body = http_get(self.stats_port, "/;csv")
        if status != 200:
            return {}
        rows = csv.DictReader(io.StringIO(body.lstrip("# ")))
        names = {f"s2s-{i}": b.port for i, b in enumerate(self.backends)}
        return {names[r["svname"]]: r["status"] for r in rows if r["pxname"] == "s2s_rt" and r["svname"] in names}

    async def until_states(self, want: dict[int, str], timeout: float = 5.0) -> None:
        async def check() -> bool:
            states = await asyncio.to_thread(self.states)
            return all(states.get(port) == state for port, state in want.items())

        assert await eventually(check, timeout), f"HAProxy states {self.states()}, wanted {want}"

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[RealtimeClient]:
        """A Realtime client connected through HAProxy, past ``session.created``."""
        async with connect(f"ws://127.0.0.1:{self.port}/v1/realtime", open_timeout=10) as ws:
            client = RealtimeClient(ws)
            await client.until("session.created")
            yield client

    async def backend_of(self, client: RealtimeClient) -> Backend:
        """The process serving ``client``, found by its session id in ``/v1/pool``."""
        session_id = client.of_type("session.created")[0]["session"]["id"]
        for backend in self.backends:
            if session_id in await session_ids(backend.port):
                return backend
        raise AssertionError(f"session {session_id} is on no backend")


def server_block(cfg: str, lines: list[str]) -> str:
    """``cfg`` with the lines between the server markers replaced by ``lines``."""
    begin, end = cfg.index(SERVERS_BEGIN), cfg.index(SERVERS_END)
    begin = cfg.index("\n", begin) + 1
    end = cfg.rindex("\n", 0, end) + 1
    return cfg[:begin] + "\n".join(lines) + "\n" + cfg[end:]


class PortTaken(Exception):
    """Someone else bound a port between our probe and our process."""


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            if "already in use" in text.lower():
                raise PortTaken(text)
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode}:\n{text[-3000:]}")
        assert time.monotonic() < deadline, f"{proc.args!r} not ready after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def start_balanced(log_dir: Path, started: list[subprocess.Popen[bytes]]) -> Balanced:
    """Two s2s-rt processes and HAProxy in front; every process goes into ``started``."""
    base = free_ports(4)  # two s2s-rt processes, then HAProxy's front and its stats page
    backends = []
    for i in range(2):
        argv = [sys.executable, "-m", "s2s_rt", "serve", "--stack", "fake", "--host", "127.0.0.1"]
        argv += ["--port", str(base + i), "--pool-size", str(POOL_SIZE), "--grace-period", "1"]
        proc = spawn(argv, log_dir / f"s2s-{i}.log")
        started.append(proc)
        backends.append(Backend(base + i, proc))
    for i, b in enumerate(backends):
        wait_for(functools.partial(healthy, b.port), b.proc, log_dir / f"s2s-{i}.log")
    cfg = log_dir / "haproxy.cfg"
    cfg.write_text(server_block(HAPROXY_CFG.read_text(), haproxy_server_lines("127.0.0.1", base, 2, POOL_SIZE)))
    lb_port, stats_port = base + 2, base + 3
    env = os.environ | {"S2S_LB_BIND": f"127.0.0.1:{lb_port}", "S2S_LB_STATS": f"127.0.0.1:{stats_port}"}
    assert HAPROXY is not None
    haproxy = spawn([HAPROXY, "-db", "-f", str(cfg)], log_dir / "haproxy.log", env)
    started.insert(0, haproxy)
    setup = Balanced(backends, haproxy, lb_port, stats_port)
    # Both UP: HAProxy's health checks on /readyz passed.
    wait_for(lambda: list(setup.states().values()) == ["UP", "UP"], haproxy, log_dir / "haproxy.log", timeout=10)
    return setup


@pytest.fixture
def balanced(tmp_path: Path) -> Iterator[Balanced]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        for attempt in range(3):
            log_dir = tmp_path / f"attempt-{attempt}"
            log_dir.mkdir()
            try:
                setup = start_balanced(log_dir, started)
                break
            except PortTaken:
                for proc in started:
                    stop(proc)
                started.clear()
        else:
            raise AssertionError("loopback ports kept being taken by someone else")
        yield setup
    finally:
        for proc in started:
            stop(proc)


# --- the shipped configuration --------------------------------------------------


def test_shipped_haproxy_cfg_is_valid() -> None:
    assert HAPROXY is not None
    check = subprocess.run([HAPROXY, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=10)
    assert check.returncode == 0, check.stdout + check.stderr


def test_shipped_haproxy_cfg_has_the_server_block_that_workers_prints() -> None:
    cfg = HAPROXY_CFG.read_text()
    assert cfg.index(SERVERS_BEGIN) < cfg.index(SERVERS_END)
    shipped = cfg[cfg.index(SERVERS_BEGIN) : cfg.index(SERVERS_END)]
    for line in haproxy_server_lines("127.0.0.1", 8000, 2, 4):
        assert line in shipped


# --- behaviour through HAProxy -------------------------------------------------------


def test_four_clients_talk_at_once_two_per_backend_and_a_fifth_is_refused_by_haproxy(balanced: Balanced) -> None:
    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            clients = await asyncio.gather(*(stack.enter_async_context(balanced.client()) for _ in range(4)))
            done = await asyncio.gather(*(c.say_text(f"hello from client {i}") for i, c in enumerate(clients)))
            assert [d["response"]["status"] for d in done] == ["completed"] * 4
            assert [await sessions_active(b.port) for b in balanced.backends] == [2, 2]

            # Both processes are full: /readyz says 503, so HAProxy marks them DOWN
            # and answers a new client itself, at once. (Within the second before
            # the checks notice, the client waits in HAProxy's queue for up to
            # "timeout queue" and then gets the same answer.)
            await balanced.until_states({b.port: "DOWN" for b in balanced.backends})
            with pytest.raises(InvalidStatus) as refused:
                async with balanced.client():
                    pass
            response = refused.value.response
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "2"
            assert json.loads(response.body)["error"]["code"] == "session_limit_reached"

            # The fifth never reached an s2s-rt process, and the four go on talking.
            for b in balanced.backends:
                metrics = (await aget(b.port, "/metrics"))[1]
                assert "s2s_rejections_total{" not in metrics
            assert [await sessions_active(b.port) for b in balanced.backends] == [2, 2]
            again = await asyncio.gather(*(c.say_text("still there?") for c in clients))
            assert [d["response"]["status"] for d in again] == ["completed"] * 4

    run(scenario(), timeout=30)


def test_drained_backend_finishes_its_sessions_while_new_ones_go_to_the_other(balanced: Balanced) -> None:
    async def scenario() -> None:
        drained, other = balanced.backends
        async with balanced.client() as first, balanced.client() as second:
            assert [await sessions_active(b.port) for b in balanced.backends] == [1, 1]
            on_drained = first if await balanced.backend_of(first) is drained else second

            status, body = await aget(drained.port, "/drain", **DRAIN)
            assert status == 200 and "1 sessions still running" in body
            # At once, before HAProxy's next health check: the drained process
            # refuses the handshake with 503 and HAProxy replays it on the other.
            async with balanced.client() as newcomer:
                assert await sessions_active(other.port) == 2
                assert await sessions_active(drained.port) == 1
                assert (await newcomer.say_text("new here"))["response"]["status"] == "completed"
                await balanced.until_states({drained.port: "DOWN"})
                # The drained process's own session goes on to the end.
                assert (await on_drained.say_text("still served"))["response"]["status"] == "completed"
            await on_drained.ws.close()

            async def drained_is_empty() -> bool:
                return await sessions_active(drained.port) == 0

            assert await eventually(drained_is_empty)

            # Later sessions too go to the other process, never to the drained one.
            await balanced.until_states({drained.port: "DOWN", other.port: "UP"})
            async with balanced.client() as later:
                assert (await later.say_text("and me"))["response"]["status"] == "completed"
                assert await sessions_active(drained.port) == 0
                assert await sessions_active(other.port) == 2
            assert (await aget(drained.port, "/readyz"))[0] == 503

    run(scenario(), timeout=30)


def test_sigkill_of_one_backend_ends_only_its_sessions_and_new_ones_go_to_the_survivor(balanced: Balanced) -> None:
    async def scenario() -> None:
        killed, survivor = balanced.backends
        async with balanced.client() as first, balanced.client() as second:
            assert [await sessions_active(b.port) for b in balanced.backends] == [1, 1]
            victim, bystander = (first, second) if await balanced.backend_of(first) is killed else (second, first)

            killed.proc.send_signal(signal.SIGKILL)
            killed.proc.wait(5)
            # The victim's connection ends; the bystander's conversation does not notice.
            with pytest.raises(ConnectionClosed):
                while True:  # events already on their way, then the close
                    await victim.recv(timeout=5)
            assert (await bystander.say_text("are you there?"))["response"]["status"] == "completed"

            # A new session at once (before the health check): connection refused
            # on the dead process, so HAProxy retries on the survivor.
            async with balanced.client() as newcomer:
                assert (await newcomer.say_text("hi"))["response"]["status"] == "completed"
                assert await sessions_active(survivor.port) == 2
            await balanced.until_states({killed.port: "DOWN"})

    run(scenario(), timeout=30)


def test_drain_cannot_be_reached_through_haproxy(balanced: Balanced) -> None:
    # Every request HAProxy forwards comes from loopback, which /drain trusts.
    async def scenario() -> None:
        assert (await aget(balanced.port, "/drain", **DRAIN))[0] == 403
        assert (await aget(balanced.port, "/drain/", **DRAIN))[0] == 403
        for b in balanced.backends:
            assert (await aget(b.port, "/readyz"))[0] == 200

    run(scenario(), timeout=15)
