"""Pacing helpers both ends use to decide when polling pays: running averages of
recent waits, the CPUs this process may use, yielding the CPU between polls, and
noticing when polling takes the CPU from other work (:class:`Contention`)."""

from __future__ import annotations

import os
import threading
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
BACKOFF = 0.5  # seconds: the longest a poller that lost the CPU sleeps at once before it polls again
FIRST_PAUSE = 0.02  # seconds: its first such pause; each loss within BACKOFF of the last pause's end doubles it
LOOK = 0.1  # seconds between two looks at how long the polling thread waited for a CPU
CROWDED = 0.25  # the share of the time since the last look it waited for one that means a crowded host


def thread_run_delay() -> tuple[int, int] | None:
    """``(thread id, nanoseconds)``: how long the calling thread has waited, runnable,
    for a CPU (Linux's ``/proc/thread-self/schedstat``); None where that is not known."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return threading.get_ident(), int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


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
    pauses (:meth:`_pause`).  That sign can stay away on a crowded host: a
    poller that mostly sleeps is favoured by the scheduler, whose ``sched_yield``
    hands it its CPU straight back while CPU-bound tasks wait, so its polling holds
    a CPU that its peer then waits for.  The second sign (:meth:`look`): the polling
    thread itself waited, runnable, for a CPU for more than ``CROWDED`` of the time
    (with four CPU-bound processes on 2 cores, a put + peek took 107 us with both
    ends polling and 98-100 us with either or neither; docs/design.md).  On a quiet
    host the poller and its peer each have a CPU, and that wait stays near zero.

    (Counting runnable tasks in ``/proc/loadavg`` as well was tried and dropped: in
    a quick exchange the poller and the peer it polls for are both runnable, and on a
    quiet 2-core machine any stray task besides them switched polling off, a small
    put taking 104 us instead of 54 us.)
    """

    __slots__ = ("lost", "backoff", "first", "pause", "until", "times", "run_delay", "next_look", "_looked")

    def __init__(self, lost: float = CPU_LOST, backoff: float = BACKOFF,
                 run_delay: Callable[[], tuple | None] | None = None, first: float = FIRST_PAUSE):
        self.lost = lost
        self.backoff = backoff
        self.first = min(first, backoff)
        self.pause = 0.0  # seconds of the last pause
        self.until = float("-inf")  # no polling before this time
        self.times = 0  # how often polling lost the CPU (or found the host crowded)
        self.run_delay = run_delay or thread_run_delay  # () -> (thread, ns waited for a CPU) or None
        self.next_look = float("-inf")  # when :meth:`look` looks again
        self._looked: tuple | None = None  # (time, run_delay()) of the last look

    def calm(self, now: float) -> bool:
        """Whether polling may go on at time ``now``."""
        return now >= self.until and (now < self.next_look or self.look(now))

    def look(self, now: float) -> bool:
        """Whether polling may go on, by how long this thread waited for a CPU since
        the last look (at most every ``LOOK`` seconds, polling or not): a share of
        over ``CROWDED`` means more work than CPUs, so polling pauses
        (:meth:`_pause`; it is looked at again then)."""
        self.next_look = now + LOOK
        seen, before, self._looked = self.run_delay(), self._looked, None
        if seen is None:
            return True
        self._looked = (now, seen)
        if before is None or before[1][0] != seen[0] or now <= before[0]:
            return True  # (a first look, or another thread's: nothing to compare)
        if (seen[1] - before[1][1]) * 1e-9 > CROWDED * (now - before[0]):
            self._pause(now)
            return False
        return True

    def check(self, before: float, after: float) -> bool:
        """One check-and-yield ran from ``before`` to ``after``: True (and polling
        pauses: :meth:`_pause`) if it lost the CPU meanwhile.

        A check that took longer than ``lost`` lost the CPU only if the thread waited
        for one, runnable, for at least half that time (:meth:`_waited_for_cpu`).
        Otherwise it was blocked: on the GIL, which another thread of this process
        held (a client's application threads, a server's disk jobs; each holds it up
        to ``sys.getswitchinterval()``, 5 ms).  That is no rival for the CPU: pausing
        for 0.5 s then made every small round trip of that half second wait
        to be woken (a peek of 16 float32 took 53-67 us instead of 19 us, beside a
        thread that fetched ``/metrics`` once a second; docs/design.md)."""
        if after - before > self.lost and self._waited_for_cpu(after - before):
            self._pause(after)
            return True
        return False

    def _pause(self, now: float) -> None:
        """Polling lost the CPU (or found the host crowded) at ``now``: it pauses for
        ``first`` seconds, or for twice its last pause (at most ``backoff``) if that
        ended less than ``backoff`` ago.  A host that stays crowded soon has it pause
        for ``backoff`` at a time, as a pause of that length always did; a task that
        took this CPU once (a scrape, a log rotation) costs ``first``, where a
        ``backoff`` of 0.5 s at once made every small round trip of that half second
        wait to be woken (a peek of 16 float32: 60 us instead of 19 us, beside a
        server that answered a scrape on the same CPU once a second)."""
        self.pause = min(2 * self.pause, self.backoff) if now - self.until < self.backoff else self.first
        self.until = now + self.pause
        self.times += 1

    def _waited_for_cpu(self, span: float) -> bool:
        """Whether this thread waited, runnable, for a CPU for at least half of the
        last ``span`` seconds: how much its wait grew since the last :meth:`look`
        (at most ``LOOK`` seconds ago while polling, so a wait of before the slow
        check may count too: the doubt goes to pausing).  True where the wait is
        not known (not Linux, no look yet, or another thread's)."""
        looked, seen = self._looked, self.run_delay()
        if looked is None or seen is None or looked[1][0] != seen[0]:
            return True
        return (seen[1] - looked[1][1]) * 1e-9 >= span / 2
