"""Child processes of a run -- the server, redis-server, workers -- and their cleanup.

Every child is tracked from the moment it starts and stopped (SIGTERM, then SIGKILL)
by :func:`stop_all`, which runs at exit; on Linux children also get SIGTERM when
this process dies (``PR_SET_PDEATHSIG``), so none outlives an interrupted run.
Every wait on a child has a deadline.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import glob
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project root: `benchmarks` imports from here
_LISTENING = re.compile(rb"listening on ([\d.]+):(\d+)")
_STATUS_PAGE = re.compile(rb"status page http://[^:]+:(\d+)/")

_children: set[subprocess.Popen] = set()
_lock = threading.Lock()


class PeerMissing(Exception):
    """A peer to compare with (redis-server, redis-py, ...) is not installed."""


class ChildError(RuntimeError):
    """A child process failed to start, answered wrongly, or took too long."""


try:  # loaded here, not in the child: dlopen after fork in a threaded process may deadlock
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    """``Popen`` that is tracked for cleanup and dies with this process."""
    if _LIBC is not None:
        kw.setdefault("preexec_fn", _die_with_parent)
    env = dict(kw.pop("env", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(cmd, env=env, **kw)
    with _lock:
        _children.add(proc)
    return proc


def stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> int | None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout`` s; returns its exit code."""
    if proc is None:
        return None
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        with _lock:
            _children.discard(proc)
    return proc.returncode


def stop_all() -> None:
    """Stop every child still running (at exit, after an error, on a signal)."""
    with _lock:
        procs = list(_children)
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.terminate()
            except OSError:
                pass
    for proc in procs:
        stop(proc, timeout=5.0)


atexit.register(stop_all)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` and of its live children (a
    multi-worker server's workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for each in (pid, *children):
        try:
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS in /proc/PID/status)."""
    rss = _status(pid).get("VmRSS")
    if rss is None:
        raise ChildError(f"no VmRSS for pid {pid}")
    return rss


def _status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def shm_area_bytes(pid: int, root: str = "/dev/shm") -> int:
    """Bytes of memory held by the files of server ``pid``'s shared-memory area."""
    from tensorshare_server.bins.shm import PREFIX

    total = 0
    for area in glob.glob(os.path.join(root, f"{PREFIX}{pid}-*")):
        for folder, _, files in os.walk(area):
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_blocks * 512
                except FileNotFoundError:  # removed meanwhile
                    pass
    return total


def _tail(path: str | None, n: int = 2000) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ------------------------------------------------------------------ tensorshare server


def _stop_and_drop_log(proc: subprocess.Popen | None, errfile) -> None:
    """Stop ``proc`` (see ``stop``), then close and delete its stderr log ``errfile``."""
    stop(proc)
    errfile.close()
    try:
        os.unlink(errfile.name)
    except OSError:
        pass


class Server:
    """``python -m tensorshare_server --port 0`` on loopback; learns its port from line one."""

    command = ("-m", "tensorshare_server", "--host", "127.0.0.1", "--port", "0")

    def __init__(self, *args: str, start_timeout: float = 60.0):
        self._errfile = tempfile.NamedTemporaryFile(prefix="tensorshare-bench-server-", suffix=".log", delete=False)
        cmd = [sys.executable, *self.command, *args]
        self.proc = spawn(cmd, stdout=subprocess.PIPE, stderr=self._errfile, stdin=subprocess.DEVNULL)
        # With --metrics-port 0 the status page's port comes on a later line.
        pattern = _STATUS_PAGE if "--metrics-port" in args else _LISTENING
        line = _read_line(self.proc, start_timeout, pattern)
        match, page = _LISTENING.search(line), pattern.search(line)
        if not match or not page:
            err = _tail(self._errfile.name)
            self.stop()
            raise ChildError(f"server did not start: {line!r} {err}")
        self.port = int(match.group(2))
        self.metrics_port = int(page.group(1)) if pattern is _STATUS_PAGE else None
        self.pid = self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu_seconds(self) -> float:
        """CPU time the server has used, its workers' included."""
        return cpu_seconds(self.pid)

    def footprint(self) -> int:
        """What the server holds in memory: its resident pages (less the shared-memory
        pages it maps) plus the pages of its shared-memory area's files, mapped or not
        (stored items move there, out of VmRSS, for same-host readers)."""
        status = _status(self.pid)
        return status["VmRSS"] - status.get("RssShmem", 0) + shm_area_bytes(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        return _tail(self._errfile.name)

    def stop(self) -> None:
        _stop_and_drop_log(self.proc, self._errfile)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FloorServer(Server):
    """The stack's floor (:mod:`benchmarks.floor_server`): a minimal Twisted server of the same framing."""

    command = ("-m", "benchmarks.floor_server")


def _read_line(proc: subprocess.Popen, timeout: float, until: re.Pattern = re.compile(rb"\n")) -> bytes:
    """What ``proc`` writes to stdout (binary pipe) up to its first line, or until
    ``until`` matches, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    data = b""
    while not until.search(data):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            break
        if select.select([fd], [], [], min(left, 0.5))[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data


# ------------------------------------------------------------------ redis-server


def redis_missing() -> str | None:
    """Why the Redis baselines cannot run, or None if they can."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install redis)"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    return None


class RedisServer:
    """A private redis-server on a free loopback port: no persistence, 2 GB bulk strings."""

    def __init__(self, start_timeout: float = 20.0):
        why = redis_missing()
        if why:
            raise PeerMissing(why)
        import redis

        self._redis = redis
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="tensorshare-bench-redis-")
        self.unix_path = os.path.join(self._dir, "redis.sock")  # its Unix socket too (the floor section)
        cmd = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
               "--unixsocket", self.unix_path, "--unixsocketperm", "700",
               "--save", "", "--appendonly", "no", "--proto-max-bulk-len", "2gb",
               "--client-query-buffer-limit", "2gb", "--protected-mode", "no"]
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                client = self._redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
                client.ping()
                client.close()
                break
            except self._redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ChildError("redis-server did not start") from None
                time.sleep(0.05)

    def client(self, timeout: float = 120.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout)

    def version(self) -> str:
        c = self.client()
        try:
            return str(c.info("server").get("redis_version", "?"))
        finally:
            c.close()

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu_seconds(self) -> float:
        """CPU time the server has used, its workers' included."""
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        stop(self.proc)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------ workers


class Worker:
    """``python -m benchmarks.workers KIND ARGS...``: talks in lines on stdin/stdout."""

    def __init__(self, kind: str, *args: object):
        self.kind = kind
        self._errfile = tempfile.NamedTemporaryFile(prefix=f"tensorshare-bench-{kind}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "benchmarks.workers", kind, *map(str, args)]
        self.proc = spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errfile,
                          text=True, bufsize=1, cwd=str(ROOT))
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"bench-{kind}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise ChildError(f"worker {self.kind} is gone: {exc} {_tail(self._errfile.name)}") from None

    def expect(self, timeout: float, prefix: str | None = None) -> str:
        """The next line (starting with ``prefix``, others skipped), within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise ChildError(f"worker {self.kind} said nothing in {timeout:.0f}s "
                                 f"(waiting for {prefix!r}) {_tail(self._errfile.name)}") from None
            if line is None:
                self.lines.put(None)
                raise ChildError(f"worker {self.kind} exited ({self.proc.poll()}): {_tail(self._errfile.name)}")
            if prefix is None or line.startswith(prefix):
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(1)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        _stop_and_drop_log(self.proc, self._errfile)


class Workers:
    """Several workers started together and always stopped together."""

    def __init__(self):
        self.all: list[Worker] = []

    def start(self, kind: str, *args: object) -> Worker:
        w = Worker(kind, *args)
        self.all.append(w)
        return w

    def stop(self) -> None:
        for w in self.all:
            if w.proc.poll() is None:
                try:
                    w.proc.stdin.write("quit\n")
                    w.proc.stdin.flush()
                except (OSError, ValueError):
                    pass
        for w in self.all:
            w.stop()
        self.all.clear()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
