"""The WebRTC calls' UDP sockets: where they are bound (``media_ports``) and when they are read (``media_poll_ms``).

aiortc's ICE (aioice) binds one UDP socket per host address for each call,
with the running loop's ``create_datagram_endpoint``, and offers no say in
either the port or the reading. The loop's method is wrapped
(:meth:`CallSockets.install`), and it is where both are decided:

- **Where:** a firewall or a Kubernetes Service that forwards a fixed range
  needs the calls' ports within one. Any socket asked for on port 0 takes a
  port of ``media_ports`` from a random start, and ``OSError`` when all are
  taken (that call then fails; the others go on).
- **When read:** a caller that sends its silence (no Opus DTX) sends a
  packet every 20 ms, and uvloop's transport wakes the loop for each: the
  kernel's switch to the loop, uvloop's pass and aioice's callback, with the
  interpreter's caches cold each time, cost more than what is done with the
  packet. aioice's sockets are made here instead (:class:`PolledTransport`).
  While its call is set up (ICE's checks, DTLS's handshake, the events
  channel's opening: round trips a delay would lengthen), a socket is read
  as each datagram comes; once set up (:meth:`CallSockets.settle`), every
  ``media_poll_ms`` with every other call's (:meth:`CallSockets.run`): one
  wake-up and one ``select`` for all of them, and each call's packets heard
  in a run. At 40 such calls on the fake stack the event loop took
  0.142-0.156 of a core read so each 10 or 20 ms, against 0.191-0.219 read
  as each came (BENCHMARKS.md). A caller's packet, or an event on its
  channel, waits at most that long (the listening clock's 10 ms tick
  batches what is heard besides). Before a caller's silence is heard for a
  gap in its packets, its sockets are read at once
  (:meth:`CallSockets.read`), so that a packet waiting there is not taken
  for a gap.

Each socket's datagrams are its call's: one whose handling raises is
closed, and aioice ends that call's connection (the call ends alone); a
socket is read at most :data:`MAX_READ` datagrams a pass, so a flooding peer
takes no more of a pass than that, its surplus waiting in (or dropped by)
the kernel's buffer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import selectors
import socket
from collections.abc import Callable, Iterable
from typing import Any, cast

from aioice.ice import StunProtocol

from s2s_rt.server import internals

log = logging.getLogger(__name__)

#: Most datagrams read from one socket in one pass (a caller sends one each 20 ms).
MAX_READ = 32
#: The largest datagram read (an Ethernet frame's payload, and more).
MAX_DATAGRAM = 2048


class PolledTransport(asyncio.DatagramTransport):
    """An aioice socket's transport: read by :class:`CallSockets` as each datagram comes while its call is set
    up, then on the process's clock (:attr:`polled`)."""

    def __init__(self, sock: socket.socket, protocol: StunProtocol, owner: CallSockets) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self._sock = sock
        self._protocol = protocol
        #: The aioice ``Connection`` (its call's) that the protocol hands each datagram to.
        self.connection = protocol.receiver
        self._owner = owner
        self._closing = False
        self._address = sock.getsockname()
        #: Its call is set up (:meth:`CallSockets.settle`), and it is read on the process's clock now (not as
        #: each datagram comes: while the call is set up, and while the clock's task is not running).
        self.settled = False
        self.polled = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"socket": self._sock, "sockname": self._address}.get(name, default)

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closing:
            return
        try:
            self._sock.sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            pass  # the kernel's buffer is full: dropped, as UDP may
        except OSError as exc:
            self._protocol.error_received(exc)

    def read(self, limit: int = MAX_READ) -> int:
        """Hand the protocol up to ``limit`` datagrams waiting on the socket; how many there were."""
        receive, protocol = self._sock.recvfrom, self._protocol
        for n in range(limit):
            if self._closing:
                return n
            try:
                data, address = receive(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return n
            except OSError as exc:
                protocol.error_received(exc)
                return n
            protocol.datagram_received(data, address)
        return limit

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._owner.forget(self)
        self._sock.close()
        if not self.loop.is_closed():
            self.loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()


class CallSockets:
    """Every WebRTC call's UDP sockets in this process: bound within ``ports`` (None: any port), and read every
    ``poll_s`` seconds (0: each datagram as it comes, by the loop's own transport)."""

    def __init__(self, ports: range | None, poll_s: float) -> None:
        self.ports = ports
        self.poll_s = poll_s
        self._selector = selectors.DefaultSelector()
        #: Each aioice connection's sockets, for reading them at once (:meth:`read`).
        self._of: dict[Any, list[PolledTransport]] = {}
        self._some = asyncio.Event()
        #: Whether its task reads the settled sockets (:meth:`run`); else every socket is read as datagrams come.
        self._running = False
        self.passes = 0

    @property
    def count(self) -> int:
        """Sockets open (read as datagrams come, or on the clock)."""
        return sum(len(transports) for transports in self._of.values())

    @property
    def polled(self) -> int:
        """Sockets read on the clock now."""
        return len(self._selector.get_map())

    def install(self) -> None:
        """Make the running loop's ``create_datagram_endpoint`` bind and read aioice's sockets as this says
        (again, for another :class:`CallSockets`; not at all where neither a range nor a clock is set).

        Raises:
            RuntimeError: naming the installed aioice, where it binds otherwise (every call then fails,
                rather than binding ports a firewall drops).
        """
        loop = asyncio.get_running_loop()
        installed = loop.create_datagram_endpoint
        if getattr(installed, "owner", None) is self or (self.ports is None and self.poll_s <= 0):
            return
        internals.require_binds()
        original = getattr(installed, "original", installed)

        async def create(factory: Callable[[], asyncio.BaseProtocol], local_addr: Any = None, **kw: Any) -> Any:
            if local_addr is None or local_addr[1] != 0:
                return await original(factory, local_addr=local_addr, **kw)
            protocol = factory()
            polled = self.poll_s > 0 and not kw and isinstance(protocol, StunProtocol)
            ports = self.ports if self.ports is not None else range(0, 1)
            start = random.randrange(len(ports))
            for i in range(len(ports)):
                address = (local_addr[0], ports[(start + i) % len(ports)], *local_addr[2:])
                try:
                    if polled:
                        return self._bind(cast(StunProtocol, protocol), address)
                    return await original(lambda: protocol, local_addr=address, **kw)
                except OSError:
                    if self.ports is None:
                        raise
            raise OSError(f"no free UDP port for media in {ports.start}-{ports.stop - 1}")

        create.media_ports = self.ports  # type: ignore[attr-defined]  # what each call's answer is checked against
        create.owner = self  # type: ignore[attr-defined]
        create.original = original  # type: ignore[attr-defined]
        loop.create_datagram_endpoint = create  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        """Give the running loop its own ``create_datagram_endpoint`` back, if this installed the one it has."""
        loop = asyncio.get_running_loop()
        installed = loop.create_datagram_endpoint
        if getattr(installed, "owner", None) is self:
            loop.create_datagram_endpoint = installed.original  # type: ignore[attr-defined,method-assign]

    def _bind(self, protocol: StunProtocol, address: tuple[Any, ...]) -> tuple[PolledTransport, StunProtocol]:
        family, kind, proto, _, where = socket.getaddrinfo(
            address[0], address[1], type=socket.SOCK_DGRAM, proto=socket.IPPROTO_UDP
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.bind(where)
        except OSError:
            sock.close()
            raise
        transport = PolledTransport(sock, protocol, self)
        self._of.setdefault(transport.connection, []).append(transport)
        protocol.connection_made(transport)
        transport.loop.add_reader(sock, self._read, transport)  # as each comes, until settled
        return transport, protocol

    def settle(self, connection: Any) -> None:
        """``connection``'s call is set up: its sockets are read on the clock from now on (while this runs)."""
        transports = self._of.get(connection, ())
        for transport in transports:
            transport.settled = True
        self._poll_settled(transports)

    def _poll_settled(self, transports: Iterable[PolledTransport]) -> None:
        """Read ``transports`` that are settled on the clock from now on (if this runs)."""
        if not self._running:
            return  # read as their datagrams come until the task (re)starts
        for transport in transports:
            if transport.settled and not transport.polled and not transport.is_closing():
                sock = transport.get_extra_info("socket")
                transport.loop.remove_reader(sock)
                self._selector.register(sock, selectors.EVENT_READ, transport)
                transport.polled = True
        if self._selector.get_map():
            self._some.set()

    def forget(self, transport: PolledTransport) -> None:
        """``transport`` is closing: it is read no more."""
        sock = transport.get_extra_info("socket")
        if transport.polled:
            self._selector.unregister(sock)
        elif not transport.loop.is_closed():
            transport.loop.remove_reader(sock)
        transports = self._of.get(transport.connection, [])
        if transport in transports:
            transports.remove(transport)
            if not transports:
                del self._of[transport.connection]
        if not self._selector.get_map():
            self._some.clear()

    def read(self, connection: Any) -> None:
        """Read what waits on the sockets of ``connection`` (an aioice ``Connection``) now."""
        for transport in list(self._of.get(connection, ())):
            self._read(transport)

    def _read(self, transport: PolledTransport) -> None:
        try:
            transport.read()
        except Exception:
            # This socket's call fails alone: aioice ends its connection once the socket is lost.
            log.exception("a call's media socket failed while its datagrams were handled; closing it")
            transport.close()

    async def run(self) -> None:
        """Bind and read the calls' sockets for as long as this runs (the process's task, supervised): every
        ``poll_s``, each socket that has datagrams waiting is read."""
        self.install()
        try:
            if self.poll_s <= 0:
                await asyncio.Event().wait()  # the loop's own transports read each datagram as it comes
            self._running = True
            # Those set up before it started, or while it was being restarted.
            self._poll_settled([t for transports in self._of.values() for t in transports])
            while True:
                await self._some.wait()
                await asyncio.sleep(self.poll_s)
                self.passes += 1
                for key, _ in self._selector.select(0):
                    self._read(key.data)
        finally:
            self._running = False
            self.uninstall()
            for key in list(self._selector.get_map().values()):  # read as they come again
                transport = key.data
                self._selector.unregister(key.fileobj)
                transport.polled = False
                transport.loop.add_reader(key.fileobj, self._read, transport)
