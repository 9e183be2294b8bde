"""A real ``tensorshare-server`` process on loopback, for tests."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from forkserver import fork_server

_LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")
STARTED: set[int] = set()  # pids of every server process the tests started


class ServerProcess:
    """Start ``python -m tensorshare_server`` (or ``command``) and learn its port from its first line."""

    def __init__(self, *args: str, port: int = 0, start_timeout: float = 30.0, log_path=None, env=None,
                 preexec_fn=None, command: list[str] | None = None):
        self.args = list(args)
        self.command = command or [sys.executable, "-m", "tensorshare_server"]  # or the tensorshare-server script
        # forked from the tests' fork server (the same server, without ~0.8 s of imports)
        # unless something of the exec itself is asked for
        self.forkable = command is None and env is None and preexec_fn is None
        self.env = None if env is None else {**os.environ, **env}  # extra environment variables
        self.port = port
        self.start_timeout = start_timeout
        self.log_path = log_path  # where the server's stderr goes (its log); None: a pipe
        self.preexec_fn = preexec_fn  # run in the child before exec (resource limits)
        self.proc: subprocess.Popen | None = None
        self.stderr = ""  # what the last run logged, once stopped
        self.start()

    def start(self) -> None:
        args = ["--host", "127.0.0.1", "--port", str(self.port), *self.args]
        stderr = open(self.log_path, "a") if self.log_path is not None else subprocess.PIPE
        forks = fork_server() if self.forkable else None
        try:
            if forks is not None:
                self.proc = forks.start(args, None if self.log_path is None else stderr.fileno())
            else:
                self.proc = subprocess.Popen([*self.command, *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                             env=self.env, preexec_fn=self.preexec_fn)
        finally:
            if self.log_path is not None:
                stderr.close()
        deadline = time.monotonic() + self.start_timeout
        line = self.proc.stdout.readline()  # the server prints it first thing
        match = _LISTENING.search(line or "")
        if not match:
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else self.log()
            raise RuntimeError(f"server did not start: {line!r} {err[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("server start took too long")
        self.port = int(match.group(2))
        STARTED.add(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the server and wait for it; returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.stderr = self.proc.stderr.read() if self.proc.stderr is not None else self.log()
        self.proc.stdout.close()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None
        return code

    def log(self) -> str:
        """What the server has written to ``log_path`` so far."""
        with open(self.log_path) as f:
            return f.read()

    def rss(self) -> int:
        """The server process's resident memory, in bytes (Linux /proc)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        """Stop and start again on the same port."""
        self.stop()
        self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid


class OneConnectionServer:
    """A loopback listener that serves one connection on a daemon thread: the base of
    the fake servers tests use.  Subclasses define :meth:`serve` (the connection is
    closed after it returns); ``rcvbuf`` shrinks the receive buffer of the accepted
    socket, to play a server that reads slowly."""

    def __init__(self, rcvbuf: int | None = None):
        self.listener = socket.socket()
        if rcvbuf is not None:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # the accepted socket inherits it
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:  # closed before anyone connected
            return
        with conn:
            conn.settimeout(10)
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()
        self.thread.join(15)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FakeServer(OneConnectionServer):
    """A loopback server that greets like tensorshare, then answers every read with
    ``replies`` (header maps, sent as frames; none: it never answers).  For testing
    clients against a server that misbehaves."""

    def __init__(self, *replies: dict):
        self.replies = replies
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        from tensorshare.wire.frames import frame_head

        conn.sendall(frame_head({"code": 220, "id": 0, "msg": "hi", "version": 1}, 0))
        try:
            while conn.recv(65536):
                for reply in self.replies:
                    conn.sendall(frame_head(reply, 0))
        except OSError:
            pass


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of ``size`` (``6m``...) mounted on the new directory ``path`` for the
    block, to fill up; skips the test where mounting needs privileges we lack."""
    import pytest

    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs privileges)")
    try:
        yield path
    finally:
        gc.collect()  # tensors mapping its files keep it busy
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
