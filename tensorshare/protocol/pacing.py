"""Pacing helpers both ends use to decide when polling pays: running averages of
recent waits, the CPUs this process may use, and yielding the CPU between polls."""

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
