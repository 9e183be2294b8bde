"""The bin store with its disk tier: spilling under a memory budget, and the durable directory.

:class:`Storage` wraps the pure :class:`~.store.BinStore` for the sessions.  It
decides when payloads move to disk and what a change must write before it is
acknowledged; the blocking file work runs through a :class:`Jobs` runner (the
server's thread pool, :mod:`.disk`; a synchronous one in tests), whose completion
callbacks come back on the caller's (reactor) thread.

* Memory only (no limit, no data directory): every call completes at once.
* ``memory_limit``: past the budget, least recently used items are written to the
  spill area and then served from their files.  While spills are on their way and
  memory is still over budget, :meth:`room` is False: sessions stop reading payloads
  (backpressure) until :meth:`wait_for_room` calls them back.  When a spill write
  fails (disk full), writes that would grow memory further get 452.
* ``data_dir``: a PUT/APPEND is acknowledged only once its item is on disk; a
  DELETE once its bin is gone from disk; a GET moves the bin's floor.  Every item
  has its files, so going over budget only drops the in-memory copy.

Files of items that left the store are deleted once nothing refers to the item
any more (a GET reply in flight may still put it back), through a finalizer.
"""

from __future__ import annotations

import errno
import itertools
import logging
import weakref
from typing import Callable, Protocol

from tensorshare.errors import RemoteError, StorageFullError

from .durable import DataDir
from .spill import ItemFiles, SpillArea, remove
from .store import BinStore, Change, Item

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


def _storage_error(exc: BaseException, what: str) -> RemoteError:
    if isinstance(exc, OSError):
        reason = "disk full" if exc.errno in _DISK_FULL else "disk error"
        return StorageFullError(f"{what}: {reason}: {exc.strerror or exc}")
    return StorageFullError(f"{what}: {exc}")


class Storage:
    """The store as the sessions use it (see the module docstring)."""

    def __init__(self, store: BinStore, jobs: Jobs, *, data_dir: DataDir | None = None,
                 spill: SpillArea | None = None):
        self.store = store
        self.jobs = jobs
        self.data_dir = data_dir
        self.spill = spill
        self._numbers = itertools.count(1)
        self._spills_in_flight = 0
        self._room_waiters: list[Callable[[], None]] = []
        self.spill_failed: str | None = None  # why the last spill write failed, until one succeeds
        self.problems: list[str] = []  # what loading the data directory skipped

    @property
    def durable(self) -> bool:
        return self.data_dir is not None

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
                            ItemFiles.of(stored, lane=name, number=number))
                items.append(item)
                self._watch(item)
            self.store.load(name, items)
            count += len(items)
        self.store.continue_from(loaded.next_number)  # sequence numbers keep growing across restarts
        return count

    # -- changes

    def add(self, name: str, item: Item, replace: bool, done: Done) -> None:
        """PUT (``replace``) or APPEND ``item``; ``done(change, error)`` when it is stored."""
        store = self.store
        store.check_add(name, replace)
        if self.data_dir is None:
            limit = store.memory_limit
            if self.spill_failed and limit is not None and store.resident_bytes + item.nbytes > limit:
                raise StorageFullError(f"memory budget full and spilling failed: {self.spill_failed}")
            done(store.put(name, item) if replace else store.append(name, item), None)
            self._enforce_budget()
            return
        number = next(self._numbers)

        def committed(stored, error) -> None:
            if error is not None:
                log.warning("could not store an item of bin %r: %s", name, error)
                done(None, _storage_error(error, "not stored"))
                return
            item.files = ItemFiles.of(stored, lane=name, number=number)
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
                      (name, number, replace, item.description, item.segments, item.nbytes, item.tag), committed)

    def delete(self, name: str, done: Done) -> None:
        """DELETE bin ``name``; ``done`` once it is gone (from disk too, if durable)."""
        change = self.store.delete(name)
        if self.data_dir is None:
            done(change, None)
            return

        def deleted(_result, error) -> None:
            done(change, None if error is None else _storage_error(error, "deleted in memory, not on disk"))

        self.jobs.run(name, self.data_dir.delete_bin, (name,), deleted)

    def taken(self, name: str, items: list[Item]) -> None:
        """A GET took ``items`` from bin ``name``: move the bin's floor on disk past them."""
        numbers = [item.files.number for item in items if item.files is not None and item.files.number]
        if self.data_dir is not None and numbers:
            self.jobs.run(name, self.data_dir.set_floor, (name, max(numbers) + 1))

    def restored(self, name: str, items: list[Item]) -> None:
        """A GET's reply was not delivered and ``items`` went back: lower the floor again."""
        numbers = [item.files.number for item in items if item.files is not None and item.files.number]
        if self.data_dir is not None and numbers:
            self.jobs.run(name, self.data_dir.set_floor, (name, min(numbers)))

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
            if item.files is not None:  # durable: the files are there already
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
                    self.spill_failed = str(error)
                    log.warning("spilling %d bytes failed: %s", item.nbytes, error)
                    self.store.evict(item)  # ends its spilling state; it stays in memory
                else:
                    self.spill_failed = None
                    files = ItemFiles.of(stored)
                    if self.store.evict(item, files):
                        self._watch(item)
                    else:  # the item left the store while it was written
                        self.jobs.run(None, remove, (files,))
                if error is None:
                    self._enforce_budget()
            finally:
                self._wake()

        self.jobs.run(None, self.spill.write, (item.description, item.segments, item.nbytes, item.tag), spilled)

    def _wake(self) -> None:
        if self._room_waiters and self.room():
            waiters, self._room_waiters = self._room_waiters, []
            for callback in waiters:
                callback()

    # -- file lifetimes

    def _watch(self, item: Item) -> None:
        """Delete ``item``'s files once it is gone from the store and from every reply."""
        weakref.finalize(item, _collect, self.jobs, item.files).atexit = False

    def close(self) -> None:
        """The server is stopping: remove the spill area (the data directory stays)."""
        if self.spill is not None:
            self.spill.close()


def _collect(jobs: Jobs, files: ItemFiles) -> None:
    if files.dropped:
        jobs.run_threadsafe(files.lane, remove, (files,))
