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
    """Tells a poller to stop polling for a while once the CPU is contended.

    A poller yields the CPU between checks.  With a CPU to spare the yield comes
    straight back (a microsecond or two); one check-and-yield that takes longer than
    ``lost`` means another task was waiting for this CPU and ran meanwhile.  Polling
    then burns CPU time that others need (on a loaded 2-core machine, the very peer
    it waits for, or the other clients of the server), and the scheduler counts that
    time against the poller too, so it waits longer for the CPU when work comes: on
    such a machine a single client's put/append/get loop ran at a quarter of the
    rate it had with polling off (docs/design.md).  So the poller sleeps at once for
    ``backoff`` seconds, then tries polling again.
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
