"""Server configuration: a TOML file, then ``S2S_RT_*`` variables, then flags.

Later sources override earlier ones field by field. Every field has a
default, so an empty configuration serves.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from s2s_rt.pipeline.clauses import FIRST_CLAUSE_WORDS


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says which."""


#: ``speculate_after_ms`` on the default stack: two of Silero's 32 ms VAD windows of silence, the shortest wait
#: tried that drops no more speculative transcripts than longer ones while bringing the answer's first audio
#: sooner (BENCHMARKS.md, "The work before the first word").
DEFAULT_SPECULATE_AFTER_MS = 64


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Network
    host: str = "127.0.0.1"
    port: int = 8000
    #: Largest client frame in MiB (an append may carry up to 15 MiB).
    max_message_mib: float = 16.0
    compression: bool = False
    open_timeout_s: float = 10.0
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0

    # The pool
    pool_size: int = 4
    #: Bound of each queue between a slot's stages.
    queue_size: int = 256
    #: How long a slot may take to drain after its session ends before it is quarantined
    #: (None: the longest engine or send deadline plus a second; see :attr:`drain_deadline_s`).
    drain_timeout_s: float | None = None
    #: On shutdown, how long live sessions may continue before they are closed with 1001.
    grace_period_s: float = 10.0
    #: Threads per stage kind (VAD, STT, LLM, TTS), shared by all slots.
    stage_workers: int = 4
    #: Most input audio a session may buffer before committing, in seconds.
    max_input_buffer_s: float = 900.0
    #: Deadline of one engine call (for streams: of each piece), per stage kind.
    vad_timeout_s: float = 5.0
    stt_timeout_s: float = 30.0
    #: The LLM's first piece comes only after the whole prompt is read: 30 s leaves room for a long prompt with
    #: tools on a slow CPU, and 60 s made ``make fuzz`` fail (commit f9eb5d3).
    llm_timeout_s: float = 30.0
    tts_timeout_s: float = 30.0

    # Protection against clients that misbehave
    #: A client that has not read its events for this long is closed with 1008.
    send_timeout_s: float = 10.0
    #: Client events per second a connection may send (sustained), and the burst above it.
    max_events_per_s: float = 200.0
    max_events_burst: int = 1000
    #: Longest session (the hosted service's limit is 60 minutes); then `session_expired` and close 1001.
    max_session_s: float = 3600.0
    #: A session with no client events for this long is closed the same way; 0 disables.
    idle_session_s: float = 600.0
    #: Concurrent connections (sessions and handshakes) from one client address; 0 disables.
    max_connections_per_ip: int = 0
    #: A connection whose events are refused by the rate limit for this many seconds in a row is closed (1008).
    flood_close_s: float = 5.0

    #: ``auto`` (uvloop's event loop when the ``uvloop`` package is installed, as it is by default: it costs
    #: the loop less CPU per client event than asyncio's; BENCHMARKS.md, "History"), ``uvloop`` or ``asyncio``
    #: (the standard one).
    event_loop: str = "auto"

    # Listening (load shedding)
    #: All sessions' new audio is heard in one batch per tick, so a chunk waits at most this long for its batch.
    #: 10 ms holds more sessions, deciding sooner, than 20 ms did (BENCHMARKS.md, "How many sessions", "History").
    listen_tick_ms: float = 10.0
    #: Hear (decode, resample, denoise, score) in a process of its own, with its own interpreter lock, where the
    #: VAD can be built there (Silero on the CPU): the event loop's work no longer slows the VAD's thread.
    hearing_process: bool = True
    #: Most seconds of one session's audio heard per tick (100x real time at the defaults); at most
    #: :data:`MAX_LISTEN_S_PER_TICK`.
    listen_s_per_tick: float = 1.0
    #: A session whose audio has waited this long to be heard is closed alone (``audio_backlog_exceeded``).
    max_audio_backlog_s: float = 5.0
    #: While audio waits this long, no new session is admitted (``/readyz`` 503); again below half of it.
    shed_after_ms: float = 250.0
    #: A session is admitted only while listening, with every admitted session and the new one streaming,
    #: is predicted busy at most this fraction of the time (cost per session measured as it runs). 0.55 is
    #: the most that kept p99 chunk -> VAD decision under 50 ms (BENCHMARKS.md, "How many sessions").
    max_listening_load: float = 0.55

    # Memory budget per session (MiB); each bound is enforced and shown in /metrics
    #: Encoded events waiting to be sent: past it, the session's producers wait for the client to read.
    max_output_mib: float = 16.0
    #: Decoded input audio waiting for the VAD stage: past it, the session's socket is not read.
    max_input_queue_mib: float = 32.0
    #: Conversation items: past it, the oldest items are dropped (``conversation.item.deleted``), as
    #: OpenAI truncates a full context; a single item larger than this is refused.
    max_conversation_mib: float = 16.0

    # Engines
    #: ``default`` (real models) or ``fake`` (deterministic engines for tests).
    stack: str = "default"
    #: ``auto`` (CUDA when it really works, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    device: str = "auto"
    #: LLM preset (``default``: Qwen2.5-Coder-0.5B-Instruct; ``fast`` or ``tiny``: SmolLM2-135M; ``best``:
    #: Qwen2.5-Coder-1.5B-Instruct, optional) or a CTranslate2 model directory.
    llm: str = "default"
    #: An OpenAI-compatible chat completions endpoint (``http://HOST:PORT/v1``) that answers
    #: instead of the in-process LLM (``llm`` is then not loaded).
    llm_url: str | None = None
    #: The model to ask ``llm_url`` for (unset: the first one it lists).
    llm_model: str | None = None
    #: Bearer key for ``llm_url``; set it with ``$S2S_RT_LLM_API_KEY`` (there is no flag: keys stay out of ``ps``).
    llm_api_key: str | None = None
    #: A CTranslate2 Whisper directory instead of the packaged Whisper base.
    stt_model: str | None = None
    #: Extra Piper voices (``.onnx`` files with their ``.onnx.json`` beside them).
    voices: list[str] = []
    #: Voice names clients may ask for, each mapped to an installed voice (the name of its ``.onnx`` file without
    #: the suffix): OpenAI's (``ash = "en_US-ryan-medium"``) or the operator's own. OpenAI's names not listed
    #: here speak with the default voice; other unknown names are an error.
    voice_names: dict[str, str] = {}
    #: Languages the server hears and answers in (ISO 639-1 codes such as ``en``, ``de``): speech in a
    #: session without a transcription language is transcribed as the likeliest of these. Empty: the
    #: languages of the voices (the server can speak no other).
    languages: list[str] = []
    #: The local LLM samples at the session's temperature times this: small models answer best near
    #: greedy (0.8, the Realtime default, becomes 0.2; 0 is always greedy). Remote LLMs get it unscaled.
    llm_temperature_scale: float = 0.25
    #: Tokens of conversation state the local LLM keeps between answers, so that an answer reads only
    #: the new turn, not the whole conversation again (168 KB a token for the default model: 6000 ≈ 1 GB).
    #: Past it the model is reloaded, forgetting them all. 0 turns it off.
    llm_prefix_cache_tokens: int = 6000
    #: The longest conversation (in tokens) whose state is kept; longer ones are read whole each answer.
    llm_prefix_session_tokens: int = 2048
    #: The model cache (``$S2S_RT_MODELS``; default ``~/.cache/s2s-rt/models``).
    models: str | None = None
    #: Transcribe a turn once its closing silence has lasted this long, before
    #: ``silence_duration_ms`` ends it, so the answer starts sooner; the guess is
    #: dropped if speech returns. 0 turns it off; unset: :data:`DEFAULT_SPECULATE_AFTER_MS` on the default
    #: stack, off on the fake one.
    speculate_after_ms: int | None = None
    #: ``semantic_vad``: the shortest silence that ends a turn (when the words so far sound finished), and
    #: how long a silence ends it while they have not been judged yet (the LLM busy, or a remote one).
    semantic_min_silence_ms: int = 200
    #: An answer's first clause, spoken as soon as it is complete, is cut after this many words or a few more,
    #: where a speaker could pause (sooner at a comma or a sentence's end); later ones at sentence ends.
    first_clause_words: int = FIRST_CLAUSE_WORDS
    semantic_unknown_ms: int = 1200
    #: Threads inside one engine call, per engine kind.
    vad_threads: int = 1
    stt_threads: int = 1
    llm_threads: int = 2
    #: Two: the LLM pauses while an answer's first clause is made into speech, so Piper has both cores then,
    #: and the first clause is spoken sooner (BENCHMARKS.md, "The work before the first word").
    tts_threads: int = 2
    #: The STT, LLM and TTS threads run this much nicer (Linux nice steps, 0-19) than the event loop
    #: and the VAD, so that when the cores are full, answers wait rather than every session's VAD
    #: decisions. 0: all at the same priority.
    engine_nice: int = 10
    #: fake stack: extra time per STT call, per LLM token, per TTS word.
    fake_stt_delay_ms: int = 0
    fake_llm_token_delay_ms: int = 0
    fake_tts_delay_ms: int = 0

    # Access
    #: When non-empty, the handshake needs ``Authorization: Bearer KEY`` or the
    #: ``openai-insecure-api-key.KEY`` subprotocol with one of these keys.
    api_keys: list[str] = []
    #: When non-empty, browsers (which send ``Origin``) must come from one of these.
    allowed_origins: list[str] = []
    #: WebRTC calls: STUN/TURN servers (``stun:host:3478``, ``USER:PASS@turn:host:3478?transport=tcp``);
    #: none: host candidates only.
    ice_servers: list[str] = []
    #: UDP ports for WebRTC media, ``LOW-HIGH`` (each call takes one per host address); none: any free port.
    media_ports: str | None = None
    #: WebRTC calls' UDP sockets are read together this often (a wake-up of the loop for every call, not one
    #: for each datagram: a caller sends one every 20 ms); 0: each datagram as it comes.
    media_poll_ms: float = 10.0
    #: A call whose data channel has not opened this long after its offer (ICE never completed) ends.
    call_timeout_s: float = 15.0
    #: Phone calls over SIP (UDP and TCP) on this port; None: off. A PBX or trunk sends its INVITEs here.
    sip_port: int | None = None
    #: The address SIP and its RTP media listen on, and, without :attr:`sip_advertised_host`, the one the
    #: server's Contact and SDP answer name (then a reachable one, not ``0.0.0.0``).
    sip_host: str = "127.0.0.1"
    #: The address the PBX reaches this server at, named in the server's Via, Contact and SDP answer when it
    #: is not :attr:`sip_host` (behind NAT: the public address mapped to the private one SIP listens on).
    sip_advertised_host: str | None = None
    #: UDP ports for the calls' media, ``LOW-HIGH``: each call takes two (RTP on an even port, RTCP the next).
    sip_media_ports: str = "30000-30999"
    #: Where ``realtime.call.incoming`` is posted (HTTP POST, JSON) when a call rings; the application then
    #: accepts or rejects it (``POST /v1/realtime/calls/{call_id}/accept``). None: see :attr:`sip_accept`.
    sip_webhook_url: str | None = None
    #: The secret the webhook is signed with (Standard Webhooks, as OpenAI signs: ``whsec_`` and base64).
    sip_webhook_secret: str | None = None
    #: Without a webhook, answer every call at once with the default session (False: refuse with 603).
    sip_accept: bool = False
    #: A ringing call neither accepted nor rejected this long after its webhook is refused (480).
    sip_answer_timeout_s: float = 10.0
    #: An answered call whose caller has sent no RTP or RTCP for this long (since the 200 OK, or since its
    #: last packet: a caller whose network or BYE was lost) is hung up (BYE). PBXs send RTP throughout a call.
    sip_media_timeout_s: float = 20.0
    #: The longest ``expires_after.seconds`` a client secret may ask for (OpenAI's bound: two hours).
    max_client_secret_s: int = 7200
    #: Let the page at ``/`` get a client secret (``POST /page/client_secret``) without a key, when keys are on.
    page_secrets: bool = False
    #: MCP servers sessions may use as ``type: "mcp"`` tools: URL prefixes (``http://127.0.0.1:9000/mcp``); a
    #: session's ``server_url`` must have the same scheme, host and port and a path under one. None: MCP tools
    #: are refused (a client must not make the server reach addresses the operator did not choose).
    mcp_servers: list[str] = []
    #: The longest an MCP listing or call may take (connecting included); then it ends ``failed``.
    mcp_timeout_s: float = 20.0
    #: The most output of one MCP call kept (longer is cut), and the largest tool listing taken.
    mcp_max_output_kib: int = 64
    #: Proxies (addresses or networks) whose ``X-Forwarded-For`` names the real client
    #: (for per-address limits and logs); other peers' header is ignored.
    trusted_proxies: list[str] = []

    log_level: str = "info"
    #: ``text`` for people, ``json`` for log collectors (one object per line).
    log_format: str = "text"
    #: Put transcripts and answers in the turn log lines (off: logs never hold what people said).
    log_content: bool = False

    @property
    def drain_deadline_s(self) -> float:
        """The drain deadline in force: set, or following from the deadlines a drain may wait on."""
        if self.drain_timeout_s is not None:
            return self.drain_timeout_s
        waits = (self.vad_timeout_s, self.stt_timeout_s, self.llm_timeout_s, self.tts_timeout_s, self.send_timeout_s)
        return max(waits) + 1.0

    def validate(self) -> Config:
        """Check ranges; returns self.

        Raises:
            ConfigError: a value out of range, naming the field.
        """
        if not 1 <= self.pool_size <= 100_000:
            raise ConfigError(f"pool_size must be 1..100000, not {self.pool_size}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, not {self.port}")
        if self.stage_workers < 1 or self.queue_size < 1:
            raise ConfigError("stage_workers and queue_size must be at least 1")
        if self.stack not in ("fake", "default"):
            raise ConfigError(f"stack must be 'fake' or 'default', not {self.stack!r}")
        if self.llm_url is not None and not self.llm_url.startswith(("http://", "https://")):
            raise ConfigError(f"llm_url must be an http:// or https:// URL, not {self.llm_url!r}")
        if self.event_loop not in ("auto", "asyncio", "uvloop"):
            raise ConfigError(f"event_loop must be 'auto', 'asyncio' or 'uvloop', not {self.event_loop!r}")
        if min(self.max_output_mib, self.max_input_queue_mib, self.max_conversation_mib) <= 0:
            raise ConfigError("max_output_mib, max_input_queue_mib and max_conversation_mib must be positive")
        if not 0 <= self.semantic_min_silence_ms <= self.semantic_unknown_ms <= 8000:
            raise ConfigError("semantic_min_silence_ms <= semantic_unknown_ms must be within 0..8000")
        if not 0 <= self.engine_nice <= 19:
            raise ConfigError(f"engine_nice must be 0..19, not {self.engine_nice}")
        if not (self.listen_tick_ms > 0 and 0 < self.listen_s_per_tick <= MAX_LISTEN_S_PER_TICK):
            raise ConfigError(f"listen_tick_ms must be positive, listen_s_per_tick within 0..{MAX_LISTEN_S_PER_TICK:g}")
        if not 0 < self.max_listening_load <= 1000:  # also refuses NaN
            raise ConfigError(
                f"max_listening_load must be above 0 (a fraction of the time), not {self.max_listening_load}"
            )
        for prefix in self.mcp_servers:
            if not prefix.startswith(("http://", "https://")) or "@" in prefix:
                raise ConfigError(f"mcp_servers must be http:// or https:// URL prefixes, not {prefix!r}")
        if not (self.mcp_timeout_s > 0 and self.mcp_max_output_kib > 0):
            raise ConfigError("mcp_timeout_s and mcp_max_output_kib must be positive")
        if not 1 <= self.first_clause_words <= 50:
            raise ConfigError("first_clause_words must be 1..50")
        if self.llm_prefix_cache_tokens < 0 or self.llm_prefix_session_tokens < 0:
            raise ConfigError("llm_prefix_cache_tokens and llm_prefix_session_tokens must be 0 or more")
        if not 0 < self.call_timeout_s <= 600:
            raise ConfigError("call_timeout_s must be above 0 and at most 600")
        if self.sip_port is not None and not 0 <= self.sip_port <= 65535:
            raise ConfigError("sip_port must be 0..65535 (0: any free port)")
        try:
            port_range(self.sip_media_ports)
        except ValueError as exc:
            raise ConfigError(f"sip_media_ports: {exc}") from None
        if self.sip_port is not None and self.sip_advertised_host is None and self.sip_host in ("0.0.0.0", "::"):
            raise ConfigError(
                f"sip_host {self.sip_host} listens on every address but names none a PBX can reach: set"
                " sip_advertised_host (the address the PBX sends to) or a concrete sip_host"
            )
        if self.sip_webhook_url is not None and not self.sip_webhook_url.startswith(("http://", "https://")):
            raise ConfigError(f"sip_webhook_url must be an http:// or https:// URL, not {self.sip_webhook_url!r}")
        if not 0 < self.sip_answer_timeout_s <= 600:
            raise ConfigError("sip_answer_timeout_s must be above 0 and at most 600")
        if not 0 < self.sip_media_timeout_s <= 600:
            raise ConfigError("sip_media_timeout_s must be above 0 and at most 600")
        if not 10 <= self.max_client_secret_s <= 86400:
            raise ConfigError("max_client_secret_s must be 10..86400")
        if not 0 <= self.media_poll_ms <= MAX_MEDIA_POLL_MS:  # also refuses NaN
            raise ConfigError(f"media_poll_ms must be within 0..{MAX_MEDIA_POLL_MS:g}, not {self.media_poll_ms}")
        if self.media_ports is not None:
            try:
                port_range(self.media_ports)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for server in self.ice_servers:
            url = server.rpartition("@")[2]
            if not url.startswith(("stun:", "turn:", "turns:")):
                raise ConfigError(f"ice_servers: {server!r} is not a stun:, turn: or turns: URL")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(f"trusted_proxies: {proxy!r} is not an address or network") from None
        return self


def mib(mebibytes: float) -> int:
    """A size given in MiB (as the settings give sizes), in bytes."""
    return int(mebibytes * 1024 * 1024)


#: Every setting at its default, what ``s2s-rt serve`` runs with when nothing is set: code that takes a setting
#: as a parameter defaults to this rather than restating the value. Read it; never change it.
DEFAULTS = Config()


def port_range(text: str) -> range:
    """``LOW-HIGH`` (inclusive) as a range of UDP ports.

    Raises:
        ValueError: not two ports in order.
    """
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"media ports {text!r}: expected LOW-HIGH, e.g. 40000-40999")
    lo, hi = int(low), int(high)
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"media ports {text!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return range(lo, hi + 1)


ENV_PREFIX = "S2S_RT_"
#: The most ``listen_s_per_tick`` may be: ten times that of one session's audio at 48 kHz (turn detection off) must
#: fit one exchange with the hearing process (:data:`s2s_rt.listening.remote.IN_BYTES`).
MAX_LISTEN_S_PER_TICK = 5.0
#: A call's packet waits at most this long to be read: within a gap in its packets before it is heard as
#: silence (``webrtc_audio.GAP_S``, 60 ms).
MAX_MEDIA_POLL_MS = 40.0


def pairs(items: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings (from a flag given again or the environment) as a table.

    Raises:
        ConfigError: an item without ``=``.
    """
    table = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(f"expected NAME=VALUE, not {item!r}")
        table[name.strip()] = value.strip()
    return table


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file, environment and explicit overrides into a :class:`Config`.

    Args:
        path: a TOML file, or None.
        environ: where ``S2S_RT_<FIELD>`` variables are read (default ``os.environ``).
        overrides: values from flags; None values are ignored.

    Raises:
        ConfigError: unreadable file, unknown field, or a value of the wrong type.
    """
    merged: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                merged.update(tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
    env = os.environ if environ is None else environ
    fields = set(Config.__struct_fields__)
    for key, value in env.items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name in fields:
                # Lists come from the environment comma-separated, tables as NAME=VALUE pairs.
                kind = str(Config.__annotations__.get(name, ""))
                items = [v.strip() for v in value.split(",") if v.strip()]
                merged[name] = items if kind.startswith("list") else pairs(items) if kind.startswith("dict") else value
    for key, value in (overrides or {}).items():
        if value is not None:
            merged[key] = value
    try:
        # strict=False lets "8" from the environment become the int 8.
        return msgspec.convert(merged, Config, strict=False).validate()
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
