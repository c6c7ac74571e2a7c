"""What the server uses of websockets, aiortc and aioice beyond their public API, and a check for each.

None of the three offers a public way to do these things (their newest
releases, websockets 17.4, aiortc 1.16.0 and aioice 0.13.0, were read), so
the server reaches into them. Each reach is listed here with the versions
whose source it was read in; its user checks it where it is first used and
says, naming the installed version, when it is gone; and
``tests/test_third_party_internals.py`` pins each on the installed versions.

websockets (``pyproject.toml``: >=17.0,<18; read in 17.0 and 17.4), used by
:mod:`~s2s_rt.server.direct`:

- ``Connection.process_event(event)``, a private method that
  ``data_received`` calls once per parsed frame: overridden to offer each
  complete text frame to the direct route first.
- ``recv_messages``, the ``Assembler`` that ``connection_made`` makes: its
  ``frames.queue`` (a deque of the frames ``recv()`` has not taken yet: a
  frame overtakes none of them), ``paused`` (True while that queue is above
  its high-water mark) and ``resume`` (what it calls once the queue drains,
  ``transport.resume_reading``; replaced so that the bytes held back are
  parsed first).

aiortc (``pyproject.toml``: >=1.14; read in 1.14.0 and 1.16.0), used by
:mod:`~s2s_rt.server.webrtc`:

- ``RTCRtpReceiver.__jitter_buffer`` (name-mangled), made in ``__init__``
  with a 4-packet prefetch and read by ``_handle_rtp_packet`` (only its
  ``add``, given each packet with its payload depayloaded in ``_data``):
  replaced with one that releases each packet as it comes
  (:func:`~s2s_rt.server.webrtc_audio.release_at_once`).
- ``RTCRtpReceiver.__decoder_queue`` (name-mangled), a ``queue.Queue`` made
  in ``__init__``: ``_handle_rtp_packet`` puts each ``(codec, encoded
  frame)`` on it, ``receive`` hands it to the decoder thread it starts (which
  calls ``get()`` until it takes ``None``), and stopping puts ``None``.
  Replaced before ``receive`` with an object whose ``put`` decodes on the
  loop (:class:`~s2s_rt.server.webrtc_audio.Hearing`).
- ``RTCRtpReceiver.__codecs``, ``__remote_streams`` and
  ``__timestamp_mapper`` (name-mangled), and ``RTCDtlsTransport._rx_srtp``:
  what ``_recv_next`` and ``_handle_rtp_packet`` read for each RTP packet.
  A call's audio packets are taken before aiortc's path and handled with
  them (:class:`~s2s_rt.server.webrtc_rtp.AudioPackets`;
  :func:`audio_packets_missing`).
- ``RTCSctpTransport._remote_max_message_size`` (1.16.0; 1.14.0 has none):
  an event too large is refused by name before aiortc's ``ValueError``,
  which is caught as well
  (:func:`~s2s_rt.server.webrtc.max_message_size`).

aioice (aiortc's dependency: >=0.12,<1 for aiortc 1.16.0, >=0.10.1 for
1.14.0; read in 0.10.1, 0.12.0 and 0.13.0), used by
:mod:`~s2s_rt.server.webrtc`:

- the module constants ``aioice.ice.CONSENT_INTERVAL`` and
  ``CONSENT_FAILURES``, read by ``Connection.query_consent`` each time it
  waits and counts: set process-wide
  (:func:`~s2s_rt.server.webrtc.check_consent_often`).
- ``Connection.data_received(data, component)``, which its protocols call
  with each datagram that is not STUN, and which puts it on the queue the
  DTLS transport reads: wrapped per call to drop the media datagrams (SRTP
  and SRTCP, first byte 128-191) past the call's budget before anything
  parses them (:func:`guard_media`). aiortc takes media as fast as it comes.
- ``RTCIceGatherer._connection`` (aiortc), the ``Connection`` a call's ICE
  transport reads.
- ``Connection.get_component_candidates`` binds each host candidate with
  ``asyncio.get_running_loop().create_datagram_endpoint(..., local_addr=(address, 0))``:
  the loop's method is wrapped to bind within ``media_ports``, and to make
  the socket of each (for its ``StunProtocol``, with a transport of the
  server's that is read on a clock: ``media_poll_ms``)
  (:class:`~s2s_rt.server.call_sockets.CallSockets`). aioice's pull
  requests #63 and #112 would add a port range; neither is released.
  ``StunProtocol.receiver``, the ``Connection`` a protocol hands its
  datagrams to, says which call's sockets to read at once.

aiosipua (``pyproject.toml``: >=0.7.1,<0.8; read in 0.7.1), used by
:mod:`~s2s_rt.server.sip`:

- ``SipUAS._calls``, where it keeps each INVITE's call until a BYE or a
  timer drops it: a call refused, unanswered or ended is dropped there
  (:func:`sip_calls`), or a flood of INVITEs would stay in it.
- ``_UdpProtocol``, whose ``connection_made`` asserts a
  ``DatagramTransport`` that Python 3.11's selector loop does not give (an
  ``AssertionError`` logged per start, the transport set anyway): subclassed
  without the check (:class:`SipUdp`).

aiortp (``pyproject.toml``: >=0.8,<0.9; read in 0.8.0), under aiosipua's
``CallSession``:

- ``RTPSession._rtp_transport._on_rtp`` and ``._rtcp_transport._on_rtcp``,
  the callbacks its UDP protocols hand each datagram with its source: wrapped
  to drop what comes from an address other than the caller's
  (:func:`guard_rtp`). The library takes RTP from anyone (each new SSRC
  resets its jitter buffer), and has no filter of its own.
- ``RTPSession.close`` sends its RTCP BYE before it closes its two UDP
  transports: when that send raises, the sockets stay open, so they are
  closed here (:func:`close_rtp_sockets`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib.metadata
import logging
import queue
from collections.abc import Callable
from typing import Any

import aioice.ice
from aiortc import RTCDtlsTransport, RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer
from aiosipua import SipUAS
from aiosipua.transport import UdpSipTransport, _UdpProtocol
from websockets.asyncio.connection import Connection
from websockets.asyncio.messages import Assembler

log = logging.getLogger(__name__)

#: The receiver's jitter buffer, as ``RTCRtpReceiver`` names its private attribute.
JITTER_BUFFER = "_RTCRtpReceiver__jitter_buffer"
#: A packet's payload as the receiver depayloads it before the jitter buffer takes the packet.
DEPAYLOADED = "_data"
#: The queue the receiver puts each encoded frame on for its decoder thread, and that thread.
DECODER_QUEUE = "_RTCRtpReceiver__decoder_queue"
DECODER_THREAD = "_RTCRtpReceiver__decoder_thread"
#: What :class:`~s2s_rt.server.webrtc_rtp.AudioPackets` reads of a receiver and its DTLS transport: the
#: codec of each payload type, the RTCP statistics of each source, the RTP time mapping, the SRTP session.
RECEIVER_CODECS = "_RTCRtpReceiver__codecs"
RECEIVER_STREAMS = "_RTCRtpReceiver__remote_streams"
TIMESTAMP_MAPPER = "_RTCRtpReceiver__timestamp_mapper"
RX_SRTP = "_rx_srtp"
#: Whether a receiver takes packets at all (``RTCRtpReceiver._enabled``).
RECEIVER_ENABLED = "_enabled"
#: The aioice ``Connection`` an ``RTCIceGatherer`` keeps (the ICE transport's own connection).
ICE_CONNECTION = "_connection"
#: The versions whose source was read, by package (what a failed check's message names).
CHECKED = {
    "websockets": "17.0 and 17.4",
    "aiortc": "1.14.0 and 1.16.0",
    "aioice": "0.10.1, 0.12.0 and 0.13.0",
    "aiosipua": "0.7.1",
    "aiortp": "0.8.0",
}
#: Where ``SipUAS`` keeps its calls, by SIP Call-ID.
SIP_CALLS = "_calls"


def version(package: str) -> str:
    """The installed version of ``package``."""
    return importlib.metadata.version(package)


def gone(package: str, what: str) -> str:
    """A message saying that the installed ``package`` lacks ``what``."""
    return f"{package} {version(package)}: {what} (this server's use of it was checked with {CHECKED[package]})"


def names(function: object, name: str) -> bool:
    """Whether ``function``'s own code names ``name`` (a global or attribute it reads, a method it calls)."""
    code = getattr(function, "__code__", None)
    return code is not None and name in code.co_names


def websockets_missing() -> list[str]:
    """What :mod:`~s2s_rt.server.direct` needs of websockets and the installed one lacks; run in an event loop."""
    missing = []
    if not names(getattr(Connection, "data_received", None), "process_event"):
        missing.append("Connection.data_received does not call process_event")
    if not names(getattr(Connection, "connection_made", None), "recv_messages"):
        missing.append("Connection.connection_made does not make recv_messages")
    assembler: Any = None
    try:
        assembler = Assembler(pause=lambda: None, resume=lambda: None)
    except TypeError as exc:
        missing.append(f"Assembler(pause=..., resume=...) fails ({exc})")
    if not isinstance(getattr(getattr(assembler, "frames", None), "queue", None), collections.deque):
        missing.append("Assembler.frames.queue is not a deque")
    if not isinstance(getattr(assembler, "paused", None), bool):
        missing.append("Assembler.paused is not a bool")
    if not names(getattr(Assembler, "maybe_resume", None), "resume"):
        missing.append("Assembler.maybe_resume does not call resume")
    return missing


def require_websockets() -> None:
    """Raise unless the installed websockets has what :mod:`~s2s_rt.server.direct` needs; run in an event loop.

    Raises:
        RuntimeError: naming the installed version and what it lacks (without this check such a version
            fails later, frame by frame, or silently stops pacing a flood).
    """
    missing = websockets_missing()
    if missing:
        raise RuntimeError(gone("websockets", "; ".join(missing)) + ": install one that pyproject.toml allows")


def consent_missing() -> str | None:
    """What :func:`~s2s_rt.server.webrtc.check_consent_often` needs of aioice and it lacks; None: nothing."""
    for name in ("CONSENT_INTERVAL", "CONSENT_FAILURES"):
        if not isinstance(getattr(aioice.ice, name, None), (int, float)):
            return f"aioice.ice.{name} is not a number"
        if not names(getattr(aioice.ice.Connection, "query_consent", None), name):
            return f"aioice.ice.Connection.query_consent does not read {name}"
    return None


def consent_adjustable() -> bool:
    """Whether aioice's consent timing can be set; when not, an error in the log says why (at the server's start)."""
    missing = consent_missing()
    if missing:
        log.error("%s; a vanished peer is noticed only as late as aioice's own timing allows", gone("aioice", missing))
    return missing is None


def jitter_buffer_missing(receiver: Any) -> str | None:
    """Why ``receiver``'s jitter buffer cannot be replaced on the installed aiortc; None: it can."""
    for name in (JITTER_BUFFER, DEPAYLOADED):
        if not names(getattr(RTCRtpReceiver, "_handle_rtp_packet", None), name):
            return f"RTCRtpReceiver._handle_rtp_packet does not name {name}"
    if not isinstance(getattr(receiver, JITTER_BUFFER, None), JitterBuffer):
        return f"the receiver's {JITTER_BUFFER} is not a JitterBuffer"
    return None


def jitter_buffer_replaceable(receiver: Any) -> bool:
    """Whether ``receiver``'s jitter buffer can be replaced; when not, an error in the log says why, once."""
    return _aiortc_allows(
        jitter_buffer_missing(receiver),
        "calls keep its 4-packet jitter buffer (each turn's end heard 80 ms later, and 280 ms after a packet lost)",
    )


def audio_packets_missing(receiver: Any) -> str | None:
    """Why a call's audio packets cannot be taken before aiortc's path on the installed aiortc; None: they can."""
    handler = getattr(RTCRtpReceiver, "_handle_rtp_packet", None)
    for name in (RECEIVER_CODECS, RECEIVER_STREAMS, TIMESTAMP_MAPPER, JITTER_BUFFER, DECODER_QUEUE, RECEIVER_ENABLED):
        if not names(handler, name):
            return f"RTCRtpReceiver._handle_rtp_packet does not name {name}"
    if not names(getattr(RTCDtlsTransport, "_recv_next", None), RX_SRTP):
        return f"RTCDtlsTransport._recv_next does not name {RX_SRTP}"
    if not isinstance(getattr(receiver, RECEIVER_CODECS, None), dict) or not isinstance(
        getattr(receiver, RECEIVER_STREAMS, None), dict
    ):
        return f"the receiver's {RECEIVER_CODECS} or {RECEIVER_STREAMS} is not a dict"
    if not callable(getattr(getattr(receiver, TIMESTAMP_MAPPER, None), "map", None)):
        return f"the receiver's {TIMESTAMP_MAPPER} has no map"
    if not isinstance(receiver.transport, RTCDtlsTransport) or not hasattr(receiver.transport, RX_SRTP):
        return f"the receiver's transport has no {RX_SRTP}"
    return None


def audio_packets_allowed(receiver: Any) -> bool:
    """Whether a call's audio packets may be taken before aiortc's path; when not, an error in the log says why,
    once."""
    return _aiortc_allows(
        audio_packets_missing(receiver), "calls' audio packets take aiortc's path (more CPU per call)"
    )


def _aiortc_allows(missing: str | None, otherwise: str) -> bool:
    """True where nothing is ``missing``; else an error in the log (once per reason) says what happens instead."""
    if missing:
        _said_once(missing, otherwise)
    return missing is None


@functools.cache
def _said_once(why: str, otherwise: str, package: str = "aiortc") -> None:
    log.error("%s; %s", gone(package, why), otherwise)


def binds_missing() -> str | None:
    """Why wrapping the loop's ``create_datagram_endpoint`` would not place aioice's host sockets; None: it would."""
    gather = getattr(aioice.ice.Connection, "get_component_candidates", None)
    if not (names(gather, "get_running_loop") and names(gather, "create_datagram_endpoint")):
        return "Connection.get_component_candidates does not bind with the running loop's create_datagram_endpoint"
    return None


def require_binds() -> None:
    """Raise unless wrapping the loop's ``create_datagram_endpoint`` places aioice's host sockets.

    Raises:
        RuntimeError: naming the installed aioice (every call then fails, rather than binding ports a
            firewall drops).
    """
    missing = binds_missing()
    if missing:
        raise RuntimeError(gone("aioice", f"{missing}, so media_ports cannot be kept"))


def require_ports_in_range(sdp: str) -> None:
    """Raise (and log an error) if a host candidate of ``sdp``, an answer, lies outside the loop's media range.

    Raises:
        RuntimeError: naming the installed aioice and the ports.
    """
    outside = host_ports_outside(sdp)
    if outside:
        why = gone("aioice", f"a call's media bound outside media_ports, on {outside}")
        log.error("%s", why)
        raise RuntimeError(why)


def host_ports_outside(sdp: str) -> list[int]:
    """The ports of ``sdp``'s host candidates outside the range the running loop binds in; [] when none is set."""
    ports = getattr(asyncio.get_running_loop().create_datagram_endpoint, "media_ports", None)
    if ports is None:
        return []
    outside = set()
    for line in sdp.splitlines():
        # a=candidate:FOUNDATION COMPONENT TRANSPORT PRIORITY ADDRESS PORT typ TYPE ...
        fields = line.split()
        if line.startswith("a=candidate:") and fields[6:8] == ["typ", "host"] and int(fields[5]) not in ports:
            outside.add(int(fields[5]))
    return sorted(outside)


def sip_calls(agent: SipUAS) -> dict[str, Any]:
    """The calls the SIP library keeps, by Call-ID: drop those refused, unanswered or ended, and those it
    kept of an INVITE it never handed over (its ``100 Trying`` failed: a TCP caller already gone)."""
    calls = getattr(agent, SIP_CALLS, None)
    if not isinstance(calls, dict):
        raise RuntimeError(gone("aiosipua", f"SipUAS has no {SIP_CALLS} dict"))
    return calls


class _Datagrams(_UdpProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        setattr(getattr(self, "_owner"), "_udp_transport", transport)  # noqa: B009, B010


class SipUdp(UdpSipTransport):
    """aiosipua's UDP transport, started without its protocol's check that fails on Python 3.11."""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(self), local_addr=self.local_addr)
        setattr(self, "_udp_transport", transport)  # noqa: B010
        self.local_addr = transport.get_extra_info("sockname")[:2]  # the port bound, when 0 was asked


def guard_rtp(rtp_session: Any, allowed: Any) -> None:
    """Hand ``rtp_session`` (aiortp's ``RTPSession``) only the RTP and RTCP datagrams whose source address
    ``allowed(addr)`` takes; the others are dropped before the library parses them."""
    for name, hook in (("_rtp_transport", "_on_rtp"), ("_rtcp_transport", "_on_rtcp")):
        transport = getattr(rtp_session, name, None)
        inner = getattr(transport, hook, None)
        if not callable(inner):
            raise RuntimeError(gone("aiortp", f"RTPSession has no {name}.{hook}"))

        def guarded(data: bytes, addr: Any, inner: Any = inner) -> None:
            if allowed(addr):
                inner(data, addr)

        setattr(transport, hook, guarded)


def media_guard_missing(ice_transport: Any) -> str | None:
    """Why :func:`guard_media` cannot wrap ``ice_transport``'s connection on the installed aioice; None: it can."""
    connection = getattr(getattr(ice_transport, "iceGatherer", None), ICE_CONNECTION, None)
    if not isinstance(connection, aioice.ice.Connection):
        return "RTCIceGatherer._connection is not an aioice Connection"
    if not names(aioice.ice.StunProtocol.datagram_received, "data_received"):
        return "aioice.ice.StunProtocol.datagram_received does not call data_received"
    return None


def guard_media(ice_transport: Any, allowed: Callable[[], bool], take: Callable[[bytes], bool] | None = None) -> bool:
    """Hand ``ice_transport``'s connection (an ``RTCIceTransport``'s) only the media datagrams that ``allowed()``
    takes and ``take`` (if any) does not take itself, and every other datagram; False, and an error in the log
    once, where aioice lacks what this wraps."""
    missing = media_guard_missing(ice_transport)
    if missing:
        _said_once(missing, "a call's media is taken as fast as its caller sends it", "aioice")
        return False
    connection = ice_connection(ice_transport)
    inner = connection.data_received

    def guarded(data: bytes, component: int) -> None:
        if data and 127 < data[0] < 192 and (not allowed() or (take is not None and take(data))):
            return
        inner(data, component)

    connection.data_received = guarded
    return True


def ice_connection(ice_transport: Any) -> Any:
    """The aioice ``Connection`` of ``ice_transport`` (an ``RTCIceTransport``; its gatherer's)."""
    return getattr(ice_transport.iceGatherer, ICE_CONNECTION)


def close_rtp_sockets(rtp_session: Any) -> None:
    """Close ``rtp_session``'s RTP and RTCP sockets (aiortp's ``close`` left them open when its BYE failed)."""
    for name in ("_rtp_transport", "_rtcp_transport"):
        transport = getattr(rtp_session, name, None)
        if transport is not None:
            transport.close()


def decoder_queue_missing(receiver: Any) -> str | None:
    """Why ``receiver``'s decoder queue cannot be replaced on the installed aiortc; None: it can."""
    for method in ("_handle_rtp_packet", "receive"):
        if not names(getattr(RTCRtpReceiver, method, None), DECODER_QUEUE):
            return f"RTCRtpReceiver.{method} does not read {DECODER_QUEUE}"
    if not isinstance(getattr(receiver, DECODER_QUEUE, None), queue.Queue):
        return f"the receiver's {DECODER_QUEUE} is not a queue.Queue"
    if getattr(receiver, DECODER_THREAD, True) is not None:
        return f"the receiver's {DECODER_THREAD} has started"
    return None


def decoder_queue_replaceable(receiver: Any) -> bool:
    """Whether ``receiver``'s decoder queue can be replaced; when not, an error in the log says why, once."""
    return _aiortc_allows(
        decoder_queue_missing(receiver), "calls' audio is decoded on aiortc's thread (more CPU per call)"
    )
