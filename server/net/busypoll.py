"""Busy-polling the reactor for a moment after each request: the server half of a quick round trip.

A reactor that sleeps in ``epoll_wait`` as soon as it has answered pays for being
woken by the next request: the kernel must wake the thread and, on a virtual
machine whose CPU went idle, the hypervisor must first resume that CPU: a large
part of a small round trip (docs/design.md).  Clients in such loops send their next
request within a few hundred microseconds of the last reply, so a reactor that
keeps polling (``epoll_wait`` with a zero timeout) for ``window`` seconds after
a request sees it at once.

The cost is CPU: after each burst of requests the reactor thread polls for up
to ``window`` seconds before it sleeps.  So it polls only while it pays: it keeps
a running estimate of the time between requests and polls while that estimate is
within the window (requests that come further apart, or an idle server, sleep as
before), and so does one whose polling lost the CPU to another task a moment
ago (:class:`~tensorshare.protocol.pacing.Contention`).  It is for a server in its own process (``tensorshare-server`` and
``run_server`` turn it on); a server embedded in a process whose other threads
need the GIL leaves it off, and so does a process that may use a single CPU,
where polling would take the CPU from the very client it waits for.

Polling is for a lone client: while requests come from more than one connection
(several clients busy at once), each request wakes the reactor anyway and polling
only takes CPU from the clients (on 2 cores, eight clients of small requests
cost 66 us of server CPU per request with polling and 58-62 us without:
docs/design.md), so it stops until one connection alone has sent requests for
``LONE`` seconds.

It works with any reactor that has ``doIteration`` (every select-style one):
the reactor's own ``doIteration(0)`` is called in a loop, so events are handled
exactly as usual, and polling stops early for a timed call that is due or for
work queued from another thread (disk jobs report back that way).
"""

from __future__ import annotations

import time
from typing import Callable

from tensorshare.protocol.pacing import Contention, moving_average, usable_cpus, yield_cpu

DEFAULT_WINDOW = 0.0005  # seconds: covers a client's time between one reply and its next request
_GAP_CAP = 10  # one long pause counts as at most this many windows (so a few quick requests resume polling)
LONE = 0.01  # seconds one connection alone must have sent requests before polling (re)starts


class BusyPoll:
    """Keeps one reactor polling for ``window`` seconds after the last request.

    Use :func:`acquire` / :meth:`release` (servers sharing a reactor share one).
    The protocol calls :meth:`note_request` for each read of request bytes.
    """

    def __init__(self, reactor, window: float, clock: Callable[[], float] = time.perf_counter):
        self._reactor = reactor
        self._clock = clock
        self.window = window
        self._sleep = reactor.doIteration  # the reactor's own iteration (polls, may sleep)
        self._last = float("-inf")  # clock() of the last request
        self._requests = 0
        self._users = 0
        self.gap = 0.0  # seconds between requests (moving average)
        self.contention = Contention()  # polling pauses while it takes the CPU from others
        self._sender = None  # the connection the last request came from
        self._shared = float("-inf")  # clock() of the last request from another connection than the one before

    def note_request(self, sender: object = None) -> None:
        """Request bytes arrived (from connection ``sender``): keep polling for
        ``window`` from now, if they come close enough together and from one
        connection alone for that to pay."""
        now = self._clock()
        gap, cap = now - self._last, _GAP_CAP * self.window
        self.gap = moving_average(self.gap, gap if gap < cap else cap)  # (not min(): a costly call per request)
        self._requests += 1
        self._last = now
        if sender is not self._sender:
            self._sender = sender
            self._shared = now

    @property
    def lone(self) -> bool:
        """Whether one connection alone has sent the requests of the last ``LONE`` seconds."""
        return self._clock() - self._shared >= LONE

    def do_iteration(self, timeout: float | None) -> None:
        """The reactor's ``doIteration``: poll without sleeping while within the
        window of the last request, then sleep as the reactor would."""
        clock = self._clock
        start = clock()
        until = self._last + self.window
        if start < until and self.gap <= self.window and start - self._shared >= LONE \
                and self.contention.calm(start):
            if timeout is not None:
                until = min(until, start + timeout)
            seen, queued, poll, contention = self._requests, self._reactor.threadCallQueue, self._sleep, self.contention
            last = now = start
            while now < until:
                poll(0)
                if self._requests != seen or queued:
                    return  # back to the reactor's loop, which runs what is due
                now = clock()
                # (checked after the poll: a client that ran on this CPU and sent its
                # request meanwhile is what polling is for, not a rival)
                if contention.check(last, now):
                    break  # a rival task needed this CPU: sleep, and poll again only later
                yield_cpu()  # clients on this CPU go first: they are what it waits for
                last = now
            if timeout is not None:
                timeout = max(0.0, timeout - (now - start))
        self._sleep(timeout)


_installed: dict[int, BusyPoll] = {}  # id(reactor) -> its BusyPoll


def acquire(reactor, window: float) -> BusyPoll | None:
    """Start busy-polling ``reactor`` (reactor thread only); None when ``window`` is 0
    or this process may use a single CPU.  Pair with :func:`release`."""
    if window <= 0 or usable_cpus() < 2:
        return None
    poller = _installed.get(id(reactor))
    if poller is None:
        poller = _installed[id(reactor)] = BusyPoll(reactor, window)
        reactor.doIteration = poller.do_iteration
    poller.window = max(poller.window, window)
    poller._users += 1
    return poller


def release(poller: BusyPoll | None) -> None:
    """A server that used ``poller`` stopped; the last one restores the reactor."""
    if poller is None:
        return
    poller._users -= 1
    if poller._users <= 0 and _installed.get(id(poller._reactor)) is poller:
        del _installed[id(poller._reactor)]
        poller._reactor.doIteration = poller._sleep
