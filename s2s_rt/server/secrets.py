"""Client secrets (``ek_…``): short-lived keys a backend mints for a browser or a phone.

A secret opens sessions (WebSocket or WebRTC) until it expires, and nothing
else: it cannot mint another secret, drain the server or read ``/v1/pool``.
It may carry a session configuration, which every session it opens starts with.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError

PREFIX = "ek_"
#: As OpenAI's: 10 minutes when ``expires_after`` is not given, 10 seconds at least.
DEFAULT_EXPIRY_S = 600
MIN_EXPIRY_S = 10


@dataclass(frozen=True, slots=True)
class ClientSecret:
    """One minted secret.

    Attributes:
        value: what the client presents (``ek_`` and 32 random bytes, URL-safe).
        expires_at: Unix time (seconds) after which it opens nothing.
        update: the session configuration it carries, as a ``session.update`` (None: none).
        transcription: the configuration is a transcription session's.
    """

    value: str
    expires_at: int
    update: ce.SessionUpdate | None
    transcription: bool

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


class ClientSecrets:
    """The process's minted secrets, forgotten once expired.

    Args:
        max_expiry_s: the longest ``expires_after.seconds`` a caller may ask for.
        max_held: how many unexpired secrets may exist at once (a caller minting in a loop is refused past it).
    """

    def __init__(self, max_expiry_s: int, max_held: int = 100_000) -> None:
        self.max_expiry_s = max_expiry_s
        self.max_held = max_held
        self._held: dict[str, ClientSecret] = {}

    def __len__(self) -> int:
        return len(self._held)

    def mint(self, body: Any) -> ClientSecret:
        """A new secret from a ``POST /v1/realtime/client_secrets`` body (a JSON object, or None).

        Raises:
            ProtocolError: a field of the wrong type, an expiry out of range, a session configuration
                a ``session.update`` would refuse, or too many secrets held.
        """
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise ProtocolError("invalid_request_error", "The body must be a JSON object")
        unknown = set(body) - {"expires_after", "session"}
        if unknown:
            name = sorted(unknown)[0]
            raise ProtocolError("unknown_parameter", f"Unknown parameter: {name!r}", param=name)
        seconds = DEFAULT_EXPIRY_S
        expires = body.get("expires_after")
        if expires is not None:
            if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
                raise ProtocolError(
                    "invalid_value", "expires_after must be {anchor: 'created_at', seconds: N}", param="expires_after"
                )
            asked = expires.get("seconds", DEFAULT_EXPIRY_S)
            if type(asked) is not int or not MIN_EXPIRY_S <= asked <= self.max_expiry_s:
                raise ProtocolError(
                    "invalid_value",
                    f"expires_after.seconds must be an integer from {MIN_EXPIRY_S} to {self.max_expiry_s}",
                    param="expires_after.seconds",
                )
            seconds = asked
        update, transcription = session_update(body.get("session"), "session")
        self._forget_expired()
        if len(self._held) >= self.max_held:
            raise ProtocolError("rate_limit_exceeded", f"{self.max_held} client secrets are live; try again later")
        secret = ClientSecret(PREFIX + secrets.token_urlsafe(32), int(time.time()) + seconds, update, transcription)
        self._held[secret.value] = secret
        return secret

    def find(self, offered: str) -> ClientSecret | None:
        """The live secret ``offered`` names (compared in constant time per candidate), or None."""
        secret = self._held.get(offered)
        if secret is None or not hmac.compare_digest(secret.value.encode(), offered.encode()):
            return None
        if secret.expired():
            del self._held[offered]
            return None
        return secret

    def forget(self, value: str) -> None:
        self._held.pop(value, None)

    def _forget_expired(self) -> None:
        now = time.time()
        for value in [v for v, s in self._held.items() if s.expired(now)]:
            del self._held[value]


def session_update(config: Any, param: str) -> tuple[ce.SessionUpdate | None, bool]:
    """A session configuration (as ``session.update`` carries it) checked and decoded; None for none.

    Returns:
        The update to apply when a session starts, and whether it configures a transcription session.

    Raises:
        ProtocolError: not an object, or fields a ``session.update`` would refuse.
    """
    if config is None:
        return None, False
    if not isinstance(config, dict):
        raise ProtocolError("invalid_value", f"{param} must be an object", param=param)
    try:
        event = ce.decode_client_event(msgspec.json.encode({"type": "session.update", "session": config}))
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, param=f"{param}.{exc.param}" if exc.param else param) from None
    assert isinstance(event, ce.SessionUpdate)
    return event, config.get("type") == "transcription"
