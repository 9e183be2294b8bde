"""A durable table's redo record: a change that replaces rows is all or nothing across a kill.

A durable table's rows are changed in place through shared mappings, so every
state of its files between the first and the last store of a change is what a
restart finds after a kill -9 (the page cache keeps what the killed process
wrote).  A change that only fills empty slots is safe by its order (bytes first,
keys last: a kill leaves the slots empty, as they were).  A change that *replaces*
rows (a TWRITE over occupied slots, an insert that evicts) cannot be ordered so:
the old rows' keys and bytes go before the new ones are whole.

So such a change is written here first, whole, before the table's files are
touched: the new rows' bytes per column, their slots, keys and priorities, then
(last) a header that makes the record count.  Once the change is applied the
record is cleared (its header zeroed).  A restart that finds a whole record
applies it again (idempotent: the same bytes and state at the same slots); one
without its header is ignored (the table's files were not touched yet).

One file, ``_slots/journal.bin``: its header is kept mapped (set and cleared with
no system call), its body written with ``pwritev`` (the file opened for each
change: no descriptor is held per table).  Without ``fsync`` this protects against
the server process dying, as the rest of a durable table's files do.  With
``fsync`` (``--fsync``) it protects against a power loss too: the body is flushed,
then the header is set and flushed, before the table's files are touched, and the
cleared header is flushed once the change is in the files (so no record a later
change overtook comes back).

File layout (little-endian)::

    header (32 bytes): b"TSJ2", rows u64, body bytes u64, names bytes u32, crc32 of the 24 bytes before, 4 zeros
    body (from byte 32): column names (JSON list, padded to 8), slots i64[rows],
                         keys i64[rows], priorities f64[rows], ends u8[rows] (1: the row ends
                         its episode; padded to 8), in a ``TSJ3`` record the rows' sample
                         counts i64[rows], then each column's rows' bytes

A write that gives its rows' sample counts (a table made again from a checkpoint)
is a ``TSJ3`` record; other changes, whose rows start at 0, are ``TSJ2``.  (A
``TSJ1`` record, from a server before episode ends, has no ``ends``: it is applied
with none.)
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import zlib
from typing import Mapping, Sequence

import numpy as np

from tensorshare.disk.files import write_all
from tensorshare.errors import StorageFullError

from .slots import COUNT_LIMIT, END

log = logging.getLogger("tensorshare.server")

_HEADER = struct.Struct("<4sQQI")
_MAGIC = b"TSJ2"
_MAGIC_WITH_COUNTS = b"TSJ3"
_MAGIC_BEFORE_ENDS = b"TSJ1"
HEADER_BYTES = 32
_NO_HEADER = bytes(HEADER_BYTES)
_I8, _F8 = np.dtype("<i8"), np.dtype("<f8")
KEEP_BYTES = 1 << 20  # a record's file up to this size is kept for the next one; a larger one is truncated


class Journal:
    """The redo record of one durable table (see the module docstring)."""

    def __init__(self, path: str, fsync: bool = False):
        self.path = path
        self.fsync = fsync
        self._head: mmap.mmap | None = None  # the file's header, mapped: set and cleared without a syscall
        self._names: tuple = ()
        self._blob = b""  # the column names as the body starts with them
        self._clear = False  # known to hold no record: a new one need not clear the header first
        self._size = 0  # the body of the record last written

    def record(self, names: Sequence[str], slots: np.ndarray, keys: np.ndarray, priorities: np.ndarray,
               views: Sequence[np.ndarray], ends: np.ndarray | None = None, counts: np.ndarray | None = None) -> None:
        """Write the change (``views``: per column of ``names``, ``[rows, row_bytes]``
        uint8; ``ends``: which rows end their episode; ``counts``: the times each was
        sampled, None: 0) whole; 452 if the disk has no room for it (nothing is
        changed then)."""
        names = tuple(names)
        if names != self._names:
            blob = json.dumps(list(names)).encode()
            self._names, self._blob = names, blob + b" " * (-len(blob) % 8)
        flags = np.zeros(slots.size + (-slots.size % 8), np.uint8)
        if ends is not None:
            flags[:slots.size] = ends
        body = [self._blob, _le(slots, _I8), _le(keys, _I8), _le(priorities, _F8), flags,
                *(() if counts is None else (_le(counts, _I8),)), *(np.ascontiguousarray(v) for v in views)]
        size = sum(part.nbytes if isinstance(part, np.ndarray) else len(part) for part in body)
        magic = _MAGIC if counts is None else _MAGIC_WITH_COUNTS
        fields = _HEADER.pack(magic, int(slots.size), size, len(self._blob))
        header = (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")
        try:
            head = self._mapped_head()
            if not self._clear:  # an old header must not vouch for a half-written body
                head[:] = _NO_HEADER
            self._clear = False
            fd = os.open(self.path, os.O_WRONLY)
            try:
                write_all(fd, body, HEADER_BYTES)
                if self.fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if self.fsync:
                head[:] = header
                head.flush()  # on the disk before the table's files change
        except OSError as exc:
            raise StorageFullError(f"no room on disk to record the write ({exc.strerror})") from None
        self._size = size
        head[:] = header  # last: the record counts from here on

    def clear(self) -> None:
        """The change is applied: forget the record (its header zeroed).  The file
        keeps its blocks for the next record (truncating, and allocating again at the
        next write, cost 0.3 ms a change on ext4) unless the record was large."""
        head = self._mapped_head()
        head[:] = _NO_HEADER
        self._clear = True
        if self.fsync:  # else a power loss could bring back a record later changes have overtaken
            try:
                head.flush()
            except OSError as exc:
                log.warning("could not clear the table journal %s on the disk: %s", self.path, exc)
        if self._size > KEEP_BYTES:
            try:
                os.truncate(self.path, HEADER_BYTES)
            except OSError as exc:
                log.warning("could not shrink the table journal %s: %s", self.path, exc)
        self._size = 0

    def close(self) -> None:
        """The table is gone: let go of the mapping."""
        if self._head is not None:
            self._head.close()
            self._head = None

    def _mapped_head(self) -> mmap.mmap:
        if self._head is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < HEADER_BYTES:
                    os.posix_fallocate(fd, 0, HEADER_BYTES)  # blocks of its own: a store is never a SIGBUS
                self._head = mmap.mmap(fd, HEADER_BYTES)
            finally:
                os.close(fd)
        return self._head

    def replay(self, columns: Mapping[str, np.ndarray], state) -> int:
        """Apply a whole record left by a killed server to the table's arrays
        (``columns``: name -> ``[capacity, row_bytes]``; ``state``: its
        :class:`~.slots.Slots`, whose key, priority, times_sampled and flags it sets);
        returns the rows it put back (0: none, or a record that is not whole or not
        this table's, ignored)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_BYTES)
                if len(raw) < HEADER_BYTES:
                    return 0
                magic, rows, size, names_len = _HEADER.unpack_from(raw)
                if magic not in (_MAGIC, _MAGIC_WITH_COUNTS, _MAGIC_BEFORE_ENDS) or \
                        struct.unpack_from("<I", raw, _HEADER.size)[0] != zlib.crc32(raw[:_HEADER.size]):
                    return 0
                body = np.fromfile(f, np.uint8, size)
        except FileNotFoundError:
            return 0
        try:
            applied = _apply(body, rows, names_len, columns, state, magic != _MAGIC_BEFORE_ENDS,
                             magic == _MAGIC_WITH_COUNTS)
        except ValueError as exc:
            log.warning("table journal %s ignored: %s", self.path, exc)
            applied = 0
        if applied and self.fsync:  # the change in the files on the disk before its record goes
            for array in (*columns.values(), state.key, state.priority, state.times_sampled, state.flags):
                if isinstance(array, np.memmap):
                    array.flush()
        self._size = size
        self.clear()
        return applied


def _apply(body: np.ndarray, rows: int, names_len: int, columns: Mapping[str, np.ndarray], state,
           with_ends: bool, with_counts: bool = False) -> int:
    key, priority, times_sampled, flags = state.key, state.priority, state.times_sampled, state.flags
    capacity = key.shape[0]
    names = json.loads(bytes(body[:names_len]))
    at = names_len
    parts_of_state = []
    for dtype in ("<i8", "<i8", "<f8"):
        parts_of_state.append(body[at:at + 8 * rows].view(dtype))
        at += 8 * rows
    slots, keys, priorities = parts_of_state
    ends = np.zeros(rows, np.uint8)
    if with_ends:
        ends = body[at:at + rows]
        at += rows + (-rows % 8)
    counts = np.zeros(rows, np.int64)
    if with_counts:
        counts = body[at:at + 8 * rows].view("<i8")
        at += 8 * rows
    if slots.size != rows or ((slots < 0) | (slots >= capacity)).any() or (keys % capacity != slots).any():
        raise ValueError("its slots and keys are not of this table")
    if counts.size != rows or (counts < 0).any():
        raise ValueError("its sample counts are not counts")
    parts = []
    for name in names:
        column = columns.get(name)
        if column is None:  # a column added after the record: none can be (one change at a time)
            raise ValueError(f"it names a column {name!r} the table lacks")
        nbytes = rows * column.shape[1]
        parts.append((column, body[at:at + nbytes]))
        at += nbytes
    if at != body.size:
        raise ValueError(f"{body.size} bytes, {at} expected")
    for column, data in parts:
        column[slots] = data.reshape(rows, column.shape[1])
    priority[slots] = priorities
    times_sampled[slots] = np.minimum(counts, COUNT_LIMIT)
    flags[slots] = np.where(ends != 0, END, 0)  # (which slots hold rows is found from the keys next)
    key[slots] = keys  # last, as a change is applied
    return rows


def _le(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return array if array.dtype == dtype and array.flags.c_contiguous else np.ascontiguousarray(array, dtype)
