"""What RLTrainer and RLWorker share: the experiment's bin names, one connection
(with a second one on demand), the first error of a call not waited for, start/stop."""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..client import connect
from ..compat import StartStop


def bin_names(experiment: str | None) -> tuple[str, str]:
    """The (parameters, rollouts) bin names of an experiment (None: the defaults)."""
    return prefix(experiment) + "parameters", prefix(experiment) + "rollouts"


def prefix(experiment: str | None) -> str:
    """What starts every bin name of an experiment (None: nothing)."""
    return f"{experiment}/" if experiment else ""


def snapshot_state(state: Any) -> Any:
    """Detach tensors of a state dict (nested values are kept as they are)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: snapshot_state(v) for k, v in state.items()}
    return state


class RLPeer(StartStop):
    """What trainer and worker share: a connection, bin names, start/stop.

    ``client_options`` go to :class:`~tensorshare.Client` (``token``, ``tls``,
    ``tls_ca``, ``tls_fingerprint``, ``keepalive``...).
    """

    def __init__(self, host: str, port: int, *, experiment: str | None, timeout: float | None,
                 connect_timeout: float | None, host_server: bool = False, **client_options: Any) -> None:
        super().__init__()
        self.server = None
        if host_server:
            from tensorshare_server import EmbeddedServer

            # The hosted server asks for the token the peer uses (None: TENSORSHARE_TOKEN, if set).
            self.server = EmbeddedServer(port=port, host=bind_address(host), token=client_options.get("token"))
            port = self.server.port
        self.experiment = experiment
        self.params_bin, self.data_bin = bin_names(experiment)
        self.control_bin = prefix(experiment) + "control"
        self.roster_bin = prefix(experiment) + "roster"
        self.workers_prefix = prefix(experiment) + "workers/"
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


def bind_address(host: str) -> str:
    """Where a hosted server listens for a peer that connects to ``host``."""
    return "127.0.0.1" if host in ("localhost", "127.0.0.1") else host

