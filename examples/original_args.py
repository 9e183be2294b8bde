"""The command line of the original tensorshare's examples: ``--help``, and ``--port``
for the port their text names (8000, the default)."""

import argparse


def port(doc: str) -> int:
    """The ``--port`` given (8000 if none), after ``--help`` if asked."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                     epilog="The original's code, unchanged but for the port it names.")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (default: 8000, the original's)")
    return parser.parse_args().port
