"""What the tables take of the server's memory budget, counted where the bins' memory is.

The bin store's ``table_bytes`` (``server/bins/store.py``) is the tables' share of
the one memory budget, which spilling bins cannot free: each table's per-slot state
and samplers' indexes (known before it is made: ``tables.state_bytes``), its
columns while they are held in memory, and a table of items' items (payload and
description, all in memory: :class:`CountedItems`).  :class:`TableMemory` checks
what a new table, new columns, an item or a sample's reply would take before it is
taken (452, :class:`~tensorshare.errors.StorageFullError`, when it does not fit;
552 for a reply larger than one may be), and counts a reply's gathered rows until
the reply is written (:meth:`TableMemory.hold_reply`).  Everything here runs on the
reactor thread.
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import StorageFullError, TooLargeError

from .store import BinStore
from .tables import MemoryBacking
from .tables.values import gathered_bytes


# Bytes of Python objects each row of a table of items' reply needs while it is made:
# the slot as an int and the entries of the lists of items, descriptions, sizes and
# payload parts that the reply's header and payload are built from.
ITEM_ROW_BYTES = 80


class CountedItems(list):
    """The slots of a table of items, whose items' bytes (payload and description,
    all in memory) the bin store counts in ``table_bytes`` while the table holds them."""

    def __init__(self, capacity: int, store: BinStore):
        super().__init__([None] * capacity)
        self.store = store
        self.held = 0  # bytes of the items it holds
        self.largest = 0  # the longest description it ever held (bounds a reply's header)
        self.largest_payload = 0  # the largest payload it ever held (bounds a reply's payload)

    def __setitem__(self, slot: int, item) -> None:
        old = self[slot]
        change = (0 if item is None else item.nbytes + len(item.description)) - \
            (0 if old is None else old.nbytes + len(old.description))
        self.held += change
        self.store.table_bytes += change
        if item is not None:
            self.largest = max(self.largest, len(item.description))
            self.largest_payload = max(self.largest_payload, item.nbytes)
        super().__setitem__(slot, item)

    def let_go(self) -> None:
        """The table is gone: its items count no more (on the reactor thread)."""
        self.store.table_bytes -= self.held
        self.held = 0


class ItemsBacking(MemoryBacking):
    """A table of items' backing: its slots count what they hold (:class:`CountedItems`)."""

    def __init__(self, store: BinStore):
        self.store = store
        self.slots: CountedItems | None = None

    def item_slots(self, capacity: int) -> list:
        self.slots = CountedItems(capacity, self.store)
        return self.slots


class TableMemory:
    """The tables' checks and counts against the memory budget of ``store`` (see the
    module docstring).  ``max_reply_bytes`` and ``max_reply_header`` bound what one
    TSAMPLE/TREAD reply may carry (the server's max_outbound and max_reply_header):
    its rows are gathered into new memory before any byte goes.  ``on_grow()``:
    tables took memory, the bins may have to spill to make room."""

    def __init__(self, store: BinStore, memory_limit: int | None, on_grow: Callable[[], None]):
        self.store = store
        self.memory_limit = memory_limit  # of the bins and the tables' memory together (store.table_bytes)
        self.on_grow = on_grow
        self.max_reply_bytes: int | None = None
        self.max_reply_header: int | None = None

    def check_state(self, capacity: int, state: int) -> None:
        """452 unless a new table's ``state`` bytes (its per-slot state and indexes) fit
        beside what spilling bins cannot free."""
        store, limit = self.store, self.memory_limit
        if limit is not None and store.unspillable_bytes + state > limit:
            raise StorageFullError(f"a table of {capacity} rows keeps {state} bytes of state in memory, and the "
                                   f"memory budget has {max(0, limit - store.unspillable_bytes)} that spilling "
                                   f"bins cannot take")

    def over_budget(self, nbytes: int) -> bool:
        """Would ``nbytes`` more in memory pass ``memory_limit``, beside the bins'
        resident bytes and what spilling them cannot free?"""
        store = self.store
        return (self.memory_limit is not None and nbytes > 0
                and store.resident_bytes + store.unspillable_bytes + nbytes > self.memory_limit)

    def in_use(self) -> int:
        """The budget's bytes in use: the bins' resident bytes and what spilling them cannot free."""
        return self.store.resident_bytes + self.store.unspillable_bytes

    def took(self, nbytes: int) -> None:
        """Tables hold ``nbytes`` more (fewer, if negative) in memory."""
        self.store.table_bytes += nbytes
        if nbytes > 0:
            self.on_grow()

    def check_room(self, nbytes: int) -> None:
        """452 unless ``nbytes`` more (an item for a table of items) fit in the memory
        budget beside what spilling the bins cannot free."""
        limit = self.memory_limit
        if limit is not None and self.store.unspillable_bytes + nbytes > limit:
            raise StorageFullError(f"memory budget full: tables hold {self.store.table_bytes} bytes, and "
                                   f"{self.store.unspillable_bytes - self.store.table_bytes} more cannot be spilled")

    def check_reply(self, columns, n: int, longest_description: int, largest_payload: int = 0) -> int:
        """The memory a TSAMPLE/TREAD reply of ``n`` rows of a table with ``columns``
        takes while it is made and written, checked before anything is drawn or
        gathered: 552 past ``max_reply_bytes`` (its payload: gathered columns, or
        for a table of items, of which its largest description and payload are
        given, as many copies of the largest item) or ``max_reply_header`` (8 bytes a
        row for each of keys, indices and probabilities, and a table of items'
        descriptions and sizes), 452 if the memory budget cannot take it (gathered
        columns; for a table of items, whose payload refers to the items held, its
        header and the objects that list its rows, :data:`ITEM_ROW_BYTES` a row)."""
        per_row = 24 + (longest_description + 9 if not columns else 0)
        if self.max_reply_header is not None and n * per_row > self.max_reply_header:
            raise TooLargeError(f"a reply of {n} rows would have a header of {n * per_row} bytes, more than the "
                                f"{self.max_reply_header} one may have (max_reply_header): ask for fewer rows")
        payload = gathered_bytes(columns, n) if columns else n * largest_payload
        if self.max_reply_bytes is not None and payload > self.max_reply_bytes:
            raise TooLargeError(f"{n} rows are up to {payload} bytes, more than the {self.max_reply_bytes} one reply "
                                f"may carry (max_outbound): ask for at most "
                                f"{self.max_reply_bytes // max(1, payload // n)}")
        held = payload if columns else n * (per_row + ITEM_ROW_BYTES)
        self.check_room(held)
        return held

    def hold_reply(self, nbytes: int) -> Callable[[], None]:
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
