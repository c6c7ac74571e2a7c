"""The calls' UDP sockets, read together on a clock (:mod:`s2s_rt.server.call_sockets`): what aioice's protocols
are handed, and when; a flood, a failure and a close kept to their own socket."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aioice.ice
import pytest
from conftest import http_get, live_server, run

from s2s_rt.server.call_sockets import MAX_READ, CallSockets, PolledTransport


class Connection:
    """What a ``StunProtocol`` hands its datagrams to (aioice's ``Connection``), as far as these tests need."""

    def __init__(self) -> None:
        self.lost: list[Any] = []

    def protocol_lost(self, protocol: Any) -> None:
        self.lost.append(protocol)


class Recorder(aioice.ice.StunProtocol):
    """aioice's protocol, recording each datagram it is handed and when (or raising, when ``broken``)."""

    def __init__(self, receiver: Any, broken: bool = False) -> None:
        super().__init__(receiver)
        self.got: list[tuple[float, bytes]] = []
        self.broken = broken

    def datagram_received(self, data: bytes | str, addr: tuple[Any, ...]) -> None:
        if self.broken:
            raise RuntimeError("a call's handling that fails")
        self.got.append((time.monotonic(), bytes(data)))  # type: ignore[arg-type]


@asynccontextmanager
async def reading(poll_s: float) -> AsyncIterator[CallSockets]:
    """Call sockets read every ``poll_s``, their task running, as the server runs it."""
    sockets = CallSockets(None, poll_s)
    task = asyncio.create_task(sockets.run())
    await asyncio.sleep(0)
    try:
        yield sockets
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def bound(connection: Any, broken: bool = False) -> tuple[Any, Recorder]:
    """A host socket bound as aioice binds one (``local_addr`` on port 0, its ``StunProtocol``)."""
    loop = asyncio.get_running_loop()
    return await loop.create_datagram_endpoint(lambda: Recorder(connection, broken), local_addr=("127.0.0.1", 0))


async def two_calls(
    sockets: CallSockets, *, first_broken: bool = False, set_up: bool = True
) -> list[tuple[Connection, Any, Recorder]]:
    """Two calls' sockets, bound as aioice binds them, and set up (read on the clock) unless ``set_up`` is not."""
    calls = []
    for broken in (first_broken, False):
        call = Connection()
        transport, protocol = await bound(call, broken)
        if set_up:
            sockets.settle(call)
        calls.append((call, transport, protocol))
    return calls


async def sent_apart(transport: Any, count: int, every_s: float) -> list[float]:
    """``count`` datagrams sent to ``transport``'s socket ``every_s`` apart (each its index); when each went."""
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = []
    for i in range(count):
        sent.append(time.monotonic())
        out.sendto(bytes([i]) * 20, transport.get_extra_info("sockname"))
        await asyncio.sleep(every_s)
    out.close()
    return sent


async def until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.005)


def sender() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def test_a_set_up_calls_datagrams_are_handed_over_in_passes_each_poll_and_before_as_each_comes() -> None:
    async def scenario() -> None:
        async with reading(0.05) as sockets:
            call = Connection()
            transport, protocol = await bound(call)
            assert isinstance(transport, PolledTransport) and sockets.count == 1 and sockets.polled == 0
            # While the call is set up (its ICE checks, its handshakes), each datagram as it comes.
            sent = await sent_apart(transport, 5, 0.01)
            await until(lambda: len(protocol.got) == 5, timeout=2)
            assert all(0 <= t - s < 0.01 for (t, _), s in zip(protocol.got, sent, strict=True)), protocol.got
            # Set up: handed over together, a few passes, each within a poll of the datagram's sending.
            sockets.settle(call)
            assert sockets.polled == 1
            protocol.got.clear()
            sent = await sent_apart(transport, 10, 0.01)  # five to a pass
            await until(lambda: len(protocol.got) == 10, timeout=2)
            assert [data[0] for _, data in protocol.got] == list(range(10))  # each once, in order
            passes = {round(t, 3) for t, _ in protocol.got}
            assert len(passes) <= 4, sorted(passes)
            assert all(0 <= t - s <= 0.05 + 0.04 for (t, _), s in zip(protocol.got, sent, strict=True))
            transport.close()
            assert sockets.count == sockets.polled == 0

    run(scenario())


def test_a_flooding_socket_is_read_a_bounded_share_each_pass_and_the_others_every_pass() -> None:
    async def scenario() -> None:
        async with reading(0.2) as sockets:
            (_, flooded, flood), (_, calm, quiet) = await two_calls(sockets)
            out = sender()
            for i in range(5 * MAX_READ):
                out.sendto(b"f%d" % i, flooded.get_extra_info("sockname"))
            out.sendto(b"calm", calm.get_extra_info("sockname"))
            passes = sockets.passes
            await until(lambda: sockets.passes > passes, timeout=2)
            assert len(flood.got) == MAX_READ and [d for _, d in quiet.got] == [b"calm"]
            await until(lambda: len(flood.got) == 5 * MAX_READ, timeout=3)  # the rest in the next passes
            assert [d for _, d in flood.got] == [b"f%d" % i for i in range(5 * MAX_READ)]
            out.close()
            flooded.close()
            calm.close()

    run(scenario())


@pytest.mark.parametrize("set_up", [True, False], ids=["set-up", "setting-up"])
def test_a_socket_whose_handling_fails_is_closed_alone_and_the_reading_goes_on(set_up: bool) -> None:
    async def scenario() -> None:
        async with reading(0.02) as sockets:
            (failing_call, failing, _), (calm_call, calm, quiet) = await two_calls(
                sockets, first_broken=True, set_up=set_up
            )
            out = sender()
            out.sendto(b"x", failing.get_extra_info("sockname"))
            await until(lambda: failing.is_closing() and failing_call.lost, timeout=2)
            assert sockets.count == 1 and not calm_call.lost  # aioice ends that call's connection: it alone
            for i in range(3):
                out.sendto(b"%d" % i, calm.get_extra_info("sockname"))
            await until(lambda: len(quiet.got) == 3, timeout=2)
            out.close()
            calm.close()
            await until(lambda: sockets.count == 0 and calm_call.lost, timeout=2)
            assert calm.get_extra_info("socket").fileno() == -1  # closed, not only forgotten

    run(scenario())


def test_a_connections_sockets_are_read_at_once_when_asked() -> None:
    async def scenario() -> None:
        async with reading(0.5) as sockets:
            (call, transport, protocol), (_, other, other_protocol) = await two_calls(sockets)
            out = sender()
            out.sendto(b"waiting", transport.get_extra_info("sockname"))
            out.sendto(b"waiting too", other.get_extra_info("sockname"))
            await asyncio.sleep(0.05)  # in the kernel's buffer, the next pass far off
            assert not protocol.got
            sockets.read(call)
            assert [d for _, d in protocol.got] == [b"waiting"] and not other_protocol.got
            out.close()
            transport.close()
            other.close()

    run(scenario())


def test_only_aioices_host_sockets_are_polled_and_the_loop_gets_its_own_method_back() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        own = loop.create_datagram_endpoint
        async with reading(0.5) as sockets:
            assert loop.create_datagram_endpoint is not own
            plain, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
            assert not isinstance(plain, PolledTransport)  # not aioice's: the loop's own transport
            plain.close()
            port = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            port.bind(("127.0.0.1", 0))
            fixed = port.getsockname()[1]
            port.close()
            given, _ = await loop.create_datagram_endpoint(
                lambda: Recorder(Connection()), local_addr=("127.0.0.1", fixed)
            )
            assert not isinstance(given, PolledTransport)  # a port asked for: not a host candidate's
            given.close()
            call = Connection()
            settled, protocol = await bound(call)
            sockets.settle(call)
        # Its task ended: the loop binds as it did, and a socket it read on its clock is read as datagrams come.
        assert loop.create_datagram_endpoint == own
        await sent_apart(settled, 1, 0)
        await until(lambda: len(protocol.got) == 1, timeout=0.3)
        settled.close()
        unpolled, _ = await bound(Connection())
        assert not isinstance(unpolled, PolledTransport)
        unpolled.close()

    run(scenario())


def test_the_sockets_task_crashing_is_restarted_and_reads_the_set_up_calls_on_its_clock_again() -> None:
    """The task is the process's, supervised: a crash is logged and restarted, the calls set up meanwhile are
    read as their datagrams come, and on the clock again once it runs."""

    async def scenario() -> None:
        async with live_server() as server:
            sockets = server.calls.sockets
            select = sockets._selector.select
            crashed: list[float] = []

            def crashing_once(timeout: float | None = None) -> Any:
                if not crashed:
                    crashed.append(time.monotonic())
                    raise OSError("a select that fails once")
                return select(timeout)

            sockets._selector.select = crashing_once  # type: ignore[method-assign]
            call = Connection()
            transport, protocol = await bound(call)
            sockets.settle(call)
            assert sockets.polled == 1
            await sent_apart(transport, 1, 0)
            await until(lambda: bool(crashed) and len(protocol.got) == 1, timeout=5)
            await until(lambda: sockets.polled == 1, timeout=5)  # restarted, it reads it on its clock again
            passes = sockets.passes
            await sent_apart(transport, 1, 0)
            await until(lambda: len(protocol.got) == 2 and sockets.passes > passes, timeout=5)
            metrics = (await http_get(server, "/metrics"))[1]
            assert 's2s_errors_total{code="task_restarted"} 1' in metrics, metrics
            transport.close()

    run(scenario())
