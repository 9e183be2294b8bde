"""The tensorshare server application (imported as ``tensorshare_server``).

Layers, from the socket inwards: :mod:`.net` (the Twisted adapter: protocol,
frame writer, flow control), :mod:`.protocol` (sans-IO: one connection's session,
the verb handlers, listeners), :mod:`.bins` (the bin store and its disk tiers,
behind one storage interface).  :mod:`.root` builds a server's shared parts and
:mod:`.app` starts it all (the command line, ``run_server``, ``EmbeddedServer``).
"""

from .app import EmbeddedServer, main, run_server, serve_in_process, stop_in_process_servers
from .config import ServerConfig

__all__ = ["EmbeddedServer", "ServerConfig", "main", "run_server", "serve_in_process", "stop_in_process_servers"]
