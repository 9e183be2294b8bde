"""The bins' memory budget: which items move to the spill area, and pausing payloads until they have.

Past ``memory_limit`` (:class:`~.store.BinStore` chooses: least recently used
first) items are written to the spill area on disk threads and then served from
their files.  While spills are on their way and memory is still over budget,
:meth:`MemoryBudget.room` is False: sessions stop reading payloads (backpressure)
until :meth:`MemoryBudget.wait_for_room` calls them back.  When a spill write
fails (disk full), :attr:`MemoryBudget.spill_failed` says why, and writes that
would grow memory further are refused (:meth:`~.storage.Storage.add`).  Durable
items already have their files: going over budget only drops their copy in memory.
"""

from __future__ import annotations

import logging
from typing import Callable

from .spill import ItemFiles, remove

log = logging.getLogger("tensorshare.server")


class MemoryBudget:
    """Keeps ``store``'s resident payload under its limit (see the module docstring).

    ``spill`` is the :class:`~.spill.SpillArea` (None: over-budget items stay in
    memory); ``area`` the :class:`~.spill.Area` same-host clients know it as (set
    once the areas are offered); ``lifetimes`` deletes spilled files once unused."""

    def __init__(self, store, jobs, spill, lifetimes):
        self.store, self.jobs, self.spill, self.lifetimes = store, jobs, spill, lifetimes
        self.area = None
        self.spill_failed: str | None = None  # why the last spill write failed, until one succeeds
        self._in_flight = 0  # spill writes under way
        self._waiters: list[Callable[[], None]] = []

    def room(self) -> bool:
        """False while memory is over budget and spills that would free it are running."""
        return not (self._in_flight and self.store.over_budget())

    def wait_for_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when :meth:`room` is True again."""
        if self.room():
            callback()
        else:
            self._waiters.append(callback)

    def enforce(self) -> None:
        """Start moving what is over the budget to disk."""
        store = self.store
        for item in store.to_evict():
            if item.files is not None and not item.files.in_memory:  # durable: the files are there already
                store.evict(item)
            elif self.spill is not None:
                self._spill(item)
            else:
                store.evict(item)  # nowhere to put it: stays in memory

    def wake(self) -> None:
        """Memory may have been freed: call back those waiting for room, if there is some."""
        if self._waiters and self.room():
            waiters, self._waiters = self._waiters, []
            for callback in waiters:
                callback()

    def _spill(self, item) -> None:
        self._in_flight += 1

        def spilled(stored, error) -> None:
            self._in_flight -= 1
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
                    files = ItemFiles.of(stored, area=self.area)
                    if self.store.evict(item, files):
                        self.lifetimes.watch(item)
                    else:  # the item left the store while it was written
                        self.jobs.run(None, remove, (files,))
                if error is None or item.unspillable:
                    self.enforce()
            finally:
                self.wake()

        # Chunks in memory, or files in shared memory (mapped on the disk thread).
        source = item.segments if item.segments is not None else item.files
        self.jobs.run(None, self._write, (item.description, source, item.nbytes, item.tag), spilled)

    def _write(self, description: bytes, source, nbytes: int, tag):
        buffers = source.buffers() if isinstance(source, ItemFiles) else source
        return self.spill.write(description, buffers, nbytes, tag)
