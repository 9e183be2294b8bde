"""Payloads received into reused memory.

A payload received with ``recv()`` lands in a new ``bytes`` object per read: fresh
pages, which the kernel must fault in and zero before it copies a byte into them.
Where first touching memory is dear (a virtual machine, say), that costs a large
put most of its rate (docs/design.md).

So the server keeps the chunks (``bytearray``, ``CHUNK`` bytes each) that large
payloads were read into in a :class:`~tensorshare.wire.recycle.Recycler`, which hands a
chunk out again once nothing refers to it any more: the item it held was replaced,
taken, deleted or spilled, and every reply that sent it has been written.  A
parameter vector put again and again, the common case in reinforcement learning,
is then received into the memory of the version before last.  The pool is bounded
(``--recv-pool``; past it, payloads are read the usual way) and lets go of chunks
free for ``--recv-pool-idle`` seconds.

:class:`PooledSink` is the frame decoder's sink that uses it: a payload is read
straight into pool memory (``recv_into``: no copy), from ``POOLED_MIN`` on: an item's
in whole chunks and then one buffer of exactly what is left, a table's rows
(``Payload.ROWS``) in one buffer of their size, which the table reads in place; the
bytes that came in the same read as the frame's header are copied into the first
buffer.  A payload of a few hundred KiB took three copies into fresh pages before
(docs/design.md, "Memory").  Smaller payloads, and what is left
when the pool is at its bound, arrive as ``bytes``, as with
:class:`~tensorshare.wire.frames.SegmentSink`.  Stored segments are read-only views.
"""

from __future__ import annotations

from tensorshare.protocol.schema import Payload
from tensorshare.wire.recycle import Recycler
from tensorshare.wire.frames import SegmentSink

CHUNK = 1 << 20  # bytes per pooled chunk
POOLED_MIN = 64 << 10  # payloads from this size on are received into the pool (smaller: a read or two)


def chunk_pool(max_bytes: int, idle: float) -> Recycler | None:
    """The receive pool for a bound of ``max_bytes`` (None when that is under a chunk)."""
    return Recycler(max_bytes, bytearray, idle) if max_bytes >= CHUNK else None


def payload_sink(kind: str, nbytes: int, pool: Recycler | None) -> SegmentSink:
    """Where a payload of ``nbytes`` of a verb's ``kind`` (``Command.payload``) is
    received: a table's rows into one pool buffer, where the table views its columns
    in place; an item's in whole chunks; small ones (or with no pool) as they come."""
    if pool is None or nbytes < POOLED_MIN:
        return SegmentSink(nbytes)
    return PooledSink(nbytes, pool, nbytes if kind == Payload.ROWS else CHUNK)


class PooledSink(SegmentSink):
    """A payload sink that lends pool buffers to read the payload into.

    The frame decoder calls :meth:`get_buffer`/:meth:`buffer_updated` for reads into
    lent memory and :meth:`write` for bytes that were read the usual way (a read
    that held the frame's header too, a tail under ``POOLED_MIN``); segments stay in
    the payload's order either way.
    """

    def __init__(self, nbytes: int, pool: Recycler, chunk: int = CHUNK):
        super().__init__(nbytes)
        self._pool = pool
        self._size = chunk
        self._left = nbytes  # payload bytes not received yet
        self._chunk: bytearray | None = None  # the pool buffer being filled
        self._view: memoryview | None = None
        self._filled = 0

    def get_buffer(self) -> memoryview | None:
        """The free part of the buffer being filled (a new one if enough of the payload
        is still to come: :meth:`_start`), or None: read the rest the usual way."""
        if self._chunk is None and not self._start():
            return None
        return self._view[self._filled :]

    def buffer_updated(self, n: int) -> None:
        self._filled += n
        self._left -= n
        if self._filled == len(self._chunk):
            self.segments.append(self._view.toreadonly())
            self._chunk = self._view = None

    def write(self, data) -> None:
        n = len(data)
        if self._chunk is None and not self._start():
            self._left -= n
            super().write(data)
            return
        room = min(n, len(self._chunk) - self._filled)  # these bytes continue the buffer
        self._view[self._filled : self._filled + room] = data[:room]
        self.buffer_updated(room)
        if room < n:
            self.write(memoryview(data)[room:])

    def _start(self) -> bool:
        """Take the next buffer from the pool: a whole chunk while one is still to
        come, else one of exactly the rest when that is ``POOLED_MIN`` or more.
        False when there is none to take (too little left, or the pool is at its
        bound and all in use)."""
        left = self._left
        size = self._size if left >= self._size else left if left >= POOLED_MIN else 0
        chunk = self._pool.take(size) if size else None
        if chunk is None:
            return False
        self._flush_small()  # bytes written before the buffer come before it
        self._chunk = chunk
        self._view = memoryview(chunk)
        self._filled = 0
        return True

    def _flush_small(self) -> None:
        if self._small:
            self.segments.append(bytes(self._small))
            self._small.clear()
