"""HTTP on the session port: health, readiness, the pool, metrics, the operator's drain, and the browser page."""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from s2s_rt.config import Config
from s2s_rt.engines.base import Stack
from s2s_rt.metrics import Metrics
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import GA
from s2s_rt.server.calls import CALLS_PATH, Calls, api_error
from s2s_rt.server.connection import Connections
from s2s_rt.server.handshake import (
    REALTIME_PATHS,
    authorized,
    check,
    check_origin,
    client_host,
    is_loopback,
    origin_allowed,
    plain,
    unauthorized,
)
from s2s_rt.server.pool import Pool
from s2s_rt.server.posts import Peer, json_of
from s2s_rt.server.secrets import ClientSecret, ClientSecrets
from s2s_rt.server.sip import Phones
from s2s_rt.server.state import Serving

#: The header operator requests (``POST /drain``, ``POST /undrain``) must carry, with the value 1.
OPERATOR_HEADER = "S2S-Operator"
SECRETS_PATH = "/v1/realtime/client_secrets"
#: Where the page at ``/`` gets a client secret when the operator enables it (``--page-secrets``).
PAGE_SECRET_PATH = "/page/client_secret"
_HANGUP = re.compile(r"^/v1/realtime/calls/([A-Za-z0-9_-]{1,64})/hangup$")
#: What an application does with a phone call (:mod:`~s2s_rt.server.sip`): operators' routes, never pages'.
_CALL_ACTION = re.compile(r"^/v1/realtime/calls/([A-Za-z0-9_-]{1,64})/(accept|reject|refer|hangup)$")


class Routes:
    """Answers the HTTP requests that are not session handshakes (and checks those that are).

    Args:
        server: whether it takes sessions, and its drain switch.
        pool: the slots (``/readyz``, ``/v1/pool``).
    """

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        server: Serving,
        pool: Pool,
        stack: Stack,
        connections: Connections,
        calls: Calls,
        phones: Phones | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.server = server
        self.pool = pool
        self.stack = stack
        self.connections = connections
        self.secrets: ClientSecrets = connections.secrets
        self.calls = calls
        #: The phone calls (SIP), when the server takes them.
        self.phones = phones

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        response = self._route(connection, request)
        if response is not None and request.method == "HEAD":
            # The headers GET would get (Content-Length included), and no body.
            response = Response(response.status_code, response.reason_phrase, response.headers, b"")
        return response

    def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0].rstrip("/") or "/"
        if len(request.headers.get_all("Authorization")) > 1:
            return plain(HTTPStatus.BAD_REQUEST, "more than one Authorization header\n")
        if path in REALTIME_PATHS:
            return check(self.config, self.metrics, request, self.server.closing or self.server.draining, self.secrets)
        if path in ("/drain", "/undrain"):
            return self._operator(connection, request, path)
        if path == "/healthz":
            return plain(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            free = 0 if self.server.closing or self.server.draining or not self.server.admits() else self.pool.free
            status = HTTPStatus.OK if free else HTTPStatus.SERVICE_UNAVAILABLE
            return plain(status, f"{'ready' if free else 'not ready'}: {free} of {len(self.pool.slots)} slots free\n")
        if path == "/v1/pool":
            # Session ids and client addresses: only for those who hold a key, when keys are set.
            if not authorized(self.config.api_keys, request, subprotocol=False):
                return unauthorized()
            body = self.pool.describe() | {
                "closing": self.server.closing,
                "draining": self.server.draining,
                "stack": self.stack.name,
            }
            return plain(HTTPStatus.OK, json.dumps(body), "application/json")
        if path == "/metrics":
            return plain(HTTPStatus.OK, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/":
            return _static("index.html")
        if path.startswith("/static/"):
            return _static(path[len("/static/") :])
        return plain(HTTPStatus.NOT_FOUND, f"not found: {path}\n")

    # --- requests with bodies (read by h11: s2s_rt.server.posts) ------------------------

    async def answer_post(self, peer: Peer, request: Request, body: bytes) -> Response:
        """A POST (or a CORS preflight) on the session port.

        A page of a foreign origin gets neither: its preflight is refused (so its
        script never sends the request) and its POST is refused before it is read
        (a form or a ``no-cors`` fetch sends a POST without asking first).
        """
        path = request.path.split("?", 1)[0].rstrip("/") or "/"
        refused = check_origin(self.config, self.metrics, request)
        if refused is not None:
            return refused
        if request.method == "OPTIONS":
            return self._cors(request, self._preflight(request, path))
        if len(request.headers.get_all("Authorization")) > 1:
            response = plain(HTTPStatus.BAD_REQUEST, "more than one Authorization header\n")
        elif path == SECRETS_PATH:
            response = self._mint(request, body, authorized(self.config.api_keys, request, subprotocol=False))
        elif path == PAGE_SECRET_PATH and self.config.page_secrets:
            # The page's own secret: no key (the operator chose to let the page get one), no configuration.
            response = self._mint(request, b"", True)
        elif path == CALLS_PATH:
            shutting = self.server.closing or self.server.draining
            response = check(self.config, self.metrics, request, shutting, self.secrets) or await self.calls.create(
                request, body, self._client(peer, request)
            )
        elif (match := _CALL_ACTION.match(path)) is not None:
            call_id, action = match.groups()
            operator = bool(self.config.api_keys) and authorized(self.config.api_keys, request, subprotocol=False)
            phones = self.phones
            if phones is not None and call_id in phones.calls:
                if operator or not self.config.api_keys:
                    response = phones.act(call_id, action, body)
                else:
                    response = api_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", f"{action} a call with an API key")
            elif action == "hangup":
                response = self.calls.hangup(call_id, request, operator or not self.config.api_keys)
            else:
                response = api_error(HTTPStatus.NOT_FOUND, "call_not_found", f"No phone call {call_id!r} is ringing")
        else:
            routed = self._route(peer, request)  # type: ignore[arg-type]
            # None: a session path, which opens by a WebSocket handshake (GET), not by a POST.
            response = routed or plain(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"{path} opens a session by a WebSocket handshake (GET); WebRTC offers go to POST {CALLS_PATH}\n",
            )
        return self._cors(request, response)

    def _client(self, peer: Peer, request: Request) -> str:
        return client_host(peer, self.connections.trusted)  # type: ignore[arg-type]

    def _mint(self, request: Request, body: bytes, allowed: bool) -> Response:
        """``POST /v1/realtime/client_secrets``: an API key mints a secret (a secret mints nothing)."""
        if not allowed:
            return api_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "Minting a client secret needs an API key")
        try:
            parsed: Any = json_of(body) if body.strip() else None
            secret = self.secrets.mint(parsed)
            session = self._session_of(secret)
        except ProtocolError as exc:
            status = HTTPStatus.TOO_MANY_REQUESTS if exc.code == "rate_limit_exceeded" else HTTPStatus.BAD_REQUEST
            return api_error(status, exc.code, exc.message, exc.param)
        self.metrics.client_secrets.inc()
        answer = {"value": secret.value, "expires_at": secret.expires_at, "session": session}
        return plain(HTTPStatus.OK, json.dumps(answer), "application/json")

    def _session_of(self, secret: ClientSecret) -> dict[str, Any]:
        """The session a secret opens, as its sessions will start (checked as a ``session.update`` would be)."""
        session = self.connections.new_session(GA, transcription=secret.transcription, model=None)
        if secret.update is not None:
            try:
                session.handle(secret.update)
            except ProtocolError:
                self.secrets.forget(secret.value)
                raise
        rendered = session.render()
        rendered["client_secret"] = {"value": secret.value, "expires_at": secret.expires_at}
        rendered["expires_at"] = secret.expires_at
        return rendered

    def _preflight(self, request: Request, path: str) -> Response:
        """A CORS preflight (its origin was allowed): approved for the routes pages use, never for operators'.

        An operator route (``/drain``, ``/undrain``) or the operator's header asked
        for is refused whatever the origin: operators use programs, not pages.
        """
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        if path in ("/drain", "/undrain") or any(h.lower() == OPERATOR_HEADER.lower() for h in asked):
            self.metrics.rejections.inc(reason="origin")
            return plain(HTTPStatus.FORBIDDEN, f"{path} and the header {OPERATOR_HEADER} are not for web pages\n")
        if not (path in (SECRETS_PATH, PAGE_SECRET_PATH, CALLS_PATH) or _HANGUP.match(path)):
            return plain(HTTPStatus.NOT_FOUND, f"no route for a page at {path}\n")
        response = Response(HTTPStatus.NO_CONTENT.value, HTTPStatus.NO_CONTENT.phrase, Headers(), b"")
        response.headers["Access-Control-Allow-Methods"] = "POST, OPTIONS"
        # The headers the page's client sends (the SDKs add their own); keys travel in them, not in cookies.
        response.headers["Access-Control-Allow-Headers"] = ", ".join(asked) or "Authorization, Content-Type"
        response.headers["Access-Control-Max-Age"] = "600"
        return response

    def _cors(self, request: Request, response: Response) -> Response:
        """Let a page of an allowed origin read the answer (its origin was checked: one Origin at most)."""
        origin = request.headers.get("Origin")
        if origin is not None and origin_allowed(self.config, request, origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Location"
            response.headers["Vary"] = "Origin"
        return response

    def _operator(self, connection: ServerConnection, request: Request, path: str) -> Response:
        """``POST /drain`` and ``POST /undrain``, for operators only.

        A browser cannot send them: they need POST and the ``S2S-Operator``
        header, which no form or image can carry (a script would need a CORS
        preflight this server never approves for them), and a browser names
        its page in ``Origin``, which they refuse. With API keys set they also
        need a key; without keys, only this host may ask.
        """
        if request.method != "POST":
            response = plain(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST {path} with the header {OPERATOR_HEADER}: 1\n")
            response.headers["Allow"] = "POST"
            return response
        if request.headers.get_all(OPERATOR_HEADER) != ["1"]:
            return plain(HTTPStatus.FORBIDDEN, f"{path} needs the header {OPERATOR_HEADER}: 1\n")
        if request.headers.get_all("Origin"):
            # A browser names the page behind every POST; no page, not even this server's own, drains it.
            return plain(HTTPStatus.FORBIDDEN, f"{path} is not for web pages\n")
        if self.config.api_keys:
            if not authorized(self.config.api_keys, request, subprotocol=False):
                return unauthorized()
        elif not is_loopback(connection):
            return plain(HTTPStatus.FORBIDDEN, f"without API keys, {path} is only allowed from this host\n")
        if path == "/drain":
            self.server.drain()
            return plain(HTTPStatus.OK, f"draining: {self.pool.busy()} sessions still running\n")
        self.server.undrain()
        return plain(HTTPStatus.OK, f"taking new sessions: {self.pool.free} slots free\n")


STATIC_DIR = Path(__file__).parent.parent / "static"
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".wav": "audio/wav",
}


def _static(name: str) -> Response:
    """A file of the browser page, from the package (no build step)."""
    if "/" in name or "\\" in name or name.startswith(".") or not name:
        return plain(HTTPStatus.NOT_FOUND, "not found\n")
    path = STATIC_DIR / name
    if not path.is_file():
        return plain(HTTPStatus.NOT_FOUND, f"not found: /static/{name}\n")
    data = path.read_bytes()
    headers = Headers(
        [
            ("Content-Type", _CONTENT_TYPES.get(path.suffix, "application/octet-stream")),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-cache"),
        ]
    )
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, data)
