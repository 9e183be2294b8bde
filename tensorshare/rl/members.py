"""What an RL trainer knows of its workers: who is alive, which version each holds,
how fast each sends rollouts, and how much work goes to waste.

Workers register themselves (see :mod:`tensorshare.rl.worker`): each puts an *ephemeral*
bin ``<experiment>/workers/<id>`` (PROTOCOL.md §4.6) whose tag is the version of
the parameters it holds, and appends its id to ``<experiment>/roster``.  The
server deletes a worker's bin when its connection ends, so the trainer hears of a
departure (a DELETE notification) as soon as the server notices it: at once for a
killed process, within the keepalive time for a host that vanished.  Nothing here
polls.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("tensorshare.rl")

RATE_WINDOW = 30.0  # seconds over which a worker's rollout rate is measured


@dataclass
class WorkerInfo:
    """One live worker, as the trainer sees it."""

    id: str
    version: int = -1  # version of the parameters it holds (-1: none yet)
    host: str = ""
    pid: int = 0
    joined: float = field(default_factory=time.time)  # when the trainer saw it join (epoch seconds)
    rollouts: int = 0  # rollouts of it that the trainer took (kept or dropped)
    _marks: deque = field(default_factory=deque, repr=False)  # (monotonic time, rollouts) samples

    @property
    def rate(self) -> float:
        """Rollouts per second the trainer took from it over the last half minute."""
        now = time.monotonic()
        marks = self._marks
        while len(marks) > 1 and now - marks[1][0] > RATE_WINDOW:
            marks.popleft()
        if not marks:
            return 0.0
        since, count = marks[0]
        return (self.rollouts - count) / max(now - since, 1e-3)

    def took(self, count: int) -> None:
        if not self._marks:
            self._marks.append((time.monotonic(), self.rollouts))
        self.rollouts += count
        self._marks.append((time.monotonic(), self.rollouts))


class StaleWatch:
    """Counts rollouts kept and dropped as stale, and warns (at most every
    ``every`` seconds) when most of the recent work is thrown away."""

    WINDOW = 200  # the most recent rollouts the warning looks at

    def __init__(self, every: float = 30.0):
        self.received = 0
        self.dropped = 0
        self._recent: deque[bool] = deque(maxlen=self.WINDOW)  # True: dropped
        self._every = every
        self._warned_at = -float("inf")

    @property
    def drop_rate(self) -> float:
        """The fraction of the recent rollouts dropped as stale."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def count(self, kept: int, dropped: int, max_staleness: int) -> None:
        self.received += kept + dropped
        self.dropped += dropped
        self._recent.extend([True] * dropped)
        self._recent.extend([False] * kept)
        if len(self._recent) >= self.WINDOW // 2 and self.drop_rate > 0.5:
            now = time.monotonic()
            if now - self._warned_at >= self._every:
                self._warned_at = now
                log.warning("%.0f%% of the last %d rollouts were dropped as made with parameters more than %d "
                            "versions old: raise max_staleness, or lower max_waiting so that workers wait instead "
                            "of producing stale work", 100 * self.drop_rate, len(self._recent), max_staleness)
