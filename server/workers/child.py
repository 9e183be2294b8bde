"""One worker of a multi-worker server: a one-process server on the sockets its parent hands it.

Started by ``supervisor.py`` as ``python -m tensorshare_server.workers``, with the
public listening socket as descriptor 3 and its own as descriptor 4.  Its first
line of standard input is its settings (JSON: its number, the workers' ports, the
server's id, its :class:`~tensorshare_server.ServerConfig`, the token); it then
serves exactly as a one-process server does (``app.serve``), refusing requests for
bins other workers own (``ownership.py``), and prints one ``ready`` line (JSON:
its operations port, the TLS fingerprint) once it accepts connections.  Standard
input stays open while the parent lives: its end means the parent is gone, and the
worker stops as on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

from tensorshare.errors import UsageError
from tensorshare.protocol.placement import WorkerMap

PUBLIC_FD, OWN_FD = 3, 4


def main() -> int:
    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
    except ValueError:
        print("tensorshare-server worker: no settings on standard input (its parent starts it)", file=sys.stderr)
        return 2
    from ..app import serve
    from ..config import ServerConfig
    from ..ops.logs import configure

    index = spec["index"]
    configure(spec["log"]["level"], spec["log"]["format"])
    logging.getLogger().handlers[0].addFilter(_Prefix(f"worker {index}: "))
    config = ServerConfig(**spec["config"])
    if spec["token"] is not None:
        config.token = bytes.fromhex(spec["token"])
    workers = WorkerMap(spec["ports"], index, spec["id"])
    _stop_with_parent()

    def ready(bound) -> None:
        info = {"index": index, "ops_port": None if bound.ops is None else bound.ops.port,
                "tls_fingerprint": bound.tls_fingerprint}
        print("ready " + json.dumps(info), flush=True)

    try:
        serve(config, ready, sockets=(PUBLIC_FD, OWN_FD), workers=workers)
    except UsageError as exc:  # a setting that cannot be used: the parent reports the failed start
        print(f"tensorshare-server worker {index}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


class _Prefix(logging.Filter):
    """Says which worker a log line comes from (they share the parent's standard error)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_worker_prefixed", False):
            record.msg = self.prefix + str(record.msg)
            record._worker_prefixed = True
        return True


def _stop_with_parent() -> None:
    """Stop the reactor when standard input ends: the parent has died (or closed it)."""
    from twisted.internet import reactor

    def watch() -> None:
        try:  # (the raw descriptor: a buffered reader's lock would stall the interpreter's exit)
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        reactor.callFromThread(reactor.stop)

    threading.Thread(target=watch, name="tensorshare-parent-watch", daemon=True).start()
