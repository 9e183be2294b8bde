"""The server example of the original tensorshare README.

(Unchanged but for the port: ``--port``, 8000 by default; ``--help``.)
"""
from original_args import port

PORT = port(__doc__)
from tensorshare import run_server

run_server(PORT)
