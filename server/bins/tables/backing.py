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

Rows go into a file-backed column with ``pwritev``, a run of consecutive slots at a
time, not through its mapping: a store into a mapped page that is not in the page
cache first reads that page from the disk, one 4 KiB fault at a time (a ring
buffer's inserts overwrite its oldest rows, the likeliest to have been evicted).
Measured here, overwriting 256 MiB of a file evicted from the page cache in 1 MiB
pieces: 0.03 GB/s and 9 ms of CPU a MiB through the mapping, 1.2 GB/s and 0.29 ms
with ``pwrite`` (whole pages are not read first); on pages in the page cache the two
cost the same (0.11 ms a MiB).  The mapping and the file share the page cache, so a
gather through the mapping sees the rows at once; a narrow column's pages just
written are mapped in too, once each, so that gathers do not fault on them
(:class:`~.readahead.WrittenPages`).

Rows come out of a column of rows of a page or more with ``preadv`` too, several at
once where the disk is needed (:mod:`.rowreads`); narrower columns are gathered
through their mappings (:mod:`.readahead`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from typing import Protocol, Sequence

import numpy as np

from tensorshare.disk.files import write_all
from tensorshare.disk.layout import fsync_dir
from tensorshare.disk.tables import table_metadata

from . import compiled
from .columns import ColumnSpec, MappedRows
from .journal import Journal
from .readahead import ReadAhead, WrittenPages, random_access
from .rowreads import RowReads, open_for_reads, wide
from .rows import take_rows
from .slots import STATE as SLOT_STATE, as_index, runs as slot_runs

SHUT_NOTE = "shut.json"  # in _slots/: the table's files are whole (a clean stop), and its counts
MAX_RUNS = 64  # a batch's slots in more runs than this are stored through the mapping (a syscall a run)
# A reopened table's trees (about a byte a row each, which each sample walks), and its
# per-slot state files up to this size (a table of large rows: 1.8 M rows of 28 KB
# have 38 MB of state beside 47 GB of columns), are read in when opened: each
# sample reads a page of each state file per row, at random, from the disk
# otherwise, 4 pages beside a 28 KB row's 9.
WARM_STATE_BYTES = 64 << 20
READ_IN_STEP = 8 << 20  # (MADV_WILLNEED reads at most the read-ahead window per call)
# A batch's rows from this size on go into columns in memory with stores around the caches
# (_loops.stream_copy: 1 MiB into memory not in the caches 125 -> 55 us); smaller ones may
# still be in the caches when sampled.
STREAM_MIN = 256 << 10


class Backing(Protocol):
    """Allocates the column arrays of one table."""

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        """A writable uint8 array of shape ``[capacity, spec.row_bytes]``."""

    def item_slots(self, capacity: int) -> list:
        """The ``capacity`` slots (None: empty) of a table of items, which has no columns."""

    def put(self, columns: Sequence[np.ndarray], slots: np.ndarray, views: Sequence[np.ndarray]) -> None:
        """Row ``i`` of each of ``views`` (``[rows, row_bytes]`` uint8) into slot
        ``slots[i]`` of its column (arrays :meth:`allocate` gave); OSError if the
        bytes could not be written."""

    def prefetch(self, slots: np.ndarray) -> None:
        """The rows ``slots`` are about to be read (a backing in files may ask for them now)."""

    def gather(self, columns: Sequence[np.ndarray], slots: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Copy the rows ``slots`` of each of ``columns`` (arrays :meth:`allocate` gave)
        into its array of ``outs``; OSError if the bytes could not be read."""

    def close(self) -> None:
        """The table is gone: let go of what :meth:`allocate` gave."""

    # ``journal``: a durable backing's :class:`~.journal.Journal` (None: changes need none)


class MemoryBacking:
    """Columns in ordinary memory.  ``numpy.zeros`` maps fresh pages lazily, so a large
    table costs memory only as its rows are written."""

    journal = None
    takes_mapped_rows = False  # rows are copied with loads: none of another's files (MappedRows)

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        return np.zeros((capacity, spec.row_bytes), np.uint8)

    def item_slots(self, capacity: int) -> list:
        return [None] * capacity

    def put(self, columns: Sequence[np.ndarray], slots: np.ndarray, views: Sequence[np.ndarray]) -> None:
        at = as_index(slots)
        loops = compiled.loops
        for column, view in zip(columns, views):
            if loops is not None and type(at) is slice and view.nbytes >= STREAM_MIN and view.flags.c_contiguous:
                loops.stream_copy(column[at], view)  # (a run of slots: one block of the column)
            else:
                column[at] = view

    def prefetch(self, slots: np.ndarray) -> None:
        pass  # (in memory)

    def gather(self, columns: Sequence[np.ndarray], slots: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        for column, out in zip(columns, outs):
            take_rows(column, slots, out)

    def close(self) -> None:
        pass


class MemmapBacking:
    """Columns in files ``<directory>/<column>.memmap`` mapped into memory.

    ``keep=False`` (spill: the files are only memory the kernel may page out) deletes
    the files on :meth:`close`; ``keep=True`` (a durable table) leaves them.  With
    ``reopen=True`` files already there are mapped as they are (their size must be
    the column's), instead of being created empty.  ``fsync=True`` (a durable table
    of a server run with ``--fsync``): :meth:`put` returns once the rows are on the
    disk, and :meth:`sync_state` puts the per-slot state there (see :meth:`put`).
    ``reads``: what reads the rows of wide columns (a server's tables share one;
    None: one of its own, closed with it).
    """

    def __init__(self, directory: str, keep: bool = False, reopen: bool = False, fsync: bool = False,
                 reads: RowReads | None = None):
        self.directory = directory
        self.keep = keep
        self.reopen = reopen
        self.fsync = fsync and keep
        self._state_files: list[int] = []  # with fsync: a descriptor of each state and tree file
        self.paths: list[str] = []
        self._hints = ReadAhead()  # narrow rows gathered at the disk's speed (.readahead)
        self._row_reads, self._own_reads = (RowReads(), True) if reads is None else (reads, False)
        self._readers: dict[int, int] = {}  # id of a wide column's array -> a descriptor to read rows with
        self._mapped: list[np.ndarray] = []
        self._files: dict[int, int] = {}  # id of a column's array -> a descriptor of its file, for put
        self._written: dict[int, WrittenPages] = {}  # id of a narrow column's array -> its pages mapped on write
        self._rows: list[np.ndarray] = []  # those with a row per slot: the columns and the per-slot state
        self._state: list[np.ndarray] = []  # the per-slot state (not the trees, not the columns)
        self._made_state = False
        # a durable table's changes that replace rows are recorded first (see .journal)
        self.journal = Journal(os.path.join(directory, "_slots", "journal.bin"), self.fsync) if keep else None

    item_slots = MemoryBacking.item_slots  # items are never in files
    # rows mapped from a file another process may cut short (MappedRows) are written with
    # pwritev only, where such a file is an error (EFAULT), not a signal; not through a
    # durable table's journal, which a change that replaces rows writes first
    takes_mapped_rows = True

    def path(self, column: str) -> str:
        return os.path.join(self.directory, f"{column}.memmap")

    def allocate(self, spec: ColumnSpec, capacity: int) -> np.ndarray:
        shape = (capacity, spec.row_bytes)
        if capacity * spec.row_bytes == 0:  # mmap cannot map an empty file
            return np.zeros(shape, np.uint8)
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(spec.name)
        array = _mapped(path, np.uint8, shape, create=not self.reopen)
        random_access(array)
        self._files[id(array)] = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        self.paths.append(path)
        self._mapped.append(array)
        if wide(spec.row_bytes):
            self._readers[id(array)] = open_for_reads(path)
        else:
            self._rows.append(array)
            self._written[id(array)] = WrittenPages(array._mmap)
        return array

    def put(self, columns: Sequence[np.ndarray], slots: np.ndarray, views: Sequence[np.ndarray]) -> None:
        """Each run of consecutive ``slots`` written to each column's file with
        ``pwritev`` (see the module docstring); slots in too many runs through the
        mappings.  With ``fsync``, each file written is flushed (``fdatasync``) before
        this returns, so the rows are on the disk before the table's state names them
        (the state is flushed after it changes: :meth:`sync_state`)."""
        if not columns:
            return
        runs = slot_runs(slots, MAX_RUNS)
        if runs is None and any(isinstance(view, MappedRows) for view in views):
            runs = slot_runs(slots, slots.size)  # (never loads from such rows: a syscall a run)
        written = []
        for column, view in zip(columns, views):
            fd = self._files.get(id(column))
            if fd is None or runs is None:
                column[as_index(slots)] = view  # (MappedRows only where a row has no bytes)
            else:
                width, pages = column.shape[1], self._written.get(id(column))
                for slot, first, stop in runs:
                    write_all(fd, [view[first:stop]], slot * width)
                    if pages is not None:  # (gathered through the mapping: mapped now, see WrittenPages)
                        pages.written(slot * width, (slot + stop - first) * width)
            if fd is not None and self.fsync:
                written.append(fd)
        for fd in written:
            os.fdatasync(fd)

    def sync_state(self) -> None:
        """With ``fsync``: the per-slot state on the disk now (``fdatasync`` of each
        file: one with no page changed since costs 0.05 ms here).  Not the trees:
        they are rebuilt from the state when a table that was not shut cleanly is
        reopened (:meth:`take_shut`).  OSError if the disk refuses the state."""
        for fd in self._state_files:
            os.fdatasync(fd)

    def sync_made(self) -> None:
        """With ``fsync``: the files of a table just made (or given new columns), and the
        directory entries naming them, on the disk now."""
        if not self.fsync:
            return
        for fd in (*self._files.values(), *self._state_files):
            os.fsync(fd)
        for array in self._mapped:  # the trees, as made
            if isinstance(array, np.memmap):
                array.flush()
        for directory in (os.path.join(self.directory, "_slots"), self.directory, os.path.dirname(self.directory)):
            if os.path.isdir(directory):
                fsync_dir(directory)

    def prefetch(self, slots: np.ndarray) -> None:
        """An operation is about to read rows ``slots``: their pages in every narrow
        column and state file are asked for at once, while gathers fault (:mod:`.readahead`)."""
        self._hints.begin(slots, self._rows)

    def gather(self, columns: Sequence[np.ndarray], slots: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Wide columns' rows read from their files (:mod:`.rowreads`), the others
        gathered through their mappings."""
        files = []
        for column, out in zip(columns, outs):
            fd = self._readers.get(id(column))
            if fd is None:
                self._hints.gather(column, slots, out)
            else:
                files.append((fd, out))
        if files:
            self._row_reads.read(files, slots)

    def state_array(self, name: str, dtype, length: int, fill) -> np.ndarray:
        """An array of the table's state (per-slot keys, priorities, sample counts and
        flags; its trees) in ``<directory>/_slots/<name>.bin``, so that a reopened
        table finds its rows (tensordict's ``load_memmap`` ignores the directory).

        A table whose files are not kept (spilled) keeps its state in memory: it is
        written at random rows (a sample's counts, an update's priorities), and in a
        file the first write to each clean page is a fault the file system serves
        (a prioritized sample of 256 from 10^8 rows took 4.5 ms of the server's CPU
        with its state in spill files, 0.6 ms in memory)."""
        if not self.keep:
            return np.full(length, fill, dtype)
        directory = os.path.join(self.directory, "_slots")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{name}.bin")
        if self.reopen and os.path.exists(path):
            _widened_before(path, dtype, length)
            array = _mapped(path, dtype, (length,), create=False)
            if name.startswith("tree") or array.nbytes <= WARM_STATE_BYTES:
                _read_in(array._mmap)
        else:
            array = _mapped(path, dtype, (length,), create=True)
            array[:] = fill
            self._made_state = True  # (a note of a clean stop says nothing of a new file)
        if not name.startswith("tree"):
            if self.fsync:  # (the trees are not flushed: a table not shut cleanly rebuilds them from this)
                self._state_files.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            if name in SLOT_STATE:  # rows' state, read at random: no read-around per fault
                random_access(array)
                self._rows.append(array)  # (hinted by slot: a one-number array such as next_seq is not)
                self._state.append(array)
        self.paths.append(path)
        self._mapped.append(array)
        return array

    @contextlib.contextmanager
    def scanning(self):
        """The per-slot state is read whole meanwhile (the trees rebuilt from it after a
        kill): its mappings are read in order, with read-ahead, then at random again.
        Left at random, each page not in memory is a read of its own: 10^8 rows'
        state out of the page cache took 24 s that way, 415,000 reads of a page
        (``MADV_WILLNEED`` reads at most the read-ahead window per call)."""
        for array in self._state:
            array._mmap.madvise(mmap.MADV_SEQUENTIAL)
        try:
            yield
        finally:
            for array in self._state:
                random_access(array)

    def take_shut(self) -> dict | None:
        """What :meth:`note_shut` noted when the table's server stopped cleanly, if it
        did since the files last changed; the note is gone once taken (and so it
        is from the disk: a table changed after this may be killed at any moment)."""
        path = os.path.join(self.directory, "_slots", SHUT_NOTE)
        if not self.reopen or not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                note = json.load(f)
        except (OSError, ValueError):
            note = None
        os.unlink(path)
        fsync_dir(os.path.dirname(path))
        return note if isinstance(note, dict) and not self._made_state else None

    def note_shut(self, note: dict) -> None:
        """Every mapping is flushed to the files, then ``note`` is written: the files
        are whole and need no rebuilding when reopened (:meth:`take_shut`)."""
        for array in self._mapped:
            if isinstance(array, np.memmap):
                array.flush()
        directory = os.path.join(self.directory, "_slots")
        tmp = os.path.join(directory, SHUT_NOTE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(note, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, SHUT_NOTE))
        fsync_dir(directory)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        for fd in (*self._files.values(), *self._state_files, *self._readers.values()):
            os.close(fd)
        self._files, self._state_files, self._readers = {}, [], {}
        if self._own_reads:
            self._row_reads.close()
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
        self._mapped, self._rows = [], []


def _read_in(mapping: mmap.mmap) -> None:
    """Ask the kernel to read the whole mapping in now (it reads in the background)."""
    for start in range(0, len(mapping), READ_IN_STEP):
        mapping.madvise(mmap.MADV_WILLNEED, start, min(READ_IN_STEP, len(mapping) - start))


def _widened_before(path: str, dtype, capacity: int) -> None:
    """A state file written wider by an older server (sample counts were int64, now
    uint32, saturating) is narrowed in place of the old one, once."""
    old = np.dtype(np.int64)
    if np.dtype(dtype).kind != "u" or np.dtype(dtype).itemsize >= old.itemsize \
            or os.path.getsize(path) != capacity * old.itemsize:
        return
    values = np.memmap(path, old, "r", shape=(capacity,))
    tmp = path + ".narrow"
    narrowed = np.memmap(tmp, dtype, "w+", shape=(capacity,))
    narrowed[:] = np.clip(values, 0, np.iinfo(dtype).max)
    narrowed.flush()
    del values, narrowed
    os.replace(tmp, path)


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
