"""RLTrainer and RLWorker: versioned parameters out, rollouts in, workers come and go.

Two bins per experiment carry everything:

* ``<experiment>/parameters`` holds one item, ``{"version": v, "parameters": state}``,
  put with tag ``v``.  A put is atomic (one item, stored whole before it is
  announced), so a worker never sees a mix of two versions.  The notification of a
  put carries the tag, so a worker learns of a new version without downloading it,
  and downloads only when it asks for parameters newer than those it holds.
* ``<experiment>/rollouts`` collects ``{"version": v, "data": obj}`` items appended
  by workers; notifications tell the trainer how many wait (only the count and
  seq matter, so coalesced ones do too) and it takes them all with one get.

Nothing is polled, and nothing depends on who is connected: a worker that dies
leaves nothing behind, a new worker starts from the latest version (learnt
atomically with its listen), and a trainer restarted against a server that kept
its bins continues the version numbers found there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from .client import connect
from .compat import StartStop
from ._client.connection import Notification
from .errors import NoSuchBinError, TimeoutError
from .protocol.messages import APPEND

log = logging.getLogger("tensorshare.rl")

__all__ = ["RLTrainer", "RLWorker"]


def bin_names(experiment: str | None) -> tuple[str, str]:
    """The (parameters, rollouts) bin names of an experiment (None: the defaults)."""
    prefix = f"{experiment}/" if experiment else ""
    return prefix + "parameters", prefix + "rollouts"


def snapshot_state(state: Any) -> Any:
    """Detach tensors of a state dict (nested values are kept as they are)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: snapshot_state(v) for k, v in state.items()}
    return state


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
        self.params_bin, self.data_bin = bin_names(experiment)
        self._client = connect(host, port, timeout=timeout, retry_for=connect_timeout, **client_options)
        self._cond = threading.Condition()
        self._closing = False

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
    """Publishes parameters and collects the workers' rollouts.

    ``filter_version=True`` drops rollouts made with parameters more than
    ``max_staleness`` versions older than the latest published one (0: only the
    current version is kept); :attr:`dropped` counts them.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, host_server: bool = False,
                 filter_version: bool = True, *, max_staleness: int = 0, experiment: str | None = None,
                 timeout: float | None = 60.0, connect_timeout: float = 30.0, **client_options):
        super().__init__(host, port, experiment=experiment, timeout=timeout, connect_timeout=connect_timeout,
                         host_server=host_server, **client_options)
        self.filter_version = filter_version
        self.max_staleness = max_staleness
        self.dropped = 0
        self._pending_rollouts = 0
        # Continue the versions a previous trainer left on the server.
        probe = self.client.listen(self.params_bin, lambda note: None)
        self.version = probe.snapshot.tag if probe.snapshot.tag is not None else -1
        probe.stop()
        # Told when the rollouts bin stops being empty, not of every append: a take
        # empties it whole.
        self._data_listen = self.client.listen(self.data_bin, self._on_data, every_append=False)
        self._pending_rollouts = self._data_listen.snapshot.n_items
        self._data_seq = self._data_listen.snapshot.seq  # newest change of the bin we know of

    def publish_parameters(self, state_dict: dict) -> int:
        """Publish ``state_dict`` as the next version and return that version.

        The tensors are on the wire when this returns: training on afterwards
        cannot change what workers receive.
        """
        version = self.version + 1
        self.client.put(self.params_bin, {"version": version, "parameters": snapshot_state(state_dict)},
                        tag=version)
        self.version = version
        return version

    def get_data(self, return_versions: bool = False, timeout: float | None = None):
        """Take the rollouts collected so far (``[]`` if none).

        With ``timeout``, wait up to that long for at least one to arrive.  With
        ``return_versions`` (as in the original), ``(data, versions)``: the rollouts
        and, in the same order, the version of the parameters each was made with.
        """
        if timeout is not None:
            deadline = time.monotonic() + timeout
            with self._cond:
                while self._pending_rollouts == 0 and not self._closing:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
        nothing = ([], []) if return_versions else []
        with self._cond:
            if self._pending_rollouts == 0:
                return nothing
        try:
            items, seq = self.client.get(self.data_bin, with_seq=True)
        except NoSuchBinError:
            return nothing
        with self._cond:
            if seq >= self._data_seq:  # no later change seen yet: the bin is empty now
                self._data_seq, self._pending_rollouts = seq, 0
        kept, versions = [], []
        oldest = self.version - self.max_staleness
        for item in items:
            version = item.get("version", -1) if isinstance(item, dict) else -1
            if self.filter_version and version < oldest:
                self.dropped += 1
                continue
            kept.append(item.get("data") if isinstance(item, dict) else item)
            versions.append(version)
        return (kept, versions) if return_versions else kept

    def _on_data(self, note: Notification) -> None:
        with self._cond:
            if note.seq <= self._data_seq:  # older than a take we already made
                return
            self._data_seq, self._pending_rollouts = note.seq, note.n_items
            if note.n_items:
                self._cond.notify_all()


class RLWorker(_RLPeer):
    """Pulls the latest parameters (only when newer than its own) and adds rollouts.

    :meth:`add_data` does not wait for the server (as the original promised): up to
    ``max_pending`` rollouts are in flight at once, sent in order on one
    connection; past that it waits for the oldest to be stored.  A rollout the
    server did not store makes the next :meth:`add_data` (or :meth:`flush`) raise
    its error.  :meth:`flush` waits until every rollout sent is stored; ``stop()``
    flushes first.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, experiment: str | None = None,
                 timeout: float | None = 60.0, connect_timeout: float = 30.0, max_pending: int = 64,
                 **client_options):
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        super().__init__(host, port, experiment=experiment, timeout=timeout, connect_timeout=connect_timeout,
                         **client_options)
        self.max_pending = max_pending
        self._in_flight = 0  # rollouts sent whose reply has not come (under _cond)
        self._failure: BaseException | None = None  # the first error since the last one raised
        self.version = -1  # version of the parameters this worker holds
        self._latest = -1  # newest version announced by the server
        self._parameters = None
        handle = self.client.listen(self.params_bin, self._on_parameters)
        self._note_version(handle.snapshot.tag)

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
            if item["version"] > self.version:
                self.version, self._parameters = item["version"], item["parameters"]
                self._latest = max(self._latest, self.version)
            return self._parameters

    def await_new_parameters(self, timeout: float | None = None) -> dict | None:
        """Wait for parameters newer than those held and return them (None on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._latest <= self.version:
                if self._closing:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
        return self.get_parameters()

    def add_data(self, obj: Any) -> None:
        """Send a rollout, stamped with the version of the parameters held, without
        waiting for the server.  ``obj`` has been copied out when this returns, so
        changing it afterwards is safe."""
        timeout = self.client.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._raise_failure()
            while self._in_flight >= self.max_pending:  # the window is full: backpressure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.max_pending} rollouts still unacknowledged after {timeout:g}s")
                self._cond.wait(remaining)
                self._raise_failure()
            self._in_flight += 1
        try:
            self.client.submit(APPEND, self.data_bin, {"version": self.version, "data": obj}, self._stored,
                               tag=self.version, inline=True)
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

    def _stored(self, _count: Any, error: BaseException | None) -> None:
        with self._cond:
            self._in_flight -= 1
            if error is not None and self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _shut(self) -> None:
        try:
            self.flush(timeout=5.0)
        except Exception as exc:  # stopping anyway: say what was lost
            log.warning("rollouts not stored before stopping: %s", exc)
        super()._shut()

    def _on_parameters(self, note: Notification) -> None:
        if note.op == "LISTEN":  # listening again after a reconnect
            with self._cond:
                if note.tag is None or note.tag < self.version:
                    # The server lost its state (it was restarted):
                    # what we hold is from before; take whatever is published next.
                    self.version = self._latest = -1
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
