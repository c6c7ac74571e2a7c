"""A call's audio packets, from the datagram to the hearing, without aiortc's path for each.

aiortc hands every datagram of a call to its DTLS transport's task (a queue
and a wake-up for each), which decrypts it, parses it into an ``RtpPacket``
(header extensions and all), routes it, and awaits its receiver's handler:
its statistics, its list of active sources (a ``datetime`` a packet), the
codec of its payload type, depayloading, the jitter buffer and the decoder
queue. A caller sends 50 such packets a second, silent or not.
:class:`AudioPackets` takes the call's audio RTP as the ICE connection is
handed it (:func:`~s2s_rt.server.internals.guard_media`) and does what the
server uses of that on the spot: SRTP, the header, the receiver's RTCP
statistics (its receiver reports go on saying what was heard), its jitter
buffer (:class:`~s2s_rt.server.webrtc_audio.InOrder`) and timestamp
mapping, and the hearing (:class:`~s2s_rt.server.webrtc_audio.Hearing`).
The DTLS transport's packet counts and the receiver's active sources
(``getStats``, ``getSynchronizationSources``), which the server never reads,
are not kept. Everything else goes aiortc's way: RTCP, DTLS, a packet
before SRTP is keyed, a payload type the receiver does not know, RTX. At 40
calls from callers sending silence the event loop took 0.195-0.207 of a
core against 0.221-0.232 (BENCHMARKS.md).
"""

from __future__ import annotations

import struct
from typing import Any

import pylibsrtp
from aiortc.rtcrtpreceiver import StreamStatistics

from s2s_rt.server import internals

_HEADER = struct.Struct("!HII")  # sequence number, timestamp, SSRC, after the first two bytes


class AudioPackets:
    """Takes a call's audio RTP datagrams for ``receiver`` (an aiortc receiver whose jitter buffer and decoder
    queue are the server's: :func:`~s2s_rt.server.internals.audio_packets_missing` says whether it may)."""

    __slots__ = ("_codecs", "_dtls", "_jitter", "_mapper", "_packet", "_queue", "_receiver", "_streams", "ice")

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver
        self._dtls = receiver.transport
        #: The ICE transport whose datagrams this takes (the DTLS transport's).
        self.ice = receiver.transport.transport
        self._codecs: dict[int, Any] = getattr(receiver, internals.RECEIVER_CODECS)
        self._streams: dict[int, StreamStatistics] = getattr(receiver, internals.RECEIVER_STREAMS)
        self._mapper = getattr(receiver, internals.TIMESTAMP_MAPPER)
        self._jitter = getattr(receiver, internals.JITTER_BUFFER)
        self._queue = getattr(receiver, internals.DECODER_QUEUE)
        #: What the statistics and the jitter buffer read of a packet, reused (neither keeps it).
        self._packet = _Packet()

    def __call__(self, data: bytes) -> bool:
        """Take ``data`` (an SRTP or SRTCP datagram) if it is the call's audio: True when taken (heard, or
        dropped as aiortc would drop it), False to leave it to aiortc."""
        dtls = self._dtls
        srtp = getattr(dtls, internals.RX_SRTP) if dtls is not None else None
        if srtp is None or len(data) < 12 or 192 <= data[1] <= 208:  # not keyed yet, or RTCP
            return False
        codec = self._codecs.get(data[1] & 0x7F)
        if codec is None or codec.name.lower() == "rtx":
            return False
        if not getattr(self._receiver, internals.RECEIVER_ENABLED):
            return True
        try:
            plain = srtp.unprotect(data)
        except pylibsrtp.Error:
            return True  # not authentic, or replayed: dropped, as aiortc does
        first = plain[0]
        start = 12 + 4 * (first & 0x0F)
        if first & 0x10:  # a header extension: its length in 32-bit words, after its profile
            start += 4 + 4 * int.from_bytes(plain[start + 2 : start + 4], "big")
        end = len(plain) - (plain[-1] if first & 0x20 else 0)
        if start > end:
            return True  # malformed: dropped, as aiortc does
        sequence, timestamp, ssrc = _HEADER.unpack_from(plain, 2)
        packet = self._packet
        packet.sequence_number, packet.timestamp = sequence, timestamp
        setattr(packet, internals.DEPAYLOADED, plain[start:end])
        stream = self._streams.get(ssrc)
        if stream is None:
            stream = self._streams[ssrc] = StreamStatistics(codec.clockRate)
        stream.add(packet)  # type: ignore[arg-type]  # it reads the sequence number and the timestamp
        _, frame = self._jitter.add(packet)
        if frame is not None:
            frame.timestamp = self._mapper.map(frame.timestamp)
            self._queue.put((codec, frame))
        return True

    def close(self) -> None:
        """Let go of the receiver (the call is over): the ICE connection that hands this its datagrams is the
        receiver's own, and they would hold one another until the cyclic collector ran."""
        self._dtls = self.ice = self._receiver = self._codecs = self._streams = self._mapper = None  # type: ignore[assignment]
        self._jitter = self._queue = None


class _Packet:
    """What the statistics and the jitter buffer read of a packet; the payload is where the jitter buffer reads
    it (``internals.DEPAYLOADED``)."""

    __slots__ = ("__dict__", "sequence_number", "timestamp")

    def __init__(self) -> None:
        self.sequence_number = 0
        self.timestamp = 0
