"""The server's tables by name: made, found, listed, deleted (issue #19).

A table is a kind of bin: its name is in the one namespace of bins (a name is a
bin or a table, never both), it shows in LIST with its row count, its changes get
sequence numbers from the bin store's counter and reach listeners like a bin's.
The rows themselves are the pure :class:`~.tables.Table`'s; where its columns live
(memory, or memory-mapped files) is the backing's, chosen by :class:`TableStore`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tensorshare.errors import BadNameError, NoSuchBinError, StorageFullError, TooLargeError

from .store import BinStore, Change
from .tables import Table, TableSpecError
from .tables.columns import parse_columns

# The settings a table is made with: name -> default (PROTOCOL.md §11).
SPEC_DEFAULTS: dict[str, Any] = {
    "capacity": None, "columns": None, "sampler": "uniform", "priority_exponent": 1.0, "remover": "fifo",
    "max_times_sampled": 0, "min_size_to_sample": 1, "samples_per_insert": None, "error_buffer": None,
}
LIMIT_KEYS = ("min_size_to_sample", "samples_per_insert", "error_buffer")


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


class TableStore:
    """The tables of one server, beside the bins of ``store`` (one namespace)."""

    def __init__(self, store: BinStore, max_tables: int = 10_000, max_table_bytes: int | None = None):
        self.store = store
        self.max_tables = max_tables
        self.max_table_bytes = max_table_bytes  # column bytes a table may preallocate (None: no bound)
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
        row_bytes = sum(math.prod(c["shape"]) * _width(c["dtype"]) for c in (full["columns"] or {}).values())
        if self.max_table_bytes is not None and full["capacity"] * row_bytes > self.max_table_bytes:
            raise TooLargeError(f"{full['capacity']} rows of {row_bytes} bytes are more than the "
                                f"{self.max_table_bytes} bytes a table may take")
        try:
            table = Table(full["capacity"], full["columns"], full["sampler"], full["priority_exponent"],
                          full["remover"], full["max_times_sampled"], full["min_size_to_sample"],
                          full["samples_per_insert"], full["error_buffer"])
        except MemoryError:
            raise StorageFullError(f"no memory for a table of {full['capacity']} rows") from None
        except (TypeError, ValueError) as exc:  # a setting of the wrong kind the engine did not name
            raise TableSpecError(f"bad table settings: {exc}") from None
        entry = self._tables[name] = TableEntry(name, full, table)
        return entry, self.changed(entry, "CREATE")

    def changed(self, entry: TableEntry, op: str) -> Change:
        """A change of ``entry``'s table, numbered, for its listeners."""
        entry.seq = self.store.next_seq()
        return Change(entry.name, entry.table.size, entry.seq, op)

    def delete(self, name: str) -> Change:
        entry = self._tables.pop(name, None)
        if entry is None:
            raise NoSuchBinError(f"no table named {name!r}")
        entry.table.close()
        return Change(name, 0, self.store.next_seq(), "DELETE")

    def listing(self) -> dict[str, int]:
        return {name: entry.table.size for name, entry in self._tables.items()}

    def state(self, name: str) -> tuple[bool, int, int, None]:
        entry = self._tables[name]
        return True, entry.table.size, entry.seq, None


def _fixed(spec: dict) -> dict:
    """The settings of a table that cannot change while it lives."""
    return {k: v for k, v in spec.items() if k not in LIMIT_KEYS}


def _width(dtype: str) -> int:
    from tensorshare.wire.dtypes import TORCH_WIDTHS

    return TORCH_WIDTHS[dtype]
