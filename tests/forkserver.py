"""A fork server for the tests' server processes: it imports what ``python -m
tensorshare_server`` imports once, then forks a server for each start.

A server started by exec spends ~0.8 s of CPU on imports before it listens (numpy,
Twisted and its TLS stack, the server's own modules), and the suite starts ~300 of
them: on 2 cores that was a fifth of the whole run.  A forked child is still the
real server: the same ``main()`` through ``runpy`` with the test's argv, environment
and working directory, its stdout and stderr on the test's pipes or log file, a
reactor of its own, its exit code reported as ``Popen.returncode`` would be.

What a fork cannot reproduce stays with exec (:class:`serverproc.ServerProcess`
decides): another command (the ``tensorshare-server`` script), extra environment
variables (read before ``main()`` by the interpreter), a ``preexec_fn``, or
``TENSORSHARE_TESTS_EXEC=1`` for the whole run.  So does every start after the fork
server failed to come up, which it says once on stderr.

The fork server is one process per test process, single-threaded (its BLAS is told
one thread, checked before it serves), and ends when the test process's end of its
socket closes.  Its imports run with ``twisted.internet.reactor`` held by a
placeholder that refuses every use, so no epoll set or waker is made before a fork
(children would share them); each child installs Twisted's default reactor and hands
it to the modules that had imported the placeholder.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import types

_REACTOR = "twisted.internet.reactor"
_SERVER = "tensorshare_server"
_START_TIMEOUT = 120.0  # seconds for the fork server's imports, on a loaded 2-core machine


class _PlaceholderReactor(types.ModuleType):
    """Stands in for ``twisted.internet.reactor`` during the fork server's imports."""

    def __getattr__(self, name):
        raise RuntimeError(f"reactor.{name} used at import time in the fork server: start such a server by exec")


# -- in the fork server ------------------------------------------------------------------

def _preload() -> str | None:
    """Import the server as its command does; None when ready, else why not."""
    placeholder = _PlaceholderReactor(_REACTOR)
    sys.modules[_REACTOR] = placeholder
    try:
        __import__(f"{_SERVER}.cli")
    except Exception as e:  # (an import error, or a module that used the reactor on import)
        return f"importing the server failed: {e!r}"
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["?"]
    if len(threads) != 1:
        return f"{len(threads)} threads after the imports: a fork would lose all but one"
    return None


def _serve(ctl: socket.socket):
    """Answer start requests until the test process closes its end; returns
    ``(request, fds)`` in a child just forked, None in the fork server at the end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so that the wakeup fd hears it)
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([ctl, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(ctl)
        if ctl not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 2)
        if not msg:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            ctl.close()
            return json.loads(msg), fds
        for fd in fds:
            os.close(fd)
        ctl.send(json.dumps({"pid": pid}).encode())


def _reap(ctl: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        ctl.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_server(request: dict, fds: list[int]) -> None:
    """In the forked child: take the test's pipes, argv, environment and directory, a
    reactor of its own, then run the server as ``python -m`` does (this raises its
    ``SystemExit``)."""
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), *zip(fds, (1, 2))):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))  # (put there to import this module)
    sys.path[0] = request["cwd"]  # (after: the test's directory may be that one, as python -m puts it first)
    sys.argv = [_SERVER, *request["args"]]
    placeholder = sys.modules.pop(_REACTOR)
    import twisted.internet
    if getattr(twisted.internet, "reactor", None) is placeholder:
        del twisted.internet.reactor
    from twisted.internet import default

    default.install()
    reactor = sys.modules[_REACTOR]
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for name, value in list(names.items()):
            if value is placeholder:
                names[name] = reactor
    runpy.run_module(_SERVER, run_name="__main__", alter_sys=True)


def main(fd: int) -> None:
    ctl = socket.socket(fileno=fd)
    why = _preload()
    ctl.send(json.dumps({"ready": why is None, "why": why}).encode())
    if why is not None:
        return
    child = _serve(ctl)
    if child is not None:
        _become_server(*child)


# -- in the test process -------------------------------------------------------------------

class ForkedProcess:
    """The part of :class:`subprocess.Popen` the tests use, for a forked server."""

    def __init__(self, args: list[str], pid: int, stdout, stderr):
        self.args = args
        self.pid = pid
        self.stdin = None
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended, its end not heard yet (as Popen allows)
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The test process's end: starts the fork server, asks it for servers, and hears
    when they end (on a daemon thread)."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot = f"import sys; sys.path.insert(1, {os.path.dirname(os.path.abspath(__file__))!r}); " \
               f"import forkserver; forkserver.main({theirs.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        theirs.close()
        self.ctl = ours
        self.lock = threading.Lock()  # one start at a time
        self.children: dict[int, ForkedProcess] = {}
        self.exits: dict[int, int] = {}  # ended before their start's reply was read
        self.replies: list[dict] = []
        self.replied = threading.Condition()
        ready, _, _ = select.select([ours], [], [], _START_TIMEOUT)
        hello = json.loads(ours.recv(1 << 16) or b"{}") if ready else {"why": "no answer"}
        self.why = None if hello.get("ready") else hello.get("why") or "it ended"
        if self.why is None:
            threading.Thread(target=self._listen, name="forkserver", daemon=True).start()

    def _listen(self) -> None:
        while True:
            msg = self.ctl.recv(1 << 16)
            if not msg:
                return
            note = json.loads(msg)
            with self.replied:
                if "exit" in note:
                    child = self.children.pop(note["exit"], None)
                    if child is None:
                        self.exits[note["exit"]] = note["code"]
                    else:
                        child._ended(note["code"])
                else:
                    self.replies.append(note)
                    self.replied.notify_all()

    def start(self, args: list[str], stderr_fd: int | None) -> ForkedProcess:
        """A server with ``args``; its stderr to ``stderr_fd`` (a file's) or, if None, a pipe."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr_fd is None else (None, os.dup(stderr_fd))
        request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
        try:
            with self.lock:
                socket.send_fds(self.ctl, [json.dumps(request).encode()], [out_w, err_w])
                with self.replied:
                    if not self.replied.wait_for(lambda: self.replies, 30):
                        raise RuntimeError("the fork server did not answer a start")
                    pid = self.replies.pop(0)["pid"]
                    child = ForkedProcess([_SERVER, *args], pid, open(out_r),
                                          None if err_r is None else open(err_r))
                    if pid in self.exits:
                        child._ended(self.exits.pop(pid))
                    else:
                        self.children[pid] = child
            return child
        finally:
            os.close(out_w)
            os.close(err_w)


_instance: ForkServer | None = None
_instance_pid = 0


def fork_server() -> ForkServer | None:
    """This test process's fork server (started on first use); None where it cannot
    serve, or ``TENSORSHARE_TESTS_EXEC`` asks for exec."""
    global _instance, _instance_pid
    if os.environ.get("TENSORSHARE_TESTS_EXEC") or not hasattr(socket, "send_fds") or sys.platform != "linux":
        return None
    if _instance is None or _instance_pid != os.getpid():
        _instance, _instance_pid = ForkServer(), os.getpid()
        if _instance.why is not None:
            print(f"fork server not used, servers start by exec: {_instance.why}", file=sys.stderr)
    return _instance if _instance.why is None else None
