"""HTTP requests with bodies on the session port, read by h11.

The WebSocket library's HTTP parser refuses request bodies, and
``POST /v1/realtime/calls`` (an SDP offer) and
``POST /v1/realtime/client_secrets`` (JSON) have them. A connection whose
first bytes are ``POST`` or ``OPTIONS`` is therefore read by h11, a
well-kept HTTP/1.1 parser, instead (see
:meth:`~s2s_rt.server.direct.DirectConnection.data_received`): one request,
one answer, then the connection closes. Everything else on the port stays
with the WebSocket library. The WebSocket handshake's ``open_timeout``
bounds the whole exchange: a client that sends its body slowly is cut off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import h11
import msgspec
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.server.handshake import plain

log = logging.getLogger(__name__)

#: Largest request body read (an SDP offer is a few KB; a session configuration with tools, tens).
MAX_BODY = 256 * 1024
#: Methods whose requests go to h11 (the first bytes of a connection decide).
METHODS = (b"POST ", b"OPTIONS ")


class Peer:
    """Who sent a request, and the request (what the routes need of a connection)."""

    __slots__ = ("remote_address", "request")

    def __init__(self, remote_address: Any, request: Request) -> None:
        self.remote_address = remote_address
        self.request = request


#: Answers one request: its peer, the request (path and headers, as a handshake's) and its body.
Answer = Callable[[Peer, Request, bytes], Awaitable[Response]]


def is_post(first: bytes) -> bool | None:
    """Whether a connection's first bytes start a request for h11; None: too few bytes to tell."""
    for method in METHODS:
        if first.startswith(method):
            return True
        if method.startswith(first):
            return None
    return False


class Exchange:
    """One HTTP request read with h11, answered by ``answer``, then the connection closed.

    Args:
        transport: the connection's transport (written to, then closed).
        answer: what answers the request.
        tasks: where the answering task is kept until it ends (the server's set).
    """

    def __init__(self, transport: asyncio.Transport, answer: Answer, tasks: set[asyncio.Task[None]]) -> None:
        self.transport = transport
        self.answer = answer
        self.tasks = tasks
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        self.request: h11.Request | None = None
        self.body = bytearray()
        self.done = False

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        try:
            self.h11.receive_data(data)
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if isinstance(event, h11.Request):
                    self.request = event
                    length = _header(list(event.headers), b"content-length")
                    if length is not None and length.isdigit() and int(length) > MAX_BODY:
                        self._reply(plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"at most {MAX_BODY} bytes\n"))
                        return
                elif isinstance(event, h11.Data):
                    self.body += event.data
                    if len(self.body) > MAX_BODY:
                        self._reply(plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"at most {MAX_BODY} bytes\n"))
                        return
                elif isinstance(event, h11.EndOfMessage):
                    self._answer()
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    self.done = True
                    return
        except h11.RemoteProtocolError as exc:
            self._reply(plain(HTTPStatus(exc.error_status_hint), f"bad request: {exc}\n"))

    def refuse(self, why: str) -> None:
        """Answer 503 at once and close, if the request has not been read whole (else nothing: it is answered)."""
        if not self.done:
            self.done = True
            self._write(plain(HTTPStatus.SERVICE_UNAVAILABLE, f"{why}\n"))

    def eof(self) -> None:
        if not self.done:
            try:
                self.h11.receive_data(b"")
            except h11.RemoteProtocolError:
                pass

    def _answer(self) -> None:
        self.done = True
        assert self.request is not None
        req = self.request
        try:
            headers = Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers])
            request = Request(req.target.decode("ascii"), headers, req.method.decode("ascii"))
        except UnicodeDecodeError:
            self._write(plain(HTTPStatus.BAD_REQUEST, "the request target must be ASCII\n"))
            return
        peer = Peer(self.transport.get_extra_info("peername"), request)
        task = asyncio.get_running_loop().create_task(self._run(peer, request, bytes(self.body)), name="http-post")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, peer: Peer, request: Request, body: bytes) -> None:
        try:
            response = await self.answer(peer, request, body)
        except Exception:
            log.exception("answering %s %s failed", request.method, request.path)
            response = plain(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error\n")
        self._write(response)

    def _reply(self, response: Response) -> None:
        """Answer at once (the request was refused before its body was read)."""
        self.done = True
        self._write(response, unread=True)

    def _write(self, response: Response, unread: bool = False) -> None:
        if self.transport.is_closing():
            return
        body = bytes(response.body)
        headers = [(k, v) for k, v in response.headers.raw_items() if k.lower() not in ("content-length", "connection")]
        headers += [("Content-Length", str(len(body))), ("Connection", "close"), ("Server", "s2s-rt")]
        try:
            out = self.h11.send(h11.Response(status_code=response.status_code, headers=headers))
            out = (out or b"") + (self.h11.send(h11.Data(data=body)) or b"") if body else out
            out = (out or b"") + (self.h11.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            # h11 is in an error state (the request was malformed): write the answer by its own rules.
            out = _plain_bytes(response.status_code, headers, body)
        self.transport.write(out)
        if unread and self.transport.can_write_eof():
            # The client may still be sending: closing now would reset the connection before it reads the
            # answer. Half-close, and drop the connection a moment later (what it still sends is ignored).
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(1.0, self.transport.close)
            return
        self.transport.close()


def json_of(data: bytes, param: str | None = None) -> Any:
    """A JSON body (or form field) decoded, or a client's error.

    Python's ``json`` takes what the rest of the server cannot: a lone
    surrogate (``"\\ud800"``) is no text to encode again, and nesting thousands
    deep exhausts its recursion. msgspec refuses the first and bounds the
    second; both are the sender's fault.

    Raises:
        ProtocolError: ``invalid_json``.
    """
    where = f"The {param} field" if param else "The body"
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # raw bytes that are not UTF-8: the second
        raise ProtocolError("invalid_json", f"{where} is not JSON: {exc}", param=param) from None
    except RecursionError:
        raise ProtocolError("invalid_json", f"{where} is nested too deeply", param=param) from None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _plain_bytes(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
