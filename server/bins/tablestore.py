"""The server's tables by name: made, found, listed, deleted, reloaded (issue #19).

A table is a kind of bin: its name is in the one namespace of bins (a name is a
bin or a table, never both), it shows in LIST with its row count, its changes get
sequence numbers from the bin store's counter and reach listeners like a bin's.
The rows themselves are the pure :class:`~.tables.Table`'s; where its columns live
is the backing's, chosen here:

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

Making a table creates its files with their blocks reserved (``posix_fallocate``:
no data is written, and a file system without room refuses the table with 452
rather than killing the server with SIGBUS on a later write into a mapped page) and
runs on the caller's thread, as the rest of a table's work does.
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
from typing import Any

from tensorshare.errors import BadNameError, NoSuchBinError, RemoteError, StorageFullError, TooLargeError

from .store import BinStore, Change
from .tables import MemmapBacking, MemoryBacking, Table, TableSpecError, state_bytes, tensordict_metadata
from .tables.columns import parse_columns
from .tables.values import gathered_bytes

log = logging.getLogger("tensorshare.server")

# The settings a table is made with: name -> default (PROTOCOL.md §12).
SPEC_DEFAULTS: dict[str, Any] = {
    "capacity": None, "columns": None, "sampler": "uniform", "priority_exponent": 1.0, "remover": "fifo",
    "max_times_sampled": 0, "min_size_to_sample": 1, "samples_per_insert": None, "error_buffer": None,
}
LIMIT_KEYS = ("min_size_to_sample", "samples_per_insert", "error_buffer")
# Slots a table may have, and all tables of a server together by default: each
# costs 41-137 bytes of state in memory (key, priority, count, order, the samplers'
# trees: tables.state_bytes), whatever the columns hold.
MAX_ROWS = 1 << 26


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


@dataclass
class TableEntry:
    """One table of the server: its settings as made, the table, its last change's seq."""

    name: str
    spec: dict
    table: Table
    seq: int = 0
    resident: int = 0  # bytes it holds in memory beside its items: its per-slot state, columns not in files
    directory: str | None = None  # its files (spilled or durable)
    tensordict: bool = False  # rows came as TensorDicts: replies say so (clients give TensorDicts back)
    items: Any = None  # a table of items' slots (_CountedItems)


class TableStore:
    """The tables of one server, beside the bins of ``store`` (one namespace)."""

    def __init__(self, store: BinStore, max_tables: int = 10_000, max_table_bytes: int | None = None, *,
                 memory_limit: int | None = None, spill_root: str | None = None, data_root: str | None = None,
                 max_rows: int = MAX_ROWS, on_grow=None):
        self.store = store
        self.max_tables = max_tables
        self.max_table_bytes = max_table_bytes  # column bytes a table may preallocate (None: no bound)
        self.max_rows = max_rows  # slots of all tables together
        self.memory_limit = memory_limit  # of the bins and the tables' memory together (store.table_bytes)
        self.spill_root = None if spill_root is None else os.path.join(spill_root, "tables")
        self.data_root = None if data_root is None else os.path.join(data_root, "tables")
        self.rows = 0  # slots of all tables
        # What one TSAMPLE/TREAD reply may carry (the server's max_outbound and
        # max_reply_header): the rows are gathered into new memory before any byte goes.
        self.max_reply_bytes: int | None = None
        self.max_reply_header: int | None = None
        self.on_grow = on_grow or (lambda: None)  # tables took memory: the bins may have to spill to make room
        self._spilled = itertools.count()
        self._tables: dict[str, TableEntry] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def current(self, name: str) -> TableEntry | None:
        """The table named ``name`` now, or None."""
        return self._tables.get(name)

    def get(self, name: str) -> TableEntry:
        entry = self._tables.get(name)
        if entry is None:
            if self.store.state(name)[0]:
                raise BadNameError(f"{name!r} is a bin, not a table")
            raise NoSuchBinError(f"no table named {name!r}")
        return entry

    def create(self, name: str, spec: dict) -> tuple[TableEntry, Change | None]:
        """Make table ``name`` with ``spec`` (see :func:`parse_spec`).  A table already
        there with the same settings is kept as it is (change None); with other
        settings, or a bin of that name, 553."""
        full = parse_spec(spec)
        entry = self._tables.get(name)
        if entry is not None:  # (the rate limits may have been changed since: they do not count)
            if _fixed(entry.spec) != _fixed(full):
                raise BadNameError(f"table {name!r} exists with other settings: delete it first")
            return entry, None
        if self.store.state(name)[0]:
            raise BadNameError(f"{name!r} is a bin: a table needs a name no bin uses")
        if len(self._tables) >= self.max_tables:
            raise TooLargeError(f"the server already holds {self.max_tables} tables")
        capacity = full["capacity"]
        if type(capacity) is int and capacity > MAX_ROWS:
            raise TooLargeError(f"a table has at most {MAX_ROWS} rows, not {capacity}")
        row_bytes = sum(math.prod(c["shape"]) * _width(c["dtype"]) for c in (full["columns"] or {}).values())
        if self.max_table_bytes is not None and capacity * row_bytes > self.max_table_bytes:
            raise TooLargeError(f"{capacity} rows of {row_bytes} bytes are more than the "
                                f"{self.max_table_bytes} bytes a table may take")
        if type(capacity) is int and self.rows + capacity > self.max_rows:
            raise TooLargeError(f"the server's tables already have {self.rows} of the {self.max_rows} rows "
                                f"they may have together: no room for {capacity} more")
        state = 0
        if type(capacity) is int and capacity > 0 and isinstance(full["sampler"], str):
            state = state_bytes(capacity, full["sampler"], full["remover"], items=not full["columns"])
        store, limit = self.store, self.memory_limit
        if limit is not None and store.unspillable_bytes + state > limit:
            raise StorageFullError(f"a table of {capacity} rows keeps {state} bytes of state in memory, and the "
                                   f"memory budget has {max(0, limit - store.unspillable_bytes)} that spilling "
                                   f"bins cannot take")
        nbytes = capacity * row_bytes
        directory = backing = None
        if not full["columns"]:
            # A table of items holds them in memory, as received (counted: _CountedItems);
            # it is neither spilled nor durable.
            backing = _ItemsBacking(store)
        elif self.data_root is not None:
            directory = os.path.join(self.data_root, _dir_key(name))
            shutil.rmtree(directory, ignore_errors=True)  # a table deleted by a server killed meanwhile
            backing = MemmapBacking(directory, keep=True)
        elif (limit is not None and nbytes
              and store.resident_bytes + store.unspillable_bytes + state + nbytes > limit):
            if self.spill_root is None:
                raise StorageFullError(f"a table of {nbytes} bytes does not fit in the memory budget")
            directory = os.path.join(self.spill_root, str(next(self._spilled)))
            backing = MemmapBacking(directory, keep=False)
        try:
            table = self._table(full, backing)
            if directory is not None and self.data_root is not None:
                _write_json(os.path.join(directory, "meta.json"), tensordict_metadata(table.columns, table.capacity))
                _write_json(os.path.join(directory, "table.json"), {"name": name, "spec": _json_spec(full)})
        except OSError as exc:
            if backing is not None:
                backing.close()
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
            raise StorageFullError(f"cannot make the table's files: {exc.strerror or exc}") from None
        entry = self._tables[name] = TableEntry(name, full, table, directory=directory,
                                                items=backing.slots if isinstance(backing, _ItemsBacking) else None)
        self._count(entry, state + (nbytes if backing is None else 0))
        return entry, self.changed(entry, "CREATE")

    def _count(self, entry: TableEntry, resident: int) -> None:
        """``entry``'s table is made: its slots and memory count from now on."""
        entry.resident = resident
        self.rows += entry.table.capacity
        self.store.table_bytes += resident
        self.on_grow()

    def check_reply(self, entry: TableEntry, n: int) -> int:
        """The payload bytes of a TSAMPLE/TREAD reply of ``n`` rows of ``entry``'s table,
        checked before anything is drawn or gathered: 552 past ``max_reply_bytes``
        (its gathered columns) or ``max_reply_header`` (8 bytes a row for each of keys,
        indices and probabilities, and a table of items' descriptions), 452 if the
        memory budget cannot take the gathered rows."""
        table = entry.table
        per_row = 24
        if entry.items is not None:
            per_row += entry.items.largest
        if self.max_reply_header is not None and n * per_row > self.max_reply_header:
            raise TooLargeError(f"a reply of {n} rows would have a header of {n * per_row} bytes, more than the "
                                f"{self.max_reply_header} one may have (max_reply_header): ask for fewer rows")
        nbytes = gathered_bytes(table.columns, n)
        if self.max_reply_bytes is not None and nbytes > self.max_reply_bytes:
            raise TooLargeError(f"{n} rows are {nbytes} bytes, more than the {self.max_reply_bytes} one reply may "
                                f"carry (max_outbound): ask for at most {self.max_reply_bytes // max(1, nbytes // n)}")
        self.check_room(nbytes)
        return nbytes

    def hold_reply(self, nbytes: int):
        """``nbytes`` of gathered rows are in a reply being written: the memory budget
        counts them until the returned callable is called (written, or abandoned)."""
        store = self.store
        store.in_flight_bytes += nbytes
        done = []

        def release() -> None:
            if not done:
                done.append(True)
                store.in_flight_bytes -= nbytes
        return release

    def check_room(self, nbytes: int) -> None:
        """452 unless ``nbytes`` more (an item for a table of items) fit in the memory
        budget beside what spilling the bins cannot free."""
        limit = self.memory_limit
        if limit is not None and self.store.unspillable_bytes + nbytes > limit:
            raise StorageFullError(f"memory budget full: tables hold {self.store.table_bytes} bytes, and "
                                   f"{self.store.unspillable_bytes - self.store.table_bytes} more cannot be spilled")

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

    def load(self) -> tuple[int, list[str]]:
        """Reopen the tables of the data directory; returns ``(tables, problems)``."""
        if self.data_root is None or not os.path.isdir(self.data_root):
            return 0, []
        problems = []
        for entry_name in sorted(os.listdir(self.data_root)):
            directory = os.path.join(self.data_root, entry_name)
            try:
                with open(os.path.join(directory, "table.json")) as f:
                    saved = json.load(f)
                name, full = saved["name"], parse_spec(saved["spec"])
                if _dir_key(name) != entry_name or name in self._tables:
                    raise ValueError("its name does not match its directory")
                table = self._table(full, MemmapBacking(directory, keep=True, reopen=True))
            except (OSError, ValueError, KeyError, TypeError, RemoteError) as exc:
                problems.append(f"table directory {entry_name}: {exc}")
                continue
            entry = self._tables[name] = TableEntry(name, full, table, directory=directory,
                                                    tensordict=bool(saved.get("tensordict")))
            self._count(entry, state_bytes(table.capacity, full["sampler"], full["remover"]))
        for problem in problems:
            log.warning("data directory: skipped %s", problem)
        return len(self._tables), problems

    def mark_tensordict(self, entry: TableEntry) -> None:
        """Rows of ``entry`` came as TensorDicts: replies say so from now on (and after a
        restart, for a durable table)."""
        if entry.tensordict:
            return
        entry.tensordict = True
        if self.data_root is not None and entry.directory is not None:
            try:
                _write_json(os.path.join(entry.directory, "table.json"),
                            {"name": entry.name, "spec": _json_spec(entry.spec), "tensordict": True})
            except OSError as exc:
                log.warning("could not note in table %r's files that it holds TensorDicts: %s", entry.name, exc)

    def changed(self, entry: TableEntry, op: str) -> Change:
        """A change of ``entry``'s table, numbered, for its listeners."""
        entry.seq = self.store.next_seq()
        return Change(entry.name, entry.table.size, entry.seq, op)

    def delete(self, name: str) -> Change:
        entry = self._tables.pop(name, None)
        if entry is None:
            raise NoSuchBinError(f"no table named {name!r}")
        entry.table.close()
        self.store.table_bytes -= entry.resident
        self.rows -= entry.table.capacity
        if entry.directory is not None:
            shutil.rmtree(entry.directory, ignore_errors=True)
        return Change(name, 0, self.store.next_seq(), "DELETE")

    def close(self) -> None:
        """The server stops: spilled tables' files go (durable ones stay)."""
        for entry in self._tables.values():
            if self.data_root is None:
                entry.table.close()

    def listing(self) -> dict[str, int]:
        return {name: entry.table.size for name, entry in self._tables.items()}

    def state(self, name: str) -> tuple[bool, int, int, None]:
        entry = self._tables[name]
        return True, entry.table.size, entry.seq, None


class _CountedItems(list):
    """The slots of a table of items, whose items' bytes (payload and description,
    all in memory) the bin store counts in ``table_bytes`` while the table holds them."""

    def __init__(self, capacity: int, store: BinStore):
        super().__init__([None] * capacity)
        self.store = store
        self.held = 0  # bytes of the items it holds
        self.largest = 0  # the longest description it ever held (bounds a reply's header)

    def __setitem__(self, slot: int, item) -> None:
        old = self[slot]
        change = (0 if item is None else item.nbytes + len(item.description)) - \
            (0 if old is None else old.nbytes + len(old.description))
        self.held += change
        self.store.table_bytes += change
        if item is not None and len(item.description) > self.largest:
            self.largest = len(item.description)
        super().__setitem__(slot, item)

    def let_go(self) -> None:
        """The table is gone: its items count no more."""
        self.store.table_bytes -= self.held
        self.held = 0


class _ItemsBacking(MemoryBacking):
    """A table of items' backing: its slots count what they hold (:class:`_CountedItems`)."""

    def __init__(self, store: BinStore):
        self.store = store
        self.slots: _CountedItems | None = None

    def item_slots(self, capacity: int) -> list:
        self.slots = _CountedItems(capacity, self.store)
        return self.slots

    def close(self) -> None:
        if self.slots is not None:
            self.slots.let_go()
            self.slots = None


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
