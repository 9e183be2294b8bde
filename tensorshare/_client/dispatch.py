"""The thread that runs a blocking client's callbacks, in order, away from its socket."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("tensorshare.client")


class Dispatcher:
    """One daemon thread that runs callbacks in order; a failing callback is logged once
    (never called again for the same event)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> None:
        self._queue.put([(fn, args)])

    def submit_all(self, jobs: list) -> None:
        """Queue ``(fn, args)`` jobs to run in order, with one hand-off for all."""
        self._queue.put(jobs)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is queued, then end the thread (waiting for it unless called from it)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            jobs = self._queue.get()
            if jobs is None:
                return
            for fn, args in jobs:
                try:
                    fn(*args)
                except Exception:  # a user callback failed: report it, never call it again for this event
                    log.exception("tensorshare callback %r failed", fn)
