"""Start-up failures of ``tensorshare-server`` told in one line, with the exit status README lists.

A server that cannot start should say why in words a user can act on, not in a
Twisted traceback: which address it could not listen on and what holds it (the
process, where this host lets us see it, and what it speaks), which option of a
config file is wrong.
"""

from __future__ import annotations

import errno
import os

from tensorshare.protocol import peers

# Exit status of tensorshare-server (README, "Operating a server").
EXIT_STOPPED, EXIT_FAILED, EXIT_USAGE, EXIT_CANNOT_LISTEN = 0, 1, 2, 3


def cannot_listen(error: OSError, host: str, port: int, option: str) -> str:
    """One line for a failed listen on ``host:port`` (given as ``option``): why, and
    for a taken port, who holds it and what to do."""
    where = f"{host}:{port}"
    code = getattr(error, "errno", None)
    if code == errno.EADDRINUSE:
        return (f"cannot listen on {where}: the port is taken{held_by(host, port)}; stop that or give another "
                f"{option} (0 picks a free one)")
    if code == errno.EACCES:
        return f"cannot listen on {where}: not allowed (ports below 1024 need privileges); give another {option}"
    if code == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {host} is not an address of this host (--host, or --metrics-host)"
    return f"cannot listen on {where}: {getattr(error, 'strerror', None) or error}"


def listen_failure(error, config) -> str:
    """One line for a ``CannotListenError`` of a server started with ``config``: its
    data port or its ``--metrics-port``."""
    metrics = config.metrics_port is not None and error.port == config.metrics_port and error.port != config.port
    host = config.metrics_host if metrics else config.host
    return cannot_listen(error.socketError, host, error.port, "--metrics-port" if metrics else "--port")


def held_by(host: str, port: int) -> str:
    """`` by a tensorshare server (pid 12, python -m tensorshare_server ...)``, as far as
    this host lets us tell; empty if nothing can be told."""
    speaks, _ = peers.probe("127.0.0.1" if host in ("", "0.0.0.0", "::") else host, port, 0.5)
    kind = {peers.TENSORSHARE: "a tensorshare server", peers.TLS: "a TLS server",
            peers.HTTP: "an HTTP server"}.get(speaks, "another program")
    process = _listener_process(port)
    return f" by {kind}" + (f" ({process})" if process else "")


def _listener_process(port: int) -> str | None:
    """``pid N: its command line`` of the process listening on TCP ``port`` (Linux
    /proc; None where it cannot be seen: another user's process, another system)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = " ".join(f.read().decode(errors="replace").replace("\0", " ").split())
                return f"pid {pid}: {command[:120]}"
        except OSError:  # gone, or not ours to look at
            continue
    return None
