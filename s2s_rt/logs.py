"""Log lines for people (``text``) or for machines (``json``, one object per line).

Records may carry ``extra={"fields": {...}}``; the JSON format puts those
fields at the top level, the text format shows the message only (which the
caller already wrote with the same facts in ``key=value`` form).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once, for the CLI."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # websockets logs every HTTP request at INFO; our own lines say what matters.
    logging.getLogger("websockets").setLevel(logging.WARNING)


class HostileInput(logging.Filter):
    """A library's lines about what a network peer sent (a datagram that does not parse, a request its
    handlers refuse): one line each, a warning without the traceback, and at most ``burst`` lines per
    ``window_s`` for each message, so a flood of bad packets cannot flood the log. The line after a
    quiet spell says how many were left out.

    Attach it to the library's logger (``logging.getLogger("aiosipua.transport").addFilter(...)``).
    """

    def __init__(self, burst: int = 5, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        #: Per message template: (the window's start, lines let through in it, lines left out since the last).
        self._seen: dict[str, list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)
        start, passed, dropped = self._seen.get(key, (now, 0.0, 0.0))
        if now - start >= self.window_s:
            start, passed = now, 0.0
        if passed >= self.burst:
            self._seen[key] = [start, passed, dropped + 1]
            return False
        self._seen[key] = [start, passed + 1, 0.0]
        if record.levelno > logging.WARNING or record.exc_info:
            exc = record.exc_info[1] if record.exc_info else None
            reason = f": {exc!r}"[:200].replace("%", "%%") if exc is not None else ""
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"{record.msg}{reason}"
            record.exc_info = record.exc_text = None
        if dropped:
            record.msg = f"{record.msg} ({int(dropped)} more like it left out)"
        return True
