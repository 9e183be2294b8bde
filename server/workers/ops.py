"""The operations port of a multi-worker server: the whole server's status and each worker's.

The parent serves ``--metrics-port`` (``/metrics``, ``/status.json``, ``/``) with the
same resource, token check and limits as a one-process server (``server/ops/web.py``:
connections, idle time, no request body);
each worker serves its own on a free loopback port.  A request to the parent asks
every worker's ``/status.json`` at once (with the server's token), waits at most
``ASK_TIMEOUT`` seconds, and answers with :func:`~tensorshare_server.ops.merge.merge`
of what came back: one worker that does not answer shows as down in the
``workers`` table (``tensorshare_worker_up 0``) and the rest still show.
"""

from __future__ import annotations

import json
import logging
import os
import time

from twisted.internet import defer
from twisted.web import client
from twisted.web.http_headers import Headers

from ..ops.merge import merge
from ..ops.status import limits_of
from ..ops.web import OpsPort, OpsResource, _loopback, ops_site

log = logging.getLogger("tensorshare.server")

ASK_TIMEOUT = 5.0  # seconds a worker has to answer one scrape


class _Parent:
    """What the operations resource needs of a server: its token."""

    def __init__(self, token: bytes | None):
        self.token = token


class Gatherer:
    """Asks the workers of ``supervisor`` for their status and merges it."""

    def __init__(self, supervisor, reactor):
        self.supervisor = supervisor
        self.reactor = reactor
        self.agent = client.Agent(reactor, connectTimeout=ASK_TIMEOUT)
        self.started = time.time()

    def __call__(self) -> defer.Deferred:
        asks = [self._ask(worker) for worker in self.supervisor.workers]
        return defer.gatherResults(asks).addCallback(self._merged)

    def _ask(self, worker) -> defer.Deferred:
        port = None if worker is None or worker.info is None else worker.info.get("ops_port")
        if port is None:
            return defer.succeed(None)
        headers = Headers()
        token = self.supervisor.token
        if token is not None:
            headers.addRawHeader(b"Authorization", b"Bearer " + token)
        d = self.agent.request(b"GET", f"http://127.0.0.1:{port}/status.json".encode(), headers)
        d.addCallback(client.readBody)
        d.addCallback(json.loads)
        d.addTimeout(ASK_TIMEOUT, self.reactor)
        d.addErrback(lambda failure: log.warning("metrics: worker %d did not answer: %s", worker.index,
                                                 failure.getErrorMessage()))
        return d

    def _merged(self, snapshots: list) -> dict | None:
        if not any(snapshots):
            return None
        supervisor, now = self.supervisor, time.time()
        config = supervisor.config
        host, port = supervisor.public.getsockname()[:2]
        mine = {"pid": os.getpid(), "host": host, "port": port, "started": self.started,
                "uptime": now - self.started, "time": now, "workers": supervisor.count,
                "worker_ports": supervisor.ports}
        return merge(snapshots, mine, limits_of(config))


def start_ops(supervisor, reactor) -> OpsPort:
    """Serve the whole server's operations site on ``--metrics-host:--metrics-port``."""
    from twisted.internet import task

    config = supervisor.config
    resource = OpsResource(_Parent(supervisor.token), None, gather=Gatherer(supervisor, reactor))
    listening = reactor.listenTCP(config.metrics_port, ops_site(resource, reactor), interface=config.metrics_host)
    if supervisor.token is None and not _loopback(config.metrics_host):
        log.warning("metrics: the status port listens on %s without a token: anyone who reaches it sees the "
                    "bins, the clients and their addresses (--token-file protects it)", config.metrics_host)
    return OpsPort(listening, task.LoopingCall(lambda: None))  # (the workers sample their own throughput)


__all__ = ["Gatherer", "start_ops"]
