"""What the server uses of websockets, aiortc and aioice beyond their public API, pinned on the installed versions.

:mod:`s2s_rt.server.internals` lists each reach and the versions whose source
it was read in. Here each is checked on what is installed: the attributes are
there with the types the code expects, and the change the server makes takes
effect (a frame waits in the queue it reads, the queue calls the resume it
sets, packets pass through the jitter buffer it puts in, aioice's consent
checks follow the constants it sets, ICE binds in the range it wraps). When
a newer release moves one of them, a test here fails before the server
misbehaves; the checks the server runs itself are tested too, against an
internal taken away on purpose.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import queue
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aioice.ice
import aioice.stun
import pytest
from aiortc import RTCConfiguration, RTCDtlsTransport, RTCPeerConnection, RTCSessionDescription
from aiortc.jitterbuffer import JitterBuffer
from aiortc.mediastreams import AudioStreamTrack
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtcsctptransport import RTCSctpTransport
from conftest import run
from websockets.asyncio.client import connect
from websockets.asyncio.messages import Assembler
from websockets.asyncio.server import ServerConnection, serve

from s2s_rt.server import internals, webrtc, webrtc_audio
from s2s_rt.server.call_sockets import CallSockets
from s2s_rt.server.direct import DirectConnection


@pytest.fixture(autouse=True)
def _collected() -> Iterator[None]:
    """Each test's peer connections collected when it ends.

    Their garbage holds finalizers; collected while pytest parses a later failing test's source, it made
    CPython 3.11's ast.parse fail ("AST constructor recursion depth mismatch") and pytest stop.
    """
    yield
    gc.collect()


# --- websockets (s2s_rt.server.direct) ----------------------------------------------------------------------


def test_websockets_has_what_the_direct_route_reads() -> None:
    async def scenario() -> None:
        assert internals.websockets_missing() == []
        assembler = Assembler(pause=lambda: None, resume=lambda: None)
        assert isinstance(assembler.frames.queue, collections.deque)
        assert assembler.paused is False

    run(scenario())


class _Counting(DirectConnection):
    """A direct connection that counts the times the queue told it that it has room again."""

    resumed = 0

    def _queue_has_room(self) -> None:
        type(self).resumed += 1
        super()._queue_has_room()


def test_a_direct_connection_sees_frames_first_and_is_resumed_by_the_queue() -> None:
    """process_event is called per frame, declined frames wait in frames.queue, and a drained queue calls resume."""
    sent = [f"m{i}" for i in range(40)]

    async def scenario() -> None:
        offered: list[bytes] = []
        got: list[Any] = []
        paused = asyncio.Event()

        async def handler(ws: ServerConnection) -> None:
            assert isinstance(ws, _Counting)
            assert isinstance(ws.recv_messages, Assembler)
            assert ws.recv_messages.resume == ws._queue_has_room  # the replacement took

            def direct(data: bytes | bytearray | memoryview) -> bool:
                offered.append(bytes(data))
                return bytes(data) == b"direct"

            ws.direct = direct
            # Nothing is read until the queue is past its high-water mark (max_queue 4) and reading paused.
            while not ws.recv_messages.paused:
                await asyncio.sleep(0.01)
            assert len(ws.recv_messages.frames.queue) > 4
            paused.set()
            while len(got) < len(sent):
                got.append(await ws.recv())

        _Counting.resumed = 0
        async with serve(handler, "127.0.0.1", 0, create_connection=_Counting, max_queue=4) as server:
            port = server.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}") as client:
                await client.send("direct")  # taken by the direct route: the queue is empty
                for text in sent:
                    await client.send(text)
                await asyncio.wait_for(paused.wait(), 10)
                while len(got) < len(sent):
                    await asyncio.sleep(0.01)
        assert offered[0] == b"direct"
        assert got == sent  # declined frames go to recv(), in order
        # A frame is offered only while none waits in frames.queue: those parsed behind a waiting one were not.
        assert offered[1] == b"m0" and len(offered) < 1 + len(sent) // 2, offered
        assert _Counting.resumed >= 1

    run(scenario(), 20)


def test_a_server_refuses_to_start_on_a_websockets_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    class Renamed(Assembler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            del self.paused

    monkeypatch.setattr(internals, "Assembler", Renamed)

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match=rf"^websockets {internals.version('websockets')}: .*Assembler.paused"):
            DirectConnection.answering(lambda *args: None)  # type: ignore[arg-type]

    run(scenario())


# --- aiortc: the receiver's jitter buffer (s2s_rt.server.webrtc_audio.release_at_once) ---------------------


async def _offer(pc: RTCPeerConnection) -> str:
    pc.createDataChannel(webrtc.EVENTS_LABEL)
    pc.addTrack(AudioStreamTrack())
    await pc.setLocalDescription(await pc.createOffer())
    return str(pc.localDescription.sdp)


@asynccontextmanager
async def _call(heard: list[bytes] | None = None) -> AsyncIterator[tuple[webrtc.Call, RTCPeerConnection]]:
    """A call answered by the server's own :class:`~s2s_rt.server.webrtc.Call`, from a peer sending silence;
    ended, and both sides closed, after the block."""
    peer = RTCPeerConnection()
    call = webrtc.Call("rtc_test", RTCConfiguration())
    if heard is not None:
        call.hear = heard.append
    try:
        answer = await call.answer(await _offer(peer))
        await peer.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        yield call, peer
    finally:
        call.end("test over")
        await call.wait_closed()
        await peer.close()


def test_aiortc_receivers_have_the_jitter_buffer_that_is_replaced() -> None:
    async def scenario() -> None:
        pc = RTCPeerConnection()
        try:
            receiver = pc.addTransceiver("audio").receiver
            assert isinstance(receiver, RTCRtpReceiver)
            assert internals.jitter_buffer_missing(receiver) is None
            assert type(getattr(receiver, internals.JITTER_BUFFER)) is JitterBuffer
        finally:
            await pc.close()

    run(scenario())


def test_a_calls_audio_passes_through_the_jitter_buffer_put_in(monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[int] = []

    class Counting(webrtc_audio.InOrder):
        def add(self, packet: Any) -> Any:
            added.append(packet.sequence_number)
            return super().add(packet)

    monkeypatch.setattr(webrtc_audio, "InOrder", Counting)

    async def scenario() -> None:
        heard: list[bytes] = []
        async with _call(heard) as (call, _peer):
            receiver = next(t.receiver for t in call.pc.getTransceivers() if t.kind == "audio")
            buffer = getattr(receiver, internals.JITTER_BUFFER)
            assert type(buffer) is Counting
            for _ in range(500):
                if len(heard) >= 5:
                    break
                await asyncio.sleep(0.02)
            assert len(heard) >= 5 and len(added) >= 5

    run(scenario())


def test_an_aiortc_without_the_jitter_buffer_is_said_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def handle_rtp_packet(self: Any, packet: Any, arrival_time_ms: int) -> None:
        """A receiver that keeps its buffer elsewhere."""

    monkeypatch.setattr(RTCRtpReceiver, "_handle_rtp_packet", handle_rtp_packet)
    internals._said_once.cache_clear()

    async def scenario() -> None:
        pc = RTCPeerConnection()
        try:
            receiver = pc.addTransceiver("audio").receiver
            with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
                webrtc_audio.release_at_once(receiver)
                webrtc_audio.release_at_once(receiver)
            assert type(getattr(receiver, internals.JITTER_BUFFER)) is JitterBuffer  # aiortc's own, left alone
        finally:
            await pc.close()

    run(scenario())
    internals._said_once.cache_clear()
    [record] = [r for r in caplog.records if "jitter buffer" in r.getMessage()]  # said once
    assert record.getMessage().startswith(f"aiortc {internals.version('aiortc')}: RTCRtpReceiver._handle_rtp_packet")


# --- aiortc: the receiver's decoder queue (s2s_rt.server.webrtc_audio.hear_on_the_loop) --------------------


def _decoder_threads() -> int:
    return sum(t.name == "audio-decoder" for t in threading.enumerate())


def test_a_calls_audio_is_decoded_on_the_loop_and_aiortcs_thread_ends_with_the_call() -> None:
    async def scenario() -> None:
        before = _decoder_threads()
        pc = RTCPeerConnection()
        try:
            receiver = pc.addTransceiver("audio").receiver
            assert internals.decoder_queue_missing(receiver) is None
            assert type(getattr(receiver, internals.DECODER_QUEUE)) is queue.Queue
        finally:
            await pc.close()
        heard: list[bytes] = []
        async with _call(heard) as (call, _peer):
            receiver = next(t.receiver for t in call.pc.getTransceivers() if t.kind == "audio")
            assert type(getattr(receiver, internals.DECODER_QUEUE)) is webrtc_audio.Hearing
            for _ in range(500):
                if len(heard) >= 5:
                    break
                await asyncio.sleep(0.02)
            # 20 ms of mono PCM16 at 16 kHz a packet, decoded where it came (the loop's thread).
            assert len(heard) >= 5 and {len(pcm) for pcm in heard} == {640}
            assert getattr(receiver, internals.DECODER_THREAD).is_alive()  # aiortc's, waiting
        # aiortc's thread took the stop from the stand-in and ended: none is left behind.
        for _ in range(100):
            if _decoder_threads() <= before:
                break
            await asyncio.sleep(0.02)
        assert _decoder_threads() <= before

    run(scenario())


def test_a_receiver_already_started_keeps_its_queue_and_an_aiortc_without_one_is_said_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    internals._said_once.cache_clear()

    async def scenario() -> None:
        pc = RTCPeerConnection()
        try:
            receiver = pc.addTransceiver("audio").receiver
            setattr(receiver, internals.DECODER_THREAD, threading.current_thread())  # as if started
            with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
                assert not webrtc_audio.hear_on_the_loop(receiver, lambda pcm: None, lambda why: None, "rtc_x")
            assert type(getattr(receiver, internals.DECODER_QUEUE)) is queue.Queue  # left alone
            setattr(receiver, internals.DECODER_THREAD, None)
            setattr(receiver, internals.DECODER_QUEUE, [])
            with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
                assert not webrtc_audio.hear_on_the_loop(receiver, lambda pcm: None, lambda why: None, "rtc_x")
                assert not webrtc_audio.hear_on_the_loop(receiver, lambda pcm: None, lambda why: None, "rtc_x")
            setattr(receiver, internals.DECODER_QUEUE, queue.Queue())
        finally:
            await pc.close()

    run(scenario())
    internals._said_once.cache_clear()
    said = [r.getMessage() for r in caplog.records if "decoded on aiortc's thread" in r.getMessage()]
    assert len(said) == 2  # each reason once
    assert said[0].startswith(f"aiortc {internals.version('aiortc')}: the receiver's {internals.DECODER_THREAD}")
    assert "is not a queue.Queue" in said[1]


# --- aiortc: the peer's largest message (s2s_rt.server.webrtc.max_message_size) ------------------------------


# --- aiortc: a call's audio packets before its path (s2s_rt.server.webrtc_rtp) ------------------------------


def test_a_calls_audio_packets_are_heard_without_aiortcs_path_and_its_receiver_reports_count_them() -> None:
    async def scenario() -> None:
        heard: list[bytes] = []
        async with _call(heard) as (call, peer):
            receiver = next(t.receiver for t in call.pc.getTransceivers() if t.kind == "audio")
            dtls = receiver.transport
            through_aiortc = 0
            handle = dtls._handle_rtp_data

            async def counted(data: bytes, arrival_time_ms: int) -> None:
                nonlocal through_aiortc
                through_aiortc += 1
                await handle(data, arrival_time_ms)

            dtls._handle_rtp_data = counted
            sender = next(t.sender for t in peer.getTransceivers() if t.kind == "audio")
            reports: list[Any] = []
            for _ in range(400):
                stats = await sender.getStats()
                reports = [s for s in stats.values() if s.type == "remote-inbound-rtp"]
                # A receiver report is sent every 0.5-1.5 s: wait for one sent after 50 packets came.
                if len(heard) >= 100 and reports and reports[0].packetsReceived >= 50:
                    break
                await asyncio.sleep(0.02)
            assert len(heard) >= 100  # 2 s of the peer's silence heard
            # Taken before aiortc's path: at most a packet or two that came before SRTP was keyed went its way.
            assert through_aiortc <= 2, through_aiortc
            # The server's receiver reports still say what it heard (else the sender would see none, or losses).
            assert reports and reports[0].packetsLost == 0 and reports[0].packetsReceived >= 50

    run(scenario())


def test_an_aiortc_without_what_the_audio_packets_read_keeps_its_path_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def recv_next(self: Any) -> None:
        """A DTLS transport that keeps its SRTP session elsewhere."""

    monkeypatch.setattr(RTCDtlsTransport, "_recv_next", recv_next)
    internals._said_once.cache_clear()

    async def scenario() -> None:
        pc = RTCPeerConnection()
        try:
            receiver = pc.addTransceiver("audio").receiver
            with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
                assert not internals.audio_packets_allowed(receiver)
                assert not internals.audio_packets_allowed(receiver)
        finally:
            await pc.close()

    try:
        run(scenario())
    finally:
        internals._said_once.cache_clear()
    [record] = [r for r in caplog.records if "audio packets" in r.getMessage()]  # said once
    assert f"RTCDtlsTransport._recv_next does not name {internals.RX_SRTP}" in record.getMessage()


def test_aiortc_keeps_the_peers_largest_message_where_it_is_read() -> None:
    assert internals.names(RTCSctpTransport._data_channel_send, "_remote_max_message_size")

    async def scenario() -> None:
        pc = RTCPeerConnection()
        try:
            channel = pc.createDataChannel("x")
            assert isinstance(channel.transport, RTCSctpTransport)
            assert webrtc.max_message_size(channel) == channel.transport._remote_max_message_size > 0
        finally:
            await pc.close()

    run(scenario())


# --- aioice: consent checks (s2s_rt.server.webrtc.check_consent_often) -------------------------------------


def test_aioice_reads_the_consent_constants_that_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert internals.consent_missing() is None
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", 0)
    webrtc.check_consent_often()
    assert (aioice.ice.CONSENT_INTERVAL, aioice.ice.CONSENT_FAILURES) == (
        webrtc.CONSENT_INTERVAL_S,
        webrtc.CONSENT_FAILURES,
    )
    # They take effect: a peer that never answers is given up on after CONSENT_FAILURES checks,
    # CONSENT_INTERVAL apart (made short here).
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.01)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", 3)
    asked: list[object] = []

    async def silent(*args: Any, **kwargs: Any) -> None:
        asked.append(args)
        raise aioice.stun.TransactionTimeout

    async def closed() -> None:
        asked.append("closed")

    pair = SimpleNamespace(protocol=SimpleNamespace(request=silent), remote_addr=("127.0.0.1", 9))
    connection = SimpleNamespace(
        remote_password="p",
        _nominated={1: pair},
        build_request=lambda pair, nominate: None,
        close=closed,
        _Connection__log_info=lambda *args: None,
    )

    async def scenario() -> None:
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(aioice.ice.Connection.query_consent(connection), 5)  # type: ignore[arg-type]
        assert asyncio.get_running_loop().time() - started < 1.0

    run(scenario())
    assert len(asked) == 3 + 1 and asked[-1] == "closed"


def test_an_aioice_without_the_consent_constants_is_said_and_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(aioice.ice, "CONSENT_FAILURES")
    with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
        webrtc.check_consent_often()
    assert not hasattr(aioice.ice, "CONSENT_FAILURES")  # not made: nothing would read it
    [record] = caplog.records
    assert record.getMessage().startswith(f"aioice {internals.version('aioice')}: aioice.ice.CONSENT_FAILURES")


# --- aioice: a call's media datagrams (s2s_rt.server.webrtc.Call._guard_media) ----------------------------


def test_aioice_hands_each_datagram_that_is_not_stun_to_the_connection_the_media_guard_wraps() -> None:
    from aiortc import RTCIceGatherer, RTCIceTransport

    async def scenario() -> None:
        ice = RTCIceTransport(RTCIceGatherer())
        assert internals.media_guard_missing(ice) is None
        asked: list[bytes] = []
        assert internals.guard_media(ice, lambda: bool(asked.append(b"")))  # refuses every media datagram
        connection = ice.iceGatherer._connection
        # Through the protocol that reads the socket, as a datagram arrives: media (SRTP's first byte 0x80) is
        # dropped before the queue the DTLS transport reads; DTLS (0x16) and an empty datagram pass.
        protocol = aioice.ice.StunProtocol(connection)
        protocol.local_candidate = SimpleNamespace(component=1)
        for data in (bytes([0x80]) + bytes(40), bytes([0x16]) + bytes(40), b""):
            protocol.datagram_received(data, ("127.0.0.1", 9))
        assert len(asked) == 1
        queued = [connection._queue.get_nowait() for _ in range(connection._queue.qsize())]
        assert [data[:1] for data, _ in queued] == [b"\x16", b""]

    run(scenario())


def test_an_aioice_whose_protocol_calls_elsewhere_keeps_the_media_unguarded_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiortc import RTCIceGatherer, RTCIceTransport

    def datagram_received(self: Any, data: bytes, addr: Any) -> None:
        self.receiver.taken(data)

    monkeypatch.setattr(aioice.ice.StunProtocol, "datagram_received", datagram_received)
    internals._said_once.cache_clear()

    async def scenario() -> bool:
        return internals.guard_media(RTCIceTransport(RTCIceGatherer()), lambda: False)

    with caplog.at_level(logging.ERROR, "s2s_rt.server.internals"):
        assert run(scenario()) is False
    [record] = caplog.records
    assert record.getMessage().startswith(f"aioice {internals.version('aioice')}: aioice.ice.StunProtocol")
    assert "taken as fast as its caller sends it" in record.getMessage()


# --- aioice: host candidates' ports (s2s_rt.server.call_sockets.CallSockets) ------------------------------


def test_aioice_binds_host_candidates_in_the_range_the_loop_is_given() -> None:
    assert internals.binds_missing() is None
    ports = range(47200, 47220)

    async def scenario() -> None:
        CallSockets(ports, 0).install()
        connection = aioice.ice.Connection(ice_controlling=True)
        try:
            await connection.gather_candidates()
            found = [c.port for c in connection.local_candidates if c.type == "host"]
            assert found and all(p in ports for p in found), found
        finally:
            await connection.close()
        # And a whole call, answered by the server's Call (which checks its ports itself).
        async with _call() as (call, _peer):
            answer = call.pc.localDescription.sdp
            found = [int(line.split()[5]) for line in answer.splitlines() if line.startswith("a=candidate:")]
            assert found and all(p in ports for p in found), found

    run(scenario())


def test_an_aioice_that_binds_otherwise_fails_every_call_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    async def elsewhere(self: Any, component: int, addresses: list[str], timeout: int = 5) -> list[Any]:
        return []  # as if aioice made its sockets itself

    monkeypatch.setattr(aioice.ice.Connection, "get_component_candidates", elsewhere)
    version = internals.version("aioice")

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match=rf"^aioice {version}: Connection.get_component_candidates"):
            CallSockets(range(47200, 47220), 0).install()

    run(scenario())


def test_a_call_bound_outside_its_range_is_refused() -> None:
    sdp = "\n".join(
        [
            "v=0",
            "a=candidate:1 1 UDP 2130706431 10.0.0.1 47205 typ host",
            "a=candidate:2 1 UDP 1694498815 203.0.113.9 61000 typ srflx raddr 10.0.0.1 rport 47205",
        ]
    )

    async def scenario() -> None:
        internals.require_ports_in_range(sdp.replace("47205 typ", "50000 typ"))  # no range set: anything goes
        CallSockets(range(47200, 47220), 0).install()
        internals.require_ports_in_range(sdp)  # a server-reflexive port is the NAT's, not bound here
        with pytest.raises(RuntimeError, match=rf"^aioice {internals.version('aioice')}: .*\[50000\]"):
            internals.require_ports_in_range(sdp.replace("47205 typ", "50000 typ"))

    run(scenario())


def test_aiosipua_keeps_its_calls_where_a_refused_call_is_dropped_and_starts_its_udp_quietly() -> None:
    from aiosipua import SipUAS

    async def scenario() -> None:
        transport = internals.SipUdp(local_addr=("127.0.0.1", 0))
        await transport.start()  # without the AssertionError the library's own protocol logs on 3.11
        try:
            agent = SipUAS(transport)
            calls = internals.sip_calls(agent)
            assert calls is getattr(agent, internals.SIP_CALLS), internals.gone("aiosipua", "SipUAS._calls")
            calls["flood-1"] = object()
            assert agent.active_calls
            del calls["flood-1"]
            assert not agent.active_calls
        finally:
            await transport.stop()

    run(scenario())


def test_aiortp_hands_each_datagram_to_callbacks_the_guard_can_wrap() -> None:
    from aiortp import RTPSession

    async def scenario() -> None:
        session = await RTPSession.create(local_addr=("127.0.0.1", 0), remote_addr=("127.0.0.1", 9), payload_type=0)
        try:
            seen: list[tuple[str, int]] = []
            internals.guard_rtp(session, lambda addr: seen.append(addr) or addr[0] == "127.0.0.1")
            heard: list[bytes] = []
            session.on_audio = lambda pcm, ts: heard.append(pcm)
            port = session._rtp_transport._transport.get_extra_info("sockname")[1]
            packet = bytes([0x80, 0x80, 0, 1, 0, 0, 0, 160, 0, 0, 0, 7]) + bytes([0x10]) * 160
            for source in ("127.0.0.2", "127.0.0.1"):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((source, 0))
                sock.sendto(packet, ("127.0.0.1", port))
                sock.close()
            for _ in range(100):
                if len(seen) == 2 and session._remote_ssrc is not None:
                    break
                await asyncio.sleep(0.02)
            assert [a[0] for a in seen] == ["127.0.0.2", "127.0.0.1"]
            assert session._remote_ssrc == 7  # the caller's packet reached the session; the stranger's did not
        finally:
            await session.close()
        # What a close that failed at its BYE leaves open: the sockets, closed by the helper.
        session = await RTPSession.create(local_addr=("127.0.0.1", 0), remote_addr=("127.0.0.1", 9), payload_type=0)
        session._rtcp_task.cancel()
        internals.close_rtp_sockets(session)
        assert session._rtp_transport._transport.is_closing() and session._rtcp_transport._transport.is_closing()

    run(scenario())
