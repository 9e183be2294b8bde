"""The table half of :class:`~.storage.Storage`: the table verbs' one way into the tables.

A handler names a table (:meth:`TableVerbs.table`: 550 if there is none, 553 for a
bin's name) and passes the handle it found back to each operation, which publishes
the change it made through the storage's sink and returns it (PROTOCOL.md §12); one
that only moves what waiting requests test (the rate limiter, priorities) touches
the table's name instead.  The tables
themselves, their files and their memory are :class:`~.tablestore.TableStore`'s
(``self.tables``); this only gives the sessions and the relay one interface for
bins and tables alike.
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import ZeroCopyUnavailableError

from .store import Change
from .tables.values import column_value, columns_in
from .tablestore import Drawn, TableEntry


class TableVerbs:
    """The table operations of :class:`~.storage.Storage` (which sets ``self.tables``)."""

    tables = None  # the TableStore
    sink = None  # the storage's ChangeSink
    sharing = None  # the storage's SharedTier

    def table(self, name: str) -> TableEntry:
        """The table named ``name`` (550 if none, 553 if a bin has the name)."""
        return self.tables.get(name)

    def is_table(self, name: str) -> bool:
        return name in self.tables.by_name

    def check_table_replacement(self, name: str, spec: dict) -> None:
        """Refuse (501, 552, 452) a table made with ``spec`` to replace table ``name``
        as TCREATE would refuse it were ``name`` gone; nothing changes either way."""
        self.tables.check_replacement(name, spec)

    def table_entries(self) -> list[TableEntry]:
        """Every table, as the operations pages show them."""
        return list(self.tables.by_name.values())

    def create_table(self, name: str, spec: dict, done: Callable, add_columns: bool = False) -> None:
        """TCREATE: ``done((table, change or None), None)`` once made (files on a disk
        thread), or ``done(None, error)``; ``add_columns``: a table there may gain columns."""
        def made(result, error) -> None:
            if error is None and result[1] is not None:
                self.sink.publish(result[1])
            done(result, error)

        self.tables.create(name, spec, made, add_columns)

    def table_rows(self, table: TableEntry, description: bytes, payload, nbytes: int, limits):
        """A request's value as rows of ``table`` (see :meth:`TableStore.rows`)."""
        return self.tables.rows(table, description, payload, nbytes, limits)

    def shared_table_rows(self, table: TableEntry, connection: str, shm_name: object, description: bytes,
                          nbytes: int, limits, kept):
        """A request's value as rows of ``table`` (a table of columns), from the item
        directory a same-host client wrote to ``incoming/<connection>/<shm_name>``
        (PROTOCOL.md §10.4), on the caller's thread (the files are in memory, tmpfs):
        its array files checked as an adopted item's are the first time, then kept
        open and mapped by ``kept``, the connection's :class:`~.keptrows.KeptRows`, for
        its next inserts (so a value of many columns costs its checks once, not a hop
        to a disk thread each time); handed on as they are to a table whose files take
        them with system calls only (:attr:`~.tables.Table.takes_mapped_rows`), else
        read (copied).  Raises :class:`~tensorshare.errors.ZeroCopyUnavailableError` if
        it cannot be taken (nothing changed), 501 for a value that is not the table's kind."""
        desc = self._shared_value(table, description, nbytes, limits)
        mapped = table.table.takes_mapped_rows
        return columns_in(desc, self.sharing.take_rows_now(connection, shm_name, description, nbytes, limits, kept,
                                                           mapped))

    def _shared_value(self, table: TableEntry, description: bytes, nbytes: int, limits):
        if not self.sharing.takes_rows:
            raise ZeroCopyUnavailableError("this server takes rows over TCP only")
        if not table.table.columns:
            raise ZeroCopyUnavailableError("a table of items takes its rows over TCP")
        return column_value(description, nbytes, limits)

    def says_tensordict(self, table: TableEntry) -> bool:
        return self.tables.says_tensordict(table)

    def mark_tensordict(self, table: TableEntry, done: Callable[[], None]) -> None:
        """Rows of ``table`` came as TensorDicts: ``done()`` once it says so (in its files, if durable)."""
        self.tables.mark_tensordict(table, done)

    def insert_rows(self, table: TableEntry, rows, priorities, ends=None):
        """TINSERT: ``(keys, change)``; raises WouldBlockError while the rate limiter holds it."""
        return self._published(self.tables.insert(table, rows, priorities, ends))

    def can_insert(self, table: TableEntry, rows) -> bool:
        return self.tables.can_insert(table, rows)

    def write_rows(self, table: TableEntry, indices, rows, priorities, ends=None, times_sampled=None):
        """TWRITE: ``(keys, change)``."""
        return self._published(self.tables.write(table, indices, rows, priorities, ends, times_sampled))

    def sample_rows(self, table: TableEntry, n: int, length: int | None = None,
                    pad: bool = False) -> tuple[Drawn, Change | None]:
        """TSAMPLE: ``(rows, change or None)`` (with ``length``: ``n`` sequences of that
        many rows); raises WouldBlockError or EmptyTableError for now.  Rows that
        reached ``max_times_sampled`` left (a change); else only the rate limiter moved."""
        return self._sampled(table, self.tables.sample(table, n, length, pad))

    def can_sample(self, table: TableEntry, n: int) -> bool:
        return self.tables.can_sample(table, n)

    def read_rows(self, table: TableEntry, indices, sampled: bool = False,
                  empty: bool = False) -> tuple[Drawn, Change | None]:
        """TREAD: ``(rows, change or None)`` at the slot indices (``sampled``: counted as
        a sample, raises WouldBlockError for now; ``empty``: empty slots read as key -1)."""
        result = self.tables.read(table, indices, sampled, empty)
        return self._sampled(table, result) if sampled else result

    def can_read_rows(self, table: TableEntry, n: int) -> bool:
        return self.tables.can_read(table, n)

    def check_rows_reply(self, table: TableEntry, n: int) -> None:
        """552 or 452 for a TSAMPLE/TREAD of ``n`` rows whose reply would be too large
        or not fit in memory, before anything is drawn."""
        self.tables.check_reply(table, n)

    def hold_reply(self, nbytes: int) -> Callable[[], None]:
        """``nbytes`` of gathered rows are in a reply being written: counted in the
        memory budget until the callable returned is called (written or abandoned)."""
        return self.tables.hold_reply(nbytes)

    def update_priorities(self, table: TableEntry, keys, priorities) -> int:
        """TPRIORITY: how many rows were updated (what waits on the table is tested again)."""
        updated = self.tables.update_priorities(table, keys, priorities)
        if updated:
            self.sink.touched(table.name)
        return updated

    def set_table_limits(self, table: TableEntry, limits: dict) -> None:
        """TLIMITS: at once; what waits on the table is tested again."""
        self.tables.set_limits(table, limits)
        self.sink.touched(table.name)

    def table_info(self, table: TableEntry, slots: int | None = None) -> dict:
        """TINFO's settings and counters (``slots``: a page of the occupied slots from that index)."""
        return self.tables.info(table, slots)

    def note_blocked(self, table: TableEntry, what: str, seconds: float) -> None:
        """A request waited ``seconds`` for ``table``'s rate limiter (``what``: insert or sample)."""
        self.tables.note_blocked(table, what, seconds)

    def _published(self, result: tuple):
        """``result`` (``(anything, change)``), once its change is published."""
        self.sink.publish(result[1])
        return result

    def _sampled(self, table: TableEntry, result: tuple):
        """``result`` of a sample, once told: its change if rows left, else the rate limiter moved."""
        change = result[1]
        if change is not None:
            self.sink.publish(change)
        else:
            self.sink.touched(table.name)
        return result
