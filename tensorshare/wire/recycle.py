"""Reusing large buffers once nothing refers to them any more.

Memory a process has not touched before is dear: the kernel faults in and zeroes
every page first, and where that is slow (a virtual machine, say) receiving 256 MiB
into new memory ran at a fraction of the rate into memory already touched. Both ends
receive large payloads over and over, often of one size (a parameter vector, version
after version), so both keep the buffers they received into and use them again.

:class:`Recycler` keeps the buffers it made, up to ``max_bytes``, and hands one out
again only when nothing else refers to it: its reference count (CPython's) says so.
There is no hook to forget: whatever still reads a buffer (a stored item, a reply
being written, a tensor the caller holds, a disk job) holds a reference to it, or to
a view of it, and the buffer stays theirs until the last one is gone.  That needs
every view to refer to the buffer itself: a ``bytearray``, or a numpy array over
memory it does not own from numpy (numpy views of a numpy array that owns its
memory refer to that owner instead, so such an array must not be the buffer).
:meth:`Recycler.trim` lets go of buffers that have stayed free for ``idle`` seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

_SCAN = 64  # most buffers one take() looks at
_SCAN_ROOM = 256  # most buffers a take() at the bound looks at to make room (oldest first)


def _refs(slots: list, i: int) -> int:
    return sys.getrefcount(slots[i][0])


# What _refs() says of a buffer that only its slot refers to (the slot's list, plus
# what the call itself adds, which differs between Python versions).
_FREE_REFS = _refs([[bytearray(0), 0, None]], 0)


def _free(slots: list, i: int) -> bool:
    return _refs(slots, i) == _FREE_REFS


class Recycler:
    """Buffers made by ``make(nbytes)``, handed out again once free, ``max_bytes`` at most.

    Safe to use from several threads (one lock)."""

    def __init__(self, max_bytes: int, make: Callable[[int], Any], idle: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_bytes < 0:
            raise ValueError("max_bytes must be 0 or more")
        self.max_bytes = max_bytes
        self.make = make
        self.idle = idle
        self.clock = clock
        self._slots: list[list] = []  # [buffer, nbytes, free since (clock) or None]
        self._held = 0  # bytes of the buffers in _slots
        self._cursor = 0  # where the next take() starts looking
        self._last_trim = clock()
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (statistics, tests)
        self.made = 0  # buffers made

    def take(self, nbytes: int) -> Any | None:
        """A buffer of ``nbytes``: a free one of that size, else a new one if it fits
        under ``max_bytes`` (letting go of free buffers of other sizes to make room,
        if that makes enough), else None (the caller uses memory of its own)."""
        with self._lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> Any | None:
        slots = self._slots
        count = len(slots)
        scan = min(count, _SCAN)
        for step in range(scan):
            i = (self._cursor + step) % count
            if slots[i][1] == nbytes and _free(slots, i):
                slot = slots[i]
                slot[2] = None
                self._cursor = i + 1
                self.reused += 1
                return slot[0]
        if count:
            self._cursor = (self._cursor + scan) % count  # the next take looks further on
        over = self._held + nbytes - self.max_bytes
        if over > 0:
            if nbytes > self.max_bytes or not self._room(nbytes, over):
                return None  # keep what is kept: it may serve the next reply
            self._drop_free(lambda slot: slot[1] != nbytes, over)
        buffer = self.make(nbytes)
        self.made += 1
        self._held += nbytes
        slots.append([buffer, nbytes, None])
        return buffer

    def _room(self, nbytes: int, over: int) -> bool:
        """Do free buffers of sizes other than ``nbytes`` add up to ``over`` bytes among
        the oldest ``_SCAN_ROOM``?  (Bounded: a pool at its bound, every buffer held by a
        stored item, costs a take no more than that look.)"""
        slots, found = self._slots, 0
        for i in range(min(len(slots), _SCAN_ROOM)):
            if slots[i][1] != nbytes and _free(slots, i):
                found += slots[i][1]
                if found >= over:
                    return True
        return False

    def trim(self) -> int:
        """Let go of the buffers free for ``idle`` seconds or more; returns their bytes.

        A buffer is seen free at one call and let go at the first call ``idle``
        seconds later: called every ``idle / 4`` seconds, a buffer goes back to the
        system between ``idle`` and ``1.25 * idle`` after it was last used."""
        with self._lock:
            now = self._last_trim = self.clock()
            slots = self._slots
            for i in range(len(slots)):
                slot = slots[i]
                if not _free(slots, i):
                    slot[2] = None
                elif slot[2] is None:
                    slot[2] = now
            return self._drop_free(lambda slot: slot[2] is not None and now - slot[2] >= self.idle)

    def maybe_trim(self) -> None:
        """:meth:`trim`, if ``idle / 4`` seconds have passed since the last one (cheap
        enough to call before every request)."""
        if self.clock() - self._last_trim >= self.idle / 4:
            self.trim()

    def clear(self) -> None:
        """Forget every buffer: what nothing else holds is freed now."""
        with self._lock:
            self._slots = []
            self._held = 0
            self._cursor = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept, in use or free."""
        return self._held

    @property
    def free_bytes(self) -> int:
        """Bytes of kept buffers that nothing else refers to now."""
        with self._lock:
            slots = self._slots
            return sum(slots[i][1] for i in range(len(slots)) if _free(slots, i))

    def _drop_free(self, which: Callable[[list], bool], enough: float = float("inf")) -> int:
        """Let go of free buffers ``which`` picks, oldest first, until ``enough`` bytes
        are gone; returns their bytes (the caller holds the lock)."""
        slots, keep, dropped = self._slots, [], 0
        for i in range(len(slots)):
            slot = slots[i]
            if dropped < enough and which(slot) and _free(slots, i):
                dropped += slot[1]
            else:
                keep.append(slot)
        if dropped:
            self._slots = keep
            self._held -= dropped
            self._cursor = 0
        return dropped


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a size buffers are made in: a multiple of 1 MiB, or of
    an eighth of the power of two below it for large sizes (at most 12.5% more), so
    that payloads whose size varies a little share buffers."""
    step = max(1 << 20, 1 << max(nbytes.bit_length() - 4, 0))
    return -(-nbytes // step) * step
