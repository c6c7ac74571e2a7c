"""The WebSocket handshake: which paths are sessions, API keys, subprotocols, and who the client is.

Everything here reads the HTTP request of a handshake (or of a plain HTTP
request on the same port) and decides nothing about sessions or slots.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from s2s_rt.config import Config
from s2s_rt.metrics import Metrics
from s2s_rt.server.secrets import PREFIX as SECRET_PREFIX
from s2s_rt.server.secrets import ClientSecrets

REALTIME_PATHS = ("/v1/realtime", "/realtime")
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
KEY_SUBPROTOCOL = "openai-insecure-api-key."


def check(
    config: Config, metrics: Metrics, request: Request, shutting: bool, secrets: ClientSecrets
) -> Response | None:
    """A request that opens a session (a handshake, or a call's offer): the refusal to send, or None.

    Args:
        shutting: the server is closing or draining (no new sessions).
        secrets: the client secrets minted; a live one opens a session as a key does.
    """
    if shutting:
        metrics.rejections.inc(reason="draining")
        return plain(HTTPStatus.SERVICE_UNAVAILABLE, "draining: no new sessions\n")
    if not opens_sessions(config.api_keys, secrets, request):
        metrics.rejections.inc(reason="unauthorized")
        return unauthorized()
    return check_origin(config, metrics, request)


def check_origin(config: Config, metrics: Metrics, request: Request) -> Response | None:
    """The refusal of a browser whose page is neither this server's own nor of an allowed origin, or None.

    A browser names the page that makes a request in ``Origin``; programs
    that are not browsers send none and are judged by their keys alone. A
    page elsewhere (any website the user visits) reaches a server on the
    user's own machine as easily as its own: it may open sessions or send
    requests only when the operator allowed its origin (``--allowed-origin``).
    """
    origins = request.headers.get_all("Origin")
    if len(origins) > 1:
        metrics.rejections.inc(reason="origin")
        return plain(HTTPStatus.BAD_REQUEST, "more than one Origin header\n")
    if origins and not origin_allowed(config, request, origins[0]):
        metrics.rejections.inc(reason="origin")
        return plain(
            HTTPStatus.FORBIDDEN,
            f"origin {origins[0]} is not allowed: only this server's own pages (at its address) and the origins"
            " it is started with (--allowed-origin; a server reached by a name allows https://NAME) may use it\n",
        )
    return None


def origin_allowed(config: Config, request: Request, origin: str) -> bool:
    """Whether a page of ``origin`` may use this server: one of its own pages, or an allowed origin."""
    return origin in config.allowed_origins or same_origin(origin, request.headers.get_all("Host"))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(origin: str, hosts: Sequence[str]) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the server's own: the address the request was sent to.

    Only an address counts (an IP literal or ``localhost``), not a name: a
    page of a name its owner points at this machine (DNS rebinding) would
    otherwise be "the server's own". A server reached by a name allows that
    name's origin explicitly (``--allowed-origin https://NAME``).
    """
    if len(hosts) != 1:
        return False
    try:
        page = urllib.parse.urlsplit(origin)
        target = urllib.parse.urlsplit(f"//{hosts[0].strip()}")
        if page.scheme not in _DEFAULT_PORTS or page.path or page.query or not page.hostname or not target.hostname:
            return False
        default = _DEFAULT_PORTS[page.scheme]
        same = page.hostname == target.hostname and (page.port or default) == (target.port or default)
        return same and _is_address(target.hostname)
    except ValueError:  # a port out of range, a bad IPv6 literal
        return False


def _is_address(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True  # resolved to loopback by browsers themselves, never by DNS
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def offered_keys(request: Request, *, subprotocol: bool = True) -> list[str]:
    """The keys a request presents: ``Authorization: Bearer``, and (handshakes) the browser's subprotocol."""
    offered: list[str] = []
    for auth in request.headers.get_all("Authorization"):
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
    for header in request.headers.get_all("Sec-WebSocket-Protocol") if subprotocol else ():
        for proto in header.split(","):
            proto = proto.strip()
            if proto.startswith(KEY_SUBPROTOCOL):
                offered.append(proto[len(KEY_SUBPROTOCOL) :])
    return offered


def authorized(keys: Sequence[str], request: Request, *, subprotocol: bool = True) -> bool:
    """Whether the request carries one of ``keys`` (always, when there are none): an API key, not a client secret.

    Args:
        subprotocol: also accept the browser's ``openai-insecure-api-key.KEY`` subprotocol
            (handshakes only; plain HTTP requests must send ``Authorization``).
    """
    if not keys:
        return True
    # Compare every offered key with every configured one, in constant time.
    ok = False
    for candidate in offered_keys(request, subprotocol=subprotocol):
        for key in keys:
            ok |= hmac.compare_digest(candidate.encode(), key.encode())
    return ok


def opens_sessions(keys: Sequence[str], secrets: ClientSecrets, request: Request, *, subprotocol: bool = True) -> bool:
    """Whether the request may open a session: an API key, or a live client secret.

    A client secret offered is checked even without API keys: an expired
    or unknown one is refused rather than ignored (with its configuration).
    """
    offered = offered_keys(request, subprotocol=subprotocol)
    ek = [o for o in offered if o.startswith(SECRET_PREFIX)]
    if ek:
        return any(secrets.find(o) is not None for o in ek)
    return authorized(keys, request, subprotocol=subprotocol)


def unauthorized() -> Response:
    response = plain(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
    response.headers["WWW-Authenticate"] = 'Bearer realm="s2s-rt"'
    return response


def plain(status: HTTPStatus, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    """An HTTP response with ``body`` (never cached)."""
    data = body.encode()
    headers = Headers(
        [("Content-Type", content_type), ("Content-Length", str(len(data))), ("Cache-Control", "no-store")]
    )
    return Response(status.value, status.phrase, headers, data)


def select_subprotocol(connection: ServerConnection, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
    # Answer "realtime" only when offered; a client offering none is fine too.
    return Subprotocol("realtime") if "realtime" in subprotocols else None


def wants_beta(request: Request | None) -> bool:
    if request is None:
        return False
    # A header may come more than once; get() would raise on that.
    if any("realtime=v1" in value for value in request.headers.get_all("OpenAI-Beta")):
        return True
    offered = ",".join(request.headers.get_all("Sec-WebSocket-Protocol"))
    return BETA_SUBPROTOCOL in [p.strip() for p in offered.split(",")]


def asked_model(request: Request | None) -> str | None:
    """The ``?model=`` a client connected with (None: none)."""
    if request is None or "?" not in request.path:
        return None
    asked = urllib.parse.parse_qs(request.path.split("?", 1)[1]).get("model")
    return asked[0] if asked else None


def wants_transcription(request: Request | None) -> bool:
    """``?intent=transcription`` on the URL: a transcription session (as OpenAI's)."""
    if request is None or "?" not in request.path:
        return False
    query = urllib.parse.parse_qs(request.path.split("?", 1)[1])
    return "transcription" in query.get("intent", [])


def is_loopback(connection: ServerConnection) -> bool:
    addr = connection.remote_address
    host = addr[0] if isinstance(addr, tuple) else str(addr)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer(ws: ServerConnection) -> tuple[str, int | None]:
    addr = ws.remote_address
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return str(addr), None


def client_host(ws: ServerConnection, trusted: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    """The client's address: the peer's, or, behind a trusted proxy, the one it forwarded for.

    ``X-Forwarded-For`` is read from the right, skipping trusted proxies; the
    header of a peer that is not a trusted proxy is ignored (anyone can send it).
    """
    host, _ = peer(ws)
    if not trusted or not _in(host, trusted) or ws.request is None:
        return host
    hops = [h.strip() for v in ws.request.headers.get_all("X-Forwarded-For") for h in v.split(",") if h.strip()]
    for hop in reversed(hops):
        if not _in(hop, trusted):
            return hop
    return hops[0] if hops else host


def _in(host: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def names_a_call(request: Request | None) -> bool:
    """Whether a WebSocket's handshake names a call (``?call_id=``) rather than asking for a session."""
    query = urllib.parse.urlsplit(request.path).query if request is not None else ""
    return "call_id" in urllib.parse.parse_qs(query, keep_blank_values=True)
