"""Starting and stopping a server: blocking (``run_server``), embedded (``EmbeddedServer``), or in this process.

The ``tensorshare-server`` command line is :mod:`.cli`.
"""

from __future__ import annotations

import atexit
import logging
import os
import resource
import shutil
import signal
import threading
from typing import Callable, Sequence

from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.internet.threads import blockingCallFromThread

from tensorshare.errors import UsageError
from tensorshare.protocol.auth import MIN_TOKEN_CHARS

from .bins.dirlock import DirLock, DirLockedError
from .bins.jobs import ThreadJobs
from .config import ServerConfig
from . import malloc
from .failures import listen_failure
from .net import busypoll
from .net.service import TensorShareFactory
from .net.twisted_internals import adopt_tcp, dispatch_directly, listen_tcp, listen_unix
from .root import build_state
from .workers.layout import place

log = logging.getLogger("tensorshare.server")

LOCAL_SOCKET = "server.sock"  # in the shared-memory area: where same-host clients connect (PROTOCOL.md §10.1)
_MAX_SOCKET_PATH = 100  # bytes (sun_path holds 108 with its NUL on Linux, fewer elsewhere)


def listen(config: ServerConfig, sockets: Sequence[int] = (), workers=None):
    """Start listening (on the reactor thread); returns the Twisted port object.

    With a data directory its bins are loaded first (item records only: the
    arrays stay on disk, so this takes time per item, not per byte).  Its
    ``tls_fingerprint`` attribute is the certificate's SHA-256 fingerprint when it
    serves TLS, else None.  Raises :class:`UsageError` for a token or TLS file that
    cannot be used.

    ``sockets`` are listening sockets (descriptors) to serve instead of binding
    ``config.host:config.port`` (the first is the port reported); ``workers`` the
    :class:`~tensorshare.protocol.placement.WorkerMap` of a worker of a
    multi-worker server (``server/workers/``), which then serves only its own bins.
    """
    tls = _tls_options(config)  # first: a certificate that cannot be used changes nothing
    made = config.data_dir is not None and not os.path.exists(config.data_dir)
    try:
        return _listen(config, sockets, workers, tls)
    except DirLockedError:  # another server made it meanwhile, and uses it
        raise
    except BaseException:
        if made:  # a start that failed (its port taken...) leaves no new data directory behind
            shutil.rmtree(config.data_dir, ignore_errors=True)
        raise


def _tls_options(config: ServerConfig) -> tuple | None:
    """``(options, fingerprint)`` for ``--tls-cert`` (None without it)."""
    if config.tls_key and not config.tls_cert:
        raise UsageError("tls_key needs tls_cert")
    if not config.tls_cert:
        return None
    from .net.tls import server_tls_options  # (says which extra it needs, before Twisted's TLS is imported)

    return server_tls_options(config.tls_cert, config.tls_key)


def _listen(config: ServerConfig, sockets: Sequence[int], workers, tls: tuple | None):
    jobs = ThreadJobs(reactor, config.disk_threads)
    try:
        if workers is None and config.data_dir:
            # Bins a multi-worker server left in its workers' directories come back to the
            # root: only while no other server uses the directory (it refuses us here).
            with DirLock(config.data_dir):
                place(config.data_dir, 1)
        state = build_state(config, jobs)
    except BaseException:
        jobs.stop()
        raise
    state.workers = workers  # (one worker of several: its sessions refuse others' bins, workers/ownership.py)
    if state.token is not None and len(state.token) < MIN_TOKEN_CHARS:
        log.warning("the token has only %d characters: use a random one of %d or more "
                    "(python -c 'import secrets; print(secrets.token_urlsafe(32))')", len(state.token), MIN_TOKEN_CHARS)

    def undo() -> None:
        jobs.stop()
        state.storage.close()

    if config.follow:
        from .relay import start_relay

        try:
            start_relay(state, config, reactor)
        except BaseException:
            undo()
            raise
    factory = TensorShareFactory(state)
    try:
        port = _bind(config, factory, sockets, tls)
    except BaseException:
        undo()
        raise
    port.jobs = jobs
    port.state = state
    port.local = None if tls is not None else _listen_local(state.storage, factory)
    port.ops = None
    if config.metrics_port is not None:
        from .ops import web

        try:
            port.ops = web.start(state, reactor, config.metrics_port, config.metrics_host,
                                 data_port=port.getHost().port)
        except BaseException:
            for listening in (*port.all, *([port.local] if port.local is not None else [])):
                listening.stopListening()
            undo()
            raise
    factory.busy_poll = port.busy_poll = busypoll.acquire(reactor, config.busy_poll)
    return port


def _bind(config: ServerConfig, factory, sockets: Sequence[int], tls: tuple | None):
    """Listen on ``config``'s address, or serve the listening ``sockets`` given; the first
    port, with ``all`` (every port) and ``tls_fingerprint``."""
    fingerprint = None
    if tls is not None:
        from twisted.protocols.tls import TLSMemoryBIOFactory

        options, fingerprint = tls
        factory = TLSMemoryBIOFactory(options, False, factory)  # what listenSSL does
    if sockets:
        ports = [adopt_tcp(fd, factory) for fd in sockets]
    else:
        ports = [listen_tcp(config.port, factory, config.host)]
    port = ports[0]
    port.all = ports
    port.tls_fingerprint = fingerprint
    return port


def _listen_local(storage, factory):
    """Listen on a Unix socket in the shared-memory area for clients on this host, who
    skip the TCP stack (PROTOCOL.md §10.1); None where there is no such area or the
    socket cannot be made (they stay on TCP then)."""
    area = storage.shm_area
    if area is None:
        return None
    path = os.path.join(area.root, LOCAL_SOCKET)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        log.info("same-host clients stay on TCP: the socket path %s is too long for a Unix socket", path)
        return None
    try:
        listening = listen_unix(path, factory)
    except (CannotListenError, OSError) as exc:
        log.warning("same-host clients stay on TCP: no Unix socket at %s (%s)", path, exc)
        return None
    storage.sharing.socket = path
    return listening


def _shut(port) -> None:
    """Stop listening on ``port``, drop its connections, finish its disk work (reactor thread)."""
    for listening in port.all:
        listening.stopListening()
    if port.local is not None:
        port.local.stopListening()
    if port.ops is not None:
        port.ops.stop()
    if getattr(port.state, "relay", None) is not None:
        port.state.relay.stop()
    factory = getattr(port.factory, "wrappedFactory", port.factory)  # TLS wraps our factory
    factory.disconnect_all()
    port.jobs.stop()
    factory.state.storage.close()
    busypoll.release(port.busy_poll)
    factory.busy_poll = None


def run_server(port: int = 8000, host: str = "127.0.0.1", *, start_reactor: bool = True, **settings):
    """Serve on ``host:port`` until SIGINT/SIGTERM; blocks the calling (main) thread.

    ``start_reactor=False`` (the original tensorshare's way to host the server in a
    client's process) starts it inside this process instead and returns at once:
    see :func:`serve_in_process`.

    ``port=0`` picks a free port; the chosen one is printed as
    ``tensorshare-server listening on HOST:PORT``.  ``settings`` are the fields of
    :class:`ServerConfig` (limits); ``busy_poll`` defaults to
    :data:`~.busypoll.DEFAULT_WINDOW` here, as the process serves and does nothing else.
    """
    if not start_reactor:
        return serve_in_process(port, host, **settings)
    settings.setdefault("busy_poll", busypoll.DEFAULT_WINDOW)  # this process is the server's own
    config = ServerConfig(host=host, port=port, **settings)
    if config.workers > 1:
        from .workers.supervisor import supervise

        return supervise(config)
    serve(config, _announce)


def serve(config: ServerConfig, announce: Callable, sockets: Sequence[int] = (), workers=None) -> None:
    """Serve until SIGINT/SIGTERM (or the reactor stops) in this process, which is
    the server's own; ``announce(port)`` runs once the reactor does (``sockets``,
    ``workers``: see :func:`listen`)."""
    malloc.tune()  # (see server/malloc.py)
    raise_open_files_limit()
    dispatch_directly(reactor)  # this process is the server's own (before listen: busy-polling wraps it)
    bound = listen(config, sockets, workers)
    reactor.addSystemEventTrigger("after", "shutdown", _shut, bound)
    # A SIGTERM/SIGINT that comes before reactor.run() installs Twisted's handlers
    # must still stop the server cleanly (removing its shared-memory and spill areas).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: reactor.callFromThread(reactor.stop))
    # Only once the reactor runs: its SIGTERM/SIGINT handlers are installed by then,
    # so a supervisor that signals as soon as it reads the announcement gets a clean
    # shutdown (spill files removed, disk work finished), not a kill.
    reactor.callWhenRunning(announce, bound)
    reactor.run()


OPEN_FILES = 65536  # descriptors the server asks for (within the hard limit): see raise_open_files_limit


def raise_open_files_limit(want: int = OPEN_FILES) -> int:
    """Raise this process's soft limit on open descriptors toward ``want``, within its
    hard limit (a soft limit of 1,024 is common); returns the limit now.  Each
    connection is a descriptor, and a same-host writer's kept directory two a column
    file (``server/bins/keptrows.py``): a few hundred same-host writers would meet
    1,024.  Past the limit, accepting connections and opening files fail."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        return soft
    except (OSError, ValueError) as exc:  # (a container that forbids it: keep what there is)
        log.info("could not raise the limit on open files: %s", exc)
        return -1


def _announce(bound) -> None:
    address = bound.getHost()
    print(f"tensorshare-server listening on {address.host}:{address.port}", flush=True)
    if bound.tls_fingerprint:
        print(f"tensorshare-server TLS certificate SHA-256 fingerprint {bound.tls_fingerprint}", flush=True)
    if bound.ops is not None:
        print(f"tensorshare-server status page http://{bound.state.config.metrics_host}:{bound.ops.port}/",
              flush=True)


_reactor_thread: threading.Thread | None = None
_reactor_lock = threading.Lock()


def ensure_reactor_thread() -> None:
    """Run the global reactor in a daemon thread, once per process, if nothing runs it."""
    global _reactor_thread
    with _reactor_lock:
        if reactor.running or _reactor_thread is not None:
            return
        _reactor_thread = threading.Thread(
            target=reactor.run, kwargs={"installSignalHandlers": False},
            name="tensorshare-reactor", daemon=True,
        )
        _reactor_thread.start()


class EmbeddedServer:
    """A server inside this process, on the reactor thread; for tests and trainers.

    >>> with EmbeddedServer(port=0) as server:
    ...     print(server.port)
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", **settings):
        self.config = ServerConfig(host=host, port=port, **settings)
        if self.config.workers > 1:
            raise UsageError("an embedded server runs in this process: one worker (run_server or "
                             "tensorshare-server --workers N for more)")
        ensure_reactor_thread()
        try:
            self._port = blockingCallFromThread(reactor, listen, self.config)
        except CannotListenError as exc:  # one line, as tensorshare-server says it
            raise UsageError(listen_failure(exc, self.config)) from None
        self.port: int = self._port.getHost().port
        self.host = host
        self.state = self._port.state  # bins, receive pool...: read it, do not change it
        self.tls_fingerprint: str | None = self._port.tls_fingerprint  # to pin (tls_fingerprint=)
        ops = self._port.ops
        self.metrics_port: int | None = ops.port if ops is not None else None  # /metrics, /status.json, /

    def stop(self) -> None:
        """Stop listening and drop the connections' state with the server."""
        if self._port is not None:
            blockingCallFromThread(reactor, _shut, self._port)
            self._port = None
            self.state = None  # the bins and the receive pool go with the server

    def __enter__(self) -> "EmbeddedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_in_process: list[EmbeddedServer] = []  # started by serve_in_process, until stopped
_in_process_lock = threading.Lock()


def serve_in_process(port: int = 8000, host: str = "127.0.0.1", **settings) -> EmbeddedServer:
    """Start a server inside this process and return at once (``run_server(port,
    start_reactor=False)``, as in the original tensorshare).

    It runs on the reactor's daemon thread, so it never keeps the process alive on
    its own: it ends with the process, with the returned handle's ``stop()``, or with
    :func:`stop_in_process_servers`, which ``TensorShare.stop()`` calls, as the
    original's ``stop()`` ended the reactor and the server with it."""
    server = EmbeddedServer(port=port, host=host, **settings)
    with _in_process_lock:
        if not _in_process:
            atexit.register(stop_in_process_servers)  # removes their shared-memory areas at exit
        _in_process.append(server)
    return server


def stop_in_process_servers(timeout: float = 10.0) -> None:
    """Stop every server :func:`serve_in_process` started that still runs."""
    with _in_process_lock:
        servers, _in_process[:] = list(_in_process), []
    for server in servers:
        if reactor.running:
            server.stop()
