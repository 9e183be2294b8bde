"""Pacing helpers both ends use to decide when polling pays: running averages of
recent waits, the CPUs this process may use, yielding the CPU between polls, and
noticing when polling takes the CPU from other work (:class:`Contention`)."""

from __future__ import annotations

import os

yield_cpu = getattr(os, "sched_yield", lambda: None)  # give the CPU to whatever else may run

_WEIGHT = 8  # a moving average moves 1/_WEIGHT of the way to each new sample


def moving_average(average: float, sample: float) -> float:
    """``average`` moved towards ``sample``: the running estimates of both pollers."""
    return average + (sample - average) / _WEIGHT


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


CPU_LOST = 0.0002  # seconds: one poll-and-yield that took this long lost the CPU to another task
BACKOFF = 0.5  # seconds a poller that lost the CPU sleeps at once before it polls again
class Contention:
    """Tells a poller not to poll while it takes the CPU from other work.

    Polling pays only with a CPU to spare: otherwise it burns CPU time that others
    need (on a loaded 2-core machine, the very peer it waits for, or the other
    clients of the server), and the scheduler counts that time against the poller,
    so it waits longer for a CPU when work comes.  On such a machine a single
    client's put/append/get loop ran at a fraction of its rate with polling on
    (docs/design.md).  The sign: one check-and-yield of the poller took longer than
    ``lost``.  With a CPU to spare the yield comes straight back (a microsecond or
    two), so another task was waiting for this CPU and ran meanwhile; polling then
    pauses for ``backoff`` seconds.

    (Counting runnable tasks in ``/proc/loadavg`` as well was tried and dropped: in
    a quick exchange the poller and the peer it polls for are both runnable, and on a
    quiet 2-core machine any stray task besides them switched polling off, a small
    put taking 104 us instead of 54 us.)
    """

    __slots__ = ("lost", "backoff", "until", "times")

    def __init__(self, lost: float = CPU_LOST, backoff: float = BACKOFF):
        self.lost = lost
        self.backoff = backoff
        self.until = float("-inf")  # no polling before this time
        self.times = 0  # how often polling lost the CPU

    def calm(self, now: float) -> bool:
        """Whether polling may go on at time ``now``."""
        return now >= self.until

    def check(self, before: float, after: float) -> bool:
        """One check-and-yield ran from ``before`` to ``after``: True (and polling
        pauses for ``backoff``) if it lost the CPU meanwhile."""
        if after - before > self.lost:
            self.until = after + self.backoff
            self.times += 1
            return True
        return False
