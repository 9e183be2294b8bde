"""One server at a time on a directory: ``flock`` locks, and the data directory's lock that names its holder.

Two servers writing one data directory would each number items from their own
counter and delete what the other wrote.  :class:`DirLock` takes an exclusive
``flock`` on ``<directory>/.lock`` and writes who holds it there (process id,
host, command, since when), so the server refused can say whom it was refused by.
The kernel drops the lock when the holder's process ends, however it ends, so a
killed server never leaves a stale lock; the file's text may stay and is only
informational.  The descriptor is not inherited by child processes (a
multi-worker server's parent holds the data directory's lock, each worker its own
directory's).  Within one process a directory is locked once, however many parts
ask (:meth:`DirLock.acquire` counts them), since two ``flock`` descriptions of one
file in one process would refuse each other.

:func:`lock_file` is the plain lock the spill and shared-memory areas also use to
tell a live server's directory from one a killed server left.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import threading
import time

from tensorshare.errors import UsageError

LOCK_NAME = ".lock"


def lock_file(directory: str, blocking: bool, create: bool = True) -> int | None:
    """An open descriptor holding an exclusive lock on ``directory``'s lock file, or None
    if taken (or, with ``create=False``, if there is no lock file)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


class DirLockedError(UsageError):
    """Another process holds the directory's lock."""

    exit_code = 75  # EX_TEMPFAIL: it may work once the other server has stopped


_held: dict[str, list] = {}  # path -> [descriptor, users] of the locks this process holds
_held_lock = threading.Lock()


def _holder_text() -> str:
    command = " ".join(sys.argv)[:200] or sys.executable
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return f"pid {os.getpid()} on {socket.gethostname()} since {stamp} ({command})\n"


def _holder(path: str) -> str:
    """What the holder wrote into the lock file (one line), or ''."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return ""


class DirLock:
    """The lock of ``directory`` (made if missing), taken by :meth:`acquire`."""

    def __init__(self, directory: str, what: str = "data directory"):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self.what = what
        self.held = False

    def acquire(self) -> "DirLock":
        """Take the lock, or raise :class:`DirLockedError` naming its holder."""
        if self.held:
            return self
        with _held_lock:
            entry = _held.get(self.path)
            if entry is None:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                fd = lock_file(self.directory, blocking=False)
                if fd is None:
                    raise DirLockedError(f"the {self.what} {self.directory} is in use by "
                                         f"{_holder(self.path) or 'another server'}: stop that server first, "
                                         f"or give this one another --data-dir")
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, _holder_text().encode(), 0)
                except OSError:  # the lock is what counts; the text only helps whoever is refused
                    pass
                entry = _held[self.path] = [fd, 0]
            entry[1] += 1
        self.held = True
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        with _held_lock:
            entry = _held.get(self.path)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del _held[self.path]
                os.close(entry[0])  # (the file stays: removing it could race with another server taking it)

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["DirLock", "DirLockedError", "LOCK_NAME", "lock_file"]
