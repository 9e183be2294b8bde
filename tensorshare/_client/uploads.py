"""The background half of puts by device reference: publishing a snapshot, and sending its bytes.

Two threads per publishing client (:mod:`.exports` says what a put by reference
is), each keeping its jobs in order:

* :class:`Publisher` takes the puts made with ``wait=False``: it waits for the
  snapshot's copies (the caller's thread does not: they run behind the training
  work it queued), shares the block and sends the PUT on the publisher's
  connection, where its reference lives (at most :data:`QUEUED` wait for it; a
  caller that publishes faster waits there).
* :class:`Uploader` sends each snapshot's bytes (a PUT with ``fill``) for readers
  elsewhere or without CUDA, on a connection of its own to the worker that owns
  the bin (the router's ``companion`` member): a value of a GiB takes a quarter of a second to send,
  and on the publisher's connection its reads, pings and next publishes would
  wait behind it, a read of that very item waiting for bytes queued behind it.
  Only the newest upload per bin waits: no reader asks for an older item's bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Any, Callable

from ..errors import TensorShareError
from ..protocol.messages import PUT, Key

log = logging.getLogger("tensorshare.client")

QUEUED = 2  # puts waiting for the publisher thread, at most


class _Jobs:
    """One daemon thread running ``run(job)`` for the jobs put in ``self._jobs`` (see the subclasses)."""

    name = "tensorshare-jobs"

    def __init__(self, run: Callable[[Any], None]):
        self._run_job = run
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def _started(self) -> None:
        """(Under the condition.)  Make the thread if need be and wake it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no job waits or runs; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def clear(self) -> None:
        with self._cond:
            self._jobs.clear()
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._next()
                self._busy = True
                self._cond.notify_all()
            try:
                self._run_job(job)
            except Exception:
                log.exception("%s: a job failed", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class Publisher(_Jobs):
    """Puts by reference made with ``wait=False``, in order (see the module docstring)."""

    name = "tensorshare-publish"

    def __init__(self, run: Callable[[Any], None]):
        super().__init__(run)
        self._jobs: deque = deque()

    def add(self, job: Any) -> None:
        with self._cond:
            while len(self._jobs) >= QUEUED and not self._closed:
                self._cond.wait()
            if self._closed:
                raise TensorShareError("the client is closed")
            self._jobs.append(job)
            self._started()

    def _next(self) -> Any:
        return self._jobs.popleft()


class Uploader(_Jobs):
    """The bytes of items put by reference, the newest per bin, sent on a connection
    of their own (see the module docstring)."""

    name = "tensorshare-upload"

    def __init__(self, owner):
        super().__init__(self._fill)
        self._jobs: OrderedDict = OrderedDict()  # bin -> (ident, snapshot): the newest per bin, oldest bin first
        self._owner = owner  # the publishing client

    def add(self, bin: str, ident: int, snapshot) -> None:
        with self._cond:
            if self._closed:
                return
            self._jobs.pop(bin, None)  # an older upload to the same bin is no longer wanted
            self._jobs[bin] = (ident, snapshot)
            self._started()

    def _next(self) -> Any:
        return self._jobs.popitem(last=False)

    def _fill(self, job: Any) -> None:
        bin, (ident, snapshot) = job
        client = self._owner
        try:  # on a second connection to the bin's worker: a read queued behind the fill on the first would hang
            client._call(PUT, {Key.BIN: bin, Key.VALUE: snapshot.description, Key.FILL: ident}, snapshot,
                         member=client.router.companion(bin))
        except TensorShareError as exc:  # readers without CUDA then wait, and may time out (451)
            (log.debug if self._closed else log.warning)(
                "could not upload the bytes of an item of %r put by device reference: %s", bin, exc)

