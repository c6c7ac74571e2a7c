"""HTTP on the session port: health, readiness, the pool, metrics, the operator's drain, and the browser page."""

from __future__ import annotations

import json
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from s2s_rt.config import Config
from s2s_rt.engines.base import Stack
from s2s_rt.metrics import Metrics
from s2s_rt.server.handshake import REALTIME_PATHS, authorized, check, is_loopback, plain, unauthorized
from s2s_rt.server.pool import Pool
from s2s_rt.server.state import Serving

#: The header operator requests (``POST /drain``, ``POST /undrain``) must carry, with the value 1.
OPERATOR_HEADER = "S2S-Operator"


class Routes:
    """Answers the HTTP requests that are not session handshakes (and checks those that are).

    Args:
        server: whether it takes sessions, and its drain switch.
        pool: the slots (``/readyz``, ``/v1/pool``).
    """

    def __init__(self, config: Config, metrics: Metrics, server: Serving, pool: Pool, stack: Stack) -> None:
        self.config = config
        self.metrics = metrics
        self.server = server
        self.pool = pool
        self.stack = stack

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
            return check(self.config, self.metrics, request, self.server.closing or self.server.draining)
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

    def _operator(self, connection: ServerConnection, request: Request, path: str) -> Response:
        """``POST /drain`` and ``POST /undrain``, for operators only.

        A browser cannot send them cross-site: they need POST and the
        ``S2S-Operator`` header, which no form or image can carry (a script
        would need a CORS preflight this server never approves). With API
        keys set they also need a key; without keys, only this host may ask.
        """
        if request.method != "POST":
            response = plain(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST {path} with the header {OPERATOR_HEADER}: 1\n")
            response.headers["Allow"] = "POST"
            return response
        if request.headers.get_all(OPERATOR_HEADER) != ["1"]:
            return plain(HTTPStatus.FORBIDDEN, f"{path} needs the header {OPERATOR_HEADER}: 1\n")
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
