"""Requests that wait in the server for their bin: parked by lane, then run or expired.

Some requests may only proceed once a bin is in a given state: an APPEND with
``below`` waits until the bin holds fewer items, a GET with ``wait`` until it holds
enough, a PEEK with ``since`` until it moves on, a table's insert or sample until
its rate limiter lets it through.  Such a request is *parked* here under its bin
and its *lane*, the kind of waiting its verb declares (``Command.lane``: ``room``,
``take``, ``peek``, ``insert``, ``sample``), with a test of whether it may go on.
Every change to a bin (each one is published,
:meth:`~.notify.ListenerRegistry.publish`) re-tests the requests parked under it,
oldest first within each lane: a sample waiting for rows never holds back the
insert that would give them, a waiting GET never an APPEND waiting for room.  A
request that waits longer than its timeout is expired.

A request that went on may take a while to change its bin (a durable APPEND is
written to disk first): it counts as *going* in its lane until it has
:meth:`~Waits.settled`, and tests of the requests behind it count it (an APPEND
``below`` 10 does not go on while nine items are stored and one is being written).

Parking holds only its own connection: the session keeps that connection's later
requests back (replies stay in request order) and every other connection is served
as usual (:mod:`.outcome`'s ``Pending``).  A parked request of a connection that
closes is dropped, unrun.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from typing import Any, Callable

log = logging.getLogger("tensorshare.server")

Key = tuple  # (bin name, lane)


class Parked:
    """One waiting request (see :meth:`Waits.park`)."""

    __slots__ = ("key", "ready", "go", "expire", "ordered", "timer", "done")

    def __init__(self, key: Key, ready: Callable[[], bool], go: Callable[[], None], expire: Callable[[], None],
                 ordered: bool = True):
        self.key, self.ready, self.go, self.expire, self.ordered = key, ready, go, expire, ordered
        self.timer: Any = None
        self.done = False


class Waits:
    """The parked requests of one server, by bin and lane.

    ``clock`` is an ``IReactorTime`` (``callLater``): the reactor in a server, a
    ``twisted.internet.task.Clock`` in tests."""

    def __init__(self, clock):
        self.clock = clock
        self._by_bin: dict[str, dict[str, deque[Parked]]] = {}  # bin -> lane -> parked, oldest first
        self._going: dict[Key, int] = defaultdict(int)  # requests that went on, not yet settled
        self._scheduled: set[str] = set()  # bins whose parked requests are tested on the next turn

    @property
    def parked(self):
        """The bins some request waits on (a live view: for ``ListenerRegistry.watch``)."""
        return self._by_bin.keys()

    def park(self, key: Key, ready: Callable[[], bool], go: Callable[[], None], timeout: float,
             expire: Callable[[], None], ordered: bool = True) -> Parked | None:
        """Run ``go()`` once ``ready()`` is true, testing it now and after each change
        to the bin of ``key`` (``(bin, lane)``); or ``expire()`` after ``timeout``
        seconds (0: at once if not ready now).  Requests parked in one lane go on in
        the order they came; an ``ordered=False`` one goes on whenever it is ready,
        whatever waits before it (each reader waiting for its own version).  Once
        ``go()`` has run, the caller owes a :meth:`settled` call.  Returns the parked
        request (for :meth:`cancel`), or None if it went on or expired at once."""
        if (not ordered or not self.waiting(key)) and ready():
            self._go(key, go)
            return None
        if timeout <= 0:
            expire()
            return None
        parked = Parked(key, ready, go, expire, ordered)
        name, lane = key
        self._by_bin.setdefault(name, {}).setdefault(lane, deque()).append(parked)
        parked.timer = self.clock.callLater(timeout, self._expire, parked)
        return parked

    def going(self, key: Key) -> int:
        """Requests of ``key`` that went on and have not settled yet."""
        return self._going.get(key, 0)

    def settled(self, key: Key) -> None:
        """A request that went on is done with its bin (stored, answered or refused):
        those parked behind it are tested again."""
        left = self._going[key] - 1
        if left > 0:
            self._going[key] = left
        else:
            self._going.pop(key, None)
        self.changed(key[0])

    def _go(self, key: Key, go: Callable[[], None]) -> None:
        self._going[key] += 1
        go()

    def changed(self, name: str) -> None:
        """Bin ``name`` changed: its parked requests, in every lane, are tested on the
        next turn of the reactor (not inside the handler of whichever request changed
        it).  The listener registry calls this after every change it publishes."""
        if name in self._by_bin and name not in self._scheduled:
            self._scheduled.add(name)
            self.clock.callLater(0, self._run, name)

    def _run(self, name: str) -> None:
        self._scheduled.discard(name)
        lanes = self._by_bin.get(name)
        for lane in list(lanes or ()):
            self._run_lane(name, lane)

    def _run_lane(self, name: str, lane: str) -> None:
        """Let the requests parked in one lane of bin ``name`` go on, oldest first,
        while they are ready (each one's ``go`` may change the bin again); unordered
        ones that are not ready hold back nobody."""
        lanes = self._by_bin.get(name)
        queue = None if lanes is None else lanes.get(lane)
        key = (name, lane)
        skipped: list[Parked] = []  # unordered requests not ready yet, in order
        while queue:
            parked = queue[0]
            try:
                ready = parked.ready()
            except Exception:  # a bug: that request is refused, the others still wait
                log.exception("a request parked on %r failed its test", key)
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
            self._go(key, parked.go)  # may change the bin: the loop tests the next one with that
        skipped = [parked for parked in skipped if not parked.done]  # (one may have been cancelled meanwhile)
        if skipped:
            queue = self._queue(key)
            queue.extendleft(reversed(skipped))
        self._drop_if_empty(key)

    def cancel(self, parked: Parked | None) -> None:
        """Drop ``parked`` without running it (its connection closed)."""
        if parked is None or parked.done:
            return
        self._finish(parked)
        self._remove(parked)
        self.changed(parked.key[0])  # it may have held back others that are ready

    def waiting_on(self, name: str) -> bool:
        """Whether any request waits on bin ``name``, in any lane."""
        return name in self._by_bin

    def waiting(self, key: Key) -> int:
        """How many requests wait in the lane of a bin (``key``: ``(bin, lane)``)."""
        lanes = self._by_bin.get(key[0])
        queue = None if lanes is None else lanes.get(key[1])
        return len(queue) if queue else 0

    def _expire(self, parked: Parked) -> None:
        parked.timer = None
        if parked.done:
            return
        self._finish(parked)
        self._remove(parked)
        parked.expire()
        self.changed(parked.key[0])

    def _finish(self, parked: Parked) -> None:
        parked.done = True
        if parked.timer is not None:
            if parked.timer.active():
                parked.timer.cancel()
            parked.timer = None

    def _queue(self, key: Key) -> deque:
        name, lane = key
        return self._by_bin.setdefault(name, {}).setdefault(lane, deque())

    def _remove(self, parked: Parked) -> None:
        name, lane = parked.key
        queue = self._by_bin.get(name, {}).get(lane)
        if queue is not None:
            try:
                queue.remove(parked)
            except ValueError:
                pass
        self._drop_if_empty(parked.key)

    def _drop_if_empty(self, key: Key) -> None:
        name, lane = key
        lanes = self._by_bin.get(name)
        if lanes is not None and not lanes.get(lane, True):
            del lanes[lane]
            if not lanes:
                del self._by_bin[name]
