"""Rows of wide file-backed columns read with ``preadv``: all of them asked of the
kernel at once, then copied out one after the other.

A row of a page or more (a 4x84x84 observation: 28 KB) is read from its column's
file, not gathered through the mapping.  Each row is first read with
``RWF_NOWAIT``, which copies a row the page cache holds and, for one it does not,
starts its read and says so (``EAGAIN`` or a short count; 12 us a call here), so
every missing row is on its way to the disk before the first is waited for; the
rows still missing are then read in turn, each finding its read under way.  Where
the kernel or the file system lacks ``RWF_NOWAIT`` they are read by up to
:data:`MAX_THREADS` threads instead (made on first need; the GIL is let go during
``preadv``), so that as many reads are in flight as the benchmark's baseline keeps.

Measured on this 2-core virtual machine (256 random rows of 28,224 bytes, evicted
from the page cache): from a 2 GB file, 8.8-9.4 ms this way, 8.1-9.2 ms for 16
threads of plain ``preadv``; in a server sampling a 47 GB table (5 rounds on one
fill, each after 12 reads of 16 threads of ``preadv``), 0.273-0.307 GB/s and
12.5-15 ms of the server's CPU a sample this way, 0.193-0.272 GB/s and 17.5-24 ms
with every missing row read by 16 threads (likely their hand-offs of the GIL:
CPU the 2 cores did not have), 0.267-0.315 GB/s and 11.7-16.7 ms gathering through the
mapping after ``MADV_WILLNEED`` hints (:mod:`.readahead`).  The files are
``POSIX_FADV_RANDOM``: a read asks for its row's pages only.  Unlike a fault on a
mapping, a read that fails (a disk error, a file cut short) is an ``OSError`` the
table answers with a reply code, not a SIGBUS that kills the server.

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
    """Reads rows of column files (see the module docstring).  ``cached_first=False``:
    every row is read by up to ``threads`` threads, as where the kernel or the file
    system lacks ``RWF_NOWAIT``; :meth:`close` stops them."""

    def __init__(self, threads: int = MAX_THREADS, cached_first: bool = True):
        self.threads = threads
        self.from_disk = 0  # rows the page cache did not hold when asked
        self._pool: ThreadPoolExecutor | None = None
        self._nowait = getattr(os, "RWF_NOWAIT", 0) if cached_first else 0

    def read(self, files: Sequence[tuple[int, np.ndarray]], slots: np.ndarray) -> None:
        """Row ``slots[i]`` of each file into row ``i`` of its array: ``files`` are
        ``(descriptor, out)`` pairs, ``out`` a C-contiguous uint8 ``[slots.size,
        row_bytes]`` array, the file ``row_bytes`` wide.  ``OSError`` if a read fails
        or a file ends before a row does (the arrays then hold some rows)."""
        rows = slots.tolist()
        missing = []  # (descriptor, what is left of a row's buffer, its offset in the file)
        for fd, out in files:
            width = out.shape[1]
            flat = memoryview(out).cast("B")
            for i, slot in enumerate(rows):
                view, offset = flat[i * width:(i + 1) * width], slot * width
                got = self._cached(fd, view, offset) if self._nowait else 0
                if got < width:
                    missing.append((fd, view[got:], offset + got))
        if not missing:
            return
        self.from_disk += len(missing)
        if self._nowait or len(missing) == 1:  # (their reads are under way: each is waited for in turn)
            _read_all(missing)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="table-reads")
        shares = min(self.threads, len(missing))
        for _ in self._pool.map(_read_all, [missing[k::shares] for k in range(shares)]):
            pass  # (raises the first share's error)

    def close(self) -> None:
        """No more reads: the threads stop (once they finish the reads under way)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _cached(self, fd: int, view: memoryview, offset: int) -> int:
        """The bytes of ``view`` read from the page cache at ``offset`` (0: none there;
        the kernel starts reading the rest)."""
        try:
            return os.preadv(fd, [view], offset, self._nowait)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            self._nowait = 0  # (a file system without it: the threads read the rows)
            return 0


def _read_all(parts: list[tuple[int, memoryview, int]]) -> None:
    """Each ``(descriptor, buffer, offset)``: the buffer filled from the file at the offset."""
    for fd, view, offset in parts:
        while view.nbytes:
            got = os.preadv(fd, [view], offset)
            if not got:
                raise OSError(errno.EIO, f"the table's file ends at byte {offset}, within a row (cut short?)")
            view, offset = view[got:], offset + got
