"""RLWorker: pulls the newest parameters, sends rollouts without waiting, registers
itself (membership) and obeys the trainer's control bin."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ..client import Notification
from ..errors import ConnectionLostError, NoSuchBinError, TimeoutError
from ..protocol.messages import APPEND, MAX_WAIT, PUT, Key, check_bin_name
from ..sharded import parse_server, rendezvous
from .peer import RLPeer
from .versions import Reader, chain_bin

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tensorshare.rl")

CAPPED_PENDING = 2  # the fewest rollouts a worker keeps in flight while its experiment is capped
POLL_S = 0.5  # the longest one long poll for parameters waits (a stop request is seen between two)
REPORT_EVERY = 0.2  # seconds: how often at most a worker tells the trainer which version it holds


class RLWorker(RLPeer):
    """Pulls the latest parameters (only when newer than its own) and adds rollouts.

    :meth:`add_data` does not wait for the server (as the original promised): up to
    ``max_pending`` rollouts are in flight at once, sent in order on one
    connection; past that it waits for the oldest to be stored.  When the trainer
    caps the rollouts waiting in the server (``max_waiting``), a rollout waits in
    the server for room and at most an eighth of the cap (at least two) are in
    flight (more would only get staler while they wait), so :meth:`add_data` waits
    too, up to the client's timeout; rollouts then travel on a second connection,
    so that parameters still arrive meanwhile.  Once the trainer asked the workers
    to stop, :meth:`add_data` discards what it is given (a warning says so, once).  A rollout the server did not store makes the next
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
                 timeout: float | None = 60.0, connect_timeout: float | None = None, max_pending: int = 64,
                 worker_id: str | None = None, servers: list[str | tuple[str, int]] | None = None,
                 **client_options: Any) -> None:
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
        self._told_stop = False  # add_data said that it discards rollouts (once per stop request)
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
        self._seq: int | None = None  # seq of the parameters bin when this worker last read it
        self._poll = None  # the connection parameters are long-polled on (await_new_parameters)
        self._reported = (-1, 0.0)  # (version, monotonic time) last put in this worker's bin
        self._report_timer: threading.Timer | None = None  # a report that follows one made a moment ago
        self._versions = Reader()  # whole versions from deltas and the keyframe chain (versions.py)
        self.chain_bin = chain_bin(experiment)
        control = self.client.listen(self.control_bin, self._on_control)
        if control.snapshot.exists:
            self._read_control()
        handle = self.client.listen(self.params_bin, self._on_parameters)
        self._note_version(handle.snapshot.tag)
        self._register()
        self.client.append(self.roster_bin, self.worker_id)

    @property
    def parameter_bytes(self) -> int:
        """Tensor bytes of the parameters read so far (deltas and keyframe chains
        included): what lighter versions save shows here."""
        return self._versions.bytes_read

    @property
    def max_waiting(self) -> int | None:
        """The trainer's cap on rollouts waiting in the server, as this worker last
        heard it (None: no cap)."""
        return self._max_waiting

    # -- parameters

    def get_parameters(self) -> dict | None:
        """The latest published parameters (None before the first publish).

        Downloads only if a newer version than the one held has been announced.
        """
        return self._fetch(None)

    def load_into(self, model: torch.nn.Module) -> int:
        """Write the latest published parameters into ``model`` (a ``torch.nn.Module``,
        or a dict of tensors) in place; returns their version (-1 before the first
        publish).  Downloads only if a newer version has been announced.

        On a worker made with a device (``RLWorker(device="cuda")``), a whole version
        whose tensors match the model's own (dtype, shape, device, contiguous)
        arrives straight into them: over TCP bucket by bucket, on the trainer's
        host device to device from its memory, with no copy in between.  Anything
        else (a cast, a delta, a version rebuilt from the keyframe chain, a CPU
        model) is copied in once it has arrived.  If a read fails midway the model
        may hold part of a version: load again.  Afterwards the parameters this
        worker holds (:meth:`get_parameters`) are the model's own tensors where
        they arrived into them."""
        targets = model.state_dict() if hasattr(model, "state_dict") else model
        state = self._fetch(targets)
        if state is None:
            return -1
        import torch

        with torch.no_grad():
            for name, tensor in state.items():
                dest = targets.get(name)
                if dest is None:
                    raise KeyError(f"the published parameters hold {name!r}, which the model has not")
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"the published parameter {name!r} is a {type(tensor).__name__}, not a tensor")
                if not (isinstance(tensor, torch.Tensor) and tensor.data_ptr() == dest.data_ptr()
                        and tensor.shape == dest.shape and tensor.dtype == dest.dtype):
                    dest.copy_(tensor)
        return self.version

    def _fetch(self, into: dict | None) -> dict | None:
        """The latest parameters, read if a newer version was announced (``into``: tensors
        a whole newer version may arrive into, by name)."""
        with self._cond:
            if self._latest <= self.version:
                return self._parameters
        placing = {} if into is None else {"into": self._placer(into)}
        try:
            items, seq = self.client.peek(self.params_bin, with_seq=True, **placing)
        except NoSuchBinError:
            return self._parameters
        return self._adopt(items, seq)

    def _placer(self, targets: dict):
        """``into`` for a read of the parameters bin: ``targets`` receive a whole version
        newer than the one held (never a delta, nor an older version: the model
        would then hold a mix that this worker does not know of)."""
        from ..wire.description import template_targets

        match = template_targets({"parameters": targets})

        def place(item: int, desc) -> dict:
            tree = desc.tree
            version = tree.get("version") if isinstance(tree, dict) else None
            if type(version) is not int or version <= self.version:
                return {}
            return match(item, desc)
        return place

    def await_new_parameters(self, timeout: float | None = None) -> dict | None:
        """Wait for parameters newer than those held and return them (None on timeout,
        or once the trainer asked the workers to stop).

        Once this worker has read a version, the wait is a long poll: a PEEK that
        the server holds until the next version is stored, on a connection of its
        own, so the new parameters come in its reply (no notification, no second
        round trip)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self.stop_requested and not self._closing:
                    self._say_stopped()
                if self._closing or self.stop_requested:
                    return None
                if self._latest > self.version:  # a newer one is known already: fetch it
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                if self._seq is None:  # nothing read yet: wait to hear of a first version
                    self._cond.wait(remaining)
                    continue
                seq = self._seq
            wait = POLL_S if remaining is None else min(remaining, POLL_S)
            try:
                items, seq = self._poller().peek(self.params_bin, with_seq=True, since=seq, wait=wait)
            except NoSuchBinError:  # deleted meanwhile: wait to hear of the next one
                with self._cond:
                    self._seq = None
                continue
            except ConnectionLostError:
                if self._closing:
                    return None
                raise
            held = self.version
            parameters = self._adopt(items, seq)
            if self.version > held:
                return parameters
        return self.get_parameters()

    def _adopt(self, items: list, seq: int) -> dict | None:
        """Take the parameters of a PEEK of the parameters bin if they are newer than
        those held (a delta is patched onto them, :mod:`.versions`); the parameters
        held."""
        with self._cond:
            self._seq = seq
            item = items[0] if items else None
            held = (self.version, self._parameters) if item is not None and item["version"] > self.version else None
        if held is not None and "parameters" not in item:  # a delta or a keyframe marker
            got = self._versions.resolve(item, *held, read_chain=lambda: self.client.peek(self.chain_bin))
            if got is None:  # no whole version to make yet (the chain is behind): wait for the next one
                with self._cond:
                    if self._latest <= item["version"]:
                        self._latest = self.version
            item = item if got is None else {"version": got[0], "parameters": got[1]}
        elif item is not None:
            self._versions.count(item)
        with self._cond:
            newer = item is not None and "parameters" in item and item["version"] > self.version
            if newer:
                self.version, self._parameters = item["version"], item["parameters"]
                self._latest = max(self._latest, self.version)
            parameters = self._parameters
        if newer:  # the trainer sees which version each worker holds
            self._report_version()
        return parameters

    def _poller(self):
        """The connection parameters are long-polled on (made on first use)."""
        if self._poll is None:
            self._poll = self._connect_again()
        return self._poll

    # -- rollouts

    def add_data(self, obj: Any) -> None:
        """Send a rollout, stamped with the version of the parameters held and this
        worker's id, without waiting for the server.  ``obj`` has been copied out
        when this returns, so changing it afterwards is safe."""
        timeout = self.client.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._raise_failure()
            # Capped, rollouts may wait in the server and get staler meanwhile: keep an
            # eighth of the cap in flight (at least two), not max_pending.
            cap = self._max_waiting
            window = self.max_pending if cap is None else min(self.max_pending, max(CAPPED_PENDING, cap // 8))
            while self._in_flight >= window:  # the window is full: backpressure
                if self.stop_requested:  # nobody will read it
                    self._say_stopped()
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._in_flight} rollouts still unacknowledged after {timeout:g}s"
                                       + (f" (the trainer holds at most {self._max_waiting} waiting, and takes "
                                          f"none: is it calling get_data?)" if self._max_waiting else ""))
                self._cond.wait(remaining)
                self._raise_failure()
            if self.stop_requested:
                self._say_stopped()
                return
            self._in_flight += 1
            cap = self._max_waiting
        if self._reported[0] != self.version:  # a version it skipped reporting (see _report_version)
            self._report_version()
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

    def _say_stopped(self) -> None:
        """Say once per stop request what it does to this worker, and why (under _cond)."""
        if not self._told_stop:
            self._told_stop = True
            log.warning("RLWorker %s: the trainer of experiment %r asked its workers to stop (stop_workers()): "
                        "await_new_parameters returns None and add_data discards rollouts until a new RLTrainer of "
                        "the experiment starts",
                        self.worker_id, self.experiment)

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
        self._reported = (self.version, time.monotonic())
        if wait:
            self.client.put(name, about, tag=self.version, ephemeral=True)
        else:
            self.client.submit(PUT, name, about, self._failed, tag=self.version, zero_copy=False, inline=True,
                               fields={Key.EPHEMERAL: True})

    def _report_version(self) -> None:
        """Tell the trainer the version held (its bin's tag), at most every
        REPORT_EVERY seconds: a worker of a fast loop does not send a PUT per
        version.  (The trainer also learns it from each rollout's stamp.)"""
        with self._cond:
            version, when = self._reported
            if version == self.version or self._closing:
                return
            due = when + REPORT_EVERY - time.monotonic()
            if due > 0:
                if self._report_timer is None:  # reported a moment ago: this one follows shortly
                    self._report_timer = timer = threading.Timer(due, self._report_due)
                    timer.daemon = True
                    timer.start()
                return
        self._register(wait=False)

    def _report_due(self) -> None:
        with self._cond:
            self._report_timer = None
            if self._closing:
                return
        try:
            self._report_version()
        except Exception as exc:  # the connection is going: the next report says it
            log.debug("version report not sent: %s", exc)

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
            self._told_stop = self._told_stop and self.stop_requested
            self._cond.notify_all()

    def _shut(self) -> None:
        try:
            # Asked to stop, the trainer reads no more: rollouts waiting for room never get it.
            self.flush(timeout=0.5 if self.stop_requested else 5.0)
        except Exception as exc:  # stopping anyway: say what was lost
            (log.info if self.stop_requested else log.warning)("rollouts not stored before stopping: %s", exc)
        timer = self._report_timer
        if timer is not None:
            timer.cancel()
        for extra in (self._rollouts, self._poll):
            if extra is not None:
                extra.close()
        super()._shut()

    def _on_parameters(self, note: Notification) -> None:
        if note.op == "LISTEN":  # listening again after a reconnect
            with self._cond:
                if note.tag is None or note.tag < self.version:
                    # The server lost its state (it was restarted):
                    # what we hold is from before; take whatever is published next.
                    self.version = self._latest = -1
            # The old connection's end deleted this worker's bin: register again, and
            # say so in the roster (a trainer that listened to the bin again before it
            # was back took this worker for gone, and stopped watching it).
            self._register(wait=False)
            self.client.submit(APPEND, self.roster_bin, self.worker_id, self._failed, zero_copy=False, inline=True)
        if note.op in ("PUT", "LISTEN", "RESTORE"):
            self._note_version(note.tag)

    def _note_version(self, tag: int | None) -> None:
        if tag is None:
            return
        with self._cond:
            if tag > self._latest:
                self._latest = tag
                self._cond.notify_all()

