"""The blocking client's background reader: a thread that keeps one member's socket drained.

While a :class:`~tensorshare.Client` listens, or has non-blocking calls in
flight, somebody must read the socket even when no caller waits for a reply:
notifications and callbacks would otherwise sit unread.  The reader takes the
member's leader role whenever no calling thread holds it, reconnects after the
engine's backoff when the connection is lost (the engine then listens again), and
ends once there is nothing left to read for.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import AuthenticationError, TensorShareError, TimeoutError

log = logging.getLogger("tensorshare.client")

_LINGER = 2.0  # seconds an idle reader waits for more work before it ends


class BackgroundReader:
    """The reader thread of one member (started by :meth:`ensure`, on demand)."""

    def __init__(self, member):
        self.member = member
        self.thread: threading.Thread | None = None
        self._idle = False  # the thread waits for work (set under the client's lock)

    def needed(self) -> bool:
        m = self.member
        return not m.closed and m.engine.failure is None and bool(m.engine.listens or m.callbacks)

    def ensure(self) -> None:
        """Make sure a reader runs if one is needed (cheap when one does)."""
        cond = self.member.cond
        if self.thread is not None:  # unlocked fast path: an exiting reader re-checks
            if self._idle:  # it waits for work: wake it for the new work
                with cond:
                    cond.notify_all()
            return
        with cond:
            if self.thread is not None or not self.needed():
                return
            self.thread = threading.Thread(target=self._run, name="tensorshare-reader", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        member, cond = self.member, self.member.cond
        idle_since = None
        try:
            while True:
                with cond:
                    if not self.needed():
                        # Linger: in a run of non-blocking calls, the calls in flight
                        # often all complete before the next is made, and starting a
                        # thread each time costs more than the calls.
                        now = time.monotonic()
                        idle_since = now if idle_since is None else idle_since
                        if member.closed or member.engine.failure is not None or now - idle_since >= _LINGER:
                            return
                        self._idle = True
                        member.waiting += 1
                        try:
                            cond.wait(idle_since + _LINGER - now)
                        finally:
                            member.waiting -= 1
                        self._idle = False
                        continue
                    idle_since = None
                    if member.reading:
                        member.waiting += 1
                        try:
                            cond.wait(1.0)
                        finally:
                            member.waiting -= 1
                        continue
                    member.reading = True
                failure = None
                try:
                    if member.link is None:
                        member.connect(None)
                    member.read_some(time.monotonic() + 1.0)
                except TimeoutError:
                    pass
                except TensorShareError as exc:
                    failure = exc
                finally:
                    with cond:
                        member.reading = False
                        cond.notify_all()
                if failure is not None:
                    if member.closed:
                        return
                    if isinstance(failure, AuthenticationError):
                        log.error("tensorshare reader: %s; not reconnecting", failure)
                        return
                    delay = member.engine.retry_delay()
                    if delay is None:
                        return
                    log.info("tensorshare reader: %s; retrying in %.2fs", failure, delay)
                    # Waited on the condition, not slept: close() ends the wait at once
                    # (it joins this thread, and a sleep held it for up to max_backoff).
                    deadline = time.monotonic() + delay
                    with cond:
                        while not member.closed and (left := deadline - time.monotonic()) > 0:
                            cond.wait(left)
                    if member.closed:
                        return
        finally:
            with cond:
                self.thread = None
            if self.needed():  # a listen raced with our exit
                self.ensure()
