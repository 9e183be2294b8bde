"""Reused memory for receiving large payloads.

A payload received with ``recv()`` lands in a new ``bytes`` object per read: fresh
pages, which the kernel must fault in and zero before it copies a byte into them.
Where first touching memory is dear (a virtual machine, say), that halves the rate
at which a server can take a large PUT: 256 MiB arrived at 0.3-0.5 GB/s against
1.5 GB/s for the same socket read into memory already touched.

:class:`ChunkPool` keeps the chunks (``bytearray``, ``CHUNK`` bytes each) that large
payloads were read into, and hands a chunk out again once nothing refers to it any
more: the item it held was replaced, taken or deleted, and every reply that sent it
has been written.  Whether anything still refers to a chunk is read from its
reference count (CPython's), so there is no hook to forget: a stored item, a reply
waiting in a queue, a disk job writing it out, each holds a view of the chunk, and
the chunk stays theirs until the last view is gone.  A parameter vector put again
and again, the common case in reinforcement learning, is then received into the
memory of the version before last.

The pool is bounded: it tracks at most ``max_bytes`` of chunks (in use or free;
chunks past that are plain memory, freed as usual), and :meth:`ChunkPool.trim`
releases chunks that have been free for ``idle`` seconds, so a burst leaves no
lasting footprint.

:class:`PooledSink` is the frame decoder's sink that uses it: whole chunks of a
payload are read straight into pool memory (``recv_into``: no copy), and what does
not fill a whole chunk arrives as ``bytes``, as with
:class:`~tensorshare.wire.frames.SegmentSink`.  Stored segments are read-only views.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from tensorshare.wire.frames import SegmentSink

CHUNK = 1 << 20  # bytes per pooled chunk: payloads from this size on are received into the pool
IDLE = 10.0  # seconds a chunk may stay free in the pool before trim() lets it go
_SCAN = 64  # most tracked chunks one take() looks at for a free one


def _refs(slots: list, i: int) -> int:
    return sys.getrefcount(slots[i][0])


# What _refs() says of a chunk that only its slot refers to (the slot's list, plus
# what the call itself adds, which differs between Python versions).
_FREE_REFS = _refs([[bytearray(0), None]], 0)


def _only_pool_holds(slots: list, i: int) -> bool:
    return _refs(slots, i) == _FREE_REFS


class ChunkPool:
    """Chunks of ``chunk`` bytes for receiving payloads into, reused once free."""

    def __init__(self, max_bytes: int, idle: float = IDLE, chunk: int = CHUNK,
                 clock: Callable[[], float] = time.monotonic):
        if max_bytes < 0 or chunk < 1:
            raise ValueError("max_bytes must be 0 or more, chunk 1 or more")
        self.chunk = chunk
        self.max_slots = max_bytes // chunk
        self.idle = idle
        self.clock = clock
        self._slots: list[list] = []  # [chunk, free since (clock) or None]
        self._cursor = 0  # where the next take() starts looking
        self.reused = 0  # chunks handed out again (statistics, tests)
        self.made = 0  # chunks allocated

    def take(self) -> bytearray:
        """A chunk to receive into: a free tracked one, else a new one."""
        slots = self._slots
        count = len(slots)
        scan = min(count, _SCAN)
        for step in range(scan):
            i = (self._cursor + step) % count
            if _only_pool_holds(slots, i):
                slot = slots[i]
                slot[1] = None
                self._cursor = i + 1
                self.reused += 1
                return slot[0]
        if count:
            self._cursor = (self._cursor + scan) % count  # the next take looks further on
        chunk = bytearray(self.chunk)
        self.made += 1
        if count < self.max_slots:
            slots.append([chunk, None])
        return chunk

    def trim(self) -> int:
        """Release the chunks free for ``idle`` seconds or more; returns the bytes released.

        A chunk is seen free at one call and released at a later one, so call this
        every ``idle / 2`` seconds or so."""
        now = self.clock()
        slots, keep = self._slots, []
        for i in range(len(slots)):
            slot = slots[i]
            if not _only_pool_holds(slots, i):
                slot[1] = None
            elif slot[1] is None:
                slot[1] = now
            elif now - slot[1] >= self.idle:
                continue
            keep.append(slot)
        released = (len(slots) - len(keep)) * self.chunk
        self._slots = keep
        self._cursor = 0
        return released

    @property
    def tracked_bytes(self) -> int:
        """Bytes of the chunks the pool tracks, in use or free."""
        return len(self._slots) * self.chunk

    @property
    def free_bytes(self) -> int:
        """Bytes of tracked chunks that nothing else refers to now."""
        slots = self._slots
        return self.chunk * sum(1 for i in range(len(slots)) if _only_pool_holds(slots, i))


class PooledSink(SegmentSink):
    """A payload sink that lends pool chunks to read whole chunks of the payload into.

    The frame decoder calls :meth:`get_buffer`/:meth:`buffer_updated` for reads into
    lent memory and :meth:`write` for bytes that were read the usual way (a read
    that held the frame's header too, and the payload's tail); segments stay in the
    payload's order either way.
    """

    def __init__(self, nbytes: int, pool: ChunkPool):
        super().__init__(nbytes)
        self._pool = pool
        self._left = nbytes  # payload bytes not received yet
        self._chunk: bytearray | None = None  # the chunk being filled
        self._view: memoryview | None = None
        self._filled = 0

    def get_buffer(self) -> memoryview | None:
        """The free part of the chunk being filled (a new one if a whole chunk of the
        payload is still to come), or None: read the rest the usual way."""
        if self._chunk is None:
            if self._left < self._pool.chunk:
                return None
            self._flush_small()  # bytes written before the chunk come before it
            self._chunk = self._pool.take()
            self._view = memoryview(self._chunk)
            self._filled = 0
        return self._view[self._filled :]

    def buffer_updated(self, n: int) -> None:
        self._filled += n
        self._left -= n
        if self._filled == len(self._chunk):
            self.segments.append(self._view.toreadonly())
            self._chunk = self._view = None

    def write(self, data) -> None:
        n = len(data)
        if self._chunk is not None:  # a chunk is half full: these bytes continue it
            room = min(n, len(self._chunk) - self._filled)
            self._view[self._filled : self._filled + room] = data[:room]
            self.buffer_updated(room)
            if room < n:
                self.write(memoryview(data)[room:])
            return
        self._left -= n
        super().write(data)

    def _flush_small(self) -> None:
        if self._small:
            self.segments.append(bytes(self._small))
            self._small.clear()
