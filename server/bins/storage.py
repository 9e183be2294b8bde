"""The one interface to a server's bins and tables: the handlers' and the relay's way in.

:class:`Storage` wraps the pure :class:`~.store.BinStore` and the
:class:`~.tablestore.TableStore` (one namespace of names) for the sessions: reads
(``state``, ``count``, ``seq``, ``listing``, ``peek``, ``take``, ``restore``,
``read``), writes (``add``, ``adopt``, ``delete``), a relay's mirror of another
server's bins (``mirror``, ``unmirror``, ``reserve_seq``) and the table verbs
(``create_table``, ``insert_rows``, ``sample_rows``...).  Every operation that
changes something publishes the :class:`~.store.Change` it made through the
:class:`ChangeSink` given at construction (the server's listener registry: the
bin's listeners are told, requests waiting on it are tested again), before it
returns the change (or calls back with it); a change only waiting requests care
about (bytes that came for an item put by reference, a table's rate limiter that
moved) is ``touched``.  No caller has to remember to publish.  Storage decides what must touch the disk first;
every blocking file operation runs through a :class:`~.jobs.Jobs` runner (the
server's disk threads; a synchronous one in tests), whose completion callbacks
come back on the caller's (reactor) thread.

* Memory only (no limit, no data directory): every call completes at once.
* ``memory_limit``: past the budget, least recently used items are written to the
  spill area and then served from their files (:mod:`.budget`: backpressure,
  452 once spilling fails).
* ``data_dir``: a PUT/APPEND is acknowledged only once its item is on disk; a
  DELETE once its bin is gone from disk; a GET moves the bin's floor.  Every item
  has its files, so going over budget only drops the in-memory copy.
* ``shm`` (same-host zero-copy, :mod:`.sharing`): the areas offered to clients on
  this host, values they wrote into shared memory, copies made there for readers.

Files of items that left the store go once nothing refers to them (:mod:`.lifetimes`).
"""

from __future__ import annotations

import errno
import itertools
import logging
from typing import Callable, Protocol

from tensorshare.disk.layout import StoredItem
from tensorshare.errors import (
    BadNameError, BadRequestError, RemoteError, ServerLocalError, StorageFullError, ZeroCopyUnavailableError,
)
from tensorshare.wire.description import DEFAULT_LIMITS, DecodeLimits

from .budget import MemoryBudget
from .durable import DataDir
from .jobs import Jobs
from .lifetimes import FileLifetimes
from .sharing import SharedTier
from .shm import ShmArea
from .spill import ItemFiles, SpillArea
from .store import BinState, BinStore, Change, Item, Reference, retier
from .tablestore import TableStore
from .tableverbs import TableVerbs
from .view import StorageView

log = logging.getLogger("tensorshare.server")

Done = Callable[[Change | None, RemoteError | None], None]

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class ChangeSink(Protocol):
    """Where :class:`Storage` tells of its changes (the server's listener registry)."""

    def publish(self, change: Change) -> None:
        """Bin (or table) ``change.bin`` changed: tell its listeners and test what waits on it."""

    def touched(self, name: str) -> None:
        """Something only requests waiting on ``name`` care about changed: test them again."""


class Unheard:
    """The sink of a storage used alone (tools, tests of the store): nobody listens."""

    def publish(self, change: Change) -> None:
        pass

    def touched(self, name: str) -> None:
        pass


def _storage_error(exc: BaseException, what: str) -> RemoteError:
    """The reply to a write that failed: 452 for the disk (trying again later may
    work), 501 for a value that cannot be written at all."""
    if isinstance(exc, OSError):
        reason = "disk full" if exc.errno in _DISK_FULL else "disk error"
        return StorageFullError(f"{what}: {reason}: {exc.strerror or exc}")
    return BadRequestError(f"{what}: this value cannot be stored: {exc}")


class Storage(TableVerbs):
    """The bins and tables as the sessions use them (see the module docstring); the
    table verbs' operations are :class:`~.tableverbs.TableVerbs`'."""

    def __init__(self, store: BinStore, jobs: Jobs, *, data_dir: DataDir | None = None,
                 spill: SpillArea | None = None, shm: ShmArea | None = None, sink: ChangeSink | None = None):
        self.store = store
        self.sink = Unheard() if sink is None else sink
        self._publish = self.sink.publish  # (bound once: the request path publishes every change)
        self.jobs = jobs
        self.data_dir = data_dir
        self.spill = spill
        self.shm = shm
        self._numbers = itertools.count(1)
        self.problems: list[str] = []  # what loading the data directory skipped
        self._taken: dict[str, list[Item]] = {}  # durable: items of GETs whose replies are not written yet
        self._committing: dict[str, int] = {}  # durable: PUTs and APPENDs of a bin on their way to the disk
        self.lifetimes = FileLifetimes(jobs)
        self.budget = MemoryBudget(store, jobs, spill, self.lifetimes)
        # room(): False while memory is over budget and spills that would free it are running
        # (asked per read of requests: the budget's own method, no call in between).
        self.room: Callable[[], bool] = self.budget.room
        self.sharing = SharedTier(jobs, self.lifetimes, shm,
                                  (("shm_area", shm and shm.path, True), ("spill_area", spill and spill.items, False),
                                   ("data_area", data_dir and data_dir.root, False)),
                                  takes_incoming=data_dir is None)
        # Tables share the bins' namespace (see _not_a_table) and the disk tiers.
        self.tables = TableStore(store, jobs, memory_limit=store.memory_limit, spill_root=spill and spill.items,
                                 data_root=data_dir and data_dir.root, on_grow=self.budget.enforce,
                                 fsync=data_dir is not None and data_dir.fsync)
        self._table_names = self.tables.by_name  # (`in` on the dict itself: the request path asks every time)
        self.view = StorageView(self)  # what the operations pages read (read-only)

    @property
    def durable(self) -> bool:
        return self.data_dir is not None

    # -- the areas same-host clients may map (.sharing)

    def share(self, token: str) -> None:
        """Offer this store's directories to same-host clients (see :meth:`SharedTier.share`)."""
        self.sharing.share(token)
        self.budget.area = self.sharing.spill_area

    @property
    def areas(self):
        return self.sharing.areas

    @property
    def token(self) -> str | None:
        return self.sharing.token

    @property
    def shm_area(self):
        return self.sharing.shm_area

    @property
    def data_area(self):
        return self.sharing.data_area

    @property
    def takes_incoming(self) -> bool:
        return self.sharing.takes_incoming

    @property
    def takes_rows(self) -> bool:
        return self.sharing.takes_rows

    def open_incoming(self, done: Callable[[str | None, BaseException | None], None]) -> None:
        self.sharing.open_incoming(done)

    def close_incoming(self, incoming: str) -> None:
        self.sharing.close_incoming(incoming)

    def promote(self, item: Item) -> None:
        self.sharing.promote(item)

    def promote_now(self, item: Item) -> bool:
        return self.sharing.promote_now(item)

    def share_rows(self, description: bytes, buffer, nbytes: int) -> ItemFiles | None:
        return self.sharing.share_rows(description, buffer, nbytes)

    # -- start-up

    def load(self) -> int:
        """Rebuild the bins from the data directory (items stay on disk); returns the item count."""
        loaded = self.data_dir.load()
        self.problems = loaded.problems
        self._numbers = itertools.count(loaded.next_number)
        count = 0
        for name, found in loaded.bins.items():
            items = []
            for number, stored in found.items:
                item = Item(stored.description, None, stored.nbytes, stored.tag,
                            ItemFiles.of(stored, lane=name, number=number, area=self.data_area))
                items.append(item)
                self.lifetimes.watch(item)
            self.store.load(name, items)
            count += len(items)
        _, problems = self.tables.load()
        self.problems += problems
        # past every seq before a clean stop; after a kill, past the items' numbers only (PROTOCOL.md §4.4)
        self.store.continue_from(max(loaded.next_number, loaded.seq))
        return count

    # -- writes

    def add_now(self, name: str, description: bytes, segments: tuple, nbytes: int, tag: int | None,
                replace: bool) -> Change:
        """PUT (``replace``) or APPEND a value (its description blob, its payload
        segments as received, their bytes, its tag) in memory, at once (spilled later
        if the budget says so), never in the data directory; the change."""
        return self._add_now(name, Item(description, segments, nbytes, tag), replace)

    def _add_now(self, name: str, item: Item, replace: bool) -> Change:
        if name in self._table_names:
            raise _is_a_table(name)
        store = self.store
        limit = store.memory_limit
        if limit is not None:
            held = len(item.description) if item.device is None else len(item.description) + item.device.nbytes
            if store.unspillable_bytes + held > limit:
                raise _unspillable_full(store)
            failed = self.budget.spill_failed
            if failed and store.resident_bytes + item.nbytes > limit:
                raise StorageFullError(f"memory budget full and spilling failed: {failed}")
        change = store.put(name, item) if replace else store.append(name, item)  # (they check the limits)
        self._publish(change)
        if limit is not None and store.over_limit():
            self.budget.enforce()
        return change

    def add(self, name: str, description: bytes, segments: tuple, nbytes: int, tag: int | None, replace: bool,
            done: Done, lasting: bool = True) -> None:
        """PUT (``replace``) or APPEND a value (as for :meth:`add_now`); ``done(change,
        error)`` when it is stored: with a data directory once it is on disk (unless
        ``lasting`` is False: then it is kept in memory only), else at once."""
        self._add(name, Item(description, segments, nbytes, tag), replace, done, lasting)

    def _add(self, name: str, item: Item, replace: bool, done: Done, lasting: bool = True) -> None:
        if self.data_dir is None or not lasting:
            done(self._add_now(name, item, replace), None)
            return
        self._not_a_table(name)
        store = self.store
        limit = store.memory_limit
        if limit is not None and store.unspillable_bytes + len(item.description) > limit:
            raise _unspillable_full(store)
        store.check_add(name, replace)  # refused before anything is written
        committing = self._committing
        committing[name] = committing.get(name, 0) + 1

        def committed(result, error) -> None:
            left = committing.pop(name) - 1
            if left:
                committing[name] = left
            if error is not None:
                log.warning("could not store an item of bin %r: %s", name, error)
                done(None, _storage_error(error, "not stored"))
                return
            stored, number = result
            item.files = ItemFiles.of(stored, lane=name, number=number, area=self.data_area)
            self.lifetimes.watch(item)
            try:
                change = store.put(name, item) if replace else store.append(name, item)
            except RemoteError as exc:  # a limit reached while the item was being written
                item.files.dropped = True
                done(None, exc)
                return
            self._publish(change)
            done(change, None)
            self.budget.enforce()

        self.jobs.run(name, self.data_dir.commit,
                      (name, self._next_number, replace, item.description, item.segments, item.nbytes, item.tag),
                      committed)

    def adopt(self, name: str, connection: str, shm_name: object, description: bytes, nbytes: int, tag,
              replace: bool, done: Done, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        """PUT (``replace``) or APPEND of a value a same-host client wrote to
        ``incoming/<connection>/<shm_name>`` in the shared-memory area: checked and
        taken over without a copy (on a disk thread), then stored as :meth:`add`
        does.  ``done(None, ZeroCopyUnavailableError)`` if it cannot be taken."""
        if not self.sharing.takes_incoming:
            raise ZeroCopyUnavailableError("this server takes values over TCP only")
        self._not_a_table(name)
        self.store.check_add(name, replace)

        def adopted(files, error) -> None:
            if error is not None:
                done(None, error)
                return
            try:
                self._add(name, Item(description, None, nbytes, tag, files), replace, done)
            except RemoteError as exc:  # limits or budget: the files go with the item
                done(None, exc)

        self.sharing.adopt(connection, shm_name, description, nbytes, limits, adopted)

    # -- values put by reference to a client's device memory (PROTOCOL.md §13; no data directory)

    def add_reference(self, name: str, description: bytes, nbytes: int, tag: int | None,
                      ref: dict, ref_bytes: int) -> tuple[Item, Change]:
        """PUT of a value by device reference ``ref`` (what readers are given, taking
        ``ref_bytes`` of memory, counted with the descriptions): stored without its
        bytes (they come later, :meth:`fill`), in memory; the item and the change."""
        item = Item(description, None, nbytes, tag)
        item.device = Reference(ref, ref_bytes)
        return item, self._add_now(name, item, True)

    def fill(self, name: str, item: Item, segments: tuple) -> None:
        """Give ``item`` of bin ``name`` (stored by device reference) the payload that
        came for it; reads waiting for it are tested again."""
        if item.segments is None and item.files is None:
            item.segments = segments
            self.store.attach(item)
            self.budget.enforce()
            self.sink.touched(name)

    def fill_shared(self, name: str, item: Item, connection: str, shm_name: object,
                    done: Callable[[RemoteError | None], None], limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        """:meth:`fill` from the item directory a same-host client wrote (taken over as
        :meth:`adopt` takes one, on a disk thread); ``done(error or None)`` after."""
        if not self.sharing.takes_incoming:
            raise ZeroCopyUnavailableError("this server takes values over TCP only")

        def adopted(files, error) -> None:
            if error is None and item.segments is None and item.files is None:
                item.files = files  # (else dropped: nothing holds them)
                retier(item)
                self.store.attach(item)
                self.budget.enforce()
                self.sink.touched(name)
            done(error)

        self.sharing.adopt(connection, shm_name, item.description, item.nbytes, limits, adopted)

    def lose_reference(self, name: str, item: Item) -> None:
        """``item`` of bin ``name``: its publisher went away: it keeps its bytes if they
        came, else it cannot be read any more (reads waiting for them are answered
        now); its reference is given to readers no more."""
        item.device.value = None
        self.sink.touched(name)

    def delete(self, name: str, done: Done) -> None:
        """DELETE bin (or table) ``name``; ``done`` once it is gone (from disk too, if durable).

        With a data directory the bin leaves memory only once it has left the disk,
        in the order of the bin's other changes there: an APPEND acknowledged before
        the DELETE is deleted with it, one after it survives, on disk as in memory.
        Items of the bin that a GET took and has not delivered yet are kept aside:
        they may go back."""
        if name in self._table_names:
            self.tables.delete(name, self.publishing(done))
            return
        if self.data_dir is None:
            change = self.store.delete(name)
            self._publish(change)
            done(change, None)
            return
        self.store.peek(name)  # 550 at once for a bin that does not exist

        def deleted(kept, error) -> None:
            if error is not None:
                done(None, _storage_error(error, "not deleted"))
                return
            for item in self._taken.get(name, ()):
                moved = kept.get(item.files.path)
                if moved is not None:
                    _repoint(item.files, moved, None)
            try:
                change = self.store.delete(name)
            except RemoteError as exc:  # deleted meanwhile, by an earlier DELETE
                done(None, exc)
                return
            self._publish(change)
            done(change, None)

        self.jobs.run(name, self._delete_bin, (name,), deleted)

    def _delete_bin(self, name: str) -> dict:
        """The disk half of :meth:`delete` (a disk thread, in the bin's lane)."""
        return self.data_dir.delete_bin(name, tuple(item.files.path for item in self._taken.get(name, ())))

    # -- a relay's mirror of another server's bins (server/relay/; a relay has no data directory)

    def mirror(self, name: str, copy: list[tuple], op: str, seq: int | None = None,
               share_from: int | None = None) -> Change:
        """Replace bin ``name``'s items with ``copy`` (in memory) in one change: its
        items as ``(description, payload segments, payload bytes, tag)``, as received.
        ``seq``: a number reserved for it earlier (:meth:`reserve_seq`).  With
        ``share_from``, a bin whose last copy same-host readers mapped (in shared
        memory) gets the new items of at least that many bytes there too, before
        anyone hears of the change: their first read maps it instead of receiving it."""
        shared = share_from is not None and any(
            item.files is not None and item.files.in_memory for item in self.store.items_of(name))
        items = self.as_items(copy)
        change = self.store.mirror(name, items, op, seq)
        if shared:
            for item in items:
                if item.nbytes >= share_from:
                    self.sharing.promote_now(item)
        self._publish(change)
        self.budget.enforce()
        return change

    @staticmethod
    def as_items(copy: list[tuple]) -> list[Item]:
        """Items as the store holds them, from ``(description, payload segments, payload
        bytes, tag)`` as received from another server (a mirror's copy, a forwarded take)."""
        return [Item(description, segments, nbytes, tag) for description, segments, nbytes, tag in copy]

    def unmirror(self, name: str) -> Change | None:
        """Drop the mirror of bin ``name`` (it is gone upstream); None if there was none."""
        if not self.store.exists(name):
            return None
        change = self.store.delete(name)
        self._publish(change)
        return change

    def reserve_seq(self) -> int:
        """A change number, reserved now for a mirror change made later (a copy that
        is announced while it still arrives)."""
        return self.store.next_seq()

    # -- reads

    def exists_or_coming(self, name: str) -> bool:
        """Whether bin (or table) ``name`` exists, or a durable PUT or APPEND of it is
        being written (it will exist: an ephemeral PUT may not take the name meanwhile)."""
        return name in self._committing or self.state(name).exists

    def state(self, name: str) -> BinState:
        """The :class:`~.store.BinState` of bin (or table) ``name``."""
        if name in self._table_names:
            return self.tables.state(name)
        return self.store.state(name)

    def count(self, name: str) -> int:
        """Items in bin ``name`` (a table's rows; 0 if there is none)."""
        entry = self._table_names.get(name)
        return self.store.count(name) if entry is None else entry.table.size

    def seq(self, name: str) -> int:
        """Bin (or table) ``name``'s last change's number."""
        entry = self._table_names.get(name)
        return self.store.seq(name) if entry is None else entry.seq

    def listing(self) -> dict[str, int]:
        """``{bin: n_items}`` for every bin (a table's: its rows)."""
        listing = self.store.listing()
        listing.update(self.tables.listing())
        return listing

    def peek(self, name: str) -> list[Item]:
        """The items of bin ``name``, which keeps them (NoSuchBinError if none)."""
        if name in self._table_names:
            raise _is_a_table(name)
        return self.store.peek(name)

    def items_of(self, name: str) -> list[Item]:
        """The items of bin ``name`` ([] if there is none), not counted as a use."""
        return self.store.items_of(name)

    def take(self, name: str, limit: int | None = None) -> tuple[list[Item], Change]:
        """GET: take every item (the first ``limit``) out of bin ``name``; with a data
        directory the bin's floor moves past them on disk.  Their payload in memory
        stays counted against the budget until :meth:`delivered` (or :meth:`restore`)."""
        if name in self._table_names:
            raise _is_a_table(name)
        items, change = self.store.get(name, limit)
        self._publish(change)
        self.store.in_flight_bytes += _resident_bytes(items)
        if self.data_dir is not None and items:
            self._taken.setdefault(name, []).extend(items)
            self.jobs.run(name, self._move_floor, (name, items))
        return items, change

    def _move_floor(self, name: str, items: list[Item]) -> None:
        """Past the taken ``items`` (a disk thread, in the bin's lane: their numbers are
        those the bin's earlier disk work gave them)."""
        numbers = [item.files.number for item in items if item.files.number is not None]
        if numbers:
            self.data_dir.set_floor(name, max(numbers) + 1)

    def delivered(self, name: str, items: list[Item]) -> None:
        """The reply of a GET that took ``items`` from bin ``name`` has been written whole."""
        self.store.in_flight_bytes -= _resident_bytes(items)
        if self._taken:  # (a data directory's)
            self._forget_taken(name, items)
        self.budget.wake()

    def restore(self, name: str, items: list[Item]) -> Change | None:
        """Put ``items`` that a GET took back at the front of bin ``name`` (its reply
        was not delivered).  They count as stored again and the budget is enforced;
        with a data directory they go back at the front of the bin on disk too,
        whatever happened to it meanwhile."""
        self.store.in_flight_bytes -= _resident_bytes(items)
        self._forget_taken(name, items)
        change = self.store.restore(name, items)
        if change is not None:
            self._publish(change)
        self.budget.enforce()
        if self.data_dir is not None and items:
            def put_back(moved, error) -> None:
                if error is not None:
                    log.error("could not put %d taken item(s) back into bin %r on disk: %s", len(items), name, error)
                    return
                held = self.store.items_of(name)
                for item in (*items, *held):  # (the restored ones whether or not a GET took them again since)
                    found = moved.get(item.files.path)
                    if found is not None:
                        _repoint(item.files, *found)
                # Restored items a GET took again (or a DELETE removed) before this: the floor
                # that GET moved was past their old numbers, below the new ones; moved again.
                there = {id(item) for item in held}
                left = [item for item in items if id(item) not in there]
                if left:
                    self.jobs.run(name, self._move_floor, (name, left))

            self.jobs.run(name, self._put_back, (name, items), put_back)
        return change

    def _put_back(self, name: str, items: list[Item]) -> dict:
        """The disk half of :meth:`restore` (a disk thread, in the bin's lane)."""
        return self.data_dir.put_back(name, [item.files.path for item in items], self._next_number)

    def publishing(self, done: Done) -> Done:
        """``done``, after the change it is called back with (if any) is published."""
        def published(change, error) -> None:
            if change is not None:
                self._publish(change)
            done(change, error)
        return published

    def _not_a_table(self, name: str) -> None:
        if name in self._table_names:
            raise _is_a_table(name)

    def _next_number(self) -> int:
        return next(self._numbers)

    def _forget_taken(self, name: str, items: list[Item]) -> None:
        taken = self._taken.get(name)
        if taken:
            gone = {id(item) for item in items}
            taken[:] = [item for item in taken if id(item) not in gone]
            if not taken:
                del self._taken[name]

    def parts_in_memory(self, items: list[Item], refs: list | None) -> list | None:
        """The payload parts of a reply carrying ``items`` (those without a reference
        in ``refs``) if every one is in memory, else None (:meth:`read` them)."""
        parts = []
        for i, item in enumerate(items):
            if refs is None or refs[i] is None:
                segments = item.segments
                if segments is None:
                    return None
                parts.extend(segments)
        return parts

    def read(self, items: list[Item], refs: list | None,
             done: Callable[[list | None, RemoteError | None], None]) -> None:
        """``done(parts, None)`` with the payload parts of a reply carrying ``items``
        (those without a reference in ``refs``), or ``done(None, error)`` (451) if
        their files cannot be opened.

        Payloads in memory are their parts at once; an item only on disk is opened
        and mapped on a disk thread (no reads: pages come in as the socket takes
        them).  What each item holds is taken now, so a spill that swaps an item's
        chunks for files meanwhile changes nothing."""
        parts = self.parts_in_memory(items, refs)
        if parts is not None:
            done(parts, None)
            return
        sources = [item.segments if item.segments is not None else item.files
                   for i, item in enumerate(items) if refs is None or refs[i] is None]

        def opened(parts, error) -> None:
            if error is not None:
                log.error("cannot read a stored item's files: %s", error)
                reason = getattr(error, "strerror", None) or error
                done(None, ServerLocalError(f"cannot read the stored item: {reason}"))
            else:
                done(parts, None)

        self.jobs.run(None, _open_parts, (sources,), opened)

    # -- the memory budget and backpressure (.budget)

    def wait_for_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when :meth:`room` is True again."""
        self.budget.wait_for_room(callback)

    @property
    def spill_failed(self) -> str | None:
        return self.budget.spill_failed

    def close(self) -> None:
        """The server is stopping: remove the spill and shared-memory areas (the data directory stays)."""
        self.lifetimes.close()
        self.tables.close()
        if self.spill is not None:
            self.spill.close()
        if self.shm is not None:
            self.shm.close()
        if self.data_dir is not None:
            self.data_dir.note_seq(self.store.last_seq)
            self.data_dir.close()  # its lock: another server may use it now


def _unspillable_full(store: BinStore) -> StorageFullError:
    return StorageFullError(f"memory budget full: {store.description_bytes} bytes of descriptions, "
                            f"{store.in_flight_bytes} of replies not yet read and {store.table_bytes} held "
                            f"by tables, which spilling cannot free")


def _is_a_table(name: str) -> BadNameError:
    """553 for a bin verb (PUT, APPEND, GET, PEEK) on a table's name."""
    return BadNameError(f"{name!r} is a table: use its table verbs (insert, sample, read, write)")


def _repoint(files: ItemFiles, stored: StoredItem, number: int | None) -> None:
    """An item's files moved (a bin rewritten, a taken item kept aside): say where they are now."""
    files.path, files.spans, files.number, files._ref = stored.path, stored.files, number, None


def _resident_bytes(items: list[Item]) -> int:
    total = 0
    for item in items:
        if item.segments is not None or item.resident:  # (the usual case first: chunks in memory)
            total += item.nbytes
    return total


def _open_parts(sources: list) -> list:
    """The frame parts of payloads held as chunks (a tuple) or as files (blocking)."""
    parts = []
    for source in sources:
        parts.extend(source if type(source) is tuple else source.open_parts())
    return parts
