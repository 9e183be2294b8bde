"""The parent of a multi-worker server: one address, N worker processes, restarts, one data-directory lock.

``tensorshare-server --workers N`` runs this process, which serves no request
itself.  It

* takes the data directory's lock (``server/bins/dirlock.py``) and puts every
  durable bin and table into the directory of the worker that owns it
  (``layout.py``), before any worker starts;
* opens the listening sockets and keeps them for the server's whole life: the
  public one (``--port``), which every worker accepts connections on, and one per
  worker (``--worker-ports``, free ports by default), which only that worker
  accepts on.  Clients learn the worker ports from the greeting and open a
  connection to each worker whose bins they use (PROTOCOL.md §14);
* starts the workers (``python -m tensorshare_server.workers``: ``child.py``),
  handing each its sockets and its settings (its share of the memory budget, its
  data directory) on its standard input;
* restarts a worker that dies, with backoff, on the same sockets: connections made
  meanwhile wait in the socket's backlog, and the new worker loads its durable bins
  before it accepts them.  A start that fails for want of descriptors or processes
  is tried again the same way.  A worker that fails before the server first became
  ready stops the server instead (a bad setting would fail again);
* stops the workers (SIGTERM, then SIGKILL after ``STOP_GRACE`` seconds) when it is
  told to stop; a worker whose parent dies sees its standard input close and stops.

With ``--metrics-port`` each worker serves its operations port on a free loopback
port and this process serves the whole server's (``ops.py``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import asdict, replace

from twisted.internet import defer, protocol
from twisted.internet.error import CannotListenError

from tensorshare.errors import UsageError

from ..bins.dirlock import DirLock
from ..config import ServerConfig
from .layout import place, worker_dir

log = logging.getLogger("tensorshare.server")

STOP_GRACE = 15.0  # seconds stopping workers get before they are killed
BACKLOG = 1024  # connections a socket queues while its worker (re)starts
_FIRST_DELAY, _MAX_DELAY = 0.1, 5.0  # seconds before restarting a worker that died (doubling)
_STEADY = 30.0  # seconds a worker must have run for its next death to restart it at once again


def worker_config(config: ServerConfig, index: int) -> ServerConfig:
    """The settings of worker ``index``: its share of each of the whole server's limits
    (the memory budget, the receive pool, connections, bins, table rows: a setting
    is the server's, whatever its number of workers), its own data directory, its
    operations port on a free loopback port (for this process to gather from) if the
    server has one.  (Spill and shared-memory areas are per process already.)"""
    count = config.workers

    def share(total: int) -> int:  # rounded up: N shares of a total >= N add up to at most total + N - 1
        return -(-total // count)

    return replace(
        config, workers=1, worker_ports=None,
        data_dir=None if config.data_dir is None else worker_dir(config.data_dir, index),
        memory_limit=None if config.memory_limit is None else max(config.memory_limit // count, 1),
        recv_pool=config.recv_pool // count,
        max_connections=share(config.max_connections),  # (0, no limit, stays 0)
        max_bins=share(config.max_bins), max_table_rows=share(config.max_table_rows),
        metrics_port=None if config.metrics_port is None else 0, metrics_host="127.0.0.1",
        token=None, token_file=None,  # the resolved token travels apart (Supervisor._spec)
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port), inheritable by workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise CannotListenError(host, port, exc) from None  # (the command line says why, as for one process)
    return sock


class WorkerProcess(protocol.ProcessProtocol):
    """One worker process, as its parent sees it: its settings go in on standard input,
    its ``ready`` line comes back on standard output; its log goes to the parent's
    standard error."""

    def __init__(self, supervisor: "Supervisor", index: int):
        self.supervisor = supervisor
        self.index = index
        self.started_at = time.monotonic()
        self.info: dict | None = None  # what its ready line said, once it said it
        self.pid: int | None = None  # (its transport forgets it once it has ended)
        self.ended = defer.Deferred()
        self._out = b""

    def connectionMade(self) -> None:  # noqa: N802 - Twisted's name
        self.pid = self.transport.pid
        # The settings, then nothing: the pipe stays open, and closes when this process ends.
        self.transport.write(json.dumps(self.supervisor.spec(self.index)).encode() + b"\n")

    def outReceived(self, data: bytes) -> None:  # noqa: N802
        self._out += data
        while b"\n" in self._out:
            line, self._out = self._out.split(b"\n", 1)
            word, _, rest = line.decode("utf-8", "replace").partition(" ")
            if word == "ready":
                try:
                    self.info = json.loads(rest)
                except ValueError:
                    self.info = {}
                self.supervisor.ready(self)

    def processEnded(self, reason) -> None:  # noqa: N802
        self.supervisor.ended(self, reason.value)
        self.ended.callback(None)


class Supervisor:
    """The workers of one server (see the module docstring); reactor thread only."""

    def __init__(self, config: ServerConfig, reactor, executable: str = sys.executable):
        self.config = config
        self.reactor = reactor
        self.executable = executable
        self.count = config.workers
        self.id = secrets.token_hex(8)  # new each run: tells clients a restarted server from this one
        self.token = config.auth_token()
        self.lock: DirLock | None = None
        self.public: socket.socket | None = None
        self.private: list[socket.socket] = []
        self.ports: list[int] = []
        self.workers: list[WorkerProcess | None] = [None] * self.count
        self.delays = [_FIRST_DELAY] * self.count
        self.up = defer.Deferred()  # fires once every worker has been ready once
        self.stopping = False
        self.failed: str | None = None  # why the server could not start

    # -- starting

    def open(self) -> None:
        """Take the data directory, place its bins, open the sockets (before any worker)."""
        config = self.config
        try:
            if config.data_dir is not None:
                self.lock = DirLock(config.data_dir).acquire()
                place(config.data_dir, self.count)
            self.public = listening_socket(config.host, config.port)
            base = config.worker_ports
            for k in range(self.count):
                self.private.append(listening_socket(config.host, 0 if base is None else base + k))
        except BaseException:
            self.close()
            raise
        self.ports = [sock.getsockname()[1] for sock in self.private]

    def start(self) -> defer.Deferred:
        """Start every worker; the Deferred fires once all are ready."""
        for k in range(self.count):
            self.spawn(k)
        return self.up

    def spec(self, index: int) -> dict:
        """What worker ``index`` is told on its standard input."""
        return {
            "index": index, "ports": self.ports, "id": self.id,
            "config": asdict(worker_config(self.config, index)),
            "token": None if self.token is None else self.token.hex(),
            "log": {"level": logging.getLevelName(logging.getLogger().level), "format": _log_format()},
        }

    def spawn(self, index: int) -> None:
        if self.stopping:
            return
        process = self.workers[index] = WorkerProcess(self, index)
        fds = {0: "w", 1: "r", 2: 2, 3: self.public.fileno(), 4: self.private[index].fileno()}
        try:
            self.reactor.spawnProcess(process, self.executable,
                                      [self.executable, "-m", "tensorshare_server.workers"],
                                      env=dict(os.environ), childFDs=fds)
        except OSError as exc:  # no descriptors or processes left for now (EMFILE, EAGAIN): try again later
            self.workers[index] = None
            why = f"could not be started ({exc.strerror or exc})"
            if not self.up.called:
                self.failed = f"worker {index} {why}"
                self.up.errback(UsageError(self.failed))
                return
            delay = self._backoff(index)
            log.error("worker %d %s; trying again in %.1fs", index, why, delay)
            self.reactor.callLater(delay, self.spawn, index)

    def ready(self, process: WorkerProcess) -> None:
        if self.workers[process.index] is not process:
            return
        log.info("worker %d ready (pid %s)", process.index, process.pid)
        if not self.up.called and all(w is not None and w.info is not None for w in self.workers):
            self.up.callback(self)

    def ended(self, process: WorkerProcess, reason) -> None:
        index = process.index
        if self.workers[index] is not process:
            return
        self.workers[index] = None
        if self.stopping:
            return
        why = _why_ended(reason)
        if not self.up.called:  # it never got going: a setting or the machine is at fault, not bad luck
            self.failed = f"worker {index} failed to start ({why})"
            self.up.errback(UsageError(self.failed))
            return
        ran = time.monotonic() - process.started_at
        if ran > _STEADY:
            self.delays[index] = _FIRST_DELAY
        delay = self._backoff(index)
        log.error("worker %d (pid %s) %s after %.1fs; restarting it in %.1fs", index, process.pid, why, ran, delay)
        self.reactor.callLater(delay, self.spawn, index)

    def _backoff(self, index: int) -> float:
        """Seconds to wait before starting worker ``index`` again (doubling, up to ``_MAX_DELAY``)."""
        delay = self.delays[index]
        self.delays[index] = min(delay * 2, _MAX_DELAY)
        return delay

    # -- stopping

    def stop(self) -> defer.Deferred:
        """Stop every worker (SIGTERM, SIGKILL after ``STOP_GRACE``); fires once all ended."""
        self.stopping = True
        running = [w for w in self.workers if w is not None]
        for worker in running:
            _signal(worker, "TERM")
        if not running:
            return defer.succeed(None)

        def kill() -> None:
            for worker in running:
                if not worker.ended.called:
                    log.error("worker %d did not stop within %gs: killing it", worker.index, STOP_GRACE)
                    _signal(worker, "KILL")

        timer = self.reactor.callLater(STOP_GRACE, kill)
        done = defer.DeferredList([w.ended for w in running])
        done.addBoth(lambda _: timer.cancel() if timer.active() else None)
        return done

    def close(self) -> None:
        """Close the sockets and let the data directory go (every worker has ended)."""
        for sock in [self.public, *self.private]:
            if sock is not None:
                sock.close()
        self.public, self.private = None, []
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _signal(worker: WorkerProcess, name: str) -> None:
    try:
        worker.transport.signalProcess(name)
    except Exception:  # noqa: BLE001 - it ended meanwhile (ProcessExitedAlready)
        pass


def _why_ended(reason) -> str:
    signal_number = getattr(reason, "signal", None)
    if signal_number:
        try:
            return f"was killed by {signal.Signals(signal_number).name}"
        except ValueError:
            return f"was killed by signal {signal_number}"
    return f"exited with code {getattr(reason, 'exitCode', '?')}"


def _log_format() -> str:
    from ..ops.logs import JsonFormatter

    handlers = logging.getLogger().handlers
    return "json" if handlers and isinstance(handlers[0].formatter, JsonFormatter) else "text"


def supervise(config: ServerConfig) -> int:
    """Run a server of ``config.workers`` workers until SIGINT/SIGTERM; blocks the calling
    (main) thread.  Prints ``tensorshare-server listening on HOST:PORT`` once every
    worker is ready; returns the exit code (2: the server could not start)."""
    from twisted.internet import reactor

    supervisor = Supervisor(config, reactor)
    supervisor.open()
    outcome = {"code": 0}

    def announce(_) -> None:
        host, port = supervisor.public.getsockname()[:2]
        print(f"tensorshare-server listening on {host}:{port}", flush=True)
        print(f"tensorshare-server workers {supervisor.count} on ports "
              f"{','.join(map(str, supervisor.ports))}", flush=True)
        info = supervisor.workers[0].info or {}
        if info.get("tls_fingerprint"):
            print(f"tensorshare-server TLS certificate SHA-256 fingerprint {info['tls_fingerprint']}", flush=True)
        if config.metrics_port is not None:
            from .ops import start_ops

            try:
                ops = start_ops(supervisor, reactor)
            except Exception as exc:  # noqa: BLE001 - the port is taken, say: the server cannot be run as asked
                failed(exc)
                return
            reactor.addSystemEventTrigger("before", "shutdown", ops.stop)
            print(f"tensorshare-server status page http://{config.metrics_host}:{ops.port}/", flush=True)

    def failed(failure) -> None:
        error = getattr(failure, "value", failure)
        print(f"tensorshare-server: {error}", file=sys.stderr, flush=True)
        outcome["code"] = 2
        reactor.stop()

    reactor.addSystemEventTrigger("before", "shutdown", supervisor.stop)
    for sig in (signal.SIGTERM, signal.SIGINT):  # before reactor.run() installs Twisted's own
        signal.signal(sig, lambda *_: reactor.callFromThread(reactor.stop))
    reactor.callWhenRunning(lambda: supervisor.start().addCallbacks(announce, failed))
    try:
        reactor.run()
    finally:
        supervisor.close()
    return outcome["code"]


__all__ = ["Supervisor", "listening_socket", "supervise", "worker_config"]
