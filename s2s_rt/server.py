"""The server: one ``websockets`` asyncio server, the pool, and HTTP on the same port.

Use it from the CLI (``s2s-rt serve``) or embed it::

    async with Server(Config(port=0)) as server:
        print(server.port)
        ...

or ``await Server(config).run()`` until SIGINT/SIGTERM or :meth:`Server.close`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import ipaddress
import json
import logging
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from s2s_rt.config import Config
from s2s_rt.connection import DirectConnection
from s2s_rt.engines.base import Stack
from s2s_rt.inference import StagePool
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.outbox import close_quickly
from s2s_rt.pool import Pool
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import BETA, GA, encode_event
from s2s_rt.protocol.session import Session
from s2s_rt.slot import Slot
from s2s_rt.supervise import supervise
from s2s_rt.turn import SemanticTurnEnd

log = logging.getLogger("s2s_rt.server")

REALTIME_PATHS = ("/v1/realtime", "/realtime")
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
#: The header operator requests (``POST /drain``, ``POST /undrain``) must carry, with the value 1.
OPERATOR_HEADER = "S2S-Operator"


def load_stack(config: Config) -> Stack:
    """Build the engines the config names (blocking: loads models).

    With ``llm_url`` the LLM is that endpoint, on either stack, and no local
    LLM is prepared or loaded.
    """
    remote = None
    if config.llm_url is not None:
        from s2s_rt.engines.remote_llm import RemoteChatLLM

        remote = RemoteChatLLM(
            config.llm_url, config.llm_model, api_key=config.llm_api_key, timeout_s=config.llm_timeout_s
        )
    if config.stack == "fake":
        from s2s_rt.engines.fake import load_fake_stack

        stack = load_fake_stack(
            stt_delay_ms=config.fake_stt_delay_ms,
            llm_token_delay_ms=config.fake_llm_token_delay_ms,
            tts_delay_ms=config.fake_tts_delay_ms,
        )
        if remote is not None:
            stack = dataclasses.replace(stack, llm=remote, description=[*stack.description, remote.describe()])
        return stack
    from s2s_rt import models
    from s2s_rt.engines.default import load_default_stack

    preset = config.llm if config.llm in models.LLM_PRESETS else "default"
    prepared = models.ensure_prepared(
        config.models, llm=models.NO_LLM if remote else preset, progress=lambda line: log.info("%s", line)
    )
    llm_dir = None
    if remote is None:
        in_cache = config.llm in models.LLM_PRESETS
        llm_dir = prepared.llm if in_cache else models.resolve_llm_dir(config.llm, config.models)
    whisper_dir = models.resolve_whisper_dir(config.stt_model, config.models) if config.stt_model else prepared.whisper
    voices = dict(prepared.voices)
    for spec in config.voices:
        path = models.resolve_voice(spec, config.models)
        voices[path.name.removesuffix(".onnx")] = path
    stack = load_default_stack(
        vad_model=prepared.vad,
        whisper_dir=whisper_dir,
        llm_dir=llm_dir,
        llm=remote,
        voices=voices,
        device=config.device,
        vad_threads=config.vad_threads,
        stt_threads=config.stt_threads,
        llm_threads=config.llm_threads,
        tts_threads=config.tts_threads,
        languages=config.languages,
        llm_temperature_scale=config.llm_temperature_scale,
        llm_prefix_cache_tokens=config.llm_prefix_cache_tokens,
        llm_prefix_session_tokens=config.llm_prefix_session_tokens,
        engine_nice=config.engine_nice,
    )
    if remote is not None:
        stack.description.append(remote.describe())
    return stack


class Server:
    """An OpenAI-Realtime-compatible speech-to-speech server.

    Args:
        config: settings; ``port=0`` picks a free port (see :attr:`port`).
        stack: engines to use instead of loading the ones ``config.stack``
            names (tests pass their own).
    """

    def __init__(self, config: Config | None = None, *, stack: Stack | None = None) -> None:
        self.config = (config or Config()).validate()
        self.stack = stack
        self.port: int = self.config.port
        self.closing = False
        self.draining = False
        self._per_ip: dict[str, int] = {}
        self._trusted = [ipaddress.ip_network(p, strict=False) for p in self.config.trusted_proxies]
        self.metrics = Metrics(
            self._slot_states, self._overdue_calls, self._held_bytes, self._llm_prefixes, self._listening
        )
        self.pool: Pool | None = None
        self.pools: dict[str, StagePool] = {}
        self.clock: ListeningClock | None = None
        self._runner: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._deadline: threading.Timer | None = None

    # --- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Load engines, build the pool and start listening; returns once it listens.

        Raises:
            Exception: whatever stopped start-up (a model that will not load,
                a port in use).
        """
        if self.stack is None:
            self.stack = await asyncio.to_thread(load_stack, self.config)
            # What is loaded now lives as long as the process (tokenizers' vocabularies, the
            # models' Python objects): out of the collector's full passes, which otherwise
            # walked all of it and stalled every session's audio for 15-35 ms at a time.
            gc.collect()
            gc.freeze()
        for line in self.stack.description:
            log.info("%s", line)
        self._runner = asyncio.create_task(self._main(), name="s2s-rt-server")
        started = asyncio.create_task(self._started.wait())
        await asyncio.wait({self._runner, started}, return_when=asyncio.FIRST_COMPLETED)
        if not self._started.is_set():
            started.cancel()
            await self._runner  # re-raises what went wrong

    async def run(self) -> None:
        """Serve until SIGINT/SIGTERM or :meth:`close`, then shut down gracefully.

        A signal ends the process within the grace period (and a second):
        if the graceful shutdown has not finished by then, whatever state
        any task or engine call is in, the process exits at once (status 1).
        """
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGINT: self._signalled, signal.SIGTERM: self._signalled, signal.SIGUSR1: self.drain}
        for sig, handler in handlers.items():
            try:
                loop.add_signal_handler(sig, handler)
            except (NotImplementedError, RuntimeError):  # not the main thread, or not Unix
                pass
        await self.start()
        assert self._runner is not None
        try:
            await self._runner
        finally:
            if self._deadline is not None:
                self._deadline.cancel()

    def _signalled(self) -> None:
        self._stop.set()
        if self._deadline is None:
            # A thread, not the loop: it fires even if the loop or a task group is wedged.
            self._deadline = threading.Timer(self.config.grace_period_s + SHUTDOWN_MARGIN_S, _exit_now)
            self._deadline.daemon = True
            self._deadline.start()

    async def close(self) -> None:
        """Stop accepting, let running turns finish (grace period), close the rest with 1001."""
        self._stop.set()
        if self._runner is not None:
            await self._runner

    async def _main(self) -> None:
        cfg = self.config
        assert self.stack is not None
        self.pools = {
            "vad": StagePool("vad", 1, self.metrics, cfg.vad_timeout_s),
            "stt": StagePool("stt", cfg.stage_workers, self.metrics, cfg.stt_timeout_s, nice=cfg.engine_nice),
            "llm": StagePool("llm", cfg.stage_workers, self.metrics, cfg.llm_timeout_s, nice=cfg.engine_nice),
            "tts": StagePool("tts", cfg.stage_workers, self.metrics, cfg.tts_timeout_s, nice=cfg.engine_nice),
        }
        clock = self.clock = ListeningClock(
            self.stack.vad,
            self.pools["vad"],
            self.metrics,
            tick_s=cfg.listen_tick_ms / 1000,
            listen_s_per_tick=cfg.listen_s_per_tick,
            max_backlog_s=cfg.max_audio_backlog_s,
            shed_after_s=cfg.shed_after_ms / 1000,
            max_load=cfg.max_listening_load,
        )
        slots = [
            Slot(
                i,
                self.stack,
                self.pools,
                clock,
                self.metrics,
                queue_size=cfg.queue_size,
                drain_timeout_s=cfg.drain_deadline_s,
                max_input_buffer_s=cfg.max_input_buffer_s,
                send_timeout_s=cfg.send_timeout_s,
                speculate_after_ms=(
                    cfg.speculate_after_ms
                    if cfg.speculate_after_ms is not None
                    else (150 if self.stack.name == "default" else 0)
                ),
                first_clause_words=cfg.first_clause_words,
                semantic=SemanticTurnEnd(
                    min_silence_ms=cfg.semantic_min_silence_ms, unknown_ms=cfg.semantic_unknown_ms
                ),
                max_output_bytes=_mib(cfg.max_output_mib),
                max_input_queue_bytes=_mib(cfg.max_input_queue_mib),
            )
            for i in range(cfg.pool_size)
        ]
        for slot in slots:
            slot.on_change.append(self._changed.set)
            slot.log_content = cfg.log_content
        self.pool = Pool(slots)
        tasks: list[asyncio.Task[Any]] = []
        try:
            cost = await clock.calibrate()
            log.info(
                "hearing costs %.0f µs per tick and %.2f ms per second of a session's audio (measured at start;"
                " remeasured as sessions stream): about %.0f listening sessions under a load of %g",
                cost.overhead_s * 1e6,
                cost.prior * 1000,
                min(clock.capacity(), cfg.pool_size),
                cfg.max_listening_load,
            )
            async with asyncio.TaskGroup() as tg:
                # Every process-wide task is supervised: a crash is logged and restarted, never left to end
                # the group (and with it every session); one that keeps crashing stops the server.
                tasks += [
                    tg.create_task(supervise(f"slot {s.index}", s.run, self.metrics), name=f"slot{s.index}")
                    for s in slots
                ]
                tasks.append(
                    tg.create_task(supervise("listening clock", clock.run, self.metrics), name="listening-clock")
                )
                tasks.append(tg.create_task(supervise("loop-lag", self._watch_loop_lag, self.metrics), name="loop-lag"))
                async with serve(
                    self._handle,
                    cfg.host,
                    cfg.port,
                    process_request=self._process_request,
                    select_subprotocol=_select_subprotocol,
                    max_size=int(cfg.max_message_mib * 1024 * 1024),
                    compression="deflate" if cfg.compression else None,
                    open_timeout=cfg.open_timeout_s,
                    ping_interval=cfg.ping_interval_s,
                    ping_timeout=cfg.ping_timeout_s,
                    server_header="s2s-rt",
                    create_connection=DirectConnection,
                ) as ws_server:
                    self.port = ws_server.sockets[0].getsockname()[1]
                    log.info(
                        "s2s-rt listening on ws://%s:%d/v1/realtime (pool of %d, %s stack)",
                        cfg.host,
                        self.port,
                        cfg.pool_size,
                        self.stack.name,
                    )
                    self._started.set()
                    await self._stop.wait()
                    await self._drain_for_shutdown()
                    ws_server.close()
                    await ws_server.wait_closed()
                for task in tasks:
                    task.cancel()
        finally:
            for pool in self.pools.values():
                pool.shutdown()
            log.info("s2s-rt stopped")

    async def _drain_for_shutdown(self) -> None:
        """Refuse new sessions at once; give running responses the grace period."""
        self.closing = True
        assert self.pool is not None
        log.info("shutting down: waiting up to %g s for running turns", self.config.grace_period_s)
        deadline = time.monotonic() + self.config.grace_period_s

        def busy() -> bool:
            assert self.pool is not None
            return any(s.ctx is not None and s.ctx.session.response is not None for s in self.pool.slots)

        while busy():
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                break

    async def _watch_loop_lag(self) -> None:
        # A ticker: how late the loop wakes it is how long something blocked the loop.
        interval = 0.05
        while True:
            before = time.perf_counter()
            await asyncio.sleep(interval)
            self.metrics.loop_lag.observe(max(0.0, time.perf_counter() - before - interval))

    # --- per connection -----------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        host = client_host(ws, self._trusted)
        self._per_ip[host] = self._per_ip.get(host, 0) + 1
        try:
            await self._serve_connection(ws, host)
        finally:
            self._per_ip[host] -= 1
            if not self._per_ip[host]:
                del self._per_ip[host]

    async def _refuse(self, ws: ServerConnection, code: str, text: str, close_code: int) -> None:
        self.metrics.rejections.inc(reason=code)
        self.metrics.errors.inc(code=code)
        dialect = BETA if _wants_beta(ws.request) else GA
        err = Session(dialect).error(ProtocolError(code, text, type="server_error"))
        try:
            await ws.send(encode_event(err), text=True)
            await ws.close(close_code, code.replace("_", " "))
        except ConnectionClosed:
            pass

    async def _serve_connection(self, ws: ServerConnection, host: str) -> None:
        assert self.pool is not None and self.stack is not None
        cfg = self.config
        if cfg.max_connections_per_ip and self._per_ip[host] > cfg.max_connections_per_ip:
            text = f"At most {cfg.max_connections_per_ip} concurrent connections per client address"
            await self._refuse(ws, "too_many_connections", text, 1008)
            return
        slot = None if self.closing or self.draining else await self._claim()
        if slot is None:
            if self.closing or self.draining:
                await self._refuse(ws, "shutting_down", "The server is not taking new sessions", 1013)
            elif not self._admits():
                # Refused before the admitted sessions degrade.
                text = "The server is at capacity (listening to one more session would make every one late)"
                await self._refuse(ws, "session_limit_reached", f"{text}; try again later", 1013)
            else:
                text = f"All {len(self.pool.slots)} sessions are in use; try again later"
                await self._refuse(ws, "session_limit_reached", text, 1013)
            return
        # From the claim on, whatever happens, the slot is handed back.
        started = time.monotonic()
        host, port = client_host(ws, self._trusted), _peer(ws)[1]
        client = f"{host}:{port}" if port is not None and host == _peer(ws)[0] else host
        session: Session | None = None
        reason = "client closed"
        try:
            dialect = BETA if _wants_beta(ws.request) else GA
            session = Session(
                dialect,
                self.stack.tts.voices,
                max_conversation_bytes=_mib(cfg.max_conversation_mib),
                transcription_only=_wants_transcription(ws.request),
                model=_asked_model(ws.request),
            )
            self.metrics.sessions_total.inc()
            await slot.attach(ws, session, client)
            log.info(
                "session %s started on slot %d for %s (%s)",
                session.id,
                slot.index,
                client,
                "beta" if dialect.beta else "GA",
                extra={
                    "fields": {"event": "session_start", "session": session.id, "slot": slot.index, "client": client}
                },
            )
            reason = await self._receive_loop(ws, slot) or reason
        except ConnectionClosedOK:
            reason = "client closed"
        except ConnectionClosed:
            reason = "connection lost"
        except Exception:
            reason = "internal error"
            log.exception("slot %d: error while handling a session", slot.index)
            await close_quickly(ws, 1011, "internal error")
        finally:
            if ws.close_code not in (None, 1000, 1001, 1005) and reason == "client closed":
                reason = f"closed with {ws.close_code}"
            clean = await slot.end_session()
            session_id = session.id if session is not None else None
            turns = session.turns if session is not None else 0
            log.info(
                "session %s ended on slot %d: %s after %.1f s, %d turns%s",
                session_id,
                slot.index,
                reason,
                time.monotonic() - started,
                turns,
                "" if clean else " (slot quarantined)",
                extra={
                    "fields": {
                        "event": "session_end",
                        "session": session_id,
                        "slot": slot.index,
                        "client": client,
                        "duration_s": round(time.monotonic() - started, 3),
                        "turns": turns,
                        "reason": reason,
                        "quarantined": not clean,
                    }
                },
            )

    async def _claim(self) -> Slot | None:
        """A free slot, or one about to be free.

        A load balancer counts a session as gone when its TCP connection
        closes, a moment before the slot has drained. A client sent in that
        gap waits (briefly) for the draining slot instead of being refused.
        None also while listening cannot take one more session, checked
        again after such a wait (others may have been admitted meanwhile).
        """
        assert self.pool is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.config.drain_deadline_s, 2.0)
        while True:
            if not self._admits():
                return None
            slot = self.pool.claim()
            # A slot whose client has closed (the server has not ended its session yet) is about to drain.
            if slot is not None or not self.pool.freeing() or self.closing or self.draining:
                return slot
            self._changed.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait()
            except TimeoutError:
                return self.pool.claim() if self._admits() else None

    async def _receive_loop(self, ws: ServerConnection, slot: Slot) -> str | None:
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
        watchdog = asyncio.create_task(self._watch(ws, slot, activity), name=f"slot{slot.index}-watchdog")

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
            if not slot.dispatch.receive_now(data):
                budget.give_back()
                return False
            refusals.accepted(now)
            return True

        ws.direct = direct
        try:
            async for message in ws:
                # From here until it is handled, nothing may overtake it on the direct route.
                with ws.handling():
                    if await self._one_message(slot, message, loop.time(), activity, budget, refusals):
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
        self, slot: Slot, message: str | bytes, now: float, activity: Activity, budget: EventBudget, refusals: Refusals
    ) -> bool:
        """Handle one message that came the usual way; True when the connection is flooding and was closed."""
        cfg = self.config
        activity.last = now
        if budget.take(now):
            unreported = refusals.accepted(now)
            if unreported:
                await self._refused(slot, unreported)
            await slot.receive(message)
            return False
        # Refusing must cost less than the abuse: one notice a second, with a count.
        unreported = refusals.refuse(now)
        if unreported:
            await self._refused(slot, unreported)
        if refusals.flooding_for(now) >= cfg.flood_close_s:
            text = f"Events were refused for {cfg.flood_close_s:g} s in a row; closing this connection"
            await slot.end_with_error(ProtocolError("rate_limit_flood", text), 1008)
            return True
        return False

    async def _refused(self, slot: Slot, count: int) -> None:
        cfg = self.config
        self.metrics.errors.inc(count - 1, code="rate_limit_exceeded")
        await slot.error(
            ProtocolError(
                "rate_limit_exceeded",
                f"Too many events: at most {cfg.max_events_per_s:g} per second (burst {cfg.max_events_burst});"
                f" {count} event(s) were not processed since the last notice",
            )
        )

    async def _watch(self, ws: ServerConnection, slot: Slot, activity: Activity) -> str:
        """Sleep until the connection's next deadline; end the session when one has passed."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        expires = activity.last + cfg.max_session_s
        while True:
            idle_at = activity.last + cfg.idle_session_s if cfg.idle_session_s > 0 else expires
            send_check = loop.time() + cfg.send_timeout_s
            await asyncio.sleep(max(0.0, min(expires, idle_at, send_check) - loop.time()))
            now = loop.time()
            if slot.outbox.stuck_for() >= cfg.send_timeout_s:
                # The client stopped reading and its buffers are full: close it
                # (1008) rather than let its output pile up. Only this slot waits.
                self.metrics.errors.inc(code="client_not_reading")
                log.warning("slot %d: client %s stopped reading; closing it", slot.index, slot.outbox.client)
                await close_quickly(ws, 1008, "client is not reading its events")
                return "client not reading"
            expired = now >= expires
            if expired or (cfg.idle_session_s > 0 and now >= activity.last + cfg.idle_session_s):
                text = (
                    f"The session reached its maximum duration of {cfg.max_session_s:g} s"
                    if expired
                    else f"The session was idle for {cfg.idle_session_s:g} s"
                )
                await slot.end_with_error(ProtocolError("session_expired", text, type="invalid_request_error"), 1001)
                return "expired" if expired else "idle"

    # --- HTTP on the same port -------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        response = self._route(connection, request)
        if response is not None and request.method == "HEAD":
            # The headers GET would get (Content-Length included), and no body.
            response = Response(response.status_code, response.reason_phrase, response.headers, b"")
        return response

    def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0].rstrip("/") or "/"
        if len(request.headers.get_all("Authorization")) > 1:
            return _response(HTTPStatus.BAD_REQUEST, "more than one Authorization header\n")
        if path in REALTIME_PATHS:
            if self.closing or self.draining:
                self.metrics.rejections.inc(reason="draining")
                return _response(HTTPStatus.SERVICE_UNAVAILABLE, "draining: no new sessions\n")
            if not self._authorized(request):
                self.metrics.rejections.inc(reason="unauthorized")
                return _unauthorized()
            origins = request.headers.get_all("Origin")
            if len(origins) > 1:
                self.metrics.rejections.inc(reason="origin")
                return _response(HTTPStatus.BAD_REQUEST, "more than one Origin header\n")
            origin = origins[0] if origins else None
            if self.config.allowed_origins and origin is not None and origin not in self.config.allowed_origins:
                self.metrics.rejections.inc(reason="origin")
                return _response(HTTPStatus.FORBIDDEN, f"origin {origin} is not allowed\n")
            return None
        assert self.pool is not None
        if path in ("/drain", "/undrain"):
            return self._operator(connection, request, path)
        if path == "/healthz":
            return _response(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            free = 0 if self.closing or self.draining or not self._admits() else self.pool.free
            status = HTTPStatus.OK if free else HTTPStatus.SERVICE_UNAVAILABLE
            return _response(
                status, f"{'ready' if free else 'not ready'}: {free} of {len(self.pool.slots)} slots free\n"
            )
        if path == "/v1/pool":
            # Session ids and client addresses: only for those who hold a key, when keys are set.
            if not self._authorized(request, subprotocol=False):
                return _unauthorized()
            body = self.pool.describe() | {
                "closing": self.closing,
                "draining": self.draining,
                "stack": self.stack.name if self.stack else None,
            }
            return _response(HTTPStatus.OK, json.dumps(body), "application/json")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/":
            return _static("index.html")
        if path.startswith("/static/"):
            return _static(path[len("/static/") :])
        return _response(HTTPStatus.NOT_FOUND, f"not found: {path}\n")

    def _operator(self, connection: ServerConnection, request: Request, path: str) -> Response:
        """``POST /drain`` and ``POST /undrain``, for operators only.

        A browser cannot send them cross-site: they need POST and the
        ``S2S-Operator`` header, which no form or image can carry (a script
        would need a CORS preflight this server never approves). With API
        keys set they also need a key; without keys, only this host may ask.
        """
        assert self.pool is not None
        if request.method != "POST":
            response = _response(
                HTTPStatus.METHOD_NOT_ALLOWED, f"use POST {path} with the header {OPERATOR_HEADER}: 1\n"
            )
            response.headers["Allow"] = "POST"
            return response
        if request.headers.get_all(OPERATOR_HEADER) != ["1"]:
            return _response(HTTPStatus.FORBIDDEN, f"{path} needs the header {OPERATOR_HEADER}: 1\n")
        if self.config.api_keys:
            if not self._authorized(request, subprotocol=False):
                return _unauthorized()
        elif not _is_loopback(connection):
            return _response(HTTPStatus.FORBIDDEN, f"without API keys, {path} is only allowed from this host\n")
        if path == "/drain":
            self.drain()
            return _response(HTTPStatus.OK, f"draining: {self.pool.busy()} sessions still running\n")
        self.undrain()
        return _response(HTTPStatus.OK, f"taking new sessions: {self.pool.free} slots free\n")

    def _authorized(self, request: Request, *, subprotocol: bool = True) -> bool:
        """Whether the request carries a configured key (always, when none is configured).

        Args:
            subprotocol: also accept the browser's ``openai-insecure-api-key.KEY`` subprotocol
                (handshakes only; plain HTTP requests must send ``Authorization``).
        """
        keys = self.config.api_keys
        if not keys:
            return True
        offered: list[str] = []
        for auth in request.headers.get_all("Authorization"):
            if auth[:7].lower() == "bearer ":
                offered.append(auth[7:].strip())
        for header in request.headers.get_all("Sec-WebSocket-Protocol") if subprotocol else ():
            for proto in header.split(","):
                proto = proto.strip()
                if proto.startswith(KEY_SUBPROTOCOL):
                    offered.append(proto[len(KEY_SUBPROTOCOL) :])
        # Compare every offered key with every configured one, in constant time.
        ok = False
        for candidate in offered:
            for key in keys:
                ok |= hmac.compare_digest(candidate.encode(), key.encode())
        return ok

    def _listening(self) -> dict[str, float]:
        clock = self.clock
        if clock is None or self.pool is None:
            return {}
        return {
            "cost": clock.cost.value_at(time.monotonic()),
            "load": clock.load(self.pool.active()),
            "lag_seconds": clock.lag_s,
        }

    def _admits(self) -> bool:
        """Whether listening can take one more session (:meth:`ListeningClock.admits`)."""
        assert self.pool is not None
        return self.clock is None or self.clock.admits(self.pool.active())

    def drain(self) -> None:
        """Stop taking new sessions (``/readyz`` 503); running sessions carry on."""
        if not self.draining:
            self.draining = True
            log.info("draining: no new sessions; %d running", self.pool.busy() if self.pool else 0)

    def undrain(self) -> None:
        """Take new sessions again after :meth:`drain` (not after shutdown began)."""
        if self.draining:
            self.draining = False
            log.info("taking new sessions again")

    def _slot_states(self) -> dict[str, int]:
        return self.pool.states() if self.pool is not None else {}

    def _llm_prefixes(self) -> dict[str, int]:
        llm = self.stack.llm if self.stack is not None else None
        prefixes = getattr(llm, "prefixes", None)
        if prefixes is None:
            return {}
        turns = getattr(llm, "turns", None)
        return {
            "prefix_tokens": prefixes.held_tokens,
            "prefixes": len(prefixes),
            "reloads": getattr(llm, "reloads", 0),
            "answers_resumed": turns.resumed if turns is not None else 0,
        }

    def _held_bytes(self) -> dict[str, int]:
        held = {"output": 0, "input_audio": 0, "conversation": 0, "resampler_cache": 0}
        for slot in self.pool.slots if self.pool is not None else ():
            held["output"] += slot.outbox.budget.used
            held["input_audio"] += slot.input_budget.used
            ctx = slot.ctx
            if ctx is not None:
                held["conversation"] += ctx.session.conversation.bytes
                held["resampler_cache"] += ctx.audio.resampler.cache_bytes
        return held

    def _overdue_calls(self) -> int:
        return sum(p.overdue for p in self.pools.values())


#: A signalled shutdown that has not ended this long after the grace period ends the process at once.
SHUTDOWN_MARGIN_S = 0.75


def _exit_now() -> None:
    log.error("shutdown did not finish within the grace period; exiting now")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def _unauthorized() -> Response:
    response = _response(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
    response.headers["WWW-Authenticate"] = 'Bearer realm="s2s-rt"'
    return response


def _mib(mib: float) -> int:
    return int(mib * 1024 * 1024)


def _response(status: HTTPStatus, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode()
    headers = Headers(
        [("Content-Type", content_type), ("Content-Length", str(len(data))), ("Cache-Control", "no-store")]
    )
    return Response(status.value, status.phrase, headers, data)


def _select_subprotocol(connection: ServerConnection, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
    # Answer "realtime" only when offered; a client offering none is fine too.
    return Subprotocol("realtime") if "realtime" in subprotocols else None


def _wants_beta(request: Request | None) -> bool:
    if request is None:
        return False
    # A header may come more than once; get() would raise on that.
    if any("realtime=v1" in value for value in request.headers.get_all("OpenAI-Beta")):
        return True
    offered = ",".join(request.headers.get_all("Sec-WebSocket-Protocol"))
    return BETA_SUBPROTOCOL in [p.strip() for p in offered.split(",")]


def _asked_model(request: Request | None) -> str | None:
    """The ``?model=`` a client connected with (None: none)."""
    if request is None or "?" not in request.path:
        return None
    asked = urllib.parse.parse_qs(request.path.split("?", 1)[1]).get("model")
    return asked[0] if asked else None


def _wants_transcription(request: Request | None) -> bool:
    """``?intent=transcription`` on the URL: a transcription session (as OpenAI's)."""
    if request is None or "?" not in request.path:
        return False
    query = urllib.parse.parse_qs(request.path.split("?", 1)[1])
    return "transcription" in query.get("intent", [])


def _is_loopback(connection: ServerConnection) -> bool:
    addr = connection.remote_address
    host = addr[0] if isinstance(addr, tuple) else str(addr)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Activity:
    """When a connection last sent something (loop time)."""

    __slots__ = ("last",)

    def __init__(self, now: float) -> None:
        self.last = now


class Refusals:
    """Events a connection had refused: when to tell it, and how long it has been flooding."""

    __slots__ = ("flood_since", "last_notice", "last_refusal", "unreported")

    def __init__(self) -> None:
        self.unreported = 0
        self.last_notice: float | None = None
        self.last_refusal = 0.0
        self.flood_since: float | None = None

    def refuse(self, now: float) -> int:
        """Count a refusal; returns how many to report now (0: not yet, one notice a second)."""
        self.unreported += 1
        self.last_refusal = now
        if self.flood_since is None:
            self.flood_since = now
        if self.last_notice is None or now - self.last_notice >= 1.0:
            n, self.unreported, self.last_notice = self.unreported, 0, now
            return n
        return 0

    def refuse_quietly(self, now: float, close_after_s: float) -> bool:
        """Count a refusal that needs nothing said or done now; False (not counted) if a notice or the close is due."""
        if self.last_notice is None or now - self.last_notice >= 1.0:
            return False
        if self.flood_since is not None and now - self.flood_since >= close_after_s:
            return False
        self.unreported += 1
        self.last_refusal = now
        if self.flood_since is None:
            self.flood_since = now
        return True

    def accepted(self, now: float) -> int:
        """Count an accepted event; returns refusals not yet reported that are due now (else 0)."""
        # A second without refusals ends a flood; an event let through now and then does not.
        if self.flood_since is not None and now - self.last_refusal >= 1.0:
            self.flood_since = None
        if self.unreported and self.last_notice is not None and now - self.last_notice >= 1.0:
            n, self.unreported, self.last_notice = self.unreported, 0, now
            return n
        return 0

    def flooding_for(self, now: float) -> float:
        return 0.0 if self.flood_since is None else now - self.flood_since


class EventBudget:
    """A token bucket: ``rate`` events per second on average, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.last: float | None = None

    def give_back(self) -> None:
        """Return the token of an event taken but not handled here (it will be taken again)."""
        self.tokens = min(self.burst, self.tokens + 1.0)

    def take(self, now: float) -> bool:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def _peer(ws: ServerConnection) -> tuple[str, int | None]:
    addr = ws.remote_address
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return str(addr), None


def client_host(ws: ServerConnection, trusted: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    """The client's address: the peer's, or, behind a trusted proxy, the one it forwarded for.

    ``X-Forwarded-For`` is read from the right, skipping trusted proxies; the
    header of a peer that is not a trusted proxy is ignored (anyone can send it).
    """
    host, _ = _peer(ws)
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


STATIC_DIR = Path(__file__).parent / "static"
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
        return _response(HTTPStatus.NOT_FOUND, "not found\n")
    path = STATIC_DIR / name
    if not path.is_file():
        return _response(HTTPStatus.NOT_FOUND, f"not found: /static/{name}\n")
    data = path.read_bytes()
    headers = Headers(
        [
            ("Content-Type", _CONTENT_TYPES.get(path.suffix, "application/octet-stream")),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-cache"),
        ]
    )
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, data)
