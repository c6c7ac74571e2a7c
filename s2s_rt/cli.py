"""The ``s2s-rt`` command: ``serve`` (and ``models`` once real models are installed)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from s2s_rt.config import ConfigError, load_config
from s2s_rt.server import Server


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the server")
    p.add_argument("--config", help="TOML file with settings (flags and S2S_RT_* variables override it)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--pool-size", type=int, dest="pool_size", help="concurrent sessions (slots)")
    p.add_argument("--stack", choices=["default", "fake"], help="engines: real models, or fake ones for tests")
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
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="s2s-rt", description="OpenAI-Realtime-compatible speech-to-speech server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
        try:
            config = load_config(args.config, overrides=overrides)
        except ConfigError as exc:
            print(f"s2s-rt: {exc}", file=sys.stderr)
            return 2
        logging.getLogger("websockets").setLevel(logging.WARNING)
        logging.basicConfig(
            level=config.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        try:
            asyncio.run(Server(config).run())
        except KeyboardInterrupt:
            pass
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
