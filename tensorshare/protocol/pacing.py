"""Pacing helpers both ends use to decide when polling pays: running averages of
recent waits, the CPUs this process may use, yielding the CPU between polls, and
noticing when polling takes the CPU from other work (:class:`Contention`)."""

from __future__ import annotations

import os
from typing import Callable

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
LOAD_LOOK = 0.1  # seconds between looks at how many tasks want a CPU


def runnable_tasks() -> int | None:
    """Tasks running or waiting for a CPU now, machine-wide (Linux), or None."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class Contention:
    """Tells a poller not to poll while the CPUs are contended.

    Polling pays only with a CPU to spare: otherwise it burns CPU time that others
    need (on a loaded 2-core machine, the very peer it waits for, or the other
    clients of the server), and the scheduler counts that time against the poller,
    so it waits longer for a CPU when work comes.  On such a machine a single
    client's put/append/get loop ran at a fraction of its rate with polling off
    (docs/design.md).  Two signs say the CPUs are contended:

    * more tasks want a CPU than the machine has (``runnable()``, looked at every
      ``LOAD_LOOK`` seconds; the caller, running, counts itself);
    * one check-and-yield of the poller took longer than ``lost``: with a CPU to
      spare the yield comes straight back (a microsecond or two), so another task
      was waiting for this CPU and ran meanwhile.  Polling then pauses for
      ``backoff`` seconds.
    """

    __slots__ = ("lost", "backoff", "until", "times", "cpus", "_runnable", "_looked", "_crowded")

    def __init__(self, lost: float = CPU_LOST, backoff: float = BACKOFF, cpus: int | None = None,
                 runnable: Callable[[], int | None] | None = None):
        self.lost = lost
        self.backoff = backoff
        self.until = float("-inf")  # no polling before this time
        self.times = 0  # how often polling lost the CPU
        self.cpus = cpus if cpus is not None else (os.cpu_count() or 1)  # (runnable() is machine-wide too)
        self._runnable = runnable  # None: runnable_tasks()
        self._looked = float("-inf")
        self._crowded = False

    def calm(self, now: float) -> bool:
        """Whether polling may go on at time ``now``."""
        if now < self.until:
            return False
        if now - self._looked >= LOAD_LOOK:
            self._looked = now
            wanting = (self._runnable or runnable_tasks)()
            self._crowded = wanting is not None and wanting > self.cpus
        return not self._crowded

    def check(self, before: float, after: float) -> bool:
        """One check-and-yield ran from ``before`` to ``after``: True (and polling
        pauses for ``backoff``) if it lost the CPU meanwhile."""
        if after - before > self.lost:
            self.until = after + self.backoff
            self.times += 1
            return True
        return False
