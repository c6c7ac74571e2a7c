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
