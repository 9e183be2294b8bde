"""The one storage interface the verb handlers use: the bins, and their disk tiers.

:class:`Storage` wraps the pure :class:`~.store.BinStore` for the sessions, for
reads (``state``, ``listing``, ``peek``, ``take``, ``restore``, ``read``) and writes
(``add``, ``adopt``, ``delete``) alike.  It decides when payloads move to disk and
what a change must write before it is acknowledged; every blocking file operation
(writing, opening and mapping an item's files, adopting, spilling) runs through a
:class:`Jobs` runner (the server's disk threads, :mod:`.jobs`; a synchronous one in
tests), whose completion callbacks come back on the caller's (reactor) thread.

* Memory only (no limit, no data directory): every call completes at once.
* ``memory_limit``: past the budget, least recently used items are written to the
  spill area and then served from their files.  While spills are on their way and
  memory is still over budget, :meth:`room` is False: sessions stop reading payloads
  (backpressure) until :meth:`wait_for_room` calls them back.  When a spill write
  fails (disk full), writes that would grow memory further get 452.
* ``data_dir``: a PUT/APPEND is acknowledged only once its item is on disk; a
  DELETE once its bin is gone from disk; a GET moves the bin's floor.  Every item
  has its files, so going over budget only drops the in-memory copy.
* ``shm`` (same-host zero-copy, :mod:`.shm`): items a client wrote into the
  shared-memory area are adopted (:meth:`adopt`), and items held in memory that a
  same-host client reads are copied there once (:meth:`promote`).  Their files are
  RAM, so they count as resident: past the budget they are spilled like chunks.

Files of items that left the store are deleted once nothing refers to the item
any more (a GET reply in flight may still put it back), through a finalizer.
Files in shared memory are deleted once nothing refers to their :class:`ItemFiles`
(an item, or a reply whose client has not mapped them yet).
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
import weakref
from typing import Callable, Protocol

from tensorshare.disk.areas import write_token
from tensorshare.disk.layout import StoredItem
from tensorshare.errors import (
    BadNameError, BadRequestError, RemoteError, ServerLocalError, StorageFullError, ZeroCopyUnavailableError,
)
from tensorshare.wire.description import DEFAULT_LIMITS, DecodeLimits

from .durable import DataDir
from .shm import ShmArea
from .spill import Area, ItemFiles, SpillArea, remove, remove_dir
from .store import BinStore, Change, Item
from .tablestore import TableStore

log = logging.getLogger("tensorshare.server")

Done = Callable[[Change | None, RemoteError | None], None]


class Jobs(Protocol):
    """Runs blocking functions; jobs of one lane run one at a time, in order."""

    def run(self, lane: str | None, fn: Callable, args: tuple,
            on_done: Callable[[object, BaseException | None], None] | None = None) -> None:
        """Run ``fn(*args)``; then ``on_done(result, error)`` on the caller's thread."""

    def run_threadsafe(self, lane: str | None, fn: Callable, args: tuple) -> None:
        """:meth:`run` with no callback, callable from any thread."""


class InlineJobs:
    """A :class:`Jobs` that runs everything at once on the calling thread (tests, tools)."""

    def run(self, lane, fn, args, on_done=None) -> None:
        try:
            result, error = fn(*args), None
        except Exception as exc:
            result, error = None, exc
        if on_done is not None:
            on_done(result, error)
        elif error is not None:
            log.error("disk job %s failed: %s", getattr(fn, "__name__", fn), error)

    def run_threadsafe(self, lane, fn, args) -> None:
        self.run(lane, fn, args)


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_SHM_FULL_PAUSE_S = 5.0  # after shared memory ran full, no item is copied there for this long


def _storage_error(exc: BaseException, what: str) -> RemoteError:
    """The reply to a write that failed: 452 for the disk (trying again later may
    work), 501 for a value that cannot be written at all."""
    if isinstance(exc, OSError):
        reason = "disk full" if exc.errno in _DISK_FULL else "disk error"
        return StorageFullError(f"{what}: {reason}: {exc.strerror or exc}")
    return BadRequestError(f"{what}: this value cannot be stored: {exc}")


class Storage:
    """The store as the sessions use it (see the module docstring)."""

    def __init__(self, store: BinStore, jobs: Jobs, *, data_dir: DataDir | None = None,
                 spill: SpillArea | None = None, shm: ShmArea | None = None):
        self.store = store
        self.jobs = jobs
        self.data_dir = data_dir
        self.spill = spill
        self.shm = shm
        self._numbers = itertools.count(1)
        self._spills_in_flight = 0
        self._room_waiters: list[Callable[[], None]] = []
        self.spill_failed: str | None = None  # why the last spill write failed, until one succeeds
        self.problems: list[str] = []  # what loading the data directory skipped
        # Same-host zero-copy (see share()): the areas clients may map, in greeting order.
        self.areas: list[Area] = []
        self.token: str | None = None
        self.shm_area = self.spill_area = self.data_area = None
        self._promoting: set[Item] = set()
        self._taken: dict[str, list[Item]] = {}  # durable: items of GETs whose replies are not written yet
        self._shm_full_until = 0.0
        self._open = [True]  # cleared by close(): finalizers that run later leave the files alone
        # Tables share the bins' namespace (see _not_a_table) and the disk tiers.
        self.tables = TableStore(store, memory_limit=store.memory_limit, spill_root=spill and spill.items,
                                 data_root=data_dir and data_dir.root, on_grow=self._enforce_budget)

    @property
    def durable(self) -> bool:
        return self.data_dir is not None

    def share(self, token: str) -> None:
        """Offer this store's directories to same-host clients: write ``token`` into each
        (the shared-memory area first, then the spill and data directories).  An area
        whose token cannot be written is not offered."""
        self.token = token
        for attr, root, in_memory in (("shm_area", self.shm and self.shm.path, True),
                                      ("spill_area", self.spill and self.spill.items, False),
                                      ("data_area", self.data_dir and self.data_dir.root, False)):
            if root is None:
                continue
            try:
                write_token(root, token)
            except OSError as exc:
                log.warning("zero-copy: cannot offer %s to same-host clients: %s", root, exc)
                continue
            area = Area(len(self.areas), root, in_memory)
            self.areas.append(area)
            setattr(self, attr, area)
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
                self._watch(item)
            self.store.load(name, items)
            count += len(items)
        _, problems = self.tables.load()
        self.problems += problems
        self.store.continue_from(loaded.next_number)  # sequence numbers keep growing across restarts
        return count

    # -- changes

    def mirror(self, name: str, items: list[Item], op: str, seq: int | None = None) -> Change:
        """Replace bin ``name``'s items with ``items`` (in memory) in one change: a
        relay's copy of an upstream bin (server/relay/; a relay has no data directory).
        ``seq``: a number reserved for it earlier (``store.next_seq()``)."""
        change = self.store.mirror(name, items, op, seq)
        self._enforce_budget()
        return change

    def add(self, name: str, item: Item, replace: bool, done: Done, lasting: bool = True) -> None:
        """PUT (``replace``) or APPEND ``item``; ``done(change, error)`` when it is stored.
        ``lasting=False``: kept in memory (or spilled) only, never in the data directory."""
        self._not_a_table(name)
        store = self.store
        limit = store.memory_limit
        if limit is not None and store.unspillable_bytes + len(item.description) > limit:
            raise StorageFullError(f"memory budget full: {store.description_bytes} bytes of descriptions, "
                                   f"{store.in_flight_bytes} of replies not yet read and {store.table_bytes} held "
                                   f"by tables, which spilling cannot free")
        if self.data_dir is None or not lasting:
            if self.spill_failed and limit is not None and store.resident_bytes + item.nbytes > limit:
                raise StorageFullError(f"memory budget full and spilling failed: {self.spill_failed}")
            done(store.put(name, item) if replace else store.append(name, item), None)  # (they check the limits)
            self._enforce_budget()
            return
        store.check_add(name, replace)  # refused before anything is written

        def committed(result, error) -> None:
            if error is not None:
                log.warning("could not store an item of bin %r: %s", name, error)
                done(None, _storage_error(error, "not stored"))
                return
            stored, number = result
            item.files = ItemFiles.of(stored, lane=name, number=number, area=self.data_area)
            self._watch(item)
            try:
                change = store.put(name, item) if replace else store.append(name, item)
            except RemoteError as exc:  # a limit reached while the item was being written
                item.files.dropped = True
                done(None, exc)
                return
            done(change, None)
            self._enforce_budget()

        self.jobs.run(name, self.data_dir.commit,
                      (name, self._next_number, replace, item.description, item.segments, item.nbytes, item.tag),
                      committed)

    def adopt(self, name: str, connection: str, shm_name: object, description: bytes, nbytes: int, tag,
              replace: bool, done: Done, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        """PUT (``replace``) or APPEND of a value a same-host client wrote to
        ``incoming/<connection>/<shm_name>`` in the shared-memory area: checked and
        taken over without a copy (:meth:`ShmArea.adopt`, on a disk thread), then
        stored as :meth:`add` does.  ``done(None, ZeroCopyUnavailableError)`` if it
        cannot be taken."""
        if self.shm_area is None or self.data_dir is not None:
            raise ZeroCopyUnavailableError("this server takes values over TCP only")
        self._not_a_table(name)
        self.store.check_add(name, replace)

        def adopted(stored, error) -> None:
            if error is not None:
                if not isinstance(error, RemoteError):
                    log.warning("could not adopt an incoming item: %s", error)
                    error = ZeroCopyUnavailableError(f"incoming item not taken: {error}")
                done(None, error)
                return
            files = ItemFiles.of(stored, area=self.shm_area)
            self._watch_shared(files)
            try:
                self.add(name, Item(description, None, nbytes, tag, files), replace, done)
            except RemoteError as exc:  # limits or budget: the files go with the item
                done(None, exc)

        self.jobs.run(None, self.shm.adopt, (connection, shm_name, description, nbytes, limits), adopted)

    def fill(self, item: Item, segments: tuple) -> None:
        """Give ``item`` (stored by device reference) the payload that came for it."""
        if item.segments is None and item.files is None:
            item.segments = segments
            self.store.attach(item)
            self._enforce_budget()

    def fill_shared(self, item: Item, connection: str, shm_name: object, done: Callable,
                    limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        """:meth:`fill` from the item directory a same-host client wrote (taken over as
        :meth:`adopt` takes one, on a disk thread); ``done(None, error)`` after."""
        if self.shm_area is None:
            raise ZeroCopyUnavailableError("this server takes values over TCP only")

        def adopted(stored, error) -> None:
            if error is not None:
                if not isinstance(error, RemoteError):
                    error = ZeroCopyUnavailableError(f"incoming item not taken: {error}")
                done(None, error)
                return
            files = ItemFiles.of(stored, area=self.shm_area)
            self._watch_shared(files)  # (removed again if the item went meanwhile: nothing holds them)
            if item.segments is None and item.files is None:
                item.files = files
                self.store.attach(item)
                self._enforce_budget()
            done(None, None)

        self.jobs.run(None, self.shm.adopt, (connection, shm_name, item.description, item.nbytes, limits), adopted)

    @property
    def takes_incoming(self) -> bool:
        """Whether same-host clients may write values into the shared-memory area."""
        return self.shm_area is not None and self.data_dir is None

    def open_incoming(self, done: Callable[[str | None, BaseException | None], None]) -> None:
        """Make an incoming directory for a same-host connection (on a disk thread);
        ``done(name, error)``."""
        self.jobs.run(None, self.shm.open_connection, (), done)

    def close_incoming(self, incoming: str) -> None:
        """A same-host connection closed: remove its incoming directory (in the background)."""
        if self.shm is not None and self._open[0]:
            self.jobs.run(None, self.shm.close_connection, (incoming,))

    def promote(self, item: Item) -> None:
        """Copy an item held in memory into the shared-memory area, in the background, so
        that same-host readers map it from then on (its chunks are freed once it is
        there; it stays resident).  Does nothing for items that have files, are on
        their way to disk, or while shared memory is full."""
        if (self.shm_area is None or item.segments is None or item.files is not None or item.spilling
                or item in self._promoting or time.monotonic() < self._shm_full_until):
            return
        self._promoting.add(item)

        def written(stored, error) -> None:
            self._promoting.discard(item)
            if error is not None:
                self._shm_failed("copy an item to", error)
                return
            files = self._shared_files(stored)
            if item.stored and item.segments is not None and item.files is None and not item.spilling:
                item.files, item.segments = files, None  # still resident: the accounting stays
            # else the item changed meanwhile: the new files go when `files` does

        self.jobs.run(None, self.shm.write, (item.description, item.segments, item.nbytes, item.tag), written)

    def promote_now(self, item: Item) -> bool:
        """:meth:`promote` on the caller's thread (a copy into tmpfs, as :meth:`share_rows`):
        for a relay's new copy of a bin its same-host readers map, so that their first
        read of it is already by reference.  True if the item is in shared memory now."""
        if (self.shm_area is None or item.segments is None or item.files is not None or item.spilling
                or time.monotonic() < self._shm_full_until):
            return False
        files = self._write_shared("copy an item to", item.description, item.segments, item.nbytes, item.tag)
        if files is None:
            return False
        item.files, item.segments = files, None  # still resident: the accounting stays
        return True

    def share_rows(self, description: bytes, buffer, nbytes: int) -> ItemFiles | None:
        """Write the rows a TSAMPLE/TREAD gathered into the shared-memory area as one
        item, for a same-host reader to map; its files, removed once nothing refers to
        them (the reply's pin).  None while shared memory is full.

        Runs on the caller's thread: the area is RAM (tmpfs), so this is a copy into
        the page cache, as the gather itself, with no disk to wait for."""
        if self.shm_area is None or time.monotonic() < self._shm_full_until:
            return None
        return self._write_shared("write sampled rows to", description, [buffer], nbytes, None)

    def _write_shared(self, what: str, description: bytes, segments, nbytes: int,
                      tag: int | None) -> ItemFiles | None:
        """Write an item into the shared-memory area on the caller's thread (tmpfs: a
        copy into RAM); its watched files, or None if shared memory is full."""
        try:
            stored = self.shm.write(description, segments, nbytes, tag)
        except OSError as exc:
            self._shm_failed(what, exc)
            return None
        return self._shared_files(stored)

    def _shm_failed(self, what: str, error: BaseException) -> None:
        """A write into shared memory failed (full): say so, and pause writing there."""
        log.info("could not %s shared memory: %s", what, error)
        self._shm_full_until = time.monotonic() + _SHM_FULL_PAUSE_S

    def _shared_files(self, stored) -> ItemFiles:
        """The files of an item just written into the shared-memory area, watched."""
        files = ItemFiles.of(stored, area=self.shm_area)
        self._watch_shared(files)
        return files

    def delete(self, name: str, done: Done) -> None:
        """DELETE bin ``name``; ``done`` once it is gone (from disk too, if durable).

        With a data directory the bin leaves memory only once it has left the disk,
        in the order of the bin's other changes there: an APPEND acknowledged before
        the DELETE is deleted with it, one after it survives, on disk as in memory.
        Items of the bin that a GET took and has not delivered yet are kept aside:
        they may go back."""
        if name in self.tables:
            done(self.tables.delete(name), None)
            return
        if self.data_dir is None:
            done(self.store.delete(name), None)
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
                done(self.store.delete(name), None)
            except RemoteError as exc:  # deleted meanwhile, by an earlier DELETE
                done(None, exc)

        self.jobs.run(name, self._delete_bin, (name,), deleted)

    def _delete_bin(self, name: str) -> dict:
        """The disk half of :meth:`delete` (a disk thread, in the bin's lane)."""
        return self.data_dir.delete_bin(name, tuple(item.files.path for item in self._taken.get(name, ())))

    # -- reads

    def state(self, name: str) -> tuple[bool, int, int, int | None]:
        """``(exists, n_items, seq, tag)`` of bin ``name`` (see :meth:`BinStore.state`)."""
        if name in self.tables:
            return self.tables.state(name)
        return self.store.state(name)

    def listing(self) -> dict[str, int]:
        """``{bin: n_items}`` for every bin (a table's: its rows)."""
        listing = self.store.listing()
        listing.update(self.tables.listing())
        return listing

    def peek(self, name: str) -> list[Item]:
        """The items of bin ``name``, which keeps them (NoSuchBinError if none)."""
        self._not_a_table(name)
        return self.store.peek(name)

    def items_of(self, name: str) -> list[Item]:
        """The items of bin ``name`` ([] if there is none), not counted as a use."""
        return self.store.items_of(name)

    def take(self, name: str, limit: int | None = None) -> tuple[list[Item], Change]:
        """GET: take every item (the first ``limit``) out of bin ``name``; with a data
        directory the bin's floor moves past them on disk.  Their payload in memory
        stays counted against the budget until :meth:`delivered` (or :meth:`restore`)."""
        self._not_a_table(name)
        items, change = self.store.get(name, limit)
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
        self._forget_taken(name, items)
        self._wake()

    def restore(self, name: str, items: list[Item]) -> Change | None:
        """Put ``items`` that a GET took back at the front of bin ``name`` (its reply
        was not delivered).  They count as stored again and the budget is enforced;
        with a data directory they go back at the front of the bin on disk too,
        whatever happened to it meanwhile."""
        self.store.in_flight_bytes -= _resident_bytes(items)
        self._forget_taken(name, items)
        change = self.store.restore(name, items)
        self._enforce_budget()
        if self.data_dir is not None and items:
            def put_back(moved, error) -> None:
                if error is not None:
                    log.error("could not put %d taken item(s) back into bin %r on disk: %s", len(items), name, error)
                    return
                for item in self.store.items_of(name):
                    found = moved.get(item.files.path)
                    if found is not None:
                        _repoint(item.files, *found)

            self.jobs.run(name, self._put_back, (name, items), put_back)
        return change

    def _put_back(self, name: str, items: list[Item]) -> dict:
        """The disk half of :meth:`restore` (a disk thread, in the bin's lane)."""
        return self.data_dir.put_back(name, [item.files.path for item in items], self._next_number)

    def _not_a_table(self, name: str) -> None:
        """553 for a bin verb (PUT, APPEND, GET, PEEK) on a table's name."""
        if name in self.tables:
            raise BadNameError(f"{name!r} is a table: use its table verbs (insert, sample, read, write)")

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

    # -- the memory budget and backpressure

    def room(self) -> bool:
        """False while memory is over budget and spills that would free it are running."""
        return not (self._spills_in_flight and self.store.over_budget())

    def wait_for_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when :meth:`room` is True again."""
        if self.room():
            callback()
        else:
            self._room_waiters.append(callback)

    def _enforce_budget(self) -> None:
        store = self.store
        for item in store.to_evict():
            if item.files is not None and not item.files.in_memory:  # durable: the files are there already
                store.evict(item)
            elif self.spill is not None:
                self._spill(item)
            else:
                store.evict(item)  # nowhere to put it: stays in memory

    def _spill(self, item: Item) -> None:
        self._spills_in_flight += 1

        def spilled(stored, error) -> None:
            self._spills_in_flight -= 1
            try:
                if error is not None:
                    if isinstance(error, OSError):  # the disk: no spill can succeed for now
                        self.spill_failed = str(error)
                    else:  # this item: it stays in memory, and the next one is tried
                        item.unspillable = True
                    log.warning("spilling %d bytes failed: %s", item.nbytes, error)
                    self.store.evict(item)  # ends its spilling state; it stays in memory
                else:
                    self.spill_failed = None
                    files = ItemFiles.of(stored, area=self.spill_area)
                    if self.store.evict(item, files):
                        self._watch(item)
                    else:  # the item left the store while it was written
                        self.jobs.run(None, remove, (files,))
                if error is None or item.unspillable:
                    self._enforce_budget()
            finally:
                self._wake()

        # Chunks in memory, or files in shared memory (mapped on the disk thread).
        source = item.segments if item.segments is not None else item.files
        self.jobs.run(None, self._spill_write, (item.description, source, item.nbytes, item.tag), spilled)

    def _spill_write(self, description: bytes, source, nbytes: int, tag):
        buffers = source.buffers() if isinstance(source, ItemFiles) else source
        return self.spill.write(description, buffers, nbytes, tag)

    def _wake(self) -> None:
        if self._room_waiters and self.room():
            waiters, self._room_waiters = self._room_waiters, []
            for callback in waiters:
                callback()

    # -- file lifetimes

    def _watch(self, item: Item) -> None:
        """Delete ``item``'s files once it is gone from the store and from every reply."""
        weakref.finalize(item, _collect, self.jobs, item.files, self._open).atexit = False

    def _watch_shared(self, files: ItemFiles) -> None:
        """Delete files in shared memory once no item and no reply refers to them."""
        weakref.finalize(files, _discard, self.jobs, files.path, self._open).atexit = False

    def close(self) -> None:
        """The server is stopping: remove the spill and shared-memory areas (the data directory stays)."""
        self._open[0] = False
        self.tables.close()
        if self.spill is not None:
            self.spill.close()
        if self.shm is not None:
            self.shm.close()
        if self.data_dir is not None:
            self.data_dir.close()  # its lock: another server may use it now


def _repoint(files: ItemFiles, stored: StoredItem, number: int | None) -> None:
    """An item's files moved (a bin rewritten, a taken item kept aside): say where they are now."""
    files.path, files.spans, files.number, files._ref = stored.path, stored.files, number, None


def _resident_bytes(items: list[Item]) -> int:
    return sum(item.nbytes for item in items if item.resident)


def _open_parts(sources: list) -> list:
    """The frame parts of payloads held as chunks (a tuple) or as files (blocking)."""
    parts = []
    for source in sources:
        parts.extend(source if type(source) is tuple else source.open_parts())
    return parts


def _collect(jobs: Jobs, files: ItemFiles, open_: list) -> None:
    if files.dropped and open_[0]:
        jobs.run_threadsafe(files.lane, remove, (files,))


def _discard(jobs: Jobs, path: str, open_: list) -> None:
    if open_[0]:
        jobs.run_threadsafe(None, remove_dir, (path,))
