"""Disk work off the reactor thread: a thread pool whose jobs of one lane run in order.

The server's :class:`~.storage.Storage` hands blocking file work (writing an item,
moving a floor, deleting a bin, making or removing a table's files) to a
:class:`Jobs` runner: :class:`ThreadJobs` in a server, :class:`InlineJobs` (at once,
on the calling thread) in tests and tools.  Jobs of the same lane (a
bin, for the data directory) run one after the other in submission order, so the
files of a bin change in the order the store does; jobs of different lanes, and
lane-less jobs (spills), run in parallel.  Completion callbacks run on the reactor
thread.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Callable, Protocol

from twisted.internet import threads
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

log = logging.getLogger("tensorshare.server")


class Jobs(Protocol):
    """Runs blocking functions; jobs of one lane run one at a time, in order."""

    def run(self, lane: str | None, fn: Callable, args: tuple,
            on_done: Callable[[object, BaseException | None], None] | None = None) -> None:
        """Run ``fn(*args)``; then ``on_done(result, error)`` on the caller's thread."""

    def run_threadsafe(self, lane: str | None, fn: Callable, args: tuple) -> None:
        """:meth:`run` with no callback, callable from any thread."""


class InlineJobs:
    """A :class:`Jobs` that runs everything at once on the calling thread (tests, tools)."""

    def run(self, lane, fn, args, on_done=None) -> None:
        try:
            result, error = fn(*args), None
        except Exception as exc:
            result, error = None, exc
        if on_done is not None:
            on_done(result, error)
        elif error is not None:
            log.error("disk job %s failed: %s", getattr(fn, "__name__", fn), error)

    def run_threadsafe(self, lane, fn, args) -> None:
        self.run(lane, fn, args)


class ThreadJobs:
    """The :class:`Jobs` of a running server."""

    def __init__(self, reactor, max_threads: int = 4):
        self.reactor = reactor
        self.pool = ThreadPool(minthreads=0, maxthreads=max_threads, name="tensorshare-disk")
        # Daemon threads: a process that never stops its reactor cleanly must still be
        # able to exit (an interrupted write is then like a crash: temporary names only).
        self.pool.threadFactory = functools.partial(threading.Thread, daemon=True)
        self.pool.start()
        self._stopped = False
        # A reactor that stops (an embedded server, a test) finishes the running jobs.
        self._trigger = reactor.addSystemEventTrigger("before", "shutdown", self.stop)
        self._lanes: dict[str, deque] = {}  # lane -> jobs waiting behind its running one

    def run(self, lane: str | None, fn: Callable, args: tuple,
            on_done: Callable[[object, BaseException | None], None] | None = None) -> None:
        job = (fn, args, on_done)
        if lane is not None:
            waiting = self._lanes.get(lane)
            if waiting is not None:
                waiting.append(job)
                return
            self._lanes[lane] = deque()
        self._start(lane, job)

    def run_threadsafe(self, lane: str | None, fn: Callable, args: tuple) -> None:
        self.reactor.callFromThread(self.run, lane, fn, args)

    def _start(self, lane: str | None, job: tuple) -> None:
        fn, args, on_done = job
        d = threads.deferToThreadPool(self.reactor, self.pool, fn, *args)
        d.addBoth(self._finished, lane, fn, on_done)

    def _finished(self, result, lane: str | None, fn: Callable, on_done) -> None:
        error = result.value if isinstance(result, Failure) else None
        try:
            if on_done is not None:
                on_done(None if error is not None else result, error)
            elif error is not None:
                log.error("disk job %s failed: %s", getattr(fn, "__name__", fn), error)
        except Exception:
            log.exception("completion of disk job %s failed", getattr(fn, "__name__", fn))
        finally:
            if lane is not None:
                waiting = self._lanes[lane]
                if waiting:
                    self._start(lane, waiting.popleft())
                else:
                    del self._lanes[lane]

    def stop(self) -> None:
        """Finish the running jobs and stop the threads (blocks); once."""
        if not self._stopped:
            self._stopped = True
            self.pool.stop()
            try:  # stopped before the reactor: one trigger less per embedded server
                self.reactor.removeSystemEventTrigger(self._trigger)
            except (ValueError, KeyError):  # it is the trigger running now
                pass
