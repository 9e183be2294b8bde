"""The tensorshare server application (imported as ``tensorshare_server``).

Layers, from the socket inwards: :mod:`.net` (the Twisted adapter: protocol,
frame writer, flow control), :mod:`.protocol` (sans-IO: one connection's session,
the verb handlers, listeners), :mod:`.bins` (the bin store and its disk tiers,
behind one storage interface), :mod:`.relay` (a server that follows another).
:mod:`.root` builds a server's shared parts, :mod:`.app` starts it all
(``run_server``, ``EmbeddedServer``) and :mod:`.cli` is the ``tensorshare-server``
command.
"""

from .app import EmbeddedServer, run_server, serve_in_process, stop_in_process_servers
from .cli import main
from .config import ServerConfig

__all__ = ["EmbeddedServer", "ServerConfig", "main", "run_server", "serve_in_process", "stop_in_process_servers"]
