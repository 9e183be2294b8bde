"""RLTrainer and RLWorker: versioned parameters out, rollouts in, workers come and go.

The bins of an experiment (``<experiment>/`` prefixes every name):

* ``parameters`` holds one item, ``{"version": v, "parameters": state}``, put with
  tag ``v``.  A put is atomic (one item, stored whole before it is announced), so a
  worker never sees a mix of two versions.  The notification of a put carries the
  tag, so a worker learns of a new version without downloading it, and downloads
  only when it asks for parameters newer than those it holds.
* ``rollouts`` collects ``{"version": v, "worker": id, "data": obj}`` items appended
  by workers.  With a cap (``max_waiting``), an append waits *in the server* while
  the bin holds that many (PROTOCOL.md §4.5): producers slow down to the learner's
  pace instead of filling memory with work that will be stale when it is read.
  Notifications tell the trainer that rollouts wait; it takes at most a batch.
* ``control`` holds one item the trainer puts, ``{"stop": bool, "max_waiting": n}``;
  workers listen to it.
* ``workers/<id>`` (ephemeral: the server deletes it when the worker's connection
  ends) and ``roster``: membership, see :mod:`tensorshare.rl_members`.

Nothing is polled, and no worker is waited for: a worker that dies leaves nothing
behind but a DELETE notification, a new worker starts from the latest version
(learnt atomically with its listen), and a trainer restarted against a server that
kept its bins continues the version numbers found there.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, NamedTuple

import torch

from .client import connect
from .compat import StartStop
from ._client.connection import Notification
from .errors import ConnectionLostError, NoSuchBinError, TimeoutError
from .protocol.messages import APPEND, MAX_WAIT, PUT, Key, check_bin_name
from .rl_members import StaleWatch, WorkerInfo
from .sharded import parse_server, rendezvous

log = logging.getLogger("tensorshare.rl")

__all__ = ["RLTrainer", "RLWorker", "Rollout", "WorkerInfo"]

DEFAULT_MAX_STALENESS = 4  # versions a rollout may lag behind and still be used
DEFAULT_MAX_WAITING = 256  # rollouts the server holds for the trainer before workers wait
CAPPED_PENDING = 2  # rollouts a worker has in flight while its experiment is capped


def bin_names(experiment: str | None) -> tuple[str, str]:
    """The (parameters, rollouts) bin names of an experiment (None: the defaults)."""
    prefix = _prefix(experiment)
    return prefix + "parameters", prefix + "rollouts"


def _prefix(experiment: str | None) -> str:
    return f"{experiment}/" if experiment else ""


def snapshot_state(state: Any) -> Any:
    """Detach tensors of a state dict (nested values are kept as they are)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: snapshot_state(v) for k, v in state.items()}
    return state


class Rollout(NamedTuple):
    """A rollout as :meth:`RLTrainer.get_data` gives it with ``return_info=True``."""

    data: Any
    version: int  # the version of the parameters that produced it (-1: unknown)
    worker: str | None  # the id of the worker that sent it
    staleness: int  # how many versions older than the trainer's latest it is


class _RLPeer(StartStop):
    """What trainer and worker share: a connection, bin names, start/stop.

    ``client_options`` go to :class:`~tensorshare.Client` (``token``, ``tls``,
    ``tls_ca``, ``tls_fingerprint``, ``keepalive``...).
    """

    def __init__(self, host: str, port: int, *, experiment: str | None, timeout: float | None,
                 connect_timeout: float, host_server: bool = False, **client_options):
        super().__init__()
        self.server = None
        if host_server:
            from tensorshare_server import EmbeddedServer

            # The hosted server asks for the token the peer uses (None: TENSORSHARE_TOKEN, if set).
            self.server = EmbeddedServer(port=port, host=_bind_address(host), token=client_options.get("token"))
            port = self.server.port
        self.experiment = experiment
        self.params_bin, self.data_bin = bin_names(experiment)
        self.control_bin = _prefix(experiment) + "control"
        self.roster_bin = _prefix(experiment) + "roster"
        self.workers_prefix = _prefix(experiment) + "workers/"
        self._address = (host, port, timeout, connect_timeout, client_options)
        self._client = connect(host, port, timeout=timeout, retry_for=connect_timeout, **client_options)
        self._cond = threading.Condition()
        self._closing = False
        self._failure: BaseException | None = None  # the first error of a call not waited for

    def _connect_again(self, server: tuple[str, int] | None = None):
        """Another connection, to the same server (or ``server``), with the same options."""
        host, port, timeout, connect_timeout, options = self._address
        if server is not None:
            host, port = server
        return connect(host, port, timeout=timeout, retry_for=connect_timeout, **options)

    def _failed(self, _result: Any, error: BaseException | None) -> None:
        """Callback of calls not waited for: keep the first error, for the next call."""
        if error is not None:
            with self._cond:
                if self._failure is None:
                    self._failure = error
                self._cond.notify_all()

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _shut(self) -> None:
        """Close the connection and the hosted server; wake anyone waiting."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None


class RLTrainer(_RLPeer):
    """Publishes parameters, collects the workers' rollouts, and watches the workers.

    ``filter_version=True`` drops rollouts made with parameters more than
    ``max_staleness`` versions older than the latest published one (0: only the
    current version is kept; the default, 4, suits asynchronous actors);
    :attr:`dropped` counts them, :attr:`drop_rate` says what share of the recent
    ones went, and a warning is logged when most of them do.

    ``max_waiting``: at most this many rollouts wait in the server; past it a
    worker's :meth:`RLWorker.add_data` waits (None: no cap).  Workers learn it
    through the experiment's control bin, so it can be changed at any time
    (:meth:`set_max_waiting`).

    :attr:`workers` lists the live workers; ``on_join(info)`` and
    ``on_leave(info)`` are called (on the client's callback thread) as they come
    and go.  :meth:`stop_workers` asks them all to stop.

    ``servers`` (``["host:port", ...]``): rollouts are spread over these servers,
    one rollouts bin on each (``max_waiting`` applies to each), and taken from
    them in turn; workers given the same list send theirs to one of them.
    Parameters, control and membership stay on ``host:port``, which workers may
    read through relays (``tensorshare-server --follow``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, host_server: bool = False,
                 filter_version: bool = True, *, max_staleness: int = DEFAULT_MAX_STALENESS,
                 max_waiting: int | None = DEFAULT_MAX_WAITING, experiment: str | None = None,
                 timeout: float | None = 60.0, connect_timeout: float = 30.0,
                 on_join: Callable[[WorkerInfo], Any] | None = None,
                 on_leave: Callable[[WorkerInfo], Any] | None = None,
                 servers: list[str | tuple[str, int]] | None = None, **client_options):
        if max_waiting is not None and max_waiting < 1:
            raise ValueError("max_waiting must be at least 1 (or None: no cap)")
        super().__init__(host, port, experiment=experiment, timeout=timeout, connect_timeout=connect_timeout,
                         host_server=host_server, **client_options)
        self.filter_version = filter_version
        self.max_staleness = max_staleness
        self.max_waiting = max_waiting
        self._stale = StaleWatch()
        self._workers: dict[str, WorkerInfo] = {}
        self._watching: dict[str, Any] = {}  # worker id -> listen handle of its bin
        self.on_join, self.on_leave = on_join, on_leave
        # Continue the versions a previous trainer left on the server.
        probe = self.client.listen(self.params_bin, lambda note: None)
        self.version = probe.snapshot.tag if probe.snapshot.tag is not None else -1
        probe.stop()
        self._put_control(stop=False)
        # The rollouts bin on this server, or one on each of ``servers``.
        self._extra_clients = [self._connect_again(parse_server(server)) for server in servers or ()]
        clients = self._extra_clients or [self.client]
        self._sources = [_RolloutBin(client, self.data_bin, self._cond) for client in clients]
        self._next_source = 0
        self._members_lock = threading.Lock()
        self.client.listen(self.roster_bin, lambda note: self._refresh_members())
        self._refresh_members()

    # -- parameters

    def publish_parameters(self, state_dict: dict, wait: bool = True) -> int:
        """Publish ``state_dict`` as the next version and return that version.

        The tensors are copied out at the call: training on afterwards cannot
        change what workers receive.  ``wait=False`` returns without waiting for
        the server (the learner's step is not held up by the network); an error
        then surfaces on the next call (or :meth:`flush`).
        """
        with self._cond:
            self._raise_failure()
        version = self.version + 1
        value = {"version": version, "parameters": snapshot_state(state_dict)}
        if wait:
            self.client.put(self.params_bin, value, tag=version)
        else:
            self.client.submit(PUT, self.params_bin, value, self._failed, tag=version)
        self.version = version
        return version

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every parameter version published with ``wait=False`` is stored
        (raise the error of one that was not)."""
        self.client.ping(timeout=timeout)  # replies come in request order: those before it are done
        with self._cond:
            self._raise_failure()

    # -- rollouts

    def get_data(self, return_versions: bool = False, timeout: float | None = None, *,
                 max_items: int | None = None, return_info: bool = False):
        """Take the rollouts collected so far (``[]`` if none), at most ``max_items``.

        With ``timeout``, wait up to that long for at least one to arrive.  With
        ``return_versions`` (as in the original), ``(data, versions)``: the rollouts
        and, in the same order, the version of the parameters each was made with.
        With ``return_info``, a list of :class:`Rollout` (data, version, worker,
        staleness).  Stale rollouts (see the class) are dropped, and more are taken
        in their place while more wait.
        """
        if max_items is not None and max_items < 1:
            raise ValueError("max_items must be at least 1")
        deadline = None if timeout is None else time.monotonic() + timeout
        kept: list[Rollout] = []
        while True:
            with self._cond:
                self._raise_failure()
                while not self._closing and not kept and deadline is not None and self._waiting() is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                source = None if self._closing else self._waiting()
                if source is None:
                    break
            want = None if max_items is None else max_items - len(kept)
            kept += self._take(source, want)
            if max_items is not None and len(kept) >= max_items:
                break
        if return_info:
            return kept
        if return_versions:
            return [r.data for r in kept], [r.version for r in kept]
        return [r.data for r in kept]

    def _waiting(self) -> "_RolloutBin | None":
        """A rollouts bin where rollouts wait, taking the servers in turn (under _cond)."""
        sources = self._sources
        for i in range(len(sources)):
            source = sources[(self._next_source + i) % len(sources)]
            if source.pending:
                self._next_source = (self._next_source + i + 1) % len(sources)
                return source
        return None

    def _take(self, source: "_RolloutBin", limit: int | None) -> list[Rollout]:
        """One GET of at most ``limit`` rollouts; the stale ones counted and dropped."""
        items = source.take(limit)
        kept, dropped, oldest = [], 0, self.version - self.max_staleness
        counts: dict[str, int] = {}
        for item in items:
            if isinstance(item, dict) and "version" in item:
                version, worker, data = item["version"], item.get("worker"), item.get("data")
            else:
                version, worker, data = -1, None, item
            if worker is not None:
                counts[worker] = counts.get(worker, 0) + 1
            if self.filter_version and version < oldest:
                dropped += 1
                continue
            kept.append(Rollout(data, version, worker, self.version - version))
        self._stale.count(len(kept), dropped, self.max_staleness)
        with self._members_lock:
            for worker, count in counts.items():
                info = self._workers.get(worker)
                if info is not None:
                    info.took(count)
        return kept

    @property
    def dropped(self) -> int:
        """Rollouts dropped as stale so far."""
        return self._stale.dropped

    @property
    def received(self) -> int:
        """Rollouts taken from the server so far (kept and dropped)."""
        return self._stale.received

    @property
    def drop_rate(self) -> float:
        """The share of the last 200 rollouts dropped as stale."""
        return self._stale.drop_rate

    def _shut(self) -> None:
        super()._shut()
        for client in self._extra_clients:
            client.close()

    # -- control

    def set_max_waiting(self, max_waiting: int | None) -> None:
        """Change the cap on rollouts waiting in the server (None: no cap); workers
        apply it to their next rollouts."""
        if max_waiting is not None and max_waiting < 1:
            raise ValueError("max_waiting must be at least 1 (or None: no cap)")
        self.max_waiting = max_waiting
        self._put_control(stop=False)

    def stop_workers(self) -> None:
        """Ask every worker, present and future, to stop (:attr:`RLWorker.stop_requested`)."""
        self._put_control(stop=True)

    def _put_control(self, stop: bool) -> None:
        self.client.put(self.control_bin, {"stop": stop, "max_waiting": self.max_waiting})

    # -- membership

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """The live workers by id (a copy)."""
        with self._members_lock:
            return dict(self._workers)

    def _refresh_members(self) -> None:
        """Watch the bins of workers that joined (listed in the roster, or found on
        the server by a trainer that starts after them)."""
        with self._members_lock:
            if self._closing:
                return
            try:
                try:
                    joined = self.client.get(self.roster_bin)
                except NoSuchBinError:
                    joined = []
                if not self._watching:  # first time: workers that registered before this trainer
                    joined += [name[len(self.workers_prefix):] for name in self.client.list()
                               if name.startswith(self.workers_prefix)]
                for worker_id in joined:
                    if isinstance(worker_id, str) and worker_id not in self._watching:
                        self._watch(worker_id)
            except ConnectionLostError:
                if not self._closing:
                    raise

    def _watch(self, worker_id: str) -> None:
        name = self.workers_prefix + worker_id
        handle = self.client.listen(name, lambda note: self._on_worker(worker_id, note))
        self._watching[worker_id] = handle
        if handle.snapshot.exists:
            self._joined(worker_id, handle.snapshot.tag)
        else:  # gone again before we looked
            self._forget(worker_id)

    def _joined(self, worker_id: str, version: int | None) -> None:
        try:
            [about] = self.client.peek(self.workers_prefix + worker_id)
        except (NoSuchBinError, ValueError):
            about = {}
        info = WorkerInfo(worker_id, -1 if version is None else version, str(about.get("host", "")),
                          int(about.get("pid", 0)))
        self._workers[worker_id] = info
        if self.on_join is not None:
            self.on_join(info)

    def _on_worker(self, worker_id: str, note: Notification) -> None:
        with self._members_lock:
            info = self._workers.get(worker_id)
            if note.op == "DELETE" or (note.op == "LISTEN" and not note.n_items):
                if info is not None:
                    del self._workers[worker_id]
                    self._forget(worker_id)
                    if self.on_leave is not None:
                        self.on_leave(info)
            elif info is None:
                self._joined(worker_id, note.tag)
            elif note.tag is not None:
                info.version = note.tag

    def _forget(self, worker_id: str) -> None:
        handle = self._watching.pop(worker_id, None)
        if handle is not None:
            try:
                handle.stop()
            except Exception:  # the connection is closing: nothing to stop
                pass


class _RolloutBin:
    """A rollouts bin as the trainer reads it: how many rollouts wait there (from
    notifications: only when it stops being empty, not of every append) and takes
    of at most a batch."""

    def __init__(self, client, name: str, cond: threading.Condition):
        self.client, self.name, self._cond = client, name, cond
        handle = client.listen(name, self._on_data, every_append=False)
        self.pending = handle.snapshot.n_items  # rollouts known to wait (0: none; may be a guess of 1)
        self.seq = handle.snapshot.seq  # newest change of the bin we know of

    def take(self, limit: int | None) -> list:
        try:
            items, seq = self.client.get(self.name, max_items=limit, with_seq=True)
        except NoSuchBinError:
            items, seq = [], self.seq
        with self._cond:
            if seq >= self.seq:  # no later change seen yet
                self.seq = seq
                # All taken: the bin is empty now.  A full batch: more may wait; the
                # next take finds out (a notification of an append since says so too).
                self.pending = 0 if limit is None or len(items) < limit else 1
        return items

    def _on_data(self, note: Notification) -> None:
        with self._cond:
            if note.seq <= self.seq:  # older than a take we already made
                return
            self.seq, self.pending = note.seq, note.n_items
            if note.n_items:
                self._cond.notify_all()


class RLWorker(_RLPeer):
    """Pulls the latest parameters (only when newer than its own) and adds rollouts.

    :meth:`add_data` does not wait for the server (as the original promised): up to
    ``max_pending`` rollouts are in flight at once, sent in order on one
    connection; past that it waits for the oldest to be stored.  When the trainer
    caps the rollouts waiting in the server (``max_waiting``), a rollout waits in
    the server for room and at most two are in flight, so :meth:`add_data` waits
    too, up to the client's timeout; rollouts then travel on a second connection,
    so that parameters still arrive meanwhile.  Once the trainer asked the workers
    to stop, :meth:`add_data` discards what it is given.  A rollout the server did not store makes the next
    :meth:`add_data` (or :meth:`flush`) raise its error.  :meth:`flush` waits until
    every rollout sent is stored; ``stop()`` flushes first.

    The worker registers under ``worker_id`` (default: host, pid and a random
    suffix), which the trainer sees in :attr:`RLTrainer.workers` and in each
    rollout.  :attr:`stop_requested` turns true when the trainer calls
    :meth:`RLTrainer.stop_workers` (and :meth:`await_new_parameters` returns None).

    ``servers``: the trainer's list of rollout servers; this worker sends its
    rollouts to the one its id hashes to (on a connection of their own), and
    reads parameters from ``host:port`` (the trainer's server, or a relay of it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, experiment: str | None = None,
                 timeout: float | None = 60.0, connect_timeout: float = 30.0, max_pending: int = 64,
                 worker_id: str | None = None, servers: list[str | tuple[str, int]] | None = None,
                 **client_options):
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        super().__init__(host, port, experiment=experiment, timeout=timeout, connect_timeout=connect_timeout,
                         **client_options)
        self.worker_id = worker_id or f"{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(3)}"
        problem = check_bin_name(self.workers_prefix + self.worker_id)
        if problem:
            self.client.close()
            raise ValueError(f"worker {self.worker_id!r} of experiment {experiment!r}: its membership bin "
                             f"{self.workers_prefix + self.worker_id!r:.60}...: {problem} (shorten the experiment "
                             f"name or the worker id)")
        self.max_pending = max_pending
        self.stop_requested = False
        self._max_waiting: int | None = None  # the trainer's cap, from the control bin
        self._rollouts = None  # the second connection rollouts take while capped (or to their server)
        # With several servers, this worker's rollouts go to one of them, the same for
        # every run of a worker of this id (rendezvous hashing spreads workers evenly).
        self._rollout_server = None
        if servers:
            addresses = [parse_server(server) for server in servers]
            self._rollout_server = addresses[rendezvous(self.worker_id, [f"{h}:{p}" for h, p in addresses])]
        self._in_flight = 0  # rollouts sent whose reply has not come (under _cond)
        self.version = -1  # version of the parameters this worker holds
        self._latest = -1  # newest version announced by the server
        self._parameters = None
        control = self.client.listen(self.control_bin, self._on_control)
        if control.snapshot.exists:
            self._read_control()
        handle = self.client.listen(self.params_bin, self._on_parameters)
        self._note_version(handle.snapshot.tag)
        self._register()
        self.client.append(self.roster_bin, self.worker_id)

    # -- parameters

    def get_parameters(self) -> dict | None:
        """The latest published parameters (None before the first publish).

        Downloads only if a newer version than the one held has been announced.
        """
        with self._cond:
            if self._latest <= self.version:
                return self._parameters
        try:
            [item] = self.client.peek(self.params_bin)
        except NoSuchBinError:
            return self._parameters
        with self._cond:
            newer = item["version"] > self.version
            if newer:
                self.version, self._parameters = item["version"], item["parameters"]
                self._latest = max(self._latest, self.version)
            parameters = self._parameters
        if newer:  # the trainer sees which version each worker holds
            self._register(wait=False)
        return parameters

    def await_new_parameters(self, timeout: float | None = None) -> dict | None:
        """Wait for parameters newer than those held and return them (None on timeout,
        or once the trainer asked the workers to stop)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._latest <= self.version:
                if self._closing or self.stop_requested:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
        return self.get_parameters()

    # -- rollouts

    def add_data(self, obj: Any) -> None:
        """Send a rollout, stamped with the version of the parameters held and this
        worker's id, without waiting for the server.  ``obj`` has been copied out
        when this returns, so changing it afterwards is safe."""
        timeout = self.client.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._raise_failure()
            # While capped, a rollout waits in the server; more than a couple queued
            # behind it would only be staler by the time they get in.
            window = self.max_pending if self._max_waiting is None else min(self.max_pending, CAPPED_PENDING)
            while self._in_flight >= window:  # the window is full: backpressure
                if self.stop_requested:  # nobody will read it
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.max_pending} rollouts still unacknowledged after {timeout:g}s"
                                       + (f" (the trainer holds at most {self._max_waiting} waiting)"
                                          if self._max_waiting else ""))
                self._cond.wait(remaining)
                self._raise_failure()
            if self.stop_requested:
                return
            self._in_flight += 1
            cap = self._max_waiting
        item = {"version": self.version, "worker": self.worker_id, "data": obj}
        try:
            if cap is None and self._rollout_server is None:
                self.client.submit(APPEND, self.data_bin, item, self._stored, tag=self.version, inline=True)
            elif cap is None:
                self._rollout_client().submit(APPEND, self.data_bin, item, self._stored, tag=self.version,
                                              inline=True)
            else:
                wait = MAX_WAIT if timeout is None else min(float(timeout), MAX_WAIT)
                self._rollout_client().submit(APPEND, self.data_bin, item, self._stored, tag=self.version,
                                              inline=True, fields={Key.BELOW: cap, Key.WAIT: wait})
        except BaseException:
            self._stored(None, None)
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every rollout :meth:`add_data` sent is stored; raise the error of
        one that was not (TimeoutError after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._in_flight} rollouts still unacknowledged after {timeout:g}s")
                self._cond.wait(remaining)
            self._raise_failure()

    def _rollout_client(self):
        if self._rollouts is None:
            self._rollouts = self._connect_again(self._rollout_server)
        return self._rollouts

    def _stored(self, _count: Any, error: BaseException | None) -> None:
        with self._cond:
            self._in_flight -= 1
            if error is not None and self._failure is None:
                self._failure = error
            self._cond.notify_all()

    # -- membership and control

    def _register(self, wait: bool = True) -> None:
        """Put (again) this worker's ephemeral bin, tagged with the version it holds."""
        about = {"id": self.worker_id, "host": socket.gethostname(), "pid": os.getpid()}
        name = self.workers_prefix + self.worker_id
        if wait:
            self.client.put(name, about, tag=self.version, ephemeral=True)
        else:
            self.client.submit(PUT, name, about, self._failed, tag=self.version, zero_copy=False,
                               fields={Key.EPHEMERAL: True})

    def _on_control(self, note: Notification) -> None:
        if note.op in ("PUT", "LISTEN", "RESTORE") and note.n_items:
            self._read_control()

    def _read_control(self) -> None:
        try:
            [control] = self.client.peek(self.control_bin)
        except (NoSuchBinError, ValueError):
            return
        with self._cond:
            cap = control.get("max_waiting") if isinstance(control, dict) else None
            self._max_waiting = cap if isinstance(cap, int) and cap >= 1 else None
            self.stop_requested = bool(control.get("stop")) if isinstance(control, dict) else False
            self._cond.notify_all()

    def _shut(self) -> None:
        try:
            # Asked to stop, the trainer reads no more: rollouts waiting for room never get it.
            self.flush(timeout=0.5 if self.stop_requested else 5.0)
        except Exception as exc:  # stopping anyway: say what was lost
            (log.info if self.stop_requested else log.warning)("rollouts not stored before stopping: %s", exc)
        if self._rollouts is not None:
            self._rollouts.close()
        super()._shut()

    def _on_parameters(self, note: Notification) -> None:
        if note.op == "LISTEN":  # listening again after a reconnect
            with self._cond:
                if note.tag is None or note.tag < self.version:
                    # The server lost its state (it was restarted):
                    # what we hold is from before; take whatever is published next.
                    self.version = self._latest = -1
            # The old connection's end deleted this worker's bin: register again.
            self._register(wait=False)
        if note.op in ("PUT", "LISTEN", "RESTORE"):
            self._note_version(note.tag)

    def _note_version(self, tag: int | None) -> None:
        if tag is None:
            return
        with self._cond:
            if tag > self._latest:
                self._latest = tag
                self._cond.notify_all()


def _bind_address(host: str) -> str:
    return "127.0.0.1" if host in ("localhost", "127.0.0.1") else host
