"""Where a table's column bytes live: ordinary memory or memory-mapped files.

A backing hands out one uint8 array of shape ``[capacity, row_bytes]`` per column;
the table gathers and scatters whole rows in it and never cares which kind it got.

:class:`MemmapBacking` lays the files out as tensordict does: one raw file per
column, ``<directory>/<column>.memmap``, rows contiguous, exactly the column's bytes
(a ``[capacity, *shape]`` tensor of its dtype).  With a ``meta.json`` from
:func:`tensordict_metadata` beside them, ``TensorDict.load_memmap(directory)`` opens
the table's columns (rows never written read as zeros).

Every file is given its blocks when it is made (``posix_fallocate``), not when a page
of its mapping is first written: a store into a mapped page the file system has no
room for is a SIGBUS that kills the server, while a reservation that finds no room
is an ``OSError`` (ENOSPC) the caller turns into a refusal (452).
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

from tensorshare.disk.tables import table_metadata

from .columns import ColumnSpec
from .journal import Journal


class Backing(Protocol):
    """Allocates the column arrays of one table."""

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        """A writable uint8 array of shape ``[capacity, spec.row_bytes]``."""

    def item_slots(self, capacity: int) -> list:
        """The ``capacity`` slots (None: empty) of a table of items, which has no columns."""

    def close(self) -> None:
        """The table is gone: let go of what :meth:`allocate` gave."""

    # ``journal``: a durable backing's :class:`~.journal.Journal` (None: changes need none)


class MemoryBacking:
    """Columns in ordinary memory.  ``numpy.zeros`` maps fresh pages lazily, so a large
    table costs memory only as its rows are written."""

    journal = None

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        return np.zeros((capacity, spec.row_bytes), np.uint8)

    def item_slots(self, capacity: int) -> list:
        return [None] * capacity

    def close(self) -> None:
        pass


class MemmapBacking:
    """Columns in files ``<directory>/<column>.memmap`` mapped into memory.

    ``keep=False`` (spill: the files are only memory the kernel may page out) deletes
    the files on :meth:`close`; ``keep=True`` (a durable table) leaves them.  With
    ``reopen=True`` files already there are mapped as they are (their size must be
    the column's), instead of being created empty.
    """

    def __init__(self, directory: str, keep: bool = False, reopen: bool = False):
        self.directory = directory
        self.keep = keep
        self.reopen = reopen
        self.paths: list[str] = []
        # a durable table's changes that replace rows are recorded first (see .journal)
        self.journal = Journal(os.path.join(directory, "_slots", "journal.bin")) if keep else None

    item_slots = MemoryBacking.item_slots  # items are never in files

    def path(self, column: str) -> str:
        return os.path.join(self.directory, f"{column}.memmap")

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        shape = (capacity, spec.row_bytes)
        if capacity * spec.row_bytes == 0:  # mmap cannot map an empty file
            return np.zeros(shape, np.uint8)
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(spec.name)
        array = _mapped(path, np.uint8, shape, create=not self.reopen)
        self.paths.append(path)
        return array

    def state_array(self, name: str, dtype, capacity: int, fill) -> np.ndarray:
        """A per-slot state array of the table (keys, priorities, sample counts) in
        ``<directory>/_slots/<name>.bin``, so that a reopened table finds its rows
        (tensordict's ``load_memmap`` ignores the directory)."""
        directory = os.path.join(self.directory, "_slots")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{name}.bin")
        if self.reopen and os.path.exists(path):
            array = _mapped(path, dtype, (capacity,), create=False)
        else:
            array = _mapped(path, dtype, (capacity,), create=True)
            array[:] = fill
        self.paths.append(path)
        return array

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        if not self.keep:
            for path in self.paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(os.path.join(self.directory, "_slots"))
            except OSError:
                pass
        self.paths = []


def _mapped(path: str, dtype, shape: tuple, create: bool) -> np.ndarray:
    """A shared mapping of the file ``path`` as an array of ``shape``, its blocks
    reserved first (see the module docstring).  ``create``: a new file (one already
    there is replaced), removed again if its blocks cannot be had; else the file must
    be there, and a reopened one too has all its blocks before it is mapped (one
    written by an older server may be sparse)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if create else os.O_RDWR
    fd = os.open(path, flags, 0o600)
    try:
        size = os.fstat(fd).st_size
        if not create and size != nbytes:
            raise ValueError(f"{path}: {size} bytes, not the {nbytes} its array needs")
        os.posix_fallocate(fd, 0, nbytes)
        return np.memmap(path, dtype, "r+", shape=shape)
    except BaseException:
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def tensordict_metadata(columns: Sequence[ColumnSpec], capacity: int) -> dict:
    """The ``meta.json`` content that lets ``TensorDict.load_memmap`` open the files of a
    :class:`MemmapBacking`: one tensor ``[capacity, *shape]`` per column, batch size
    ``[capacity]``."""
    return table_metadata(columns, capacity)
