"""A server process with its operations port on, and small HTTP helpers for tests."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

from serverproc import ServerProcess

TOKEN = "ops-token-5d1e0b7c92aa4f31"  # the token of the ``token_server`` fixture (conftest.py)

_STATUS = re.compile(r"status page http://([\d.]+):(\d+)/")


class OpsServer(ServerProcess):
    """``tensorshare-server --metrics-port 0 ...``; ``metrics_port`` is the port it printed."""

    def __init__(self, *args: str, **kw):
        self.metrics_port = None
        super().__init__("--metrics-port", "0", *args, **kw)

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            match = _STATUS.search(line or "")
            if match:
                self.metrics_port = int(match.group(2))
                return
            if not line:
                break
        raise RuntimeError("the server printed no status page address")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"


def http_get(url: str, headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """``(status, headers, body)`` of a GET, error statuses included."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
