"""The ``s2s-rt`` command: ``serve``, and ``models``, ``talk`` and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn

from s2s_rt.config import ConfigError, load_config, pairs
from s2s_rt.logs import setup_logging
from s2s_rt.server import Server


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the server")
    p.add_argument("--config", help="TOML file with settings (flags and S2S_RT_* variables override it)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--pool-size", type=int, dest="pool_size", help="concurrent sessions (slots)")
    p.add_argument(
        "--stack", choices=["default", "fake"], help="engines: real models (default), or fake ones for tests"
    )
    p.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--llm", help="LLM preset (default, fast, best; tiny = fast) or a CTranslate2 model directory")
    p.add_argument(
        "--llm-url",
        dest="llm_url",
        help="an OpenAI-compatible endpoint (http://HOST:PORT/v1) that answers instead of the in-process LLM; "
        "key from $S2S_RT_LLM_API_KEY",
    )
    p.add_argument("--llm-model", dest="llm_model", help="the model to ask --llm-url for (default: the first listed)")
    p.add_argument("--stt-model", dest="stt_model", help="a CTranslate2 Whisper directory")
    p.add_argument("--voice", dest="voices", action="append", help="an extra Piper voice .onnx; repeatable")
    p.add_argument(
        "--voice-name",
        dest="voice_names",
        action="append",
        help="NAME=VOICE: a voice name clients may ask for (OpenAI's ash, verse... or your own) spoken by an"
        " installed voice; repeatable",
    )
    p.add_argument(
        "--language",
        dest="languages",
        action="append",
        help="a language the server hears and answers in (en, de, ...); repeatable; default: the voices' languages",
    )
    p.add_argument(
        "--workers",
        type=worker_count,
        help="run N servers (auto: one per CPU core) on ports --port .. --port+N-1 and print their HAProxy lines"
        " (see deploy/README.md)",
    )
    p.add_argument(
        "--drain-timeout", type=float, dest="drain_timeout_s", help="seconds before a stuck slot is quarantined"
    )
    p.add_argument("--grace-period", type=float, dest="grace_period_s", help="seconds running turns get on shutdown")
    p.add_argument("--stage-workers", type=int, dest="stage_workers", help="threads per engine kind")
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        help="require this key (Bearer header or browser subprotocol); repeatable; env S2S_RT_API_KEYS=k1,k2",
    )
    p.add_argument(
        "--allowed-origin", dest="allowed_origins", action="append", help="allow browsers from this Origin; repeatable"
    )
    p.add_argument(
        "--mcp-server",
        dest="mcp_servers",
        action="append",
        help="let sessions use MCP servers under this URL prefix as type 'mcp' tools; repeatable; default: none",
    )
    p.add_argument(
        "--ice-server",
        dest="ice_servers",
        action="append",
        help="a STUN or TURN server for WebRTC calls (stun:HOST:PORT, USER:PASS@turn:HOST:PORT?transport=tcp);"
        " repeatable; default: host candidates only",
    )
    p.add_argument(
        "--media-ports", dest="media_ports", help="UDP ports for WebRTC media, LOW-HIGH (default: any free port)"
    )
    p.add_argument("--sip-port", type=int, dest="sip_port", help="take phone calls over SIP on this port (off)")
    p.add_argument("--sip-host", dest="sip_host", help="the address SIP and RTP listen on and name (127.0.0.1)")
    p.add_argument(
        "--sip-advertised-host",
        dest="sip_advertised_host",
        help="the address SIP and SDP name when not --sip-host (NAT)",
    )
    p.add_argument("--sip-media-ports", dest="sip_media_ports", help="UDP ports for calls' RTP (30000-30999)")
    p.add_argument("--sip-webhook", dest="sip_webhook_url", help="post realtime.call.incoming here when a call rings")
    p.add_argument(
        "--sip-accept",
        dest="sip_accept",
        action="store_const",
        const=True,
        help="without a webhook, answer every call with the default session",
    )
    p.add_argument(
        "--call-timeout", type=float, dest="call_timeout_s", help="seconds a WebRTC call may take to connect (15)"
    )
    p.add_argument(
        "--page-secrets",
        dest="page_secrets",
        action="store_const",
        const=True,
        help="with API keys on, let the page at / get a short-lived client secret (POST /page/client_secret)",
    )
    p.add_argument(
        "--trusted-proxy",
        dest="trusted_proxies",
        action="append",
        help="a proxy address or network whose X-Forwarded-For names the client; repeatable",
    )
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", dest="log_format", choices=["text", "json"], help="text (default) or json lines")
    p.add_argument(
        "--log-content",
        dest="log_content",
        action="store_const",
        const=True,
        help="include what users said and the answers in turn log lines",
    )


def run_loop(main: Coroutine[Any, Any, None], kind: str) -> None:
    """Run ``main`` on uvloop's event loop (``uvloop``, or ``auto`` when it is installed), else asyncio's."""
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def worker_count(value: str) -> int:
    """``--workers``: a number, or ``auto`` for one process per CPU core this process may use."""
    if value == "auto":
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("at least one worker")
    return n


#: Subcommands with argument parsers of their own: name -> (module with main(argv), what it does).
DELEGATED = {
    "models": ("s2s_rt.models.cli", "prepare, list or verify the model cache"),
    "talk": ("s2s_rt.talk", "say one thing (a WAV or text) and save the spoken answer"),
    "bench": ("s2s_rt.bench.cli", "the load generator: latency per turn, capacity, memory"),
    "gpu-check": ("s2s_rt.bench.gpu", "on an NVIDIA GPU: each engine on it, the load single-fresh and with 32 talkers"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="s2s-rt", description="OpenAI-Realtime-compatible speech-to-speech server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, (_, what) in DELEGATED.items():
        sub.add_parser(name, help=f"{what} (s2s-rt {name} --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]))
    args = parser.parse_args(argv)
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "workers")}
        try:
            if args.voice_names:
                overrides["voice_names"] = pairs(args.voice_names)
            config = load_config(args.config, overrides=overrides)
        except ConfigError as exc:
            print(f"s2s-rt: {exc}", file=sys.stderr)
            return 2
        if args.workers is not None and config.sip_port is not None:
            # Each process would bind the same SIP port and media range: start them one by one instead.
            print("s2s-rt: --workers with SIP: start each process with its own --sip-port, --sip-media-ports and"
                  " --sip-webhook (deploy/README.md, Phone calls over SIP)", file=sys.stderr)  # fmt: skip
            return 2
        if args.workers is not None:
            from s2s_rt.workers import run_workers, worker_devices

            return run_workers(
                args.workers,
                argv[argv.index("serve") + 1 :],
                config.port,
                config.host,
                worker_devices(config.device, args.workers),
                pool_size=config.pool_size,
            )
        setup_logging(config.log_level, config.log_format)
        from s2s_rt.models import ModelError

        try:
            run_loop(Server(config).run(), config.event_loop)
        except KeyboardInterrupt:
            pass
        except ModelError as exc:
            print(f"s2s-rt: {exc}", file=sys.stderr)
            return 1
        except Exception:
            # A process-wide task failed past restarting (or start-up failed): exit non-zero at once, for the
            # supervisor to restart it; an engine call still blocking its thread must not hold the exit.
            logging.getLogger("s2s_rt").exception("s2s-rt stopped after a failure")
            _exit_now(1)
        # Shut down gracefully; engine threads still blocked in a call (they cannot be cancelled) must not hold
        # the process: the interpreter would wait for them at exit.
        _exit_now(0)
    return 2


def _exit_now(status: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
    return 2


if __name__ == "__main__":
    sys.exit(main())
