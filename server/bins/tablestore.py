"""The server's tables by name: made, found, changed, listed, deleted, reloaded (issue #19).

A table is a kind of bin: its name is in the one namespace of bins (a name is a
bin or a table, never both), it shows in LIST with its row count, its changes get
sequence numbers from the bin store's counter and reach listeners like a bin's.
The rows themselves are the pure :class:`~.tables.Table`'s; :class:`TableStore`
runs each table operation on it and returns the :class:`~.store.Change` it made
(for the caller to publish), and chooses where a table's columns live:

* in memory, while the preallocated columns of every table held in memory fit
  under ``memory_limit``;
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

A table's files are made, rewritten and removed on the disk threads (jobs in the
table's lane, so a table deleted and made again under one name finds its old
files gone); its rows are gathered and scattered where the request is handled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tensorshare.errors import (
    BadNameError, BadRequestError, NoSuchBinError, ProtocolError, RemoteError, StorageFullError, TooLargeError,
)
from tensorshare.wire.description import check_description
from tensorshare.wire.recycle import Recycler

from .store import BinState, BinStore, Change, Item
from .tables import MemmapBacking, MemoryBacking, Table, TableError, TableSpecError, tensordict_metadata
from .tables.columns import parse_columns
from .tables.values import Gathered, columns_of

log = logging.getLogger("tensorshare.server")

# The settings a table is made with: name -> default (PROTOCOL.md §12).
SPEC_DEFAULTS: dict[str, Any] = {
    "capacity": None, "columns": None, "sampler": "uniform", "priority_exponent": 1.0, "remover": "fifo",
    "max_times_sampled": 0, "min_size_to_sample": 1, "samples_per_insert": None, "error_buffer": None,
}
LIMIT_KEYS = ("min_size_to_sample", "samples_per_insert", "error_buffer")
# Slots a table may have: each costs about 80 bytes of state in memory (key, priority,
# count, order, the samplers' trees), whatever the columns hold.
MAX_ROWS = 1 << 26
# Reply buffers of samples and reads, used again once written (a learner samples the
# same size over and over): 64 MiB at most, let go after 10 s unused.
_GATHER_BUFFERS = Recycler(64 << 20, bytearray, idle=10.0)


def parse_spec(spec: dict) -> dict:
    """The full settings of a table from a TCREATE's ``spec`` (defaults filled in);
    501 (:class:`TableSpecError`) for an unknown key or a value of the wrong kind."""
    unknown = [k for k in spec if k not in SPEC_DEFAULTS]
    if unknown:
        raise TableSpecError(f"unknown table setting {unknown[0]!r:.60} (known: {', '.join(SPEC_DEFAULTS)})")
    full = {**SPEC_DEFAULTS, **spec}
    if full["capacity"] is None:
        raise TableSpecError("a table needs a capacity")
    eb = full["error_buffer"]
    if isinstance(eb, list):
        full["error_buffer"] = tuple(eb)
    full["columns"] = {s.name: s.as_dict() for s in parse_columns(full["columns"])} or None
    return full


@dataclass(eq=False)
class TableEntry:
    """One table of the server: its settings as made, the table, its last change's
    seq.  Callers of :class:`TableStore` hold it as a handle (the table they found
    under a name) and pass it back; only the store looks inside."""

    name: str
    spec: dict
    table: Table
    seq: int = 0
    resident: int = 0  # column bytes it holds in memory (not in files)
    directory: str | None = None  # its files (spilled or durable)
    tensordict: bool = False  # rows came as TensorDicts: replies say so (clients give TensorDicts back)


class Drawn:
    """Rows a sample or read took, ready for a reply: their keys, slot indices and
    (a sample's) probabilities; the stacked columns (``gathered``, a
    :class:`~.tables.values.Gathered`) or, for a table of items, the ``items``; the
    table's ``seq``, and whether its rows came as TensorDicts."""

    __slots__ = ("keys", "indices", "probabilities", "gathered", "items", "seq", "tensordict")

    def __init__(self, rows, probabilities, gathered: Gathered | None, entry: TableEntry):
        self.keys, self.indices, self.probabilities = rows.keys, rows.indices, probabilities
        self.gathered, self.items = gathered, rows.items
        self.seq, self.tensordict = entry.seq, entry.tensordict


class TableStore:
    """The tables of one server, beside the bins of ``store`` (one namespace); their
    file work goes to ``jobs`` (a :class:`~.jobs.Jobs`)."""

    def __init__(self, store: BinStore, jobs, max_tables: int = 10_000, max_table_bytes: int | None = None, *,
                 memory_limit: int | None = None, spill_root: str | None = None, data_root: str | None = None):
        self.store = store
        self.jobs = jobs
        self.max_tables = max_tables
        self.max_table_bytes = max_table_bytes  # column bytes a table may preallocate (None: no bound)
        self.memory_limit = memory_limit  # column bytes of all tables held in memory
        self.spill_root = None if spill_root is None else os.path.join(spill_root, "tables")
        self.data_root = None if data_root is None else os.path.join(data_root, "tables")
        self.resident = 0  # column bytes of the tables held in memory
        self._spilled = itertools.count()
        self.by_name: dict[str, TableEntry] = {}  # read it (``name in``), do not change it
        self._making: dict[str, list[Callable[[], None]]] = {}  # name -> creates waiting for its files

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

    def create(self, name: str, spec: dict, done: Callable) -> None:
        """Make table ``name`` with ``spec`` (see :func:`parse_spec`); ``done((entry,
        change), None)`` once made, or ``done(None, error)``.  A table already there
        with the same settings is kept as it is (change None); with other settings,
        or a bin of that name, 553.  A table in files is made on a disk thread (its
        directory cleared first: a table deleted by a server killed meanwhile)."""
        full = parse_spec(spec)
        if name in self._making:  # its files are being made: answered once they are
            self._making[name].append(lambda: self._create_again(name, spec, done))
            return
        entry = self.by_name.get(name)
        if entry is not None:  # (the rate limits may have been changed since: they do not count)
            if _fixed(entry.spec) != _fixed(full):
                raise BadNameError(f"table {name!r} exists with other settings: delete it first")
            done((entry, None), None)
            return
        nbytes, directory, keep = self._placement(name, full)
        if directory is None:
            table = self._table(full, None)
            done(self._add(name, full, table, nbytes, None), None)
            return
        self._making[name] = []

        def made(table, error) -> None:
            waiting = self._making.pop(name)
            try:
                if error is not None:
                    if not isinstance(error, RemoteError):
                        error = StorageFullError(f"cannot make the table's files: {getattr(error, 'strerror', None) or error}")
                    done(None, error)
                elif self.store.exists(name):  # a bin took the name meanwhile
                    self.jobs.run(name, _remove_files, (table, directory))
                    done(None, BadNameError(f"{name!r} is a bin: a table needs a name no bin uses"))
                else:
                    done(self._add(name, full, table, 0, directory), None)
            finally:
                for again in waiting:
                    again()

        self.jobs.run(name, self._make_files, (name, full, directory, keep), made)

    def _create_again(self, name: str, spec: dict, done: Callable) -> None:
        try:
            self.create(name, spec, done)
        except RemoteError as exc:
            done(None, exc)

    def _placement(self, name: str, full: dict) -> tuple[int, str | None, bool]:
        """``(column bytes, directory or None, keep)`` of a new table: where its
        columns live; the limits that refuse it first."""
        if self.store.exists(name):
            raise BadNameError(f"{name!r} is a bin: a table needs a name no bin uses")
        if len(self.by_name) + len(self._making) >= self.max_tables:
            raise TooLargeError(f"the server already holds {self.max_tables} tables")
        if type(full["capacity"]) is int and full["capacity"] > MAX_ROWS:
            raise TooLargeError(f"a table has at most {MAX_ROWS} rows, not {full['capacity']}")
        row_bytes = sum(math.prod(c["shape"]) * _width(c["dtype"]) for c in (full["columns"] or {}).values())
        nbytes = full["capacity"] * row_bytes
        if self.max_table_bytes is not None and nbytes > self.max_table_bytes:
            raise TooLargeError(f"{full['capacity']} rows of {row_bytes} bytes are more than the "
                                f"{self.max_table_bytes} bytes a table may take")
        if not full["columns"]:
            return nbytes, None, False  # a table of items holds them in memory: neither spilled nor durable
        if self.data_root is not None:
            return nbytes, os.path.join(self.data_root, _dir_key(name)), True
        if self.memory_limit is not None and nbytes and self.store.resident_bytes + self.resident + nbytes > self.memory_limit:
            if self.spill_root is None:
                raise StorageFullError(f"a table of {nbytes} bytes does not fit in the memory budget")
            return nbytes, os.path.join(self.spill_root, str(next(self._spilled))), False
        return nbytes, None, False

    def _make_files(self, name: str, full: dict, directory: str, keep: bool) -> Table:
        """A new table whose columns are files in ``directory`` (a disk thread)."""
        shutil.rmtree(directory, ignore_errors=True)  # (durable: a table deleted by a server killed meanwhile)
        backing = MemmapBacking(directory, keep=keep)
        try:
            table = self._table(full, backing)
            if keep:
                _write_json(os.path.join(directory, "meta.json"), tensordict_metadata(table.columns, table.capacity))
                _write_json(os.path.join(directory, "table.json"), {"name": name, "spec": _json_spec(full)})
        except BaseException:
            backing.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return table

    def _add(self, name: str, full: dict, table: Table, resident: int, directory: str | None):
        self.resident += resident
        entry = self.by_name[name] = TableEntry(name, full, table, resident=resident, directory=directory)
        return entry, self._changed(entry, "CREATE")

    @staticmethod
    def _table(full: dict, backing) -> Table:
        try:
            return Table(full["capacity"], full["columns"], full["sampler"], full["priority_exponent"],
                         full["remover"], full["max_times_sampled"], full["min_size_to_sample"],
                         full["samples_per_insert"], full["error_buffer"], backing=backing or MemoryBacking())
        except MemoryError:
            raise StorageFullError(f"no memory for a table of {full['capacity']} rows") from None
        except (TypeError, ValueError) as exc:  # a setting of the wrong kind the engine did not name
            raise TableSpecError(f"bad table settings: {exc}") from None

    def delete(self, name: str, done: Callable) -> None:
        """Remove table ``name`` from the namespace now, and its files on a disk thread
        (a durable table's too); ``done(change, None)`` once they are gone."""
        entry = self.by_name.pop(name, None)
        if entry is None:
            raise NoSuchBinError(f"no table named {name!r}")
        self.resident -= entry.resident
        change = Change(name, 0, self.store.next_seq(), "DELETE")

        def removed(_result, error) -> None:
            if error is not None:
                log.warning("could not remove the files of table %r: %s", name, error)
            done(change, None)

        self.jobs.run(name, _remove_files, (entry.table, entry.directory), removed)

    def load(self) -> tuple[int, list[str]]:
        """Reopen the tables of the data directory (at start-up, before serving);
        returns ``(tables, problems)``."""
        if self.data_root is None or not os.path.isdir(self.data_root):
            return 0, []
        problems = []
        for entry_name in sorted(os.listdir(self.data_root)):
            directory = os.path.join(self.data_root, entry_name)
            try:
                with open(os.path.join(directory, "table.json")) as f:
                    saved = json.load(f)
                name, full = saved["name"], parse_spec(saved["spec"])
                if _dir_key(name) != entry_name or name in self.by_name:
                    raise ValueError("its name does not match its directory")
                table = self._table(full, MemmapBacking(directory, keep=True, reopen=True))
            except (OSError, ValueError, KeyError, TypeError, RemoteError) as exc:
                problems.append(f"table directory {entry_name}: {exc}")
                continue
            self.by_name[name] = TableEntry(name, full, table, directory=directory,
                                            tensordict=bool(saved.get("tensordict")))
        for problem in problems:
            log.warning("data directory: skipped %s", problem)
        return len(self.by_name), problems

    def close(self) -> None:
        """The server stops: spilled tables' files go (durable ones stay)."""
        for entry in self.by_name.values():
            if self.data_root is None:
                entry.table.close()

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
        self.jobs.run(entry.name, _note_tensordict, (entry.directory, entry.name, _json_spec(entry.spec)),
                      lambda _result, _error: done())

    def insert(self, entry: TableEntry, rows, priorities) -> tuple[np.ndarray, Change]:
        """Add ``rows`` (from :meth:`rows`): their keys, and the change.  Raises the
        engine's :class:`~.tables.WouldBlockError` when the rate limiter holds it back."""
        written = self._live(entry).table.insert(rows, priorities)
        return written.keys, self._changed(entry, "INSERT")

    def write(self, entry: TableEntry, indices: np.ndarray, rows, priorities) -> tuple[np.ndarray, Change]:
        """Put ``rows`` at slot ``indices``: their keys, and the change."""
        written = self._live(entry).table.write(indices, rows, priorities)
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

    def sample(self, entry: TableEntry, n: int) -> tuple[Drawn, Change | None]:
        """Draw ``n`` rows with the table's sampler: the rows, and the change if rows
        left (those sampled ``max_times_sampled`` times).  Raises
        :class:`~.tables.WouldBlockError` or :class:`~.tables.EmptyTableError` when it
        cannot go on now."""
        table = self._live(entry).table
        gathered = self._gathered(table, n)
        drawn = table.sample(n, out=None if gathered is None else gathered.out)
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

    def read(self, entry: TableEntry, indices: np.ndarray) -> Drawn:
        """The rows at slot ``indices`` (no sample is counted)."""
        table = self._live(entry).table
        gathered = self._gathered(table, indices.size)
        rows = table.read(indices, out=None if gathered is None else gathered.out)
        return Drawn(rows, None, gathered, entry)

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

    def info(self, entry: TableEntry) -> dict:
        """The table's settings, counters and rate-limiter state as msgpack's plain
        types, with its ``seq``."""
        info = entry.table.info()
        info["seq"] = entry.seq
        return _plain(info)

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


def _remove_files(table: Table, directory: str | None) -> None:
    """Let go of a deleted table's columns and remove its files (a disk thread)."""
    table.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _note_tensordict(directory: str, name: str, spec: dict) -> None:
    """Note in a durable table's files that its rows come as TensorDicts (a disk thread)."""
    try:
        _write_json(os.path.join(directory, "table.json"), {"name": name, "spec": spec, "tensordict": True})
    except OSError as exc:
        log.warning("could not note in table %r's files that it holds TensorDicts: %s", name, exc)


def _plain(value):
    """``value`` with numpy scalars and tuples made msgpack's plain types; inf as None."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _dir_key(name: str) -> str:
    """A table's directory name: names are data, never paths."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _json_spec(full: dict) -> dict:
    spec = dict(full)
    if isinstance(spec["error_buffer"], tuple):
        spec["error_buffer"] = list(spec["error_buffer"])
    return spec


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _fixed(spec: dict) -> dict:
    """The settings of a table that cannot change while it lives."""
    return {k: v for k, v in spec.items() if k not in LIMIT_KEYS}


def _width(dtype: str) -> int:
    from tensorshare.wire.dtypes import TORCH_WIDTHS

    return TORCH_WIDTHS[dtype]
