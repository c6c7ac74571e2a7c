"""One phone call (:mod:`~s2s_rt.server.sip`): its SIP dialog, its RTP, and the channel its session writes to.

The caller's audio arrives as G.711 over RTP (:mod:`aiortp`, through
:mod:`aiosipua`'s call session), decoded to 8 kHz PCM16 for the listening
clock; the answers' audio leaves from a
:class:`~s2s_rt.server.playout.Playout`, one 20 ms packet at a time while
there is something to play (silence is not sent). The session's events go to
the application's WebSocket when one watches the call.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiosipua import CallSession
from aiosipua.incoming_call import IncomingCall
from websockets.exceptions import ConnectionClosed

from s2s_rt.audio import AudioFormat
from s2s_rt.budget import PacketBudget
from s2s_rt.memory import weakly
from s2s_rt.protocol.session import Session
from s2s_rt.server import internals
from s2s_rt.server.playout import HEARD_DELAY_MS, CallEnded, Pacer, Playout

log = logging.getLogger(__name__)

#: What RTP carries both ways here: G.711 at 8 kHz, in 20 ms packets (μ-law, A-law), with RFC 4733 keypad events.
RATE = 8_000
FRAME_SAMPLES = RATE // 50
CODECS = [0, 8]
HEARD_FORMAT = AudioFormat("audio/pcm", RATE)
#: Events the application's WebSocket may have sent and the session not yet read before the call ends.
MAX_WAITING_EVENTS = 4096


class PhoneCall:
    """One phone call: its SIP dialog, its RTP, and the session's channel while it is answered.

    The session's events go to the application's WebSocket when one watches
    the call, else nowhere; its audio goes to the caller (:attr:`playback`).

    Args:
        call_id: the id the webhook and the routes name (``rtc_…``).
        invite: the caller's INVITE, as the SIP library holds it.
        client: the caller's signalling address, for admission and logs.
        dropped: called for each media datagram dropped past the call's budget (a metric's count).
    """

    heard_format = HEARD_FORMAT
    transport = "SIP"

    def __init__(
        self, call_id: str, invite: IncomingCall, client: str, dropped: Callable[[], None] = lambda: None
    ) -> None:
        self.id = call_id
        self.invite = invite
        self.client = client
        self.playback = Playout(RATE, FRAME_SAMPLES, HEARD_DELAY_MS)
        self.pacer = Pacer(FRAME_SAMPLES / RATE)
        self.media: CallSession | None = None
        self.inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        #: The application's answer while the call rings: the session it accepted with, or a status.
        self.answer: asyncio.Future[Session | int] = asyncio.get_running_loop().create_future()
        #: Set when the call is over, whoever ended it; ``why`` says why.
        self.gone = asyncio.Event()
        self.why = ""
        self.close_code: int | None = None
        #: Takes each packet of the caller's audio, as 8 kHz mono PCM16 (set while a session is attached).
        self.hear: Any = None
        #: Told each keypad press (set while a session is attached).
        self.keypad: Any = None
        #: The application's WebSocket watching the call, if one does.
        self.watcher: Any = None
        self.secret: str | None = None
        #: When the caller's last RTP or RTCP packet came (loop time); None: none yet.
        self.last_packet_at: float | None = None
        #: Datagrams dropped because they came from another address than the caller's.
        self.strays = 0
        #: The caller's datagrams past this budget are dropped before the library parses them.
        self._media = PacketBudget(f"phone call {call_id}", dropped, weakly(self.end))
        #: The addresses the caller's media may come from (its offers' and its INVITE's).
        self._callers: set[str] = set()
        #: The address the call's RTP binds (set when its media starts).
        self.host = ""
        self._sender: asyncio.Task[None] | None = None

    # --- the channel the session writes to -------------------------------------

    @property
    def is_open(self) -> bool:
        return not self.gone.is_set()

    async def send(self, message: Any, *, text: bool | None = True) -> None:
        if self.gone.is_set():
            raise CallEnded
        watcher = self.watcher
        if watcher is None:
            return  # nobody watches the call: its events are not kept
        try:
            await watcher.send(message if isinstance(message, str) else bytes(message).decode())
        except ConnectionClosed:
            self.watcher = None  # the application stopped watching; the call goes on

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.close_code = code
        self.end(reason or "closed by the server")

    def abort(self) -> None:
        self.end("aborted by the server")

    # --- media -----------------------------------------------------------------

    async def start_media(self, host: str, advertised: str | None, ports: range, media_timeout_s: float) -> Any:
        """Bind the call's RTP on ``host`` at a free port of ``ports`` and start sending; the SDP answer (naming
        ``advertised`` when given, else ``host``).

        Media is taken only from the caller: from the address its offer names or the one its INVITE
        came from (any port); datagrams from elsewhere are dropped. A call whose caller has sent
        nothing for ``media_timeout_s`` (from the answer, or since its last packet) ends (BYE).

        Raises:
            ValueError: the offer has no audio this server takes (G.711), or no address.
            OSError: no port of the range is free.
        """
        offer = self.invite.sdp_offer
        if offer is None:
            raise ValueError("the INVITE has no SDP offer")
        tried = 0
        for port in _ports_to_try(ports):
            # Media goes where the SDP says (latching to the source breaks callers that send from another port).
            media = CallSession(
                host, port, offer, supported_codecs=CODECS, symmetric_rtp=False, advertised_ip=advertised
            )
            try:
                await media.start()
            except OSError:
                tried += 1
                if tried >= 20:
                    raise
                continue
            break
        # What the call hands the RTP library reaches it weakly: the library's objects may stay in cycles of their
        # own after the call, until the collector (seldom: s2s_rt.memory) frees them, and would keep the call (its
        # session among what it holds) as long.
        media.on_audio = weakly(self._heard)
        media.on_dtmf = weakly(self._pressed)
        self.host = host
        offered = offer.rtp_address
        self._callers = {self.invite.source_addr[0]} | ({offered[0]} if offered else set())
        internals.guard_rtp(media.rtp_session, weakly(self._from_caller, False))
        self.media = media
        sender = self._send_audio(media, media_timeout_s)
        self._sender = asyncio.get_running_loop().create_task(sender, name=f"{self.id}-rtp")
        return media.sdp_answer

    def _from_caller(self, addr: Any) -> bool:
        """Whether a datagram from ``addr`` is the caller's and within the call's media budget (counted, and the
        last one's time kept); past the budget for :data:`~s2s_rt.budget.MEDIA_FLOOD_S`, the call is ended."""
        if addr[0] not in self._callers:
            self.strays += 1
            if self.strays == 1:
                log.info("phone call %s: media from %s, not the caller (%s), dropped", self.id, addr[0], self._callers)
            return False
        self.last_packet_at = now = asyncio.get_running_loop().time()
        return self._media.take(now)

    def renegotiate(self, offer: Any) -> Any:
        """A re-INVITE's offer (a session refresh, hold, a media address moved): the SDP answer, the media sent
        where the offer now says. None: the offer keeps none of the call's codec (the caller is refused 488).

        The answer is the call's first one: the same codec and port (RFC 3264 allows an unchanged answer).
        """
        media = self.media
        assert media is not None
        answer = media.sdp_answer
        if offer is None or offer.audio is None:
            return answer  # no offer: ours again, answered in the ACK
        chosen = answer.audio.codecs[0].payload_type if answer.audio and answer.audio.codecs else None
        if chosen is not None and all(c.payload_type != chosen for c in offer.audio.codecs):
            return None
        address = media_address(offer, self.host)
        if address is None:
            return None
        self._callers.add(address[0])
        if media.rtp_session is not None and address[0] not in ("0.0.0.0", "::"):  # not a hold of old
            media.rtp_session.update_remote(address)
        return answer

    def _heard(self, pcm: bytes, timestamp: int) -> None:
        hear = self.hear
        if hear is None or self.gone.is_set():
            return
        try:
            hear(pcm)
        except Exception:
            # This call's share of the hearing failed: it ends, alone.
            log.exception("phone call %s: its audio could not be heard; ending it", self.id)
            self.end("internal error while hearing its audio")

    def _pressed(self, digit: str, duration: int) -> None:
        keypad = self.keypad
        if keypad is not None and not self.gone.is_set():
            keypad(digit)

    async def _send_audio(self, media: CallSession, media_timeout_s: float) -> None:
        """Each frame of what the session plays, when the :class:`~s2s_rt.server.playout.Pacer` says it is due;
        between answers nothing is sent, and nothing wakes every 20 ms. The call ends when its caller has sent
        nothing for ``media_timeout_s``."""
        loop = asyncio.get_running_loop()
        answered = loop.time()
        pacer = self.pacer
        pacer.start()
        while not self.gone.is_set():
            left = (self.last_packet_at or answered) + media_timeout_s - loop.time()
            if left <= 0:
                self.end(f"no media from the caller for {media_timeout_s:g} s")
                return
            frame = await pacer.next(self.playback, left)
            if frame is None:
                continue
            try:
                # RTP time runs on through the silences.
                media.send_audio_pcm(frame.tobytes(), (pacer.index * FRAME_SAMPLES) & 0xFFFFFFFF)
            except (OSError, ValueError) as exc:
                self.end(f"its audio could not be sent: {exc!r}")
                return

    # --- lifecycle ----------------------------------------------------------------

    def end(self, why: str) -> None:
        """The call is over: BYE if it was answered, its RTP closed, its session told (its inbox ends)."""
        if self.gone.is_set():
            return
        self.why = why
        self.gone.set()
        self.inbox.put_nowait(None)
        self.hear = self.keypad = None
        if not self.answer.done():
            self.answer.set_result(int(HTTPStatus.GONE))
        if self.invite.dialog.state.name == "CONFIRMED":
            self.invite.hangup()
        if self._sender is not None:
            self._sender.cancel()

    async def wait_closed(self) -> None:
        """Until the call's RTP is closed (after :meth:`end`); the library's failures closing it are logged."""
        sender = self._sender
        if sender is not None:
            await asyncio.wait((sender,))
            if not sender.cancelled() and sender.exception() is not None:
                log.warning("phone call %s: its sender failed: %r", self.id, sender.exception())
            # Its cancellation's traceback holds the sender's frame, and that frame the call: let go of it.
            self._sender = None
        if self.media is not None:
            try:
                await self.media.close()
            except (OSError, ValueError) as exc:
                # Its RTCP (a report, or the BYE) failed to send, and the library stopped before its sockets.
                log.warning("phone call %s: closing its RTP: %r", self.id, exc)
                internals.close_rtp_sockets(self.media.rtp_session)


def media_address(offer: Any, host: str) -> tuple[str, int] | None:
    """Where an SDP offer asks for its audio, when that is an IP address (nothing to look up) of the family
    of ``host``, the address the call's RTP binds (an IPv4 socket cannot send to an IPv6 address)."""
    address = offer.rtp_address if offer is not None and offer.audio is not None else None
    if address is None or not 0 <= address[1] <= 65535:
        return None
    try:
        ip = ipaddress.ip_address(address[0])
    except ValueError:
        return None  # a host name (a DNS lookup, maybe off this network) or no address at all
    try:
        if ip.version != ipaddress.ip_address(host).version:
            return None
    except ValueError:
        pass  # the server's own host is a name: the socket's family is its resolver's choice
    return str(address[0]), int(address[1])


def _ports_to_try(ports: range) -> list[int]:
    """Even ports of ``ports`` (RTP's convention), from a random one on."""
    even = [p for p in ports if p % 2 == 0] or list(ports)
    first = random.randrange(len(even))
    return even[first:] + even[:first]
