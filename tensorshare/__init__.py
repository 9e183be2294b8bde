"""tensorshare: share PyTorch tensors between processes and machines through a server.

Public API: :class:`Client` (blocking), :class:`AsyncClient` (Twisted Deferreds),
:class:`TensorShare` (the original callback style), :func:`run_server`, and the
error classes in :mod:`tensorshare.errors`.  The wire format is in
:mod:`tensorshare.wire`.
"""

__version__ = "0.1.0"

from . import errors, wire
from .async_client import AsyncClient
from .client import Client, Listening
from .compat import TensorShare
from .rl import RLTrainer, RLWorker
from .connection import ListenSnapshot, Notification
from .errors import (
    ConnectionLostError, NoSuchBinError, ProtocolError, RemoteError, TensorShareError, TimeoutError,
)


def run_server(port: int = 8000, host: str = "127.0.0.1", **settings) -> None:
    """Serve bins on ``host:port``, blocking until SIGINT/SIGTERM (see ``tensorshare-server``)."""
    from tensorshare_server import run_server as _run

    _run(port, host, **settings)


__all__ = [
    "Client", "AsyncClient", "TensorShare", "RLTrainer", "RLWorker", "Listening", "Notification", "ListenSnapshot", "run_server", "errors", "wire",
    "TensorShareError", "ConnectionLostError", "NoSuchBinError", "ProtocolError", "RemoteError",
    "TimeoutError",
]
