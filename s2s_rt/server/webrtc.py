"""WebRTC calls: ``POST /v1/realtime/calls`` (an SDP offer in, the answer out), through aiortc.

A call is one session, served by the same code as a WebSocket's; only what
carries it differs. Its JSON events travel on the data channel named
``oai-events`` (:class:`Call` is the session's channel, as a WebSocket
connection is), its microphone arrives as Opus on the media track, decoded
and handed to the listening clock as 16 kHz PCM, and its answers' audio
leaves on an outgoing track (:class:`Playback`) instead of in
``response.output_audio.delta`` events. Because the server plays the audio
itself, it knows what was heard: it sends ``output_audio_buffer.started`` /
``stopped`` / ``cleared`` as OpenAI does, and on barge-in it truncates the
assistant's item at the audio actually played (the client sends no
``conversation.item.truncate``).

A call holds its slot from the offer on. If its data channel does not open
within ``call_timeout_s`` (ICE never completed, or the client never opened
it), or the data channel or the peer connection closes, or the client
posts ``/v1/realtime/calls/{id}/hangup``, its session ends and the slot goes
back, as when a WebSocket closes. (Past aiortc's and aioice's public API: :mod:`~s2s_rt.server.internals`.)
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from s2s_rt.budget import PacketBudget
from s2s_rt.memory import weakly
from s2s_rt.pipeline.ports import EventTooLarge
from s2s_rt.server import internals
from s2s_rt.server.call_sockets import CallSockets
from s2s_rt.server.playout import CallEnded
from s2s_rt.server.webrtc_audio import HEARD_FORMAT, Playback, ToHeard, hear_on_the_loop, release_at_once
from s2s_rt.server.webrtc_rtp import AudioPackets

log = logging.getLogger(__name__)

#: The data channel's events wait while more than this is buffered for the client (its ``bufferedAmount``).
CHANNEL_HIGH_WATER = 1 << 20
EVENTS_LABEL = "oai-events"
#: Events a call's data channel may have delivered and its session not yet read before the call ends.
MAX_WAITING_EVENTS = 4096


def ask_for_dtx(sdp: str) -> str:
    """``sdp`` (an answer) asking the caller for Opus DTX (``usedtx=1`` on its Opus format, RFC 7587): while
    its user is silent a browser then sends one packet in 400 ms, not 50 a second (the server hears the gaps as
    silence: :class:`~s2s_rt.server.webrtc_audio.Hearing`). aiortc's answer leaves it out."""
    lines = sdp.split("\r\n")
    out: list[str] = []
    opus: set[str] = set()
    for line in lines:
        rtpmap = re.match(r"a=rtpmap:(\d+) opus/", line, re.IGNORECASE)
        fmtp = re.match(r"a=fmtp:(\d+) ", line)
        if fmtp and fmtp.group(1) in opus:
            opus.discard(fmtp.group(1))
            if "usedtx" not in line:
                line += ";usedtx=1"
        elif out and opus and not line.startswith("a=rtcp-fb:"):
            out += [f"a=fmtp:{pt} usedtx=1" for pt in sorted(opus)]
            opus.clear()
        out.append(line)
        if rtpmap:
            opus.add(rtpmap.group(1))
    return "\r\n".join(out)


class Call:
    """One WebRTC call: its peer connection, its ``oai-events`` channel, its audio both ways.

    It is the session's channel (what the send loop writes to), as a
    WebSocket connection is: :meth:`send`, :meth:`close`, :meth:`abort`,
    :attr:`is_open`, and :attr:`playback`, the audio it plays.

    Args:
        call_id: the id in the answer's ``Location`` (``rtc_…``).
        configuration: STUN/TURN servers.
        dropped: called for each media datagram dropped past the call's budget (a metric's count).
    """

    #: The caller's audio as it is heard (:attr:`hear`).
    heard_format = HEARD_FORMAT
    transport = "WebRTC"

    def __init__(
        self,
        call_id: str,
        configuration: RTCConfiguration,
        dropped: Callable[[], None] = lambda: None,
        sockets: CallSockets | None = None,
    ) -> None:
        self.id = call_id
        #: The process's call sockets, which read this call's (None: the loop reads them as datagrams come).
        self._sockets = sockets
        #: Its aioice connections, once it is set up and its sockets are read on the clock (:meth:`_set_up`).
        self._settled: list[Any] = []
        #: The caller's media datagrams past this budget are dropped before aiortc reads them.
        self._media = PacketBudget(f"call {call_id}", dropped, weakly(self.end))
        self.pc = RTCPeerConnection(configuration)
        self.playback = Playback()  # sends nothing while it has nothing to play
        self.channel: Any = None
        self.inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        #: Set when the events channel opens (ICE and DTLS are done).
        self.opened = asyncio.Event()
        #: Set when the call is over, whoever ended it; ``why`` says why.
        self.gone = asyncio.Event()
        self.why = ""
        self.close_code: int | None = None
        #: Takes each 20 ms of the caller's audio, as 16 kHz mono PCM16 (set while a session is attached).
        self.hear: Callable[[bytes], None] | None = None
        #: The secret that opened it (it may hang up with that), if one did.
        self.secret: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Takes the caller's audio packets before aiortc's path, where it may (:meth:`answer`).
        self._audio: AudioPackets | None = None
        #: The tasks that hear the caller's tracks (cancelled when the call ends).
        self._listening: list[asyncio.Task[Any]] = []
        # What the call hands aiortc reaches it weakly: the peer connection and its transports stay in cycles of
        # their own after it closes, until the collector (seldom: s2s_rt.memory) frees them, and they would keep
        # the call, its playback and its inbox as long. The call is freed when its serving lets go of it.
        pc = self.pc
        pc.on("datachannel", weakly(self._datachannel))
        pc.on("track", weakly(self._track))
        pc.on("connectionstatechange", weakly(self._state_changed))

    # --- the channel the session writes to -------------------------------------

    @property
    def is_open(self) -> bool:
        return not self.gone.is_set()

    async def send(self, message: Any, *, text: bool | None = True) -> None:
        channel = self.channel
        if self.gone.is_set() or channel is None or channel.readyState != "open":
            raise CallEnded
        data = bytes(message) if isinstance(message, (bytes, bytearray, memoryview)) else str(message).encode()
        limit = max_message_size(channel)
        if limit and len(data) > limit:
            # aiortc would raise ValueError: refused here, by name, before anything is queued.
            raise EventTooLarge(len(data), limit)
        try:
            channel.send(data.decode())
        except ValueError as exc:  # an aiortc whose limit is kept elsewhere
            raise EventTooLarge(len(data), limit) from exc
        if channel.bufferedAmount > CHANNEL_HIGH_WATER:
            await self._drained(channel)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.close_code = code
        self.end(reason or "closed by the server")
        await self.wait_closed()

    def abort(self) -> None:
        self.end("aborted by the server")

    # --- lifecycle --------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to ``offer_sdp``, once this side's candidates are gathered.

        Raises:
            ValueError: the offer is not one this server can answer (no audio, or not SDP).
        """
        if "m=audio" not in offer_sdp:
            raise ValueError("the offer has no audio (m=audio) section")
        await self.pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise ValueError("the offer has no audio track")
        audio[0].sender.replaceTrack(self.playback)
        audio[0].direction = "sendrecv"
        receiver = audio[0].receiver
        ours = release_at_once(receiver)
        # Its audio is decoded as it comes, on the loop (else aiortc's thread delivers it to the track: _listen).
        ours &= hear_on_the_loop(receiver, weakly(self._heard), weakly(self.end), self.id, weakly(self._read_media))
        answer = await self.pc.createAnswer()
        await self.pc.setLocalDescription(answer)
        internals.require_ports_in_range(sdp := str(self.pc.localDescription.sdp))  # not ports a firewall drops
        # Its packets go from the datagram to the hearing without aiortc's path, where the jitter buffer and the
        # decoder queue are the server's.
        if ours and receiver.transport is not None and internals.audio_packets_allowed(receiver):
            self._audio = AudioPackets(receiver)
        self._guard_media()
        return ask_for_dtx(sdp)

    def _guard_media(self) -> None:
        """The caller's media past its budget is dropped before aiortc reads it, and a flood of it ends the call.

        aiortc takes every datagram it is sent (its ICE queue, SRTP, RTP, the jitter buffer: some 0.2 ms of the
        loop each): a caller sending 1,500 packets a second took a third of a core.
        """
        loop, media = asyncio.get_running_loop(), self._media
        audio = self._audio
        for ice in self._ice_transports():
            take = audio if audio is not None and ice is audio.ice else None
            internals.guard_media(ice, lambda: media.take(loop.time()), take)

    def _ice_transports(self) -> set[Any]:
        transports = {t.receiver.transport.transport for t in self.pc.getTransceivers() if t.receiver.transport}
        if self.pc.sctp is not None:
            transports.add(self.pc.sctp.transport.transport)
        return transports

    def _read_media(self) -> None:
        """Read what waits on the call's sockets now (the process reads them on a clock once it is set up)."""
        if self._sockets is not None:
            for connection in self._settled:
                self._sockets.read(connection)

    def end(self, why: str) -> None:
        """The call is over: nothing more is sent or heard; the peer connection closes in the background."""
        if self.gone.is_set():
            return
        self.why = why
        self.gone.set()
        self.inbox.put_nowait(None)
        self.hear = None
        # The caller's track may never deliver a frame (a call that never connected): nothing else wakes it.
        for task in self._listening:
            task.cancel()
        # A cancelled task keeps its exception, whose traceback holds the task's frame, which holds the call.
        self._listening.clear()
        self._spawn(self._close_peer())

    async def _close_peer(self) -> None:
        try:
            await self.pc.close()
        finally:
            unhook(self.pc)
            if self._audio is not None:
                self._audio.close()

    async def wait_closed(self) -> None:
        """Until the peer connection has closed (after :meth:`end`), two seconds at most."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"call-{self.id}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("call %s: %r", self.id, task.exception())

    # --- aiortc's callbacks --------------------------------------------------------

    def _datachannel(self, channel: Any) -> None:
        if channel.label != EVENTS_LABEL or self.channel is not None:
            return  # other channels are not ours to read
        self.channel = channel
        channel.on("message", weakly(self._message))
        channel.on("close", weakly(self._channel_closed))
        if channel.readyState == "open":
            self._set_up()
        else:
            channel.on("open", weakly(self._set_up))

    def _set_up(self) -> None:
        """The call is set up (ICE, DTLS and its events channel): its sockets are read on the process's clock
        from now on, where each datagram of the setup's round trips was read as it came."""
        self.opened.set()
        if self._sockets is not None:
            self._settled = [internals.ice_connection(ice) for ice in self._ice_transports()]
            for connection in self._settled:
                self._sockets.settle(connection)

    def _message(self, data: str | bytes) -> None:
        if self.gone.is_set():
            return
        if self.inbox.qsize() >= MAX_WAITING_EVENTS:
            # The session's loop refuses a flood at its rate limit; events it has not even read
            # yet are not kept without bound: a client this far ahead is ended.
            log.warning("call %s: %d events waiting to be read; ending it", self.id, MAX_WAITING_EVENTS)
            self.end("flooded its data channel")
            return
        self.inbox.put_nowait(data)

    def _channel_closed(self) -> None:
        self.end("data channel closed")

    def _track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and not self.gone.is_set():
            self._listening.append(self._spawn(self._listen(track)))

    def _state_changed(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.end(f"peer connection {self.pc.connectionState}")

    async def _listen(self, track: MediaStreamTrack) -> None:
        """The caller's audio as the track delivers it, in mono, to :meth:`_heard` (a track whose packets are
        decoded on the loop delivers none; this only waits for its end)."""
        heard = ToHeard()
        while not self.gone.is_set():
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if isinstance(frame, AudioFrame):
                self._heard(heard(frame))

    def _heard(self, pcm: bytes) -> None:
        """20 ms of the caller's audio (mono PCM16 at 16 kHz), to whoever hears the call now."""
        hear = self.hear
        if hear is None:
            return
        try:
            hear(pcm)
        except Exception:
            # This call's share of the hearing failed: it ends, alone.
            log.exception("call %s: its audio could not be heard; ending it", self.id)
            self.end("internal error while hearing its audio")

    async def _drained(self, channel: Any) -> None:
        low = asyncio.Event()
        channel.bufferedAmountLowThreshold = CHANNEL_HIGH_WATER // 2
        channel.once("bufferedamountlow", low.set)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({asyncio.ensure_future(low.wait()), gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if self.gone.is_set():
            raise CallEnded


def unhook(pc: RTCPeerConnection) -> None:
    """A closed peer connection made free by reference counting, and what the call gave it with it.

    aiortc's objects listen to one another (the peer connection to its
    transports' state, the transports to their parts): after ``close`` they
    are cycles that would wait for the cyclic collector, which the server runs
    seldom (:mod:`s2s_rt.memory`), with each call's RTP history, codecs and
    DTLS state (some 100 kB of Python objects a call, and the native state of
    its codecs). Their listeners are removed, through aiortc's public
    attributes, and the call's own track is taken back from its sender.
    """
    emitters: list[Any] = [pc, pc.sctp, pc.sctp.transport if pc.sctp else None]
    for transceiver in pc.getTransceivers():
        transceiver.sender.replaceTrack(None)
        for dtls in (transceiver.sender.transport, transceiver.receiver.transport):
            ice = dtls.transport if dtls is not None else None
            emitters += [dtls, ice, ice.iceGatherer if ice is not None else None]
        emitters.append(transceiver.receiver.track)
    for emitter in emitters:
        if emitter is not None:
            emitter.remove_all_listeners()


#: A call whose peer has gone without a word (a closed tab, a crashed phone, a lost network) is noticed
#: when the peer stops answering ICE consent checks (RFC 7675), which every live peer answers, muted or
#: silent too. aioice checks every 5 s and gives up after 6 misses in a row, so a vanished browser held
#: its slot about 30 s; the server checks about every second and gives up after 4 misses (some 6 s).
CONSENT_INTERVAL_S = 1.0
CONSENT_FAILURES = 4


def check_consent_often() -> None:
    """Make aioice check consent every :data:`CONSENT_INTERVAL_S`, and give up after :data:`CONSENT_FAILURES` misses.

    aioice reads its module's two constants each time it waits and counts (it
    offers no setting); they are process-wide, and the server's calls are the
    only ICE connections of its process. An aioice without them is left alone.
    """
    if internals.consent_adjustable():
        aioice.ice.CONSENT_INTERVAL = CONSENT_INTERVAL_S  # type: ignore[assignment]
        aioice.ice.CONSENT_FAILURES = CONSENT_FAILURES


def max_message_size(channel: Any) -> int:
    """The largest message the peer of ``channel`` takes, as its SDP said (``a=max-message-size``); 0: no limit.

    aiortc keeps it privately on the SCTP transport (since 1.16) and refuses a larger one with ``ValueError``.
    """
    return int(getattr(getattr(channel, "transport", None), "_remote_max_message_size", 0) or 0)


def ice_configuration(servers: list[str]) -> RTCConfiguration:
    """aiortc's configuration from ``--ice-server`` values.

    Each is a STUN or TURN URL (``stun:host:3478``, ``turn:host:3478?transport=tcp``,
    ``turns:host:443``), with ``USERNAME:CREDENTIAL@`` in front for TURN.

    Raises:
        ValueError: a value that is not such a URL.
    """
    ice = []
    for entry in servers:
        username = credential = None
        url = entry
        if "@" in entry:
            auth, url = entry.rsplit("@", 1)
            username, _, credential = auth.partition(":")
        if not url.startswith(("stun:", "turn:", "turns:")):
            raise ValueError(f"ice server {entry!r}: expected stun:, turn: or turns: (with USER:PASS@ for TURN)")
        ice.append(RTCIceServer(urls=url, username=username, credential=credential))
    return RTCConfiguration(iceServers=ice)
