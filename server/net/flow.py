"""Outbound flow control of one connection, without I/O: what its unsent frames cost,
when it counts as congested, and when its reader counts as stalled.

A client that does not read its replies or notifications must not make the server's
memory grow.  :class:`OutboundBudget` keeps the account that the connection's
:class:`~.service.FrameWriter` reports to, and the policy built on it:

* **What is counted**: the bytes of every frame queued but not yet handed to the
  transport.  Frame heads (replies, notifications) are counted per frame.  Large
  payload parts (``>= SHARED_PART`` bytes: the stored chunks an item is made of)
  are counted once however many queued frames refer to them, so a hundred
  pipelined PEEKs of one 64 MiB item count 64 MiB, not 6.4 GiB.  Such parts cost
  nothing extra while their item stays stored, but they are counted all the same:
  a PUT, GET or DELETE by anyone may drop the item from the store while the reply
  waits, and then the queue alone keeps the bytes alive.  The count is therefore
  an upper bound of the memory the connection's queue pins.  Bytes already handed
  to Twisted's transport (at most its ``bufferSize`` plus one part) and to the
  kernel are not counted.
* **Congested**: over ``limit`` bytes.  While congested the session handles no
  further request of the connection and its socket is not read (backpressure on
  writers), and a new notification replaces the one still waiting for the same bin
  (coalescing).  It stops being congested at ``limit / 2`` (hysteresis, so that it
  does not flip at every frame).
* **Stalled**: congested, and for ``stall_timeout`` seconds neither a part left
  the queue nor did the transport pass a byte on to the socket: the peer does not
  read; the connection is closed.  A peer that reads slowly but steadily is never
  stalled.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

SHARED_PART = 64 << 10  # parts this large are counted once per queue (stored item chunks)


class OutboundBudget:
    """The byte account and congestion state of one connection's outbound queue."""

    def __init__(self, limit: int, stall_timeout: float, clock: Callable[[], float] = time.monotonic):
        if limit < 1:
            raise ValueError("the outbound limit must be at least 1 byte")
        self.limit = limit
        self.resume_below = limit // 2
        self.stall_timeout = stall_timeout
        self.clock = clock
        self.queued = 0  # bytes the queued parts keep alive (see the module docstring)
        self.congested = False
        self.last_progress = 0.0  # clock() when a part last left the queue while congested
        self._large: dict[int, list] = {}  # id(part) -> [references, size]; the queue holds the parts

    def charge(self, parts: Iterable) -> bool:
        """Count the parts of a frame just queued; True if that made the queue congested."""
        for part in parts:
            size = len(part)
            if size >= SHARED_PART:
                slot = self._large.get(id(part))
                if slot is not None:
                    slot[0] += 1
                    continue
                self._large[id(part)] = [1, size]
            self.queued += size
        if not self.congested and self.queued > self.limit:
            self.congested = True
            self.last_progress = self.clock()
            return True
        return False

    def discharge(self, parts: Iterable, written: bool = True) -> bool:
        """Uncount parts that left the queue, handed to the transport (``written``) or
        dropped (a coalesced notification); True if that ended the congestion."""
        for part in parts:
            size = len(part)
            if size >= SHARED_PART:
                key = id(part)
                slot = self._large[key]
                slot[0] -= 1
                if slot[0]:
                    continue
                del self._large[key]
            self.queued -= size
        if self.congested:
            if written:
                self.last_progress = self.clock()
            if self.queued <= self.resume_below:
                self.congested = False
                return True
        return False

    def note_progress(self) -> None:
        """The transport passed bytes on to the socket (progress the queue cannot see
        while one large part drains)."""
        if self.congested:
            self.last_progress = self.clock()

    def stalled_for(self) -> float:
        """Seconds the congested queue has gone without progress (0 if not congested)."""
        if not self.congested:
            return 0.0
        return max(0.0, self.clock() - self.last_progress)
