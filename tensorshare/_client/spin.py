"""Adaptive busy-polling for a reply that is about to arrive.

A thread that sleeps in ``poll()`` while its reply is on the way pays for being
woken when the reply comes: the kernel must wake it, and on a virtual machine
whose CPU went idle the hypervisor must first resume that CPU (a large part of a
small round trip: docs/design.md).  A caller that polls without sleeping for a short while, instead,
sees the reply as soon as it lands.  Between checks it yields the CPU, so that a
process that needs it (the server, when both share a small machine) runs first.

Polling burns the CPU it waits on, so :class:`ReplySpin` only does it while it
pays: it keeps a running estimate of how long replies have taken to come and
polls (for at most ``limit`` seconds) only while that estimate is within the
limit.  Replies that take longer (large transfers, a slow network, a busy
server) make it fall back to sleeping at once, as does polling that just lost the
CPU to another task (:class:`~tensorshare.protocol.pacing.Contention`), and the estimate, still updated
from the sleeping waits, brings polling back when replies are quick again.  It
never polls on a machine that lets this process use a single CPU, where polling
would take the CPU from the very server it waits for.
"""

from __future__ import annotations

import time
from typing import Callable

from ..protocol.pacing import Contention, moving_average, usable_cpus, yield_cpu
from .sockets import wait as sleep_until_ready

DEFAULT_LIMIT = 0.0005  # seconds: a loopback or LAN round trip of a small request fits well within it


class ReplySpin:
    """When and how long to poll for a reply before sleeping (see the module docstring).

    ``limit`` is the most seconds one wait polls; 0 (or a single usable CPU) turns
    polling off.  Not thread-safe: one reading thread at a time uses it (the
    client's leader).
    """

    def __init__(self, limit: float = DEFAULT_LIMIT, cpus: int | None = None):
        if limit < 0:
            raise ValueError("the spin limit cannot be negative")
        if (usable_cpus() if cpus is None else cpus) < 2:
            limit = 0.0
        self.limit = limit
        self.estimate = 0.0  # seconds recent replies took to come (moving average)
        self.contention = Contention()  # polling pauses while it takes the CPU from others

    @property
    def active(self) -> bool:
        """Whether the next wait polls before sleeping."""
        return self.limit > 0 and self.estimate <= self.limit

    def poll(self, ready: Callable[[], object], within: float | None = None,
             clock: Callable[[], float] = time.perf_counter) -> float | None:
        """Poll ``ready()`` (a non-blocking check) until it is true, the limit passes
        or ``within`` seconds (the caller's deadline) pass.

        Returns the time polling started if it should go on to sleep (not ready, or
        polling is off), else None; pass that time to :meth:`waited` once the
        sleeping wait is over."""
        start = clock()
        limit, contention = self.limit, self.contention
        # (self.active and contention.calm(start), without two calls on every small round trip)
        if (limit > 0 and self.estimate <= limit and (within is None or within > 0) and start >= contention.until
                and (start < contention.next_look or contention.look(start))):
            end = start + (limit if within is None else min(limit, within))
            last = start
            while True:
                if ready():
                    self.estimate = moving_average(self.estimate, clock() - start)
                    return None
                now = clock()
                # (checked after ready(): a server that ran on this CPU meanwhile is no rival)
                if now >= end or contention.check(last, now):
                    break  # a rival task needed this CPU: sleep, and poll again only later
                yield_cpu()  # let whatever else waits for this CPU run (the server, say)
                last = now
        return start

    def wait(self, ready: Callable[[], object], poller, until: float | None) -> None:
        """Wait until ``ready()``: polling first, while that pays (:meth:`poll`), then
        asleep in ``poller.poll``; TimeoutError at ``until`` (monotonic; None: never)."""
        started = self.poll(ready, None if until is None else until - time.monotonic())
        if started is not None:  # not there yet: sleep until it is
            sleep_until_ready(poller, until)
            self.waited(started)

    def waited(self, start: float, clock: Callable[[], float] = time.perf_counter) -> None:
        """A sleeping wait that began (with polling) at ``start`` is over: learn from it."""
        self._note(clock() - start)

    def _note(self, seconds: float) -> None:
        self.estimate = moving_average(self.estimate, seconds)
