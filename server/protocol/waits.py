"""Requests that wait in the server for a bin to change: parked, then run or refused.

Some requests may only proceed once a bin is in a given state: an APPEND with
``below`` waits until the bin holds fewer items, and a table's insert or sample
waits until its rate limiter lets it through.  Such a request is *parked* here
under the bin's name with a test of whether it may go on; every change to a bin
(each one is published, :class:`~.notify.ListenerRegistry.publish`) re-tests the
requests parked under it, oldest first.  A request that waits longer than its
timeout is expired (its connection gets 450).

A request that went on may take a while to change its bin (a durable APPEND is
written to disk first): it counts as *going* until its handler says it
:meth:`~Waits.settled`, and tests of the requests behind it count it (an APPEND
``below`` 10 does not go on while nine items are stored and one is being written).

Parking holds only its own connection: the session keeps that connection's later
requests back (replies stay in request order, as while it waits for the disk),
and every other connection is served as usual.  A parked request of a connection
that closes is dropped, unrun.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from typing import Any, Callable

log = logging.getLogger("tensorshare.server")


class Parked:
    """One waiting request (see :meth:`Waits.park`)."""

    __slots__ = ("name", "ready", "go", "expire", "ordered", "timer", "done")

    def __init__(self, name: str, ready: Callable[[], bool], go: Callable[[], None], expire: Callable[[], None],
                 ordered: bool = True):
        self.name, self.ready, self.go, self.expire, self.ordered = name, ready, go, expire, ordered
        self.timer: Any = None
        self.done = False


class Waits:
    """The parked requests of one server, by bin name.

    ``clock`` is an ``IReactorTime`` (``callLater``): the reactor in a server, a
    ``twisted.internet.task.Clock`` in tests."""

    def __init__(self, clock):
        self.clock = clock
        self._by_bin: dict[str, deque[Parked]] = {}
        self._going: dict[str, int] = defaultdict(int)  # requests that went on, not yet settled
        self._scheduled: set[str] = set()  # bins whose parked requests are tested on the next turn

    def park(self, name: str, ready: Callable[[], bool], go: Callable[[], None], timeout: float,
             expire: Callable[[], None], ordered: bool = True) -> Parked | None:
        """Run ``go()`` once ``ready()`` is true, testing it now and after each change
        to bin ``name``; or ``expire()`` after ``timeout`` seconds (0: at once if
        not ready now).  Requests parked under one bin go on in the order they came;
        an ``ordered=False`` one goes on whenever it is ready, whatever waits before
        it (each reader waiting for its own version).  Once ``go()`` has run, the
        caller owes a :meth:`settled` call.  Returns the parked request (for
        :meth:`cancel`), or None if it went on or expired at once."""
        if (not ordered or not self._by_bin.get(name)) and ready():
            self._go(name, go)
            return None
        if timeout <= 0:
            expire()
            return None
        parked = Parked(name, ready, go, expire, ordered)
        self._by_bin.setdefault(name, deque()).append(parked)
        parked.timer = self.clock.callLater(timeout, self._expire, parked)
        return parked

    def watcher(self, *lanes: str) -> Callable[[str], None]:
        """A listener-registry watcher: a change of bin ``name`` tests the requests
        parked under ``name`` and under ``name + lane`` for each of ``lanes`` (kinds
        of request that wait in queues of their own: a table's samples, held reads)."""
        keys, parked = ("", *lanes), self._by_bin

        def changed(name: str) -> None:
            if parked:  # (the usual case: nothing waits anywhere)
                for lane in keys:
                    self.changed(name + lane)
        return changed

    def going(self, name: str) -> int:
        """Requests on bin ``name`` that went on and have not settled yet."""
        return self._going.get(name, 0)

    def settled(self, name: str) -> None:
        """A request that went on is done with bin ``name`` (stored, or refused):
        those parked behind it are tested again."""
        left = self._going[name] - 1
        if left > 0:
            self._going[name] = left
        else:
            self._going.pop(name, None)
        self.changed(name)

    def _go(self, name: str, go: Callable[[], None]) -> None:
        self._going[name] += 1
        go()

    def changed(self, name: str) -> None:
        """Bin ``name`` changed: its parked requests are tested on the next turn of
        the reactor (not inside the handler of whichever request changed it)."""
        if name in self._by_bin and name not in self._scheduled:
            self._scheduled.add(name)
            self.clock.callLater(0, self._run, name)

    def _run(self, name: str) -> None:
        """Let the requests parked on bin ``name`` go on, oldest first, while they
        are ready (each one's ``go`` may change the bin again); unordered ones that
        are not ready hold back nobody."""
        self._scheduled.discard(name)
        queue = self._by_bin.get(name)
        skipped: list[Parked] = []  # unordered requests not ready yet, in order
        while queue:
            parked = queue[0]
            try:
                ready = parked.ready()
            except Exception:  # a bug: that request is refused, the others still wait
                log.exception("a request parked on %r failed its test", name)
                queue.popleft()
                self._finish(parked)
                parked.expire()
                continue
            if not ready:
                if parked.ordered:
                    break
                skipped.append(queue.popleft())
                continue
            queue.popleft()
            self._finish(parked)
            self._go(name, parked.go)  # may change the bin: the loop tests the next one with that
        skipped = [parked for parked in skipped if not parked.done]  # (one may have been cancelled meanwhile)
        if skipped:
            if queue is None or self._by_bin.get(name) is not queue:
                queue = self._by_bin.setdefault(name, deque())
            queue.extendleft(reversed(skipped))
        if queue is not None and not queue and self._by_bin.get(name) is queue:
            del self._by_bin[name]

    def cancel(self, parked: Parked | None) -> None:
        """Drop ``parked`` without running it (its connection closed)."""
        if parked is None or parked.done:
            return
        self._finish(parked)
        self._remove(parked)
        self.changed(parked.name)  # it may have held back others that are ready

    def waiting(self, name: str) -> int:
        """How many requests wait on bin ``name``."""
        queue = self._by_bin.get(name)
        return len(queue) if queue else 0

    def _expire(self, parked: Parked) -> None:
        parked.timer = None
        if parked.done:
            return
        self._finish(parked)
        self._remove(parked)
        parked.expire()
        self.changed(parked.name)

    def _finish(self, parked: Parked) -> None:
        parked.done = True
        if parked.timer is not None:
            if parked.timer.active():
                parked.timer.cancel()
            parked.timer = None

    def _remove(self, parked: Parked) -> None:
        queue = self._by_bin.get(parked.name)
        if queue is not None:
            try:
                queue.remove(parked)
            except ValueError:
                pass
            if not queue:
                del self._by_bin[parked.name]
