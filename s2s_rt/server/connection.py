"""One connection's life: refused or given a slot, its frames fed in under rate limits, its deadlines kept."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.http11 import Request

from s2s_rt.budget import EventBudget, Flood
from s2s_rt.config import Config, ConfigError, mib
from s2s_rt.engines.base import CountsTokens, Stack
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.ports import Channel, close_quickly
from s2s_rt.protocol.errors import ProtocolError, ServerFault
from s2s_rt.protocol.mcp import McpPolicy
from s2s_rt.protocol.server_events import BETA, GA, Dialect, encode_event
from s2s_rt.protocol.session import Session
from s2s_rt.protocol.truncation import ContextWindow
from s2s_rt.protocol.voices import Voices
from s2s_rt.server.direct import DirectConnection
from s2s_rt.server.handshake import (
    asked_model,
    client_host,
    names_a_call,
    offered_keys,
    peer,
    wants_beta,
    wants_transcription,
)
from s2s_rt.server.pool import Pool
from s2s_rt.server.secrets import PREFIX as SECRET_PREFIX
from s2s_rt.server.secrets import ClientSecret, ClientSecrets
from s2s_rt.server.state import Serving
from s2s_rt.server.webrtc import Call
from s2s_rt.slot import SessionPort, Slot

log = logging.getLogger(__name__)


class Connections:
    """Every connection of the server: per-address counts, the claim of a slot, the receive loop.

    Args:
        server: whether it takes sessions.
        pool: the slots.
        stack: the engines (their voices, for new sessions).

    Raises:
        ConfigError: ``voice_names`` maps a name to a voice that is not installed.
        secrets: the client secrets minted (a session opened with one starts with its configuration).
    """

    def __init__(
        self, config: Config, metrics: Metrics, server: Serving, pool: Pool, stack: Stack, secrets: ClientSecrets
    ) -> None:
        self.config = config
        self.secrets = secrets
        self.metrics = metrics
        self.server = server
        self.pool = pool
        self.stack = stack
        try:
            self.voices = Voices.of(stack.tts.voices, config.voice_names)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.per_ip: dict[str, int] = {}
        self.trusted = [ipaddress.ip_network(p, strict=False) for p in config.trusted_proxies]

    def enter(self, host: str) -> bool:
        """Count a connection (a WebSocket or a call) of ``host`` from now on; False when it is one too many.

        Counted before anything is awaited, so that connections arriving
        together are counted together; each :meth:`enter` is paired with a :meth:`leave`.
        """
        self.per_ip[host] = self.per_ip.get(host, 0) + 1
        limit = self.config.max_connections_per_ip
        return not limit or self.per_ip[host] <= limit

    def leave(self, host: str) -> None:
        self.per_ip[host] -= 1
        if not self.per_ip[host]:
            del self.per_ip[host]

    def too_many(self) -> tuple[str, str]:
        """The error code and text of a connection over the per-address limit."""
        return (
            "too_many_connections",
            f"At most {self.config.max_connections_per_ip} concurrent connections per client address",
        )

    async def handle(self, ws: ServerConnection, *, phone_calls: Callable[..., Awaitable[None]] | None = None) -> None:
        """Serve one connection, handshake to close (``phone_calls``: one naming a call, ``?call_id=``)."""
        host = client_host(ws, self.trusted)
        within = self.enter(host)
        try:
            if within and phone_calls is not None and names_a_call(ws.request):
                await phone_calls(ws)
            elif within:
                await self._serve_connection(ws, host)
            else:
                await self._refuse(ws, *self.too_many(), 1008)
        finally:
            self.leave(host)

    async def _refuse(self, ws: ServerConnection, code: str, text: str, close_code: int) -> None:
        self.metrics.rejections.inc(reason=code)
        self.metrics.errors.inc(code=code)
        dialect = BETA if wants_beta(ws.request) else GA
        err = Session(dialect).error(ServerFault(code, text))
        try:
            await ws.send(encode_event(err), text=True)
            await ws.close(close_code, code.replace("_", " "))
        except ConnectionClosed:
            pass

    async def admit(self) -> Slot | Refusal:
        """A slot for a new session (WebSocket or call), or why there is none."""
        cfg = self.config
        server = self.server
        slot = (
            None
            if server.closing or server.draining
            else await self.pool.claim(
                server.admits, min(cfg.drain_deadline_s, 2.0), lambda: server.closing or server.draining
            )
        )
        if slot is not None:
            return slot
        if server.closing or server.draining:
            return Refusal("shutting_down", "The server is not taking new sessions", 1013)
        if not server.admits():
            # Refused before the admitted sessions degrade.
            text = "The server is at capacity (listening to one more session would make every one late)"
            return Refusal("session_limit_reached", f"{text}; try again later", 1013)
        text = f"All {len(self.pool.slots)} sessions are in use; try again later"
        return Refusal("session_limit_reached", text, 1013)

    def new_session(self, dialect: Dialect, *, transcription: bool, model: str | None) -> Session:
        llm = self.stack.llm
        return Session(
            dialect,
            self.voices,
            max_conversation_bytes=mib(self.config.max_conversation_mib),
            transcription_only=transcription,
            model=model,
            window=ContextWindow(llm.context_tokens, llm.message_tokens) if isinstance(llm, CountsTokens) else None,
            mcp=McpPolicy(
                tuple(self.config.mcp_servers), self.config.mcp_timeout_s, self.config.mcp_max_output_kib << 10
            ),
        )

    async def _serve_connection(self, ws: ServerConnection, host: str) -> None:
        slot = await self.admit()
        if isinstance(slot, Refusal):
            await self._refuse(ws, slot.code, slot.text, slot.close_code)
            return
        host, port = client_host(ws, self.trusted), peer(ws)[1]
        client = f"{host}:{port}" if port is not None and host == peer(ws)[0] else host
        secret = self.secret_of(ws.request)
        try:
            session = self.new_session(
                BETA if wants_beta(ws.request) else GA,
                transcription=wants_transcription(ws.request) or (secret is not None and secret.transcription),
                model=asked_model(ws.request),
            )
            if secret is not None and secret.update is not None:
                session.handle(secret.update)
        except BaseException:
            await slot.end_session()
            raise
        assert isinstance(ws, DirectConnection)  # serve() makes every connection one
        await self.serve(slot, ws, session, client, functools.partial(self._receive_loop, ws))

    async def serve(
        self,
        slot: Slot,
        channel: Channel,
        session: Session,
        client: str,
        receive: Callable[[SessionPort], Awaitable[str | None]],
    ) -> None:
        """Serve a session on a claimed slot until ``receive`` returns (why the session ended, or None).

        ``receive`` feeds the session's port (:class:`~s2s_rt.slot.SessionPort`), the one thing of the
        slot a transport holds. The same for every transport: from the claim on, whatever happens, the
        slot is handed back.
        """
        started = time.monotonic()
        reason = "client closed"
        port: SessionPort | None = None
        try:
            self.metrics.sessions_total.inc()
            port = await slot.attach(channel, session, client)
            log.info(
                "session %s started on slot %d for %s (%s%s)",
                session.id,
                slot.index,
                client,
                "beta" if session.dialect.beta else "GA",
                f", {getattr(channel, 'transport', 'a call')}" if channel.playback.takes_audio else "",
                extra={
                    "fields": {"event": "session_start", "session": session.id, "slot": slot.index, "client": client}
                },
            )
            reason = await receive(port) or reason
        except ConnectionClosedOK:
            reason = "client closed"
        except ConnectionClosed:
            reason = "connection lost"
        except Exception:
            reason = "internal error"
            log.exception("slot %d: error while handling a session", slot.index)
            await close_quickly(channel, 1011, "internal error")
        finally:
            if channel.close_code not in (None, 1000, 1001, 1005) and reason == "client closed":
                reason = f"closed with {channel.close_code}"
            clean = await (port.end() if port is not None else slot.end_session())
            turns = session.turns
            log.info(
                "session %s ended on slot %d: %s after %.1f s, %d turns%s",
                session.id,
                slot.index,
                reason,
                time.monotonic() - started,
                turns,
                "" if clean else " (slot quarantined)",
                extra={
                    "fields": {
                        "event": "session_end",
                        "session": session.id,
                        "slot": slot.index,
                        "client": client,
                        "duration_s": round(time.monotonic() - started, 3),
                        "turns": turns,
                        "reason": reason,
                        "quarantined": not clean,
                    }
                },
            )

    def secret_of(self, request: Request | None) -> ClientSecret | None:
        """The live client secret a handshake or request presents, if any (the handshake checked it)."""
        if request is None:
            return None
        for offered in offered_keys(request):
            if offered.startswith(SECRET_PREFIX):
                found = self.secrets.find(offered)
                if found is not None:
                    return found
        return None

    async def receive_call(self, call: Call, port: SessionPort) -> str | None:
        """Feed a call's events (its data channel) and audio (its track) to its slot until the call ends.

        Events pass the same budget as a WebSocket's; audio is not an event
        (it comes in real time, and the input budget bounds it).

        Returns:
            Why the session ended.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        budget = EventBudget(cfg.max_events_per_s, cfg.max_events_burst)
        refusals = Refusals()
        activity = Activity(loop.time())
        watchdog = asyncio.create_task(self._watch(call, port, activity), name=f"slot{port.index}-watchdog")
        hear = functools.partial(port.hear, call.heard_format)

        def heard(pcm: bytes) -> None:
            # The caller's audio is its activity, as appends are a WebSocket's (idle_session_s counts from it).
            activity.last = loop.time()
            hear(pcm)

        call.hear = heard
        try:
            # The call's end (whoever ended it, the watchdog too) puts None in its inbox.
            while (message := await call.inbox.get()) is not None:
                if await self._one_message(port, message, loop.time(), activity, budget, refusals):
                    return "flood"
        finally:
            call.hear = None
            watchdog.cancel()
            await asyncio.wait((watchdog,))
        return call.why if watchdog.cancelled() else watchdog.result()

    async def _receive_loop(self, ws: ServerConnection, port: SessionPort) -> str | None:
        """Feed the client's frames to its slot until the socket closes or a limit ends the session.

        One watchdog per connection keeps its deadlines (session length,
        idleness, a client that stopped reading), so a message costs no timer.

        Returns:
            Why the session ended, when a limit ended it.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        budget = EventBudget(cfg.max_events_per_s, cfg.max_events_burst)
        refusals = Refusals()
        activity = Activity(loop.time())
        assert isinstance(ws, DirectConnection)  # serve() makes every connection one
        watchdog = asyncio.create_task(self._watch(ws, port, activity), name=f"slot{port.index}-watchdog")

        def direct(data: bytes | bytearray | memoryview) -> bool:
            # An append is handled as its frame is parsed: no task wakes per message.
            now = loop.time()
            activity.last = now
            if not budget.take(now):
                # Refused as it is parsed, undecoded: a flood's frames cost a count each, not a
                # trip through the queue and recv(), and the connection's next frames are read
                # later (see DirectConnection.refusing). The usual way sends the notice and closes.
                ws.refusing()
                return refusals.refuse_quietly(now, cfg.flood_close_s)
            if refusals.unreported:
                budget.give_back()
                return False  # a notice is owed first: the usual way sends it
            # Not UTF-8 is not valid JSON either: declined, and the usual way closes with 1007.
            if not port.receive_now(data):
                budget.give_back()
                return False
            refusals.accepted(now)
            return True

        ws.direct = direct
        try:
            async for message in ws:
                # From here until it is handled, nothing may overtake it on the direct route.
                with ws.handling():
                    if await self._one_message(port, message, loop.time(), activity, budget, refusals):
                        return "flood"
                    if refusals.unreported:
                        ws.refusing()  # refused the usual way: the connection's next frames wait too
        finally:
            ws.direct = None
            # The watchdog is owned here: it ends with the connection, and is waited for.
            watchdog.cancel()
            await asyncio.wait((watchdog,))
        if watchdog.cancelled():
            return None
        return watchdog.result()

    async def _one_message(
        self,
        port: SessionPort,
        message: str | bytes,
        now: float,
        activity: Activity,
        budget: EventBudget,
        refusals: Refusals,
    ) -> bool:
        """Handle one message that came the usual way; True when the connection is flooding and was closed."""
        cfg = self.config
        activity.last = now
        if budget.take(now):
            unreported = refusals.accepted(now)
            if unreported:
                await self._refused(port, unreported)
            await port.receive(message)
            return False
        # Refusing must cost less than the abuse: one notice a second, with a count.
        unreported = refusals.refuse(now)
        if unreported:
            await self._refused(port, unreported)
        if refusals.flooding_for(now) >= cfg.flood_close_s:
            text = f"Events were refused for {cfg.flood_close_s:g} s in a row; closing this connection"
            await port.end_with_error(ProtocolError("rate_limit_flood", text), 1008)
            return True
        return False

    async def _refused(self, port: SessionPort, count: int) -> None:
        cfg = self.config
        self.metrics.errors.inc(count - 1, code="rate_limit_exceeded")
        await port.error(
            ProtocolError(
                "rate_limit_exceeded",
                f"Too many events: at most {cfg.max_events_per_s:g} per second (burst {cfg.max_events_burst});"
                f" {count} event(s) were not processed since the last notice",
            )
        )

    async def _watch(self, ws: Channel, port: SessionPort, activity: Activity) -> str:
        """Sleep until the connection's next deadline; end the session when one has passed."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        expires = activity.last + cfg.max_session_s
        while True:
            idle_at = activity.last + cfg.idle_session_s if cfg.idle_session_s > 0 else expires
            send_check = loop.time() + cfg.send_timeout_s
            await asyncio.sleep(max(0.0, min(expires, idle_at, send_check) - loop.time()))
            now = loop.time()
            if port.stuck_for() >= cfg.send_timeout_s:
                # The client stopped reading and its buffers are full: close it
                # (1008) rather than let its output pile up. Only this slot waits.
                self.metrics.errors.inc(code="client_not_reading")
                log.warning("slot %d: client %s stopped reading; closing it", port.index, port.client)
                await close_quickly(ws, 1008, "client is not reading its events")
                return "client not reading"
            expired = now >= expires
            if expired or (cfg.idle_session_s > 0 and now >= activity.last + cfg.idle_session_s):
                text = (
                    f"The session reached its maximum duration of {cfg.max_session_s:g} s"
                    if expired
                    else f"The session was idle for {cfg.idle_session_s:g} s"
                )
                await port.end_with_error(ProtocolError("session_expired", text, type="invalid_request_error"), 1001)
                return "expired" if expired else "idle"


class Refusal(NamedTuple):
    """Why a new session gets no slot: an error code and text, and the WebSocket close code."""

    code: str
    text: str
    close_code: int


class Activity:
    """When a connection last sent something (loop time)."""

    __slots__ = ("last",)

    def __init__(self, now: float) -> None:
        self.last = now


class Refusals:
    """Events a connection had refused: when to tell it, and how long it has been flooding."""

    __slots__ = ("flood", "last_notice", "unreported")

    def __init__(self) -> None:
        self.unreported = 0
        self.last_notice: float | None = None
        self.flood = Flood()

    def refuse(self, now: float) -> int:
        """Count a refusal; returns how many to report now (0: not yet, one notice a second)."""
        self.unreported += 1
        self.flood.refused(now)
        if self.last_notice is None or now - self.last_notice >= 1.0:
            n, self.unreported, self.last_notice = self.unreported, 0, now
            return n
        return 0

    def refuse_quietly(self, now: float, close_after_s: float) -> bool:
        """Count a refusal that needs nothing said or done now; False (not counted) if a notice or the close is due."""
        if self.last_notice is None or now - self.last_notice >= 1.0:
            return False
        if self.flood.past(now, close_after_s):
            return False
        self.unreported += 1
        self.flood.refused(now)
        return True

    def accepted(self, now: float) -> int:
        """Count an accepted event; returns refusals not yet reported that are due now (else 0)."""
        self.flood.accepted(now)
        if self.unreported and self.last_notice is not None and now - self.last_notice >= 1.0:
            n, self.unreported, self.last_notice = self.unreported, 0, now
            return n
        return 0

    def flooding_for(self, now: float) -> float:
        return self.flood.lasted(now)
