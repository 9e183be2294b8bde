"""The server's tables by name: made, found, changed, listed, deleted, reloaded (issue #19).

A table is a kind of bin: its name is in the one namespace of bins (a name is a
bin or a table, never both), it shows in LIST with its row count, its changes get
sequence numbers from the bin store's counter and reach listeners like a bin's.
The rows themselves are the pure :class:`~.tables.Table`'s; :class:`TableStore`
runs each table operation on it and returns the :class:`~.store.Change` it made
(for the caller to publish), and chooses where a table's columns live:

* in memory, while the preallocated columns of every table held in memory fit
  under ``memory_limit`` beside the bins' resident bytes;
* past it, in memory-mapped files in the spill area (``<spill>/tables/<n>/``),
  which the kernel pages in and out: a table far larger than the memory budget
  works, at the speed of the disk for rows not in the page cache;
* with a data directory, always in files, durable (a table of items, which has no
  columns, is held in memory only and does not survive a restart): ``<data>/tables/<hash>/``
  holds ``table.json`` (name and settings), one ``<column>.memmap`` file per column
  and ``meta.json`` in tensordict's memmap layout (``TensorDict.load_memmap`` opens
  the columns), and ``_slots/`` (each slot's key, priority and sample count).
  Rows are in the files as soon as they are in the table (shared mappings: the
  page cache keeps what a killed server wrote), and a restarted server reopens
  every table with its rows, keys and priorities (:meth:`TableStore.load`).

A table's files are made (their blocks reserved with ``posix_fallocate``: a file
system without room refuses the table with 452 rather than killing the server
with SIGBUS on a later write into a mapped page), given new columns, rewritten and
removed on the disk threads (jobs in the table's lane, so a table deleted and made
again under one name finds its old files gone); its rows are gathered and
scattered where the request is handled.  Its settings are :mod:`.tablespec`'s, what
it takes of the memory budget :mod:`.tablememory`'s.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tensorshare.errors import (
    BadNameError, BadRequestError, NoSuchBinError, ProtocolError, RemoteError, StorageFullError, TooLargeError,
)
from tensorshare.disk.layout import fsync_dir
from tensorshare.disk.tables import TABLE_RECORD
from tensorshare.wire.description import check_description
from tensorshare.wire.recycle import Recycler

from ..malloc import heap_temporaries
from .store import BinState, BinStore, Change, Item
from .tablememory import CountedItems, ItemsBacking, TableMemory
from .tables import MemmapBacking, Table, TableError, TableSpecError, state_bytes
from .tables.values import Gathered, columns_of, float64_bytes, int64_bytes
from .tables.rowreads import RowReads
from .tablespec import (
    LIMIT_KEYS, check_settings, column_bytes, default_max_rows, dir_key, fixed, json_spec, make_table, parse_spec,
    physical_memory, plain, write_files,
)

log = logging.getLogger("tensorshare.server")
TABLES_DIR = "tables"  # a data or spill directory's tables (a multi-worker server moves them by it too)
# A table in memory of more rows is made on a disk thread, off the reactor: its per-slot
# state (keys, priorities, counts, the samplers' trees) took 0.24 s to fill for 4M rows.
MADE_INLINE = 1 << 16

# Reply buffers of samples and reads, used again once written (a learner samples the
# same size over and over): 64 MiB at most, let go after 10 s unused.
_GATHER_BUFFERS = Recycler(64 << 20, bytearray, idle=10.0)


@dataclass(eq=False)
class TableEntry:
    """One table of the server: its settings as made, the table, its last change's
    seq.  Callers of :class:`TableStore` hold it as a handle (the table they found
    under a name) and pass it back; only the store looks inside."""

    name: str
    spec: dict
    table: Table
    seq: int = 0
    resident: int = 0  # bytes it holds in memory beside its items: its per-slot state, columns not in files
    directory: str | None = None  # its files (spilled or durable)
    tensordict: bool = False  # rows came as TensorDicts: replies say so (clients give TensorDicts back)
    items: CountedItems | None = None  # a table of items' slots
    # seconds requests waited for the rate limiter, inserts and samples (ended waits)
    blocked: dict = field(default_factory=lambda: {"insert": 0.0, "sample": 0.0})

    @property
    def nbytes(self) -> int:
        """The column bytes the table holds (its capacity's worth: columns are preallocated)."""
        return self.table.capacity * sum(spec.row_bytes for spec in self.table.columns)

    def info(self) -> dict:
        """The table's settings, counters and rate-limiter state (:meth:`Table.info`),
        with what the server adds: the client's ``meta``, its bytes and where they
        live, the seconds requests waited for the rate limiter, and its ``seq``."""
        info = self.table.info()
        info["meta"] = self.spec.get("meta")
        info["bytes"] = self.nbytes
        info["in_files"] = self.directory is not None
        info["blocked_seconds"] = dict(self.blocked)
        info["seq"] = self.seq
        return info


class Drawn:
    """Rows a sample or read took, ready for a reply: their keys, slot indices and
    (a sample's) probabilities; the stacked columns (``gathered``, a
    :class:`~.tables.values.Gathered`) or, for a table of items, the ``items``; the
    table's ``seq``, and whether its rows came as TensorDicts."""

    __slots__ = ("keys", "indices", "probabilities", "lengths", "gathered", "items", "seq", "tensordict")

    def __init__(self, rows, probabilities, gathered: Gathered | None, entry: TableEntry):
        self.keys, self.indices, self.probabilities = rows.keys, rows.indices, probabilities
        self.lengths = getattr(rows, "lengths", None)  # a sample of sequences: each one's real length
        self.gathered, self.items = gathered, rows.items
        self.seq, self.tensordict = entry.seq, entry.tensordict


def _check_disk(root: str, nbytes: int, freed: int = 0) -> None:
    """452 unless the file system of ``root`` (or of its nearest existing parent) has
    room for ``nbytes`` of new files, counting ``freed`` bytes that will be given back
    first: a table's files are allocated whole when made."""
    path = root
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return  # (not known: making the files will say)
    if nbytes > free + freed:
        raise StorageFullError(f"no room on the disk for a table of {nbytes} bytes ({free} bytes free)")


class TableStore:
    """The tables of one server, beside the bins of ``store`` (one namespace); their
    file work goes to ``jobs`` (a :class:`~.jobs.Jobs`)."""

    def __init__(self, store: BinStore, jobs, max_tables: int = 10_000, max_table_bytes: int | None = None, *,
                 memory_limit: int | None = None, spill_root: str | None = None, data_root: str | None = None,
                 max_rows: int | None = None, on_grow: Callable[[], None] = lambda: None, fsync: bool = False):
        self.store = store
        self.fsync = fsync  # durable tables' changes are flushed to the disk before they are acknowledged
        self.jobs = jobs
        self.max_tables = max_tables
        self.max_table_bytes = max_table_bytes  # column bytes a table may preallocate (None: no bound)
        self.max_rows = default_max_rows(memory_limit) if max_rows is None else max_rows  # of all tables together
        self.memory = TableMemory(store, memory_limit, on_grow)
        self.spill_root = None if spill_root is None else os.path.join(spill_root, TABLES_DIR)
        self.data_root = None if data_root is None else os.path.join(data_root, TABLES_DIR)
        self.total_rows = 0  # slots of all tables (those being made included)
        self._spilled = itertools.count()
        self.by_name: dict[str, TableEntry] = {}  # read it (``name in``), do not change it
        self._making: dict[str, list[Callable[[], None]]] = {}  # name -> creates waiting for its files
        self.reads = RowReads()  # the threads that read rows of tables in files from the disk

    def bound(self, max_rows: int | None, max_reply_bytes: int | None, max_reply_header: int | None) -> None:
        """The server's limits: rows of all tables together (None: what the memory
        budget holds, :func:`~.tablespec.default_max_rows`), and what one TSAMPLE/TREAD
        reply may carry (its max_outbound and max_reply_header)."""
        self.max_rows = default_max_rows(self.memory.memory_limit) if max_rows is None else max_rows
        self.memory.max_reply_bytes, self.memory.max_reply_header = max_reply_bytes, max_reply_header

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def current(self, name: str) -> TableEntry | None:
        """The table named ``name`` now, or None."""
        return self.by_name.get(name)

    def get(self, name: str) -> TableEntry:
        """The table named ``name``: 550 if there is none, 553 if a bin has the name."""
        entry = self.by_name.get(name)
        if entry is None:
            if self.store.exists(name):
                raise BadNameError(f"{name!r} is a bin, not a table")
            raise NoSuchBinError(f"no table named {name!r}")
        return entry

    # -- making and removing tables

    def create(self, name: str, spec: dict, done: Callable, add_columns: bool = False) -> None:
        """Make table ``name`` with ``spec`` (see :func:`~.tablespec.parse_spec`);
        ``done((entry, change), None)`` once made, or ``done(None, error)``.  A table
        already there with the same settings is kept as it is (change None); with
        other settings, or a bin of that name, 553.  ``add_columns``: a table there
        whose settings differ only by lacking some of ``spec``'s columns gains them
        (:meth:`_add_columns`).  A table in files is made on a disk thread (its
        directory cleared first: a table deleted by a server killed meanwhile), as is
        one in memory of more than ``MADE_INLINE`` rows."""
        full = parse_spec(spec)
        if name in self._making:  # its files are being made: answered once they are
            self._making[name].append(lambda: self._create_again(name, spec, done, add_columns))
            return
        entry = self.by_name.get(name)
        if entry is not None:  # (the rate limits may have been changed since: they do not count)
            if fixed(entry.spec) != fixed(full):
                if add_columns and fixed(entry.spec, "columns") == fixed(full, "columns") and full["columns"]:
                    self._add_columns(entry, full["columns"], done)
                    return
                raise BadNameError(f"table {name!r} exists with other settings: delete it first")
            done((entry, None), None)
            return
        nbytes, directory, keep, state = self._placement(name, full)
        capacity = full["capacity"]
        if directory is None and capacity <= MADE_INLINE:
            table, items = self._make_in_memory(full)  # (501 or 452 before its rows are counted)
            self.total_rows += capacity
            done(self._add(name, full, table, state + nbytes, None, items), None)
            return
        self._making[name] = []
        self.total_rows += capacity  # (counted while it is made: creates meanwhile see it)
        resident = state if directory is not None else state + nbytes

        def made(result, error) -> None:
            waiting = self._making.pop(name)
            try:
                if error is not None:
                    self.total_rows -= capacity
                    if not isinstance(error, RemoteError):
                        error = StorageFullError(f"cannot make the table's files: "
                                                 f"{getattr(error, 'strerror', None) or error}")
                    done(None, error)
                elif self.store.exists(name):  # a bin took the name meanwhile
                    self.total_rows -= capacity
                    if directory is not None:
                        self.jobs.run(name, _remove_files, (result[0], directory))
                    done(None, BadNameError(f"{name!r} is a bin: a table needs a name no bin uses"))
                else:
                    done(self._add(name, full, result[0], resident, directory, result[1]), None)
            finally:
                for again in waiting:
                    again()

        if directory is None:  # a large one: its per-slot state is allocated and filled off the reactor
            self.jobs.run(name, self._make_in_memory, (full,), made)
        else:
            self.jobs.run(name, self._make_files, (name, full, directory, keep), made)

    def check_replacement(self, name: str, spec: dict) -> None:
        """Raise what :meth:`create` of ``spec`` would raise for its settings and the
        server's limits if table ``name`` were gone (its rows and memory free), and
        allocate nothing: what a replacement checks before the table is deleted."""
        full = parse_spec(spec)
        check_settings(full)
        entry = self.by_name.pop(name)
        released = entry.resident + (entry.items.held if entry.items is not None else 0)
        self.total_rows -= entry.table.capacity
        self.store.table_bytes -= released
        try:
            self._placement(name, full, entry.nbytes if entry.directory is not None else 0)
        finally:
            self.by_name[name] = entry
            self.total_rows += entry.table.capacity
            self.store.table_bytes += released

    def _make_in_memory(self, full: dict) -> tuple[Table, CountedItems | None]:
        """A new table in memory, and the counted slots of a table of items (None for one
        of columns)."""
        backing = None if full["columns"] else ItemsBacking(self.store)
        return make_table(full, backing), backing and backing.slots

    def _create_again(self, name: str, spec: dict, done: Callable, add_columns: bool) -> None:
        try:
            self.create(name, spec, done, add_columns)
        except RemoteError as exc:
            done(None, exc)

    def _placement(self, name: str, full: dict, freed_disk: int = 0) -> tuple[int, str | None, bool, int]:
        """``(column bytes in memory, directory or None, keep, state bytes)`` of a new
        table: where its columns live, and the memory its per-slot state takes; the
        limits that refuse it first, the machine's memory and the disk's free space
        (``freed_disk``: bytes of files a replaced table gives back) among them, so that a
        replacement refused for them leaves the old table as it was."""
        if self.store.exists(name):
            raise BadNameError(f"{name!r} is a bin: a table needs a name no bin uses")
        if len(self.by_name) + len(self._making) >= self.max_tables:
            raise TooLargeError(f"the server already holds {self.max_tables} tables")
        capacity = full["capacity"]
        nbytes = column_bytes(full["columns"], capacity)
        if self.max_table_bytes is not None and nbytes > self.max_table_bytes:
            raise TooLargeError(f"{capacity} rows of {nbytes // max(1, capacity)} bytes are more than the "
                                f"{self.max_table_bytes} bytes a table may take")
        if type(capacity) is int and self.total_rows + capacity > self.max_rows:
            raise TooLargeError(f"the server's tables already have {self.total_rows} of the {self.max_rows} rows "
                                f"they may have together: no room for {capacity} more")
        state = 0
        if type(capacity) is int and capacity > 0 and isinstance(full["sampler"], str):
            state = state_bytes(capacity, full["sampler"], full["remover"], items=not full["columns"])
        self.memory.check_state(capacity, state)
        if not full["columns"]:
            # A table of items holds them in memory, as received (counted: CountedItems);
            # it is neither spilled nor durable.
            return 0, None, False, state
        if self.data_root is not None:
            _check_disk(self.data_root, nbytes, freed_disk)
            return 0, os.path.join(self.data_root, dir_key(name)), True, state
        if self.memory.over_budget(state + nbytes):
            if self.spill_root is None:
                raise StorageFullError(f"a table of {nbytes} bytes ({capacity} rows of {nbytes // max(1, capacity)}) "
                                       f"does not fit in the memory budget (--memory-limit "
                                       f"{self.memory.memory_limit}, {self.memory.in_use()} in use) and the server "
                                       f"has no spill directory")
            _check_disk(self.spill_root, nbytes, freed_disk)
            return 0, os.path.join(self.spill_root, str(next(self._spilled))), False, state
        machine = physical_memory()
        if state + nbytes > machine:  # (without --memory-limit the budget does not say so)
            raise StorageFullError(f"no memory for a table of {capacity} rows: {state + nbytes} bytes are more than "
                                   f"the machine's {machine} (give the server --memory-limit and --spill-dir to "
                                   f"keep its columns in files)")
        return nbytes, None, False, state

    def _make_files(self, name: str, full: dict, directory: str, keep: bool) -> tuple[Table, None]:
        """A new table whose columns are files in ``directory`` (a disk thread)."""
        shutil.rmtree(directory, ignore_errors=True)  # (durable: a table deleted by a server killed meanwhile)
        backing = MemmapBacking(directory, keep=keep, fsync=self.fsync, reads=self.reads)
        try:
            table = make_table(full, backing)
            if keep:
                write_files(directory, name, json_spec(full), table.columns, table.capacity, False, self.fsync)
                backing.sync_made()
                if self.fsync:  # (the data directory's entry of tables/, made with the first table)
                    fsync_dir(os.path.dirname(self.data_root))
        except BaseException:
            backing.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return table, None

    def _add(self, name: str, full: dict, table: Table, resident: int, directory: str | None,
             items: CountedItems | None = None):
        entry = self.by_name[name] = TableEntry(name, full, table, resident=resident, directory=directory,
                                                items=items)
        self.memory.took(resident)
        return entry, self._changed(entry, "CREATE")

    def _add_columns(self, entry: TableEntry, columns: dict, done: Callable) -> None:
        """Give ``entry``'s table the columns of ``columns`` it lacks (those it has must
        be the same, else 553); ``done((entry, change or None), None)``: None if it
        lacks none.  A table in files gets their files on a disk thread."""
        have = entry.spec["columns"] or {}
        if not have:
            raise BadNameError(f"table {entry.name!r} holds items, not columns")
        changed = [k for k in have if k in columns and columns[k] != have[k]]
        if changed:
            raise BadNameError(f"table {entry.name!r} has a column {changed[0]!r} of {have[changed[0]]}, "
                               f"not {columns[changed[0]]}")
        new = {k: v for k, v in columns.items() if k not in have}
        if not new:
            done((entry, None), None)
            return
        nbytes = column_bytes(new, entry.table.capacity)
        if self.max_table_bytes is not None and entry.nbytes + nbytes > self.max_table_bytes:
            raise TooLargeError(f"{entry.nbytes + nbytes} bytes are more than the {self.max_table_bytes} "
                                f"bytes a table may take")
        if entry.directory is None and self.memory.over_budget(nbytes):
            raise StorageFullError(f"{nbytes} more bytes of columns in memory are over the memory budget "
                                   f"(--memory-limit {self.memory.memory_limit})")
        if entry.directory is None:  # in memory: no file to make
            machine = physical_memory()
            if entry.nbytes + nbytes > machine:
                raise StorageFullError(f"no memory for {nbytes} more bytes of columns: the table's would be more "
                                       f"than the machine's {machine}")
            try:
                arrays = entry.table.new_columns(new)
            except MemoryError:
                raise StorageFullError(f"no memory for {nbytes} more bytes of columns") from None
            self._attach_columns(entry, new, arrays, nbytes, done)
            return
        name = entry.name
        self._making[name] = []

        def made(result, error) -> None:
            waiting = self._making.pop(name)
            try:
                if error is not None:
                    if not isinstance(error, RemoteError):
                        error = StorageFullError(f"cannot make the columns' files: "
                                                 f"{getattr(error, 'strerror', None) or error}")
                    done(None, error)
                elif self.by_name.get(name) is not entry:
                    done(None, NoSuchBinError(f"table {name!r} was deleted while its columns were made"))
                else:
                    self._attach_columns(entry, new, result, 0, done)
            finally:
                for again in waiting:
                    again()

        self.jobs.run(name, entry.table.new_columns, (new,), made)

    def _attach_columns(self, entry: TableEntry, new: dict, made: tuple, resident: int, done: Callable) -> None:
        try:
            entry.table.attach_columns(*made)
        except TableSpecError as exc:
            done(None, exc)
            return
        entry.spec["columns"] = {**(entry.spec["columns"] or {}), **new}
        entry.resident += resident
        self.memory.took(resident)
        change = self._changed(entry, "CREATE")
        if entry.directory is None or self.data_root is None:
            done((entry, change), None)
            return
        self.jobs.run(entry.name, write_files, self._files_of(entry),
                      lambda _result, error: done((entry, change), None) if error is None else done(
                          None, StorageFullError(f"cannot write the table's files: {error}")))

    def _files_of(self, entry: TableEntry) -> tuple:
        """:func:`~.tablespec.write_files`' arguments for ``entry`` (taken on the reactor thread)."""
        return (entry.directory, entry.name, json_spec(entry.spec), entry.table.columns, entry.table.capacity,
                entry.tensordict, self.fsync)

    def delete(self, name: str, done: Callable) -> None:
        """Remove table ``name`` from the namespace now, and its files on a disk thread
        (a durable table's too); ``done(change, None)`` once they are gone."""
        entry = self.by_name.pop(name, None)
        if entry is None:
            raise NoSuchBinError(f"no table named {name!r}")
        self.memory.took(-entry.resident)
        if entry.items is not None:  # (on this thread: the counts are the reactor's)
            entry.items.let_go()
        self.total_rows -= entry.table.capacity
        change = Change(name, 0, self.store.next_seq(), "DELETE")

        def removed(_result, error) -> None:
            if error is not None:
                log.warning("could not remove the files of table %r: %s", name, error)
            done(change, None)

        self.jobs.run(name, _remove_files, (entry.table, entry.directory, self.fsync), removed)

    def load(self) -> tuple[int, list[str]]:
        """Reopen the tables of the data directory (at start-up, before serving);
        returns ``(tables, problems)``."""
        if self.data_root is None or not os.path.isdir(self.data_root):
            return 0, []
        problems = []
        for entry_name in sorted(os.listdir(self.data_root)):
            directory = os.path.join(self.data_root, entry_name)
            try:
                with open(os.path.join(directory, TABLE_RECORD)) as f:
                    saved = json.load(f)
                name, full = saved["name"], parse_spec(saved["spec"])
                if dir_key(name) != entry_name or name in self.by_name:
                    raise ValueError("its name does not match its directory")
                table = make_table(full, MemmapBacking(directory, keep=True, reopen=True, fsync=self.fsync,
                                                       reads=self.reads))
            except (OSError, ValueError, KeyError, TypeError, RemoteError) as exc:
                problems.append(f"table directory {entry_name}: {exc}")
                continue
            self.by_name[name] = TableEntry(name, full, table, directory=directory,
                                            tensordict=bool(saved.get("tensordict")))
            self.total_rows += table.capacity
            resident = state_bytes(table.capacity, full["sampler"], full["remover"])
            self.by_name[name].resident = resident
            self.memory.took(resident)
        for problem in problems:
            log.warning("data directory: skipped %s", problem)
        return len(self.by_name), problems

    def close(self) -> None:
        """The server stops: spilled tables' files go; durable ones stay, noted whole
        (their trees are mapped as they are when the server starts again)."""
        for entry in self.by_name.values():
            if self.data_root is None:
                entry.table.close()
            elif entry.directory is not None:
                try:
                    entry.table.shut()
                except OSError as exc:  # (then it is rebuilt from its rows when reopened)
                    log.warning("could not note table %r's files whole: %s", entry.name, exc)
        self.reads.close()

    # -- rows in

    def rows(self, entry: TableEntry, description: bytes, payload, nbytes: int, limits):
        """A request's value as rows of ``entry``: ``{column: RawArray}`` viewing the
        payload, or, for a table of items, a list of the one item it is (501 for a
        value that is neither)."""
        if entry.table.columns:
            return columns_of(description, payload, nbytes, limits)
        try:
            check_description(description, nbytes, limits)
        except ProtocolError as exc:
            raise BadRequestError(f"bad value: {exc}") from None
        self.memory.check_room(nbytes + len(description))  # a table of items holds them in memory
        return [Item(description, tuple(payload), nbytes)]

    def says_tensordict(self, entry: TableEntry) -> bool:
        """Whether ``entry``'s replies say its rows come as TensorDicts already (or,
        for a table of items, never can)."""
        return entry.tensordict or not entry.table.columns

    def mark_tensordict(self, entry: TableEntry, done: Callable[[], None]) -> None:
        """Rows of ``entry`` came as TensorDicts: its replies say so from now on, and,
        for a durable table, after a restart too; ``done()`` once its files say so
        (written on a disk thread)."""
        entry.tensordict = True
        if self.data_root is None or entry.directory is None:
            done()
            return

        def noted(_result, error) -> None:
            if error is not None:
                log.warning("could not note in table %r's files that it holds TensorDicts: %s", entry.name, error)
            done()

        self.jobs.run(entry.name, write_files, self._files_of(entry), noted)

    def insert(self, entry: TableEntry, rows, priorities, ends=None) -> tuple[np.ndarray, Change]:
        """Add ``rows`` (from :meth:`rows`; ``ends``: which end their episode): their
        keys, and the change.  Raises the engine's :class:`~.tables.WouldBlockError`
        when the rate limiter holds it back."""
        table = self._live(entry).table
        with heap_temporaries():  # (a batch's numpy temporaries: see server/malloc.py)
            written = table.insert(rows, priorities, ends)
        return written.keys, self._changed(entry, "INSERT")

    def write(self, entry: TableEntry, indices: np.ndarray, rows, priorities, ends=None,
              times_sampled=None) -> tuple[np.ndarray, Change]:
        """Put ``rows`` at slot ``indices`` (already sampled ``times_sampled`` times): their keys, and the change."""
        table = self._live(entry).table
        with heap_temporaries():
            written = table.write(indices, rows, priorities, ends, times_sampled)
        return written.keys, self._changed(entry, "WRITE")

    def can_insert(self, entry: TableEntry, rows) -> bool:
        """Whether :meth:`insert` of ``rows`` may go on now (True too when it never
        could, or the table is gone: the insert then says why)."""
        if self.by_name.get(entry.name) is not entry:
            return True
        count = len(rows) if isinstance(rows, list) else _rows_in(rows)
        try:
            return entry.table.can_insert(count)
        except TableError:
            return True

    # -- rows out

    def sample(self, entry: TableEntry, n: int, length: int | None = None,
               pad: bool = False) -> tuple[Drawn, Change | None]:
        """Draw ``n`` rows with the table's sampler (with ``length``: ``n`` sequences of
        that many rows, ``pad``: padded when cut short): the rows, and the change if
        rows left (those sampled ``max_times_sampled`` times).  Raises
        :class:`~.tables.WouldBlockError` or :class:`~.tables.EmptyTableError` when it
        cannot go on now."""
        table = self._live(entry).table
        gathered = self._gathered(table, n * (length or 1))
        out = None if gathered is None else gathered.out
        if length is None:  # (states=False: a reply carries neither priorities nor counts)
            drawn = table.sample(n, out=out, states=False)
        else:
            drawn = table.sample_sequences(n, length, pad, out=out, states=False)
        change = self._changed(entry, "SAMPLE") if drawn.removed.keys.size else None
        return Drawn(drawn, drawn.probabilities, gathered, entry), change

    def can_sample(self, entry: TableEntry, n: int) -> bool:
        """Whether :meth:`sample` may go on now (True too when it never could, or the
        table is gone: the sample then says why)."""
        if self.by_name.get(entry.name) is not entry:
            return True
        try:
            return entry.table.size > 0 and entry.table.can_sample(n)
        except TableError:
            return True

    def read(self, entry: TableEntry, indices: np.ndarray, sampled: bool = False,
             empty: bool = False) -> tuple[Drawn, Change | None]:
        """The rows at slot ``indices``, and the change if rows left.  No sample is
        counted, unless ``sampled``: rows the reader drew itself, counted (and
        rate-limited: :class:`~.tables.WouldBlockError` for now) as a sample is.
        ``empty``: a slot that holds no row reads as key -1 and zeros."""
        table = self._live(entry).table
        gathered = self._gathered(table, indices.size)
        rows = table.read(indices, out=None if gathered is None else gathered.out, sampled=sampled, empty=empty,
                          states=False)
        change = self._changed(entry, "SAMPLE") if sampled and rows.removed.keys.size else None
        return Drawn(rows, None, gathered, entry), change

    def can_read(self, entry: TableEntry, n: int) -> bool:
        """Whether :meth:`read` of ``n`` rows counted as a sample may go on now (True
        too when it never could, or the table is gone: the read then says why)."""
        if self.by_name.get(entry.name) is not entry:
            return True
        try:
            return entry.table.can_read_sampled(n)
        except TableError:
            return True

    def check_reply(self, entry: TableEntry, n: int) -> None:
        """A TSAMPLE/TREAD reply of ``n`` rows of ``entry`` is bounded and its memory
        counted before anything is drawn (:meth:`TableMemory.check_reply`)."""
        items = entry.items
        self.memory.check_reply(entry.table.columns, n, 0 if items is None else items.largest,
                                0 if items is None else items.largest_payload)

    def hold_reply(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of gathered rows in a reply until the callable returned is called."""
        return self.memory.hold_reply(nbytes)

    @staticmethod
    def _gathered(table: Table, n: int) -> Gathered | None:
        if not table.columns:
            return None
        _GATHER_BUFFERS.maybe_trim()
        return Gathered(table.columns, n, _GATHER_BUFFERS.take)

    # -- settings and state

    def update_priorities(self, entry: TableEntry, keys: np.ndarray, priorities: np.ndarray) -> int:
        """Set the priorities of the rows ``keys`` (rows gone meanwhile are skipped);
        returns how many were updated."""
        return self._live(entry).table.update_priorities(keys, priorities)

    def set_limits(self, entry: TableEntry, limits: dict) -> None:
        """Change the rate limits now (501 for an unknown or bad one)."""
        unknown = [k for k in limits if k not in LIMIT_KEYS]
        if unknown:
            raise BadRequestError(f"unknown limit {unknown[0]!r:.60} (known: {', '.join(LIMIT_KEYS)})")
        given = dict(limits)
        if isinstance(given.get("error_buffer"), list):
            given["error_buffer"] = tuple(given["error_buffer"])
        try:
            self._live(entry).table.set_limits(**given)
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"bad limits: {exc}") from None

    def info(self, entry: TableEntry, slots: int | None = None) -> dict:
        """The table's settings, counters and rate-limiter state as msgpack's plain
        types (:meth:`TableEntry.info`); with ``slots``, a page of the occupied slots
        from that index on (indices, keys, priorities and sample counts as bytes, and
        the index to ask from next)."""
        info = entry.info()
        if slots is not None:
            page = entry.table.slots(slots)
            info["slots"] = {"indices": int64_bytes(page["indices"]), "keys": int64_bytes(page["keys"]),
                             "priorities": float64_bytes(page["priorities"]),
                             "times_sampled": int64_bytes(page["times_sampled"]),
                             "ends": np.asarray(page["ends"], np.uint8).tobytes(), "next": page["next"]}
        return plain(info)

    def note_blocked(self, entry: TableEntry, what: str, seconds: float) -> None:
        """A request waited ``seconds`` for the rate limiter (``what``: insert or sample)."""
        entry.blocked[what] += seconds

    def listing(self) -> dict[str, int]:
        return {name: entry.table.size for name, entry in self.by_name.items()}

    def state(self, name: str) -> BinState:
        entry = self.by_name[name]
        return BinState(True, entry.table.size, entry.seq, None)

    def _live(self, entry: TableEntry) -> TableEntry:
        """``entry``, if it is still the table of its name (550 if it was deleted, say
        while a request waited)."""
        if self.by_name.get(entry.name) is not entry:
            raise NoSuchBinError(f"table {entry.name!r} was deleted while this request waited")
        return entry

    def _changed(self, entry: TableEntry, op: str) -> Change:
        """A change of ``entry``'s table, numbered, for its listeners."""
        entry.seq = self.store.next_seq()
        return Change(entry.name, entry.table.size, entry.seq, op)


def _rows_in(batch: dict) -> int:
    first = next(iter(batch.values()), None)
    return 0 if first is None or not first.shape else int(first.shape[0])


def _remove_files(table: Table, directory: str | None, fsync: bool) -> None:
    """Let go of a deleted table's columns and remove its files (a disk thread);
    ``fsync``: the removal is on the disk before this returns."""
    table.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        if fsync:
            fsync_dir(os.path.dirname(directory))
