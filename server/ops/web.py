"""The operations HTTP port: ``/metrics``, ``/status.json`` and ``/`` (the status page).

Served by Twisted Web from the reactor that serves the data (``--metrics-port``);
every response is computed on request from the store and the counters.  When the
server has a token, each request must carry it (``Authorization: Bearer TOKEN``,
or ``?token=TOKEN`` for a browser), compared in constant time; anything else gets
401.  It binds 127.0.0.1 unless ``--metrics-host`` says otherwise, and speaks plain
HTTP: put it behind a TLS proxy to expose it.

Its limits are its own, apart from the data port's: at most
:data:`MAX_CONNECTIONS` connections at once (more are closed as they come, so the
port cannot take the descriptors the data port needs), each closed after
:data:`IDLE_TIMEOUT` seconds without a byte, headers of at most 16 KiB (Twisted's),
and no request body: a request that announces one is answered (401 without the
token, else 413) and closed as soon as its headers are in, before a byte of the
body is read.
"""

from __future__ import annotations

import hmac
import json
import logging
from urllib.parse import quote

from twisted.internet import task
from twisted.web import resource, server

from . import page, prom
from .status import Throughput, snapshot

log = logging.getLogger("tensorshare.server")

MAX_CONNECTIONS = 32  # HTTP connections open at once
IDLE_TIMEOUT = 30  # seconds an HTTP connection may stay silent (a request half sent included)


class OpsResource(resource.Resource):
    """The whole site: three paths, checked for the token first."""

    isLeaf = True

    def __init__(self, state, throughput: Throughput | None, data_port: int | None = None, gather=None):
        super().__init__()
        self.state = state
        self.throughput = throughput
        self.data_port = data_port  # the port that serves the data (the config's may be 0)
        # A multi-worker server's parent (server/workers/ops.py): gather() fires with the
        # whole server's snapshot, or None if no worker answered; else this process's own.
        self.gather = gather

    def render_GET(self, request) -> bytes:  # noqa: N802 - Twisted's name
        token = self.state.token
        query = ""
        if token is not None:
            if not _authorized(request, token):
                request.setResponseCode(401)
                request.setHeader(b"WWW-Authenticate", b'Bearer realm="tensorshare"')
                request.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
                return _UNAUTHORIZED
            if request.args.get(b"token"):
                query = "?token=" + quote(_given_token(request).decode("utf-8", "replace"), safe="")
        request.setHeader(b"Cache-Control", b"no-store")
        path = request.path.rstrip(b"/") or b"/"
        if path not in (b"/metrics", b"/status.json", b"/"):
            return _plain(request, 404, b"404 try /, /status.json or /metrics\n")
        if path == b"/metrics" and not prom.available():
            return _plain(request, 503, b"503 /metrics needs prometheus_client: the metrics extra: pip install "
                                        b"prometheus_client\n")
        if self.gather is None:
            return self._render(request, path, snapshot(self.state, self.throughput, data_port=self.data_port), query)

        def gathered(data) -> None:
            if data is None:
                body = _plain(request, 503, b"503 no worker of this server answered\n")
            else:
                body = self._render(request, path, data, query)
            if not request.finished and not getattr(request, "_disconnected", False):
                request.write(body)
                request.finish()

        self.gather().addCallback(gathered).addErrback(
            lambda failure: log.error("metrics: gathering the workers' status failed: %s", failure.getErrorMessage()))
        return server.NOT_DONE_YET

    @staticmethod
    def _render(request, path: bytes, data: dict, query: str) -> bytes:
        if path == b"/metrics":
            body, content_type = prom.exposition(data)
            request.setHeader(b"Content-Type", content_type.encode())
            return body
        if path == b"/status.json":
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps(data).encode()
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        return page.render(data, query).encode()


def _plain(request, code: int, text: bytes) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
    return text


_UNAUTHORIZED = b"401 the server's token is required (Authorization: Bearer TOKEN, or ?token=TOKEN)\n"


def _authorized(request, token: bytes) -> bool:
    given = _given_token(request)
    return given is not None and hmac.compare_digest(given, token)


class _Discard:
    """Where the bytes of a refused request's body go (those already read with its headers)."""

    def write(self, data: bytes) -> None:
        pass

    def seek(self, *args) -> None:
        pass

    def close(self) -> None:
        pass


class _OpsRequest(server.Request):
    """A request of the operations port: one that announces a body is answered and
    closed once its headers are in (see the module docstring)."""

    def gotLength(self, length) -> None:  # noqa: N802 - Twisted's name
        if length == 0:
            super().gotLength(length)
            return
        self.content = _Discard()
        token = self.channel.site.resource.state.token
        if token is not None and not _authorized(self, token):
            status, body = b"401 Unauthorized", _UNAUTHORIZED
        else:
            status, body = b"413 Content Too Large", b"413 this port takes no request body\n"
        self.channel.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; charset=utf-8\r\n"
                                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        self.channel.loseConnection()  # (stops reading the socket)


class _OpsSite(server.Site):
    """The site, counting its connections: past :data:`MAX_CONNECTIONS` a new one is
    closed at once."""

    requestFactory = _OpsRequest
    open_connections = 0

    def buildProtocol(self, addr):  # noqa: N802 - Twisted's name
        if self.open_connections >= MAX_CONNECTIONS:
            log.warning("metrics: %d HTTP connections are open (the most the status port takes); closing one "
                        "from %s", self.open_connections, getattr(addr, "host", addr))
            return None
        protocol = super().buildProtocol(addr)
        self.open_connections += 1
        lost = protocol.connectionLost

        def connection_lost(reason) -> None:
            self.open_connections -= 1
            lost(reason)

        protocol.connectionLost = connection_lost
        return protocol


def ops_site(resource: OpsResource, reactor=None) -> _OpsSite:
    """The operations site serving ``resource``, with the port's limits (see the
    module docstring): a one-process server's, and a multi-worker server's parent's."""
    site = _OpsSite(resource, timeout=IDLE_TIMEOUT, reactor=reactor)
    site.noisy = False
    site.log = lambda request: None  # no access log lines for scrapes
    return site


def _given_token(request) -> bytes | None:
    header = request.getHeader(b"authorization")
    if header is not None:
        scheme, _, value = header.partition(b" ")
        if scheme.lower() == b"bearer":
            return value.strip()
    values = request.args.get(b"token") if request.args is not None else None  # (None: the query is not read yet)
    return values[0] if values else None


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class OpsPort:
    """The listening operations port and its throughput sampler; :meth:`stop` ends both."""

    def __init__(self, listening, sampler):
        self.listening = listening
        self.sampler = sampler
        self.port: int = listening.getHost().port

    def stop(self) -> None:
        if self.sampler.running:
            self.sampler.stop()
        self.listening.stopListening()


def start(state, reactor, port: int, host: str = "127.0.0.1", sample_every: float = 2.0,
          data_port: int | None = None) -> OpsPort:
    """Serve the operations site on ``host:port`` (reactor thread)."""
    throughput = Throughput(state.counters, interval=sample_every, state=state)
    sampler = task.LoopingCall(throughput.sample)
    sampler.clock = reactor
    listening = reactor.listenTCP(port, ops_site(OpsResource(state, throughput, data_port), reactor),
                                  interface=host)
    sampler.start(sample_every, now=True)
    if state.token is None and not _loopback(host):
        log.warning("metrics: the status port listens on %s without a token: anyone who reaches it sees the "
                    "bins, the clients and their addresses (--token-file protects it)", host)
    if not prom.available():
        log.warning("metrics: prometheus_client is not installed, so /metrics answers 503 "
                    "(the metrics extra: pip install prometheus_client); / and /status.json work")
    return OpsPort(listening, sampler)
