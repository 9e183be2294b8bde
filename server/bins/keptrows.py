"""Table rows a same-host writer sends again and again through the same files.

A writer that inserts through shared memory (PROTOCOL.md §10.4) writes each batch
into an item directory of its incoming directory, and once the insert is answered
writes its next batch of the same columns into the same files.  The first insert
naming a directory checks it as an adopted item is checked
(:meth:`~.shm.ShmArea.take_rows`); :class:`KeptRows` then keeps its array files
open and mapped, so that the next inserts naming it cost a ``fstat`` a file instead
of a walk of the directory, its record read and a lease taken on each file.

The mapped bytes stay the writer's: it may cut a file short at any time, and a
load from a page past the end of a mapped file is a SIGBUS that ends the server.
So they are handed on as :class:`MappedRows`, which only system calls read
(``pwritev`` into a table's files: there the kernel's copy fails with EFAULT, an
error the insert answers with 451).  A table that would copy rows with loads of its
own (in memory, or a durable table's journal) gets them copied out first, with
``preadv`` (:meth:`KeptRows.copied`).
"""

from __future__ import annotations

import mmap
import os
import stat
from collections import OrderedDict
from typing import Callable

import numpy as np

from tensorshare.disk.files import read_all

from ..malloc import heap_temporaries
from .tables.columns import MappedRows

MAX_ITEMS = 8  # directories kept per connection (a writer reuses one per kind of batch)
MAX_BYTES = 256 << 20  # the most bytes of array files kept per connection; a larger item is checked each time


class _Kept:
    """One kept directory: its description, payload size, and per array file a
    descriptor, its length and the bytes mapped (read-only)."""

    def __init__(self, description: bytes, nbytes: int, files: list[tuple[int, int, np.ndarray]]):
        self.description, self.nbytes, self.files = description, nbytes, files

    def intact(self) -> bool:
        """Whether every file still has its length and a name (its writer did not
        cut it short, or remove the directory to write another)."""
        for fd, length, _mapped in self.files:
            st = os.fstat(fd)
            if st.st_size != length or st.st_nlink != 1:
                return False
        return True

    def close(self) -> None:
        for fd, _length, _mapped in self.files:
            os.close(fd)
        self.files = []  # (the mappings go with the last array viewing them)


class KeptRows:
    """The item directories one connection's client writes rows into again (see the
    module docstring), at most :data:`MAX_ITEMS` of them and :data:`MAX_BYTES`,
    the least recently used let go first.  Used on the reactor's thread only."""

    def __init__(self, max_items: int = MAX_ITEMS, max_bytes: int = MAX_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0

    def arrays(self, name: str, description: bytes, nbytes: int, check: Callable[[], list[tuple[int, str]]],
               mapped: bool) -> list[np.ndarray]:
        """The arrays of the directory ``name`` (one uint8 array a file, in payload
        order): :class:`MappedRows` if ``mapped``, else copies.  ``check()`` checks a
        directory not kept (or changed since) and returns ``[(length, path)]`` of its
        array files, raising what refuses it; a file cut short while it is read is
        ``ValueError``."""
        kept = self._kept.get(name)
        if kept is not None:
            self._kept.move_to_end(name)
            if kept.description != description or kept.nbytes != nbytes or not kept.intact():
                self._drop(name)
                kept = None
        if kept is None:
            kept = self._open(name, description, nbytes, check())
        try:
            if mapped:
                return [mapped_bytes.view(MappedRows) for _fd, _length, mapped_bytes in kept.files]
            return self.copied(kept)
        finally:
            if self._kept.get(name) is not kept:  # (too large to keep: its mappings live on in the arrays)
                kept.close()

    def _open(self, name: str, description: bytes, nbytes: int, files: list[tuple[int, str]]) -> _Kept:
        opened: list[tuple[int, int, np.ndarray]] = []
        try:
            for length, path in files:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                opened.append((fd, length, _EMPTY))
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != length or st.st_nlink != 1:
                    raise ValueError(f"{path} is not a regular file of exactly {length} bytes and one link")
                if length:
                    opened[-1] = (fd, length, np.frombuffer(mmap.mmap(fd, length, prot=mmap.PROT_READ), np.uint8))
        except BaseException:
            for fd, _length, _mapped in opened:
                os.close(fd)
            raise
        kept = _Kept(description, nbytes, opened)
        size = sum(length for _fd, length, _mapped in opened)
        if size <= self.max_bytes:
            self._kept[name] = kept
            self._bytes += size
            while len(self._kept) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._kept)))
        return kept

    @staticmethod
    def copied(kept: _Kept) -> list[np.ndarray]:
        """The kept directory's arrays read into memory with ``preadv`` (the kernel
        copying: a file cut short meanwhile is ``ValueError``, never a fault)."""
        with heap_temporaries():  # (pages used before: no fault and zeroing per page, see server/malloc.py)
            buffer = np.empty(sum(length for _fd, length, _mapped in kept.files), np.uint8)
        arrays, at = [], 0
        for fd, length, _mapped in kept.files:
            array = buffer[at:at + length]
            read_all(fd, array)
            arrays.append(array)
            at += length
        return arrays

    def _drop(self, name: str) -> None:
        kept = self._kept.pop(name)
        self._bytes -= sum(length for _fd, length, _mapped in kept.files)
        kept.close()

    def close(self) -> None:
        """The connection is gone: let every file go."""
        for name in list(self._kept):
            self._drop(name)


_EMPTY = np.zeros(0, np.uint8)
