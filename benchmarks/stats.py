"""Timing helpers: warm-up, repeated runs, and the median/min/max of what they measured."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


@dataclass(frozen=True)
class Sample:
    """Several runs of one measurement, in one unit; the figure reported is the median."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> "Sample":
        vals = tuple(float(v) for v in values)
        if not vals:
            raise ValueError("a sample needs at least one run")
        return cls(vals)

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def runs(self) -> int:
        return len(self.values)

    def map(self, fn: Callable[[float], float]) -> "Sample":
        """The same runs in another unit (e.g. seconds -> GB/s)."""
        return Sample(tuple(fn(v) for v in self.values))


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest-rank, of ``values``."""
    s = sorted(values)
    if not s:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[min(rank, len(s)) - 1]


def time_runs(fn: Callable[[], object], reps: int, warmup: int = 1,
              setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds taken by each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    ``setup`` runs untimed before every call (to put a value back, drop a result...).
    """
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return times


def per_op_latencies(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds taken by each of ``n`` consecutive calls of ``fn``."""
    out = [0.0] * n
    clock = time.perf_counter
    for i in range(n):
        start = clock()
        fn()
        out[i] = clock() - start
    return out


@dataclass(frozen=True)
class LatencyRuns:
    """Per-run median and p99 latency (seconds) of several runs of many ops each."""

    medians: Sample
    p99s: Sample


def interleaved_latency_runs(fns: dict[str, Callable[[], object]], ops: int, runs: int,
                             warmup_ops: int) -> dict[str, LatencyRuns]:
    """Per-run median and p99 latency of each operation in ``fns``: ``warmup_ops``
    untimed calls of each, then ``runs`` runs that each time ``ops`` calls of every
    operation in turn, starting each run with the next one, so that a change in the
    machine's load (a noisy neighbour, a busy core) falls on all of them alike
    instead of on whichever was measured at that moment."""
    names = list(fns)
    for name in names:
        for _ in range(warmup_ops):
            fns[name]()
    meds: dict[str, list] = {name: [] for name in names}
    p99s: dict[str, list] = {name: [] for name in names}
    for r in range(runs):
        for name in names[r % len(names):] + names[: r % len(names)]:
            lat = per_op_latencies(fns[name], ops)
            meds[name].append(median(lat))
            p99s[name].append(percentile(lat, 99))
    return {name: LatencyRuns(Sample.of(meds[name]), Sample.of(p99s[name])) for name in names}


def gbps(nbytes: int) -> Callable[[float], float]:
    """Seconds -> GB/s (10^9 bytes per second) for a transfer of ``nbytes``."""
    return lambda seconds: nbytes / seconds / 1e9


def mib(nbytes: int) -> str:
    """``nbytes`` as a short label: '256 MiB', '64 KiB', '25.0 MiB'."""
    if nbytes >= 1 << 30 and nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes / (1 << 20):.1f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes >> 10} KiB" if nbytes % (1 << 10) == 0 else f"{nbytes / (1 << 10):.1f} KiB"
    return f"{nbytes} B"
