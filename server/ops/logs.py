"""How the server's log lines look: ``--log-format text`` (default) or ``json``.

JSON lines are for log shippers: one object per line with ``time`` (ISO 8601,
UTC), ``level``, ``logger``, ``message``, and ``conn``/``event`` when the line is
about one connection (open, close, auth_failed, drop...).
"""

from __future__ import annotations

import json
import logging
import sys
import time

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("conn", "event"):
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, fmt: str = "text", stream=None) -> None:
    """Send the server's log to ``stream`` (stderr) at ``level`` in format ``fmt``
    (ValueError for an unknown level, before anything changes)."""
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
