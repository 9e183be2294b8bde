"""What the multi-process examples share: a server on a free port, and ending every
process they started, whatever happens."""

import contextlib
import re
import subprocess
import sys


@contextlib.contextmanager
def server_and_processes(*server_args: str, announce: bool = True):
    """Start ``tensorshare-server --port 0 *server_args`` and yield ``(port, procs)``:
    ``procs`` holds the server first; append what you start.  On the way out each
    process still running is terminated (killed if it takes over 10 s)."""
    server = subprocess.Popen([sys.executable, "-m", "tensorshare_server", "--port", "0", *server_args],
                              stdout=subprocess.PIPE, text=True)
    procs = [server]
    try:
        line = server.stdout.readline()
        port = int(re.search(r":(\d+)$", line.strip()).group(1))
        if announce:
            print(line.strip(), flush=True)
        yield port, procs
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
