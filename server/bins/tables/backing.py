"""Where a table's column bytes live: ordinary memory or memory-mapped files.

A backing hands out one uint8 array of shape ``[capacity, row_bytes]`` per column;
the table gathers and scatters whole rows in it and never cares which kind it got.

:class:`MemmapBacking` lays the files out as tensordict does: one raw file per
column, ``<directory>/<column>.memmap``, rows contiguous, exactly the column's bytes
(a ``[capacity, *shape]`` tensor of its dtype).  With a ``meta.json`` from
:func:`tensordict_metadata` beside them, ``TensorDict.load_memmap(directory)`` opens
the table's columns (rows never written read as zeros).
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

from tensorshare.disk.tables import table_metadata

from .columns import ColumnSpec


class Backing(Protocol):
    """Allocates the column arrays of one table."""

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        """A writable uint8 array of shape ``[capacity, spec.row_bytes]``."""

    def close(self) -> None:
        """The table is gone: let go of what :meth:`allocate` gave."""


class MemoryBacking:
    """Columns in ordinary memory.  ``numpy.zeros`` maps fresh pages lazily, so a large
    table costs memory only as its rows are written."""

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        return np.zeros((capacity, spec.row_bytes), np.uint8)

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

    def path(self, column: str) -> str:
        return os.path.join(self.directory, f"{column}.memmap")

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        shape = (capacity, spec.row_bytes)
        if capacity * spec.row_bytes == 0:  # mmap cannot map an empty file
            return np.zeros(shape, np.uint8)
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(spec.name)
        array = np.memmap(path, np.uint8, "r+" if self.reopen else "w+", shape=shape)
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
            array = np.memmap(path, dtype, "r+", shape=(capacity,))
        else:
            array = np.memmap(path, dtype, "w+", shape=(capacity,))
            array[:] = fill
        self.paths.append(path)
        return array

    def close(self) -> None:
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


def tensordict_metadata(columns: Sequence[ColumnSpec], capacity: int) -> dict:
    """The ``meta.json`` content that lets ``TensorDict.load_memmap`` open the files of a
    :class:`MemmapBacking`: one tensor ``[capacity, *shape]`` per column, batch size
    ``[capacity]``."""
    return table_metadata(columns, capacity)
