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
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    AuthenticationError, ConnectionLostError, NoSuchBinError, ProtocolError, RemoteError, TensorShareError,
    TimeoutError, WrongServerError,
)
from .version import __version__ as __version__

_LAZY = {
    "Client": "client", "Listening": "_client.listens", "connect": "client",
    "AsyncClient": "async_client",
    "ShardedClient": "sharded",
    "TensorShare": "compat",
    "RLTrainer": "rl", "RLWorker": "rl",
    "Notification": "_client.connection", "ListenSnapshot": "_client.connection",
    "save_memmap": "memmap", "load_memmap": "memmap",
    "wire": None,
}


if TYPE_CHECKING:  # what the lazy imports below give, as type checkers and the API reference see it
    from . import wire
    from ._client.connection import ListenSnapshot, Notification
    from ._client.listens import Listening
    from .async_client import AsyncClient
    from .client import Client, connect
    from .compat import TensorShare
    from .memmap import load_memmap, save_memmap
    from .rl import RLTrainer, RLWorker
    from .sharded import ShardedClient
else:
    def __getattr__(name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module 'tensorshare' has no attribute {name!r}")
        module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def run_server(port: int = 8000, start_reactor: bool | str = True, host: str = "127.0.0.1",
               **settings: Any) -> Any:
    """Serve bins on ``host:port``, blocking until SIGINT/SIGTERM (see ``tensorshare-server``).

    With ``start_reactor=False`` (as in the original tensorshare) the server starts
    inside this process and this returns at once, with a handle whose ``stop()``
    ends it; it never keeps the process alive on its own, and ``TensorShare.stop()``
    ends it too.  ``settings`` are :class:`tensorshare_server.ServerConfig`'s
    fields (limits, ``token``, ``memory_limit``...).  (A string in second place is
    the host, as in earlier versions of this function.)
    """
    from tensorshare_server import run_server as _run

    if isinstance(start_reactor, str):
        host, start_reactor = start_reactor, True
    return _run(port, host, start_reactor=start_reactor, **settings)


__all__ = [
    "Client", "AsyncClient", "ShardedClient", "TensorShare", "RLTrainer", "RLWorker", "Listening", "Notification",
    "ListenSnapshot", "connect", "run_server", "save_memmap", "load_memmap", "errors", "wire", "TensorShareError",
    "ConnectionLostError", "NoSuchBinError", "ProtocolError", "RemoteError", "TimeoutError", "AuthenticationError",
    "WrongServerError",
]
