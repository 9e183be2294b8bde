"""Gathers from memory-mapped column files at the disk's speed: the kernel is told
which rows a gather is about to read, and only when it helps.

A row of a file-backed column that is not in the page cache faults in on first
touch.  Measured here (virtio disk with ``read_ahead_kb`` 8192; 256 random rows of
28,232 bytes from a 2.8 GB column evicted from the page cache, medians of 5):

* a plain gather (``numpy.take``): 998 ms -- each fault reads up to 8 MB around it;
* with ``MADV_RANDOM`` on the mapping: 178 ms -- no read-around, but one 4 KiB
  page per fault, one fault at a time;
* ``MADV_WILLNEED`` on each row's pages, then the gather: 13 ms (550 MB/s) -- the
  kernel reads every row at once, as 16 threads of ``preadv`` do (12 ms, 588 MB/s;
  one thread of them: 31 ms);
* on rows already in the page cache the hints cost 256 ``madvise`` calls (0.96 ms
  against 0.67 ms for the gather alone).

So a column mapping gets ``MADV_RANDOM`` once, and :class:`ReadAhead` hints the
rows an operation is about to read, in every narrow column and per-row state file
(one ``madvise`` per run of consecutive slots), while gathers are slow, that is, while
they fault pages in from the disk: a gather that takes longer than rows in memory
would turns hinting on; while on, one operation in ``probe`` goes without hints,
and turns them off if its gathers were fast (else ``probe`` doubles, up to
:data:`MAX_PROBE`).  The kernel's own paths, no threads: the gather runs where it
did, and waits for the disk in parallel instead of in turn.

Rows of a page or more are not gathered through the mappings at all but read from
the files (:mod:`.rowreads`), as fast, and a read that fails is an error the table
answers instead of a SIGBUS.
"""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np

from .rows import take_rows

PAGE = mmap.PAGESIZE
# (Linux 5.14; Python's mmap names it from 3.12 on)
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
MAX_PROBE = 1024
# A gather slower than this from memory is faulting pages in: a few us a row and a
# few GB/s (the cached gathers measured here: 2.6 us a row of 28 KB, 0.04 us a row of 64 B).
SLOW_SECONDS_PER_ROW = 5e-6
SLOW_SECONDS_PER_BYTE = 1 / 4e9


def random_access(array: np.ndarray) -> None:
    """Tell the kernel the mapping under ``array`` (a ``numpy.memmap``) is read at random."""
    mapping = getattr(array, "_mmap", None)
    if mapping is not None and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)


class WrittenPages:
    """Maps a column's pages into its mapping once rows are written there with
    ``pwritev`` (``MADV_POPULATE_READ``), so that the first gathers after the
    writes do not fault.

    A write with ``pwritev`` puts the rows in the page cache but not in the
    mapping's page tables: each page's first touch by a gather is then a fault,
    8-10 us on this virtual machine (768 random bytes of a 2 GiB file just
    written: 6.5 ms and 651 faults, 0.18 ms once its pages were mapped; a
    prioritized sample of 256 reads two columns and the state).  Mapping a
    MiB just written costs about 0.05 ms (a fourth of its ``pwrite``), and
    costs as much again for pages already mapped, so each page is mapped once:
    a ring buffer's later laps, which overwrite pages mapped by the first, pay
    nothing (a byte of memory per 4 KiB page of the column tells which).  Pages
    the kernel later takes back fault again, as before.  Where the kernel lacks
    the advice (before Linux 5.14), or refuses it, nothing more is asked.
    """

    def __init__(self, mapping: mmap.mmap):
        self.mapping = mapping
        self._mapped = np.zeros(-(-len(mapping) // PAGE), bool)
        self.on = POPULATE_READ is not None

    def written(self, first: int, stop: int) -> None:
        """Bytes ``[first, stop)`` of the column's file were just written."""
        if not self.on or stop <= first:
            return
        low, high = first // PAGE, -(-stop // PAGE)
        if self._mapped[low:high].all():
            return
        try:
            self.mapping.madvise(POPULATE_READ, low * PAGE, (high - low) * PAGE)
        except (OSError, ValueError):
            self.on = False  # (an old kernel; a file cut short is for the gathers to find)
            return
        self._mapped[low:high] = True


class ReadAhead:
    """Gathers rows of mapped columns, hinting the rows first while that pays (see the module docstring)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.hinting = False
        self.probe = 16
        self._since_probe = 0
        self._hinted = False  # the operation under way had its rows hinted
        self._probing = False

    def begin(self, slots: np.ndarray, arrays) -> None:
        """An operation is about to read the rows ``slots`` of ``arrays`` (mapped
        arrays, a row each along their first dimension): hint them, if hinting."""
        self._hinted = self._probing = False
        if not self.hinting:
            return
        self._since_probe += 1
        if self._since_probe >= self.probe:
            self._probing, self._since_probe = True, 0
            return
        for array in arrays:
            mapping = getattr(array, "_mmap", None)
            if mapping is not None:
                hint(mapping, slots, array.strides[0])
        self._hinted = True

    def gather(self, column: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
        start = self.clock()
        take_rows(column, slots, out)
        if self._hinted or getattr(column, "_mmap", None) is None:
            return
        slow = self.clock() - start > slots.size * SLOW_SECONDS_PER_ROW + out.nbytes * SLOW_SECONDS_PER_BYTE
        if self._probing:
            self._probing = False
            if slow:
                self.probe = min(2 * self.probe, MAX_PROBE)
            else:
                self.hinting, self.probe = False, 16
        elif slow and not self.hinting:
            self.hinting, self._since_probe = True, 0


def hint(mapping: mmap.mmap, slots: np.ndarray, row_bytes: int) -> None:
    """Ask the kernel to read the rows ``slots`` of a mapped ``[rows, row_bytes]``
    column now (``MADV_WILLNEED``), one call per run of consecutive slots."""
    if not row_bytes or not slots.size:
        return
    rows = np.unique(slots)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    firsts = rows[np.concatenate(([0], breaks))] * row_bytes
    stops = (rows[np.concatenate((breaks - 1, [rows.size - 1]))] + 1) * row_bytes
    for first, stop in zip(firsts.tolist(), stops.tolist()):
        aligned = first - first % PAGE
        mapping.madvise(mmap.MADV_WILLNEED, aligned, stop - aligned)
