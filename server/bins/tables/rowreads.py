"""Rows of wide file-backed columns read with ``preadv``: those in the page cache at
once, on the calling thread, and the others from the disk by a few threads at once.

A row of a page or more (a 4x84x84 observation: 28 KB) is read from its column's
file, not gathered through the mapping.  While reads find their rows in the page
cache, the calling thread reads each row with ``RWF_NOWAIT``, which copies a row the
page cache holds and otherwise starts its read and says so (``EAGAIN`` or a short
count); the rows still missing are then read by up to :data:`MAX_THREADS` threads,
each waiting on its share of the disk's queue (the GIL is let go during ``preadv``).
Once a read found most of its rows missing, the next one hands every row to the
threads at once (each tries the page cache first too, which tells the next read
which way to go): started one after the other on the calling thread, the rows'
reads took a third of a server's time in a sample of an evicted 47 GB table.

Measured here (virtio disk; 256 random rows of 28,224 bytes from a 2 GB file
evicted from the page cache, medians of 7): 16 threads of plain ``preadv`` 8.1-9.1
ms, these reads 8.4-9.9 ms; on rows in the page cache 0.9 ms of the calling thread.
The files are ``POSIX_FADV_RANDOM``: each read asks for its row's pages only.
Unlike a fault on a mapping, a read that fails (a disk error, a file cut short) is
an ``OSError`` the table answers with a reply code, not a SIGBUS that kills the
server.

Narrower rows (an action, a reward) stay gathered through their mappings: a syscall
a row would cost more than their bytes (:mod:`.readahead` hints their pages while
those gathers fault).
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

WIDE_ROW = mmap.PAGESIZE  # rows of at least this many bytes are read with preadv
MAX_THREADS = 16  # as many reads in flight as the benchmark's baseline keeps (a disk's queue is deeper)


def wide(row_bytes: int) -> bool:
    """Whether a column of rows of ``row_bytes`` is read with :class:`RowReads`."""
    return row_bytes >= WIDE_ROW


def open_for_reads(path: str) -> int:
    """A descriptor of the column file ``path`` to read rows from: read at random (the
    kernel reads no more than each row's pages)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class RowReads:
    """Reads rows of column files (see the module docstring) with up to ``threads``
    threads, made at the first read the page cache cannot serve, stopped by
    :meth:`close`.  ``cached_first=False``: every row is read by the threads, and
    read there as the kernel gives it (as where it or the file system lacks
    ``RWF_NOWAIT``)."""

    def __init__(self, threads: int = MAX_THREADS, cached_first: bool = True):
        self.threads = threads
        self.from_disk = 0  # rows the page cache did not hold (read by the threads)
        self._pool: ThreadPoolExecutor | None = None
        self._nowait = getattr(os, "RWF_NOWAIT", 0) if cached_first else 0
        # The last read found most of its rows in the page cache: the calling thread
        # copies those first.  Else every row goes to the threads at once: asked for
        # on one thread, each row's read is started in turn (a third of a server's
        # time went there, 256 rows of an evicted 47 GB table).
        self._mostly_cached = True

    def read(self, files: Sequence[tuple[int, np.ndarray]], slots: np.ndarray) -> None:
        """Row ``slots[i]`` of each file into row ``i`` of its array: ``files`` are
        ``(descriptor, out)`` pairs, ``out`` a C-contiguous uint8 ``[slots.size,
        row_bytes]`` array, the file ``row_bytes`` wide.  ``OSError`` if a read fails
        or a file ends before a row does (the arrays then hold some rows)."""
        rows = slots.tolist()
        here = self._nowait if self._mostly_cached else 0
        todo = []  # (descriptor, what is left of a row's buffer, its offset in the file)
        for fd, out in files:
            width = out.shape[1]
            flat = memoryview(out).cast("B")
            for i, slot in enumerate(rows):
                view, offset = flat[i * width:(i + 1) * width], slot * width
                got = _cached(fd, view, offset) if here else 0
                if got < width:
                    todo.append((fd, view[got:], offset + got))
        if not todo:
            return
        nowait = 0 if here else self._nowait  # (rows already tried are read as they are)
        if len(todo) == 1:
            missed = _read_all(todo, nowait)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="table-reads")
            shares = min(self.threads, len(todo))
            missed = sum(self._pool.map(_read_all, [todo[k::shares] for k in range(shares)],
                                        [nowait] * shares))  # (raises the first share's error)
        self.from_disk += missed
        self._mostly_cached = 2 * missed < len(rows) * len(files)

    def close(self) -> None:
        """No more reads: the threads stop (once they finish the reads under way)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _cached(fd: int, view: memoryview, offset: int) -> int:
    """The bytes of ``view`` read from the page cache at ``offset`` (0: none there;
    the kernel starts reading the rest)."""
    try:
        return os.preadv(fd, [view], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:  # (a file system without it: every row is a miss)
            raise
        return 0


def _read_all(parts: list[tuple[int, memoryview, int]], nowait: int = 0) -> int:
    """Each ``(descriptor, buffer, offset)``: the buffer filled from the file at the
    offset (``nowait``: those in the page cache first, as :func:`_cached`).  Returns
    how many were not (all of them, without ``nowait``)."""
    missed = 0
    for fd, view, offset in parts:
        got = _cached(fd, view, offset) if nowait else 0
        if got < view.nbytes:
            missed += 1
            view, offset = view[got:], offset + got
        while view.nbytes:
            got = os.preadv(fd, [view], offset)
            if not got:
                raise OSError(errno.EIO, f"the table's file ends at byte {offset}, within a row (cut short?)")
            view, offset = view[got:], offset + got
    return missed
