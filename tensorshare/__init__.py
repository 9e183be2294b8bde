"""tensorshare: share PyTorch tensors between processes and machines through a server.

Public API: :class:`Client` (blocking), :class:`AsyncClient` (Twisted Deferreds),
:class:`TensorShare` (the original callback style), :class:`RLTrainer` and
:class:`RLWorker`, :func:`run_server`, and the errors of :mod:`tensorshare.errors`.
The wire format is in :mod:`tensorshare.wire`.

The clients are imported on first use, so that ``tensorshare_server``, which needs
only the protocol modules, starts without loading torch.
"""

from __future__ import annotations

import importlib

from . import errors
from .errors import (
    AuthenticationError, ConnectionLostError, NoSuchBinError, ProtocolError, RemoteError, TensorShareError,
    TimeoutError,
)

__version__ = "0.1.0"

_LAZY = {
    "Client": "client", "Listening": "_client.listens", "connect": "client",
    "AsyncClient": "async_client",
    "TensorShare": "compat",
    "RLTrainer": "rl", "RLWorker": "rl",
    "Notification": "_client.connection", "ListenSnapshot": "_client.connection",
    "save_memmap": "memmap", "load_memmap": "memmap",
    "wire": None,
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tensorshare' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def run_server(port: int = 8000, host: str = "127.0.0.1", **settings) -> None:
    """Serve bins on ``host:port``, blocking until SIGINT/SIGTERM (see ``tensorshare-server``)."""
    from tensorshare_server import run_server as _run

    _run(port, host, **settings)


__all__ = [
    "Client", "AsyncClient", "TensorShare", "RLTrainer", "RLWorker", "Listening", "Notification",
    "ListenSnapshot", "connect", "run_server", "save_memmap", "load_memmap", "errors", "wire", "TensorShareError",
    "ConnectionLostError", "NoSuchBinError", "ProtocolError", "RemoteError", "TimeoutError", "AuthenticationError",
]
