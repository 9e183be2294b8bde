"""The tensorshare server application (imported as ``tensorshare_server``).

Layers, from the socket inwards: :mod:`.service` (Twisted adapter and frame writer),
:mod:`.session` (per-connection protocol logic, sans-IO), :mod:`.notify` (listeners),
:mod:`.store` (the bins).  :mod:`.app` starts it all.
"""

from .app import EmbeddedServer, main, run_server
from .config import ServerConfig

__all__ = ["EmbeddedServer", "ServerConfig", "main", "run_server"]
