"""Outbound flow control of one connection, without I/O: what its unsent frames cost,
when it counts as congested, and when its output counts as stalled.

A client that does not read its replies or notifications must not make the server's
memory grow.  :class:`OutboundBudget` keeps the account that the connection's
:class:`~.service.FrameWriter` reports to, and the policy built on it:

* **What is counted**: the bytes of every frame queued but not yet handed to the
  transport, plus :data:`FRAME_COST` per frame for the objects that hold it in the
  queue (so that many tiny notifications cost what they really take).  Frame heads
  (replies, notifications) are counted per frame.  Large
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
* **Stalled** (:class:`StallWatch`): frames wait, congested or not, and for
  ``stall_timeout`` seconds neither did a byte leave the queue nor did the socket
  take one: the peer does not read, and the connection is dropped (a GET whose
  reply it was puts its items back).  A connection that is closing gets a shorter
  grace.
"""

from __future__ import annotations

from typing import Iterable

SHARED_PART = 64 << 10  # parts this large are counted once per queue (stored item chunks)
FRAME_COST = 256  # bytes of Python objects that keep one queued frame (entry, lists, the bytes object)


class OutboundBudget:
    """The byte account and congestion state of one connection's outbound queue."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("the outbound limit must be at least 1 byte")
        self.limit = limit
        self.resume_below = limit // 2
        self.queued = 0  # bytes the queued frames keep alive (see the module docstring)
        self.congested = False
        self._large: dict[int, list] = {}  # id(part) -> [references, size]; the queue holds the parts

    def charge(self, parts: list) -> bool:
        """Count a frame just queued (its parts and :data:`FRAME_COST`); True if that
        made the queue congested."""
        if len(parts) == 1 and len(parts[0]) < SHARED_PART:  # the usual frame: one small part
            self.queued += FRAME_COST + len(parts[0])
            if self.queued > self.limit and not self.congested:
                self.congested = True
                return True
            return False
        self.queued += FRAME_COST
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
            return True
        return False

    def sent_small(self, nbytes: int, frames: int) -> bool:
        """``frames`` whole frames of ``nbytes`` in small parts (none shared) left the
        queue at once; True if that ended the congestion.  (:meth:`discharge` and
        :meth:`frame_done` in one step, for the writer's direct send.)"""
        self.queued -= nbytes + frames * FRAME_COST
        return self.congested and self._eased()

    def discharge(self, parts: Iterable) -> bool:
        """Uncount parts that left the queue (handed to the transport, or dropped with a
        withdrawn frame); True if that ended the congestion."""
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
        return self._eased()

    def frame_done(self) -> bool:
        """A frame left the queue whole (its parts were discharged); True if that
        ended the congestion."""
        return self.frame_done_many(1)

    def frame_done_many(self, frames: int) -> bool:
        """``frames`` frames left the queue whole (their parts discharged)."""
        self.queued -= frames * FRAME_COST
        return self._eased()

    def _eased(self) -> bool:
        if self.congested and self.queued <= self.resume_below:
            self.congested = False
            return True
        return False


class StallWatch:
    """How long a connection's pending output has gone without progress.

    The adapter calls :meth:`observe` on every tick with whether frames wait and a
    marker of progress (bytes handed to the transport, bytes the socket still
    holds): any change of the marker is progress.  A peer that reads slowly but
    steadily is never stalled."""

    def __init__(self):
        self._since: float | None = None
        self._marker = None

    def observe(self, now: float, pending: bool, marker) -> float:
        """Seconds without progress while output is pending (0 when none is)."""
        if not pending:
            self._since, self._marker = None, marker
            return 0.0
        if self._since is None or marker != self._marker:
            self._since, self._marker = now, marker
        return now - self._since
