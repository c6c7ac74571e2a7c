"""Phone calls over SIP, as OpenAI's Realtime SIP takes them: a PBX or trunk dials the server, a caller talks to it.

A call's INVITE (UDP or TCP, :mod:`aiosipua`) takes a slot through the same
admission as a WebSocket or a WebRTC call: a full pool answers ``486 Busy
Here``. The call then rings (180) while ``realtime.call.incoming`` is posted
to the operator's webhook (signed as OpenAI signs its webhooks), and the
application answers with ``POST /v1/realtime/calls/{call_id}/accept`` (the
session's configuration) or ``/reject``; later ``/refer`` transfers it and
``/hangup`` ends it. Without a webhook, ``sip_accept`` answers every call with
the default session. Accepted, the call answers 200 with its SDP, and its
audio travels as G.711 (μ-law or A-law) over RTP (:mod:`aiortp`): the
caller's into the listening clock at 8 kHz, the answers' out from a
:class:`~s2s_rt.server.playout.Playout` paced every 20 ms, so that barge-in
truncates at what the caller heard, as over WebRTC. Keypad presses (RFC 4733)
arrive as ``input_audio_buffer.dtmf_event_received``. A caller's BYE, or
CANCEL while it rings, ends the session and hands the slot back.

A phone call has no events channel of its own: the session's events are
dropped unless the application watches the call.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import json
import logging
import socket
import time
import urllib.request
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from aiosipua import SipUAS
from aiosipua.incoming_call import IncomingCall
from aiosipua.sdp_negotiate import SdpNegotiationError
from aiosipua.transport import TcpSipTransport
from aiosipua.uac import SipUAC
from websockets.datastructures import Headers
from websockets.http11 import Response

from s2s_rt.config import Config, port_range
from s2s_rt.logs import HostileInput
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import GA, encode_event, new_id
from s2s_rt.protocol.session import Session
from s2s_rt.server import internals
from s2s_rt.server.calls import api_error
from s2s_rt.server.connection import Connections, Refusal
from s2s_rt.server.phone import CODECS, MAX_WAITING_EVENTS, PhoneCall, media_address
from s2s_rt.server.posts import json_of
from s2s_rt.server.secrets import session_update

log = logging.getLogger(__name__)

#: The SIP and RTP libraries' loggers that report what callers send (unparsable messages and packets):
#: their lines are warnings without tracebacks, and a flood of them is cut (:class:`HostileInput`).
PEER_LOGGERS = ("aiosipua.transport", "aiosipua.uas", "aiosipua.message", "aiortp.session", "aiortp.transport")
_hostile_input = HostileInput()


def sign_webhook(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` of a webhook (Standard Webhooks, as OpenAI signs: HMAC-SHA256, base64)."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def _post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as answer:  # the operator's URL
        return int(answer.status)


class Phones:
    """Every phone call of the server, from its INVITE to its BYE.

    Args:
        connections: admission, sessions and their serving (shared with the WebSocket and WebRTC).
    """

    def __init__(self, config: Config, connections: Connections) -> None:
        self.config = config
        self.connections = connections
        self.media_ports = port_range(config.sip_media_ports)
        self.calls: dict[str, PhoneCall] = {}
        #: The SIP Call-ID of each call, for the library's callbacks.
        self._by_dialog: dict[str, PhoneCall] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._agents: list[SipUAS] = []
        self.port: int | None = None

    async def watch(self, ws: Any) -> None:
        """The application's WebSocket on a call (``/v1/realtime?call_id=``): it sees the call's session's events
        and steers it with its own (authorised as any session is, by the handshake)."""
        asked = parse_qs(urlsplit(ws.request.path).query).get("call_id", [""])[0]
        call = self.calls.get(asked)
        if call is None or call.gone.is_set() or call.watcher is not None:
            why = "is watched already" if call is not None and call.watcher is not None else "is not in progress"
            error = Session(GA).error(ProtocolError("call_not_found", f"Call {asked!r} {why}", param="call_id"))
            await ws.send(encode_event(error).decode())
            await ws.close(1008, "no such call")
            return
        call.watcher = ws
        gone = asyncio.ensure_future(call.gone.wait())
        try:
            while True:
                message = asyncio.ensure_future(ws.recv())
                await asyncio.wait((message, gone), return_when=asyncio.FIRST_COMPLETED)
                if not message.done():
                    message.cancel()
                    break
                if message.exception() is not None:
                    break  # the application closed its WebSocket: the call goes on
                if call.inbox.qsize() >= MAX_WAITING_EVENTS:
                    call.end("its WebSocket flooded the call with events")
                    break
                call.inbox.put_nowait(message.result())
        finally:
            gone.cancel()
            if call.watcher is ws:
                call.watcher = None
        await ws.close(1000, "the call ended" if call.gone.is_set() else "")

    async def start(self) -> None:
        """Listen for SIP on ``sip_host:sip_port``, UDP and TCP (port 0: a free one, the same for both)."""
        cfg = self.config
        for name in PEER_LOGGERS:
            logger = logging.getLogger(name)
            if _hostile_input not in logger.filters:
                logger.addFilter(_hostile_input)
        port = cfg.sip_port or free_port(cfg.sip_host)
        for transport in (
            internals.SipUdp(local_addr=(cfg.sip_host, port)),
            TcpSipTransport(local_addr=(cfg.sip_host, port)),
        ):
            advertised = (cfg.sip_advertised_host, port) if cfg.sip_advertised_host else None
            agent = SipUAS(transport, user_agent="s2s-rt", uac=SipUAC(transport), advertised_addr=advertised)
            agent.on_invite = self._invited
            agent.on_reinvite = self._reinvited
            agent.on_bye = lambda invite, request: self._ended(invite.call_id, "the caller hung up")
            agent.on_cancel = lambda request, addr: self._ended(request.call_id or "", "the caller gave up")
            await agent.start()
            self._agents.append(agent)
        self.port = port
        named = f", named {cfg.sip_advertised_host}" if cfg.sip_advertised_host else ""
        log.info("SIP listening on %s:%d (UDP and TCP%s)", cfg.sip_host, port, named)

    async def close(self) -> None:
        """End every call (shutdown), wait for their sessions, stop listening."""
        for call in list(self.calls.values()):
            call.end("the server is shutting down")
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.config.drain_deadline_s + 2.0)
        for agent in self._agents:
            await agent.stop()

    # --- the SIP side -------------------------------------------------------------------

    def _invited(self, invite: IncomingCall) -> None:
        host = invite.source_addr[0]
        metrics = self.connections.metrics
        call = PhoneCall(new_id("rtc"), invite, host, lambda: metrics.media_dropped.inc(transport="sip"))
        self.calls[call.id] = call
        self._by_dialog[invite.call_id] = call
        task = asyncio.get_running_loop().create_task(self._take(call), name=call.id)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _reinvited(self, invite: IncomingCall) -> None:
        """A re-INVITE of an answered call (a session refresh, hold, media moved): answered at once, or the
        caller would end the call when its transaction times out (32 s)."""
        call = self._by_dialog.get(invite.call_id)
        if call is None or call.media is None or call.gone.is_set():
            invite.reject(481, "Call/Transaction Does Not Exist")
            return
        answer = call.renegotiate(invite.sdp_offer)
        if answer is None:
            invite.reject(488, "Not Acceptable Here")
            return
        invite.accept(answer)
        log.info("phone call %s: re-INVITE answered", call.id)

    def _sweep(self) -> None:
        """Drop what the SIP library keeps of calls that are not (or no longer) ours."""
        for agent in self._agents:
            calls = internals.sip_calls(agent)
            for dialog_id in [d for d in calls if d not in self._by_dialog]:
                del calls[dialog_id]

    async def sweep(self) -> None:
        """Every second, :meth:`_sweep` (a flood of INVITEs the library keeps but never hands over stays bounded)."""
        while True:
            await asyncio.sleep(1.0)
            self._sweep()

    def _ended(self, dialog_id: str, why: str) -> None:
        call = self._by_dialog.get(dialog_id)
        if call is not None:
            call.end(why)

    async def _take(self, call: PhoneCall) -> None:
        """A call from its INVITE: a slot or busy, ringing, the application's answer, the session, its end."""
        connections = self.connections
        invite = call.invite
        counted = connections.enter(call.client)
        try:
            if not counted:
                connections.metrics.rejections.inc(reason="too_many_connections")
                invite.reject(486, "Busy Here")
                return
            offer = invite.sdp_offer
            if (
                media_address(offer, self.config.sip_host) is None
                or offer is None
                or offer.audio is None
                or not any(c.payload_type in CODECS for c in offer.audio.codecs)
            ):
                # No audio, none in G.711, or no IP address to send it to: refused before it rings.
                invite.reject(488, "Not Acceptable Here")
                return
            slot = await connections.admit()
            if isinstance(slot, Refusal):
                connections.metrics.rejections.inc(reason=slot.code)
                invite.reject(486, "Busy Here")
                log.info("phone call %s from %s refused: %s", call.id, call.client, slot.text)
                return
            served = False
            try:
                served = await self._ring_and_serve(call, slot)
            finally:
                if not served:
                    await slot.end_session()
        except Exception:
            log.exception("phone call %s failed", call.id)
            if invite.dialog.state.name not in ("CONFIRMED", "TERMINATED"):
                invite.reject(500, "Server Internal Error")
        finally:
            call.end(call.why or "session ended")
            await call.wait_closed()  # never raises: what follows always runs
            self.calls.pop(call.id, None)
            self._by_dialog.pop(invite.call_id, None)
            self._sweep()
            if counted:
                connections.leave(call.client)

    async def _ring_and_serve(self, call: PhoneCall, slot: Any) -> bool:
        """Ring until the application answers; serve the session if it accepts. Whether a session was served."""
        cfg = self.config
        invite = call.invite
        invite.ringing()
        if cfg.sip_webhook_url is not None:
            post = asyncio.get_running_loop().create_task(self._post_incoming(call), name=f"{call.id}-webhook")
            self.tasks.add(post)  # kept until done (a failed post is logged; shutdown waits for it as for calls)
            post.add_done_callback(self.tasks.discard)
            try:
                answer = await asyncio.wait_for(asyncio.shield(call.answer), cfg.sip_answer_timeout_s)
            except TimeoutError:
                invite.reject(480, "Temporarily Unavailable")
                call.end(f"not answered within {cfg.sip_answer_timeout_s:g} s")
                return False
        elif cfg.sip_accept:
            answer = self._session({})
            call.answer.set_result(answer)
        else:
            answer = 603
            call.answer.set_result(answer)
            invite.reject(603, "Decline")
        if isinstance(answer, int) or call.gone.is_set():
            call.end(call.why or "rejected")
            return False
        session = answer
        try:
            sdp = await call.start_media(
                cfg.sip_host, cfg.sip_advertised_host, self.media_ports, cfg.sip_media_timeout_s
            )
        except (ValueError, OSError, SdpNegotiationError) as exc:
            log.info("phone call %s: no media: %s", call.id, exc)
            invite.reject(503 if isinstance(exc, OSError) else 488)
            return False
        invite.accept(sdp)
        log.info("phone call %s from %s answered (%s)", call.id, call.client, invite.caller)

        async def receive(port: Any) -> str | None:
            call.keypad = port.dtmf
            return await self.connections.receive_call(call, port)  # type: ignore[arg-type]

        await self.connections.serve(slot, call, session, call.client, receive)
        return True

    async def _post_incoming(self, call: PhoneCall) -> None:
        """Post ``realtime.call.incoming`` to the operator's webhook (a failure is logged; the call rings on)."""
        cfg = self.config
        assert cfg.sip_webhook_url is not None
        invite = call.invite.invite
        headers = [
            {"name": name, "value": str(value)}
            for name, values in invite.headers.items()
            if name.lower() not in ("authorization", "proxy-authorization")
            for value in (values if isinstance(values, list) else [values])
        ]
        event_id = new_id("evt")
        body = json.dumps(
            {
                "object": "event",
                "id": event_id,
                "type": "realtime.call.incoming",
                "created_at": int(time.time()),
                "data": {"call_id": call.id, "sip_headers": headers, "sip_media_security": "rtp"},
            }
        ).encode()
        sent = {"Content-Type": "application/json", "User-Agent": "s2s-rt"}
        if cfg.sip_webhook_secret:
            stamp = int(time.time())
            sent |= {
                "webhook-id": event_id,
                "webhook-timestamp": str(stamp),
                "webhook-signature": sign_webhook(cfg.sip_webhook_secret, event_id, stamp, body),
            }
        post = functools.partial(_post, cfg.sip_webhook_url, body, sent, cfg.sip_answer_timeout_s)
        try:
            status = await asyncio.to_thread(post)
            log.info("phone call %s: webhook answered %d", call.id, status)
        except Exception as exc:
            log.warning("phone call %s: the webhook %s failed: %r", call.id, cfg.sip_webhook_url, exc)

    # --- the application's side (POST /v1/realtime/calls/{call_id}/...) -------------------------

    def _session(self, config: dict[str, Any]) -> Session:
        """A call's session, configured as ``accept`` asked (as a ``session.update`` would).

        Raises:
            ProtocolError: a configuration the session refuses.
        """
        update, transcription = session_update(config or None, "session")
        session = self.connections.new_session(GA, transcription=transcription, model=None)
        if update is not None:
            session.handle(update)
        return session

    def act(self, call_id: str, action: str, body: bytes) -> Response:
        """``accept``, ``reject``, ``refer`` or ``hangup`` a phone call (the caller has an API key)."""
        call = self.calls.get(call_id)
        if call is None or call.gone.is_set():
            return api_error(HTTPStatus.NOT_FOUND, "call_not_found", f"No call {call_id!r} is in progress")
        try:
            params = json_of(body) if body.strip() else {}
            if not isinstance(params, dict):
                raise ProtocolError("invalid_value", "the body must be a JSON object")
            answered = call.answer.done()
            if answered and action in ("accept", "reject"):
                return api_error(HTTPStatus.CONFLICT, "call_already_answered", f"Call {call_id} was answered already")
            if action == "accept":
                # The session is made here: a configuration it refuses is this request's 400, and the call rings on.
                call.answer.set_result(self._session(params))
            elif action == "reject":
                status = params.get("status_code", 603)
                if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 699:
                    raise ProtocolError(
                        "invalid_value", "status_code must be a SIP status, 400-699", param="status_code"
                    )
                call.invite.reject(status)
                call.answer.set_result(status)
            elif action == "refer":
                target = params.get("target_uri")
                if (
                    not isinstance(target, str)
                    or not target.startswith(("sip:", "sips:", "tel:"))
                    or len(target) > 512
                    or any(c.isspace() or c in '<>"' or ord(c) < 32 for c in target)
                ):
                    raise ProtocolError(
                        "invalid_value", "target_uri must be a sip:, sips: or tel: URI", param="target_uri"
                    )
                if call.invite.dialog.state.name != "CONFIRMED":
                    return api_error(HTTPStatus.CONFLICT, "call_not_answered", f"Call {call_id} is not answered")
                agent = next(a for a in self._agents if a.transport is call.invite.transport)
                assert agent.uac is not None
                agent.uac.send_refer(call.invite.dialog, target, call.invite.source_addr)
            else:  # hangup
                if answered:
                    call.end("hung up")
                else:
                    call.invite.reject(603)
                    call.answer.set_result(603)
        except ProtocolError as exc:
            return api_error(HTTPStatus.BAD_REQUEST, exc.code, exc.message, exc.param)
        return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, Headers([("Content-Length", "0")]), b"")


def free_port(host: str) -> int:
    """A port free for both UDP and TCP on ``host``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((host, 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind((host, port))
                except OSError:
                    continue
                return port
    raise OSError("no port free for both UDP and TCP")
