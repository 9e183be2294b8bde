"""Large payloads received into reused memory.

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

:class:`PooledSink` is the frame decoder's sink that uses it: whole chunks of a
payload are read straight into pool memory (``recv_into``: no copy), and what does
not fill a whole chunk arrives as ``bytes``, as with
:class:`~tensorshare.wire.frames.SegmentSink`.  Stored segments are read-only views.
"""

from __future__ import annotations

from tensorshare.wire.recycle import Recycler
from tensorshare.wire.frames import SegmentSink

CHUNK = 1 << 20  # bytes per pooled chunk: payloads from this size on are received into the pool


def chunk_pool(max_bytes: int, idle: float) -> Recycler | None:
    """The receive pool for a bound of ``max_bytes`` (None when that is under a chunk)."""
    return Recycler(max_bytes, bytearray, idle) if max_bytes >= CHUNK else None


class PooledSink(SegmentSink):
    """A payload sink that lends pool chunks to read whole chunks of the payload into.

    The frame decoder calls :meth:`get_buffer`/:meth:`buffer_updated` for reads into
    lent memory and :meth:`write` for bytes that were read the usual way (a read
    that held the frame's header too, and the payload's tail); segments stay in the
    payload's order either way.
    """

    def __init__(self, nbytes: int, pool: Recycler, chunk: int = CHUNK):
        super().__init__(nbytes)
        self._pool = pool
        self._size = chunk
        self._left = nbytes  # payload bytes not received yet
        self._chunk: bytearray | None = None  # the chunk being filled
        self._view: memoryview | None = None
        self._filled = 0

    def get_buffer(self) -> memoryview | None:
        """The free part of the chunk being filled (a new one if a whole chunk of the
        payload is still to come), or None: read the rest the usual way."""
        if self._chunk is None:
            if self._left < self._size:
                return None
            chunk = self._pool.take(self._size)
            if chunk is None:  # the pool is at its bound and all in use
                return None
            self._flush_small()  # bytes written before the chunk come before it
            self._chunk = chunk
            self._view = memoryview(chunk)
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
