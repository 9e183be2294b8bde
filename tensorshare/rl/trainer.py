"""RLTrainer: publishes parameters, takes rollouts in batches, watches its workers."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, NamedTuple

import torch

from ..client import Notification
from ..errors import ConnectionLostError, NoSuchBinError, TimeoutError
from ..protocol.messages import PUT
from ..sharded import parse_server
from ..wire.codec import encode
from .members import StaleWatch, WorkerInfo
from .peer import RLPeer, snapshot_state
from .staging import Sender, snapshot
from .versions import Encoder, PublishStats, cast_state, chain_bin, check_dtype, flatten, publish, tensor_bytes

log = logging.getLogger("tensorshare.rl")

DEFAULT_MAX_STALENESS = 4  # versions a rollout may lag behind and still be used
DEFAULT_MAX_WAITING = 256  # rollouts the server holds for the trainer before workers wait


class Rollout(NamedTuple):
    """A rollout as :meth:`RLTrainer.get_data` gives it with ``return_info=True``."""

    data: Any
    version: int  # the version of the parameters that produced it (-1: unknown)
    worker: str | None  # the id of the worker that sent it
    staleness: int  # how many versions older than the trainer's latest it is


class RLTrainer(RLPeer):
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
                 timeout: float | None = 60.0, connect_timeout: float | None = None,
                 on_join: Callable[[WorkerInfo], Any] | None = None,
                 on_leave: Callable[[WorkerInfo], Any] | None = None,
                 servers: list[str | tuple[str, int]] | None = None, **client_options: Any) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError("max_waiting must be at least 1 (or None: no cap)")
        super().__init__(host, port, experiment=experiment, timeout=timeout, connect_timeout=connect_timeout,
                         host_server=host_server, **client_options)
        self.filter_version = filter_version
        self.max_staleness = max_staleness
        self.max_waiting = max_waiting
        self._stale = StaleWatch()
        self._versions = Encoder()  # what delta publishes compare with (versions.py)
        self._device_sender: Sender | None = None  # sends versions in device memory (staging.py)
        self.chain_bin = chain_bin(experiment)
        self.last_publish: PublishStats | None = None
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
        # One server: the rollouts are taken on a connection of their own, so that a take
        # that waits there for rollouts holds back no publish or membership call.
        clients = self._extra_clients or [self._connect_again()]
        self._extra_clients = clients
        self._sources = [_RolloutBin(client, self.data_bin, self._cond) for client in clients]
        self._next_source = 0
        self._carried: list[Rollout] = []  # taken by a get_data that then timed out short of min_items
        self._members_lock = threading.Lock()
        # Workers append their ids to the roster; the trainer's own takes of it (n = 0)
        # are no news (reading the roster again for them would only take again: a loop).
        self.client.listen(self.roster_bin, lambda note: self._refresh_members() if note.n_items else None)
        self._refresh_members()

    # -- parameters

    def publish_parameters(self, state_dict: dict, wait: bool = True, *, dtype: torch.dtype | None = None,
                           delta: bool = False) -> int:
        """Publish ``state_dict`` as the next version and return that version.

        The tensors are copied out at the call: training on afterwards cannot
        change what workers receive.  ``wait=False`` returns without waiting for
        the server (the learner's step is not held up by the network); an error
        then surfaces on the next call (or :meth:`flush`).  A state in GPU memory
        is copied once on the GPU and sent from there by a background thread
        (at most two publishes wait for it; see :mod:`tensorshare.rl.staging`).

        ``dtype`` (``torch.bfloat16``...): send the floating-point tensors cast to
        it (workers receive the rounded values; ``load_state_dict`` casts them back
        into their model).  ``delta=True``: send only the leaves that changed since
        the version published before (workers that hold it patch their copy; others
        read the keyframe chain).  :attr:`last_publish` says what was sent.  See
        :mod:`tensorshare.rl.versions`.
        """
        with self._cond:
            self._raise_failure()
        check_dtype(dtype)
        version = self.version + 1
        if not delta and self._by_reference(state_dict):
            self.last_publish = self._publish_by_reference(state_dict, version, dtype, wait)
            self.version = version
            return version
        if dtype is not None or delta:
            self.last_publish = publish(self._versions, self.client, self.params_bin, self.chain_bin, state_dict,
                                        version, dtype, delta, wait, self._failed, self._sender)
            self.version = version
            return version
        self._versions.forget()  # the next delta publish starts with a keyframe
        value = {"version": version, "parameters": snapshot_state(state_dict)}
        if wait:
            self.client.put(self.params_bin, value, tag=version)
        else:
            enc = encode(value)
            if enc.engine is None:
                self.client.submit(PUT, self.params_bin, enc, self._failed, tag=version, inline=True)
            else:  # device tensors: one snapshot on the device, sent by the sender thread (rl/staging.py)
                self._sender().send(PUT, self.params_bin, snapshot(enc), version, self._failed)
        nbytes = tensor_bytes(value)
        leaves = len(flatten(state_dict)) if isinstance(state_dict, dict) else 1
        self.last_publish = PublishStats(version, "full", leaves, nbytes, nbytes, None)
        self.version = version
        return version

    def _by_reference(self, state: Any) -> bool:
        """Whether a whole version of ``state`` goes by device reference: a state in
        CUDA memory, on the server's host, which takes references (PROTOCOL.md §13)."""
        if not self.client.device_references:
            return False
        first = next((leaf for leaf in flatten(state).values() if isinstance(leaf, torch.Tensor)), None) \
            if isinstance(state, dict) else state
        return isinstance(first, torch.Tensor) and first.is_cuda

    def _publish_by_reference(self, state: Any, version: int, dtype, wait: bool) -> PublishStats:
        """A whole version put by device reference: one snapshot on the GPU (cast there),
        which same-host CUDA workers copy device to device; its bytes follow in the
        background for the others (``Client.put``'s ``by_reference``)."""
        self._versions.forget()  # the next delta publish starts with a keyframe
        value = {"version": version, "parameters": cast_state(state, dtype)}
        if wait:
            self.client.put(self.params_bin, value, tag=version, by_reference=True)
        else:
            self.client.submit(PUT, self.params_bin, value, self._failed, tag=version, by_reference=True)
        nbytes = tensor_bytes(value)
        leaves = len(flatten(state)) if isinstance(state, dict) else 1
        return PublishStats(version, "full", leaves, nbytes, nbytes, None)

    def set_keyframes(self, every: int = 100, fraction: float = 0.5) -> None:
        """When ``delta`` publishes put a new keyframe in the chain: every ``every``
        versions, or once the deltas since the last one weigh more than ``fraction``
        of the whole state (a worker that missed versions reads at most
        ``1 + fraction`` times the state)."""
        self._versions = Encoder(every, fraction)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every parameter version published with ``wait=False`` is stored
        (raise the error of one that was not)."""
        if self._device_sender is not None:  # device versions still to hand to the client
            self._device_sender.flush(timeout)
        self.client.flush(timeout=timeout)  # (versions put by reference included)
        with self._cond:
            self._raise_failure()

    # -- rollouts

    def get_data(self, return_versions: bool = False, timeout: float | None = None, *,
                 max_items: int | None = None, min_items: int | None = None, return_info: bool = False) -> Any:
        """Take the rollouts collected so far (``[]`` if none), at most ``max_items``.

        With ``timeout``, wait up to that long for at least one rollout to arrive
        (``[]`` if none did).  With ``min_items`` too, for at least that many:
        ``get_data(max_items=64, min_items=64, timeout=30)`` is a batch of exactly
        64, or :class:`~tensorshare.errors.TimeoutError` after 30 s, saying how many
        came (and how many workers there are); those are kept for the next call,
        never lost.  (Without ``timeout``, ``min_items`` is not waited for.)  With ``return_versions``
        (as in the original), ``(data, versions)``: the rollouts and, in the same
        order, the version of the parameters each was made with.  With
        ``return_info``, a list of :class:`Rollout` (data, version, worker,
        staleness).  Stale rollouts (see the class) are dropped, and more are taken
        in their place while more wait.

        On one server the wait happens in the server (a GET that waits: the reply
        comes as soon as the rollouts do, with no notification in between).
        """
        if max_items is not None and max_items < 1:
            raise ValueError("max_items must be at least 1")
        if min_items is not None and (min_items < 1 or (max_items is not None and min_items > max_items)):
            raise ValueError("min_items must be at least 1 and at most max_items")
        deadline = None if timeout is None else time.monotonic() + timeout
        least = min_items or 1
        with self._cond:  # what an earlier call took but could not return (a batch short at its timeout)
            kept, self._carried = self._carried[:max_items], self._carried[max_items or len(self._carried):]
        while max_items is None or len(kept) < max_items:
            want = None if max_items is None else max_items - len(kept)
            remaining = None if deadline is None else deadline - time.monotonic()
            if len(self._sources) == 1 and remaining is not None and remaining > 0 and len(kept) < least:
                with self._cond:  # one server: the take itself waits there
                    self._raise_failure()
                    if self._closing:
                        break
                try:
                    items = self._sources[0].take(want, wait=remaining, least=least - len(kept))
                except ConnectionLostError:
                    if self._closing:  # stopped from another thread meanwhile
                        break
                    raise
                kept += self._sort(items)
                if (max_items is not None and len(kept) >= max_items) or \
                        (len(kept) >= least and (want is None or len(items) < want)):
                    break  # a full batch; or enough, and the bin was emptied: nothing more waits
                continue
            with self._cond:
                self._raise_failure()
                while not self._closing and len(kept) < least and deadline is not None and self._waiting() is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                source = None if self._closing else self._waiting()
                if source is None:
                    break
            kept += self._sort(source.take(want))
            if max_items is not None and len(kept) >= max_items:
                break
        if min_items is not None and timeout is not None and len(kept) < min_items and not self._closing:
            with self._cond:
                self._carried = kept + self._carried
            raise TimeoutError(self._short_batch(len(kept), min_items, timeout))
        if return_info:
            return kept
        if return_versions:
            return [r.data for r in kept], [r.version for r in kept]
        return [r.data for r in kept]

    def _short_batch(self, got: int, min_items: int, timeout: float) -> str:
        """Why a batch of ``min_items`` did not come within ``timeout``, and what to do."""
        workers = len(self.workers)
        said = f"get_data: {got} of min_items={min_items} rollouts within {timeout:g}s (kept for the next call)"
        if not workers:
            return f"{said}: no worker of experiment {self.experiment!r} is connected"
        if self.dropped:
            said += f"; {self.dropped} dropped as stale so far (max_staleness={self.max_staleness})"
        return f"{said}; {workers} worker(s) connected: wait longer, or ask for fewer"

    def _waiting(self) -> "_RolloutBin | None":
        """A rollouts bin where rollouts wait, taking the servers in turn (under _cond)."""
        sources = self._sources
        for i in range(len(sources)):
            source = sources[(self._next_source + i) % len(sources)]
            if source.pending:
                self._next_source = (self._next_source + i + 1) % len(sources)
                return source
        return None

    def _sort(self, items: list) -> list[Rollout]:
        """The rollouts of one take, the stale ones counted and dropped; each worker's
        count and version noted."""
        kept, dropped, oldest = [], 0, self.version - self.max_staleness
        seen: dict[str, list[int]] = {}  # worker -> [rollouts, newest version]
        for item in items:
            if isinstance(item, dict) and "version" in item:
                version, worker, data = item["version"], item.get("worker"), item.get("data")
            else:
                version, worker, data = -1, None, item
            if worker is not None:
                counts = seen.setdefault(worker, [0, version])
                counts[0] += 1
                counts[1] = max(counts[1], version)
            if self.filter_version and version < oldest:
                dropped += 1
                continue
            kept.append(Rollout(data, version, worker, self.version - version))
        self._stale.count(len(kept), dropped, self.max_staleness)
        with self._members_lock:
            for worker, (count, version) in seen.items():
                info = self._workers.get(worker)
                if info is not None:
                    info.took(count)
                    info.version = max(info.version, version)  # it held at least that one
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

    def _sender(self) -> Sender:
        """The thread that sends device versions (made on first use)."""
        if self._device_sender is None:
            self._device_sender = Sender(self.client)
        return self._device_sender

    def _shut(self) -> None:
        if self._device_sender is not None:
            self._device_sender.close()
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
        """Ask every worker, present and future, to stop (:attr:`RLWorker.stop_requested`).

        The request stays in the server after this trainer stops, so workers started
        later stop too (a supervisor restarting them ends the run); the next
        :class:`RLTrainer` of the experiment lifts it."""
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

    def take(self, limit: int | None, wait: float | None = None, least: int | None = None) -> list:
        """At most ``limit`` rollouts; with ``wait``, once ``least`` wait (or what
        there is after ``wait`` seconds)."""
        try:
            items, seq = self.client.get(self.name, max_items=limit, with_seq=True, wait=wait,
                                         least=least if wait else None)
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
            # older than a take we already made; but a LISTEN (listening again after a
            # reconnection) is the bin's state now, with the seqs of a server that may
            # have restarted and counts them anew: kept, it held every later one back
            if note.seq <= self.seq and note.op != "LISTEN":
                return
            self.seq, self.pending = note.seq, note.n_items
            if note.n_items:
                self._cond.notify_all()


