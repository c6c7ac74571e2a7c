"""The calls of the server: ``POST /v1/realtime/calls`` and ``/v1/realtime/calls/{id}/hangup``.

A call takes its slot from the same pool, through the same admission, as a
WebSocket (:meth:`~s2s_rt.server.connection.Connections.admit`), and its
session is served by the same code (:meth:`~s2s_rt.server.connection.Connections.serve`);
:mod:`s2s_rt.server.webrtc` carries it.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import functools
import json
import logging
import os
from http import HTTPStatus
from typing import Any

import aioice
import aiortc
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from s2s_rt.config import Config, port_range
from s2s_rt.metrics import Metrics
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import BETA, GA, new_id
from s2s_rt.server.call_sockets import CallSockets
from s2s_rt.server.connection import Connections, Refusal
from s2s_rt.server.handshake import asked_model, offered_keys, wants_beta, wants_transcription
from s2s_rt.server.posts import json_of
from s2s_rt.server.secrets import session_update
from s2s_rt.server.webrtc import Call, check_consent_often, ice_configuration

log = logging.getLogger(__name__)

CALLS_PATH = "/v1/realtime/calls"


def api_error(status: HTTPStatus, code: str, message: str, param: str | None = None) -> Response:
    """An error as OpenAI's HTTP API answers one (``{"error": {...}}``), which the SDK raises as its own."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": code, "param": param}}).encode()
    headers = Headers(
        [("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")]
    )
    return Response(status.value, status.phrase, headers, body)


#: What an offer may hold. A browser's has two or three media sections (audio, the data channel, perhaps video)
#: and a few candidates each; aiortc's parsing costs more than linearly in what it is given (2,400 sections
#: held the loop 1.7 s), and each candidate is a place it sends connectivity checks to.
MAX_SECTIONS = 8
MAX_CANDIDATES = 64
MAX_SDP_LINES = 1024
#: Parts of a multipart offer (the SDK sends ``sdp`` and ``session``); the form is parsed only within this.
MAX_PARTS = 8


def offer_of(request: Request, body: bytes) -> tuple[str, Any]:
    """The SDP offer and the session configuration (or None) of a ``POST /v1/realtime/calls``.

    Either ``application/sdp`` (the offer is the body) or ``multipart/form-data``
    with ``sdp`` and an optional ``session`` (JSON), as the official SDK sends.

    Raises:
        ProtocolError: another content type, a part missing, more parts than
            :data:`MAX_PARTS`, JSON that is not, or an offer over the bounds (:func:`check_offer`).
    """
    kind = request.headers.get("Content-Type", "")
    base = kind.split(";", 1)[0].strip().lower()
    if base in ("application/sdp", "text/plain"):
        return check_offer(body.decode("utf-8", "replace")), None
    if base != "multipart/form-data":
        raise ProtocolError(
            "invalid_request_error",
            f"Send the offer as application/sdp or multipart/form-data, not {kind or 'nothing'}",
        )
    # The standard library's MIME parser reads the form: it needs the Content-Type in front of the body.
    head = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + kind.encode("latin-1") + b"\r\n\r\n"
    )
    boundary = head.get_boundary()
    # RFC 2046: 1 to 70 characters. Every part begins with "--" and the boundary: counted before parsing.
    if not boundary or len(boundary) > 70 or body.count(b"--" + boundary.encode("latin-1")) > MAX_PARTS + 1:
        raise ProtocolError(
            "invalid_request_error", f"The form needs a boundary of 1 to 70 characters and at most {MAX_PARTS} parts"
        )
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + kind.encode("latin-1") + b"\r\n\r\n" + body
    )
    fields: dict[str, bytes] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = payload if isinstance(payload, bytes) else b""
    if "sdp" not in fields:
        raise ProtocolError("missing_required_parameter", "The form has no sdp field", param="sdp")
    session: Any = json_of(fields["session"], "session") if fields.get("session") else None
    return check_offer(fields["sdp"].decode("utf-8", "replace")), session


def check_offer(sdp: str) -> str:
    """``sdp``, if it is within what an offer may hold (:data:`MAX_SECTIONS`, :data:`MAX_CANDIDATES` and lines).

    Raises:
        ProtocolError: ``invalid_offer``.
    """
    lines = sdp.splitlines()
    sections = sum(line.startswith("m=") for line in lines)
    candidates = sum(line.startswith("a=candidate") for line in lines)
    if len(lines) > MAX_SDP_LINES or sections > MAX_SECTIONS or candidates > MAX_CANDIDATES:
        raise ProtocolError(
            "invalid_offer",
            f"An offer may have at most {MAX_SECTIONS} media sections, {MAX_CANDIDATES} candidates and"
            f" {MAX_SDP_LINES} lines; this one has {sections}, {candidates} and {len(lines)}",
            param="sdp",
        )
    return sdp


#: Where the WebRTC libraries' own code lies: a task running it belongs to some call's peer connection.
_LIBRARIES = tuple(os.path.dirname(module.__file__ or "") + os.sep for module in (aiortc, aioice))


def contain_library_tasks(metrics: Metrics) -> None:
    """Log a failure of a task that aiortc or aioice started and never awaits as a call's failure, not the loop's.

    aiortc starts some of a peer connection's work with ``ensure_future`` and
    keeps no handle to it (connecting the transports, sending on SCTP).
    When a call is closed while such a task is between two steps, the task
    fails ("'NoneType' object has no attribute 'transport'", "Cannot send
    data, not connected") and asyncio reports an exception never retrieved,
    as if the process had lost track of a task. It has not: the call the
    task served has ended or fails its consent checks and ends within
    seconds, which ends its session and frees its slot. Such a failure is
    logged as a warning and counted (``webrtc_task_failed``); any other
    task's goes to the handler there was before.
    """
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        future, exc = context.get("future"), context.get("exception")
        coro = future.get_coro() if isinstance(future, asyncio.Task) else None
        where = getattr(getattr(coro, "cr_code", None), "co_filename", "")
        if isinstance(exc, Exception) and where.startswith(_LIBRARIES):
            metrics.errors.inc(code="webrtc_task_failed")
            log.warning("a WebRTC call's own task %s failed: %r", getattr(coro, "__qualname__", coro), exc)
        elif before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


class Calls:
    """Every WebRTC call of the server, from its offer to its hangup.

    Args:
        connections: admission, sessions and their serving (shared with the WebSocket).
    """

    def __init__(self, config: Config, connections: Connections) -> None:
        self.config = config
        self.connections = connections
        self.configuration = ice_configuration(config.ice_servers)
        check_consent_often()
        #: Every call's UDP sockets: where they are bound, and read on a clock (its task: :meth:`CallSockets.run`).
        media_ports = port_range(config.media_ports) if config.media_ports is not None else None
        self.sockets = CallSockets(media_ports, config.media_poll_ms / 1000)
        contain_library_tasks(connections.metrics)
        self.calls: dict[str, Call] = {}
        #: Each call's serving task, until its session has ended and its peer connection closed.
        self.tasks: set[asyncio.Task[None]] = set()

    async def create(self, request: Request, body: bytes, client: str) -> Response:
        """Answer an offer: a slot claimed, the session made, the SDP answer (201, ``Location``)."""
        connections = self.connections
        self.sockets.install()  # as its task did when the server started (a test's loop may lack the task)
        try:
            offer, config = offer_of(request, body)
            update, transcription = session_update(config, "session")
        except ProtocolError as exc:
            return api_error(HTTPStatus.BAD_REQUEST, exc.code, exc.message, exc.param)
        secret = connections.secret_of(request)
        # A call counts as a connection of its address, as a WebSocket does: from before its first await,
        # so that offers sent together are counted together.
        if not connections.enter(client):
            connections.leave(client)
            code, text = connections.too_many()
            connections.metrics.rejections.inc(reason=code)
            return api_error(HTTPStatus.TOO_MANY_REQUESTS, code, text)
        served = False
        try:
            response, served = await self._answer(request, offer, update, transcription, secret, client)
            return response
        finally:
            if not served:
                connections.leave(client)

    async def _answer(
        self, request: Request, offer: str, update: Any, transcription: bool, secret: Any, client: str
    ) -> tuple[Response, bool]:
        """The rest of :meth:`create`: the slot, the session, the answer; or a refusal.

        Returns:
            The response, and whether a call is served (its serving task then owns the address's count).
        """
        connections = self.connections
        slot = await connections.admit()
        if isinstance(slot, Refusal):
            connections.metrics.rejections.inc(reason=slot.code)
            return api_error(HTTPStatus.SERVICE_UNAVAILABLE, slot.code, slot.text), False
        metrics = connections.metrics
        call = Call(
            new_id("rtc"), self.configuration, lambda: metrics.media_dropped.inc(transport="webrtc"), self.sockets
        )
        call.secret = secret.value if secret is not None else None
        try:
            session = connections.new_session(
                BETA if wants_beta(request) else GA,
                transcription=wants_transcription(request) or transcription or bool(secret and secret.transcription),
                model=asked_model(request),
            )
            for carried in (secret.update if secret else None, update):
                if carried is not None:
                    session.handle(carried)
            answer = await call.answer(offer)
        except BaseException as exc:
            call.end("refused")
            await slot.end_session()
            await call.wait_closed()
            if isinstance(exc, ProtocolError):
                return api_error(HTTPStatus.BAD_REQUEST, exc.code, exc.message, exc.param), False
            if isinstance(exc, Exception):
                # aiortc's parser and negotiation fail on a malformed offer with whatever Python raises
                # (AssertionError, KeyError, AttributeError, ValueError...): the offer's fault, not ours.
                log.info("call offer from %s refused: %s: %s", client, type(exc).__name__, exc)
                text = f"The SDP offer cannot be answered: {type(exc).__name__}: {exc}"[:500]
                return api_error(HTTPStatus.BAD_REQUEST, "invalid_offer", text), False
            raise
        self.calls[call.id] = call
        task = asyncio.get_running_loop().create_task(self._serve(call, slot, session, client), name=call.id)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        data = answer.encode()
        headers = Headers(
            [
                ("Content-Type", "application/sdp"),
                ("Content-Length", str(len(data))),
                ("Location", f"{CALLS_PATH}/{call.id}"),
                ("Cache-Control", "no-store"),
            ]
        )
        return Response(HTTPStatus.CREATED.value, HTTPStatus.CREATED.phrase, headers, data), True

    async def _serve(self, call: Call, slot: Any, session: Any, client: str) -> None:
        timeout = self.config.call_timeout_s
        try:
            opened = asyncio.ensure_future(call.opened.wait())
            gone = asyncio.ensure_future(call.gone.wait())
            await asyncio.wait((opened, gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
            gone.cancel()
            if not call.opened.is_set():
                why = call.why or f"its data channel did not open within {timeout:g} s (ICE did not complete)"
                call.end(why)
                await slot.end_session()
                log.info("call %s from %s ended before its session began: %s", call.id, client, why)
                return
            receive = functools.partial(self.connections.receive_call, call)
            await self.connections.serve(slot, call, session, client, receive)
        except Exception:
            log.exception("call %s failed", call.id)
        finally:
            call.end(call.why or "session ended")
            self.calls.pop(call.id, None)
            self.connections.leave(client)
            await call.wait_closed()

    def hangup(self, call_id: str, request: Request, operator: bool) -> Response:
        """``POST /v1/realtime/calls/{id}/hangup``: by an API key, or by the client secret that opened the call."""
        call = self.calls.get(call_id)
        if call is None:
            return api_error(HTTPStatus.NOT_FOUND, "call_not_found", f"No call {call_id!r} is in progress")
        if not operator and (call.secret is None or call.secret not in offered_keys(request, subprotocol=False)):
            return api_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "Hang up with an API key or the call's secret")
        call.end("hung up")
        return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, Headers([("Content-Length", "0")]), b"")

    async def close(self) -> None:
        """End every call (shutdown) and wait until their sessions have ended."""
        for call in list(self.calls.values()):
            call.end("the server is shutting down")
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.config.drain_deadline_s + 2.0)
