"""The storage's same-host tier: the areas clients on this host may map, and the items in shared memory.

Same-host zero-copy (PROTOCOL.md §10) is offered by writing a token into each
directory clients may map (the shared-memory area first, then the spill and data
directories, :meth:`SharedTier.share`).  Items a client wrote into its incoming
directory in the shared-memory area are adopted without a copy (:meth:`SharedTier.adopt`),
items held in memory that a same-host client reads are copied there once
(:meth:`SharedTier.promote`), and the rows a table sample gathered may be written
there for one reply (:meth:`SharedTier.share_rows`).  Those files are RAM, so
their items count as resident.  When shared memory runs full, nothing is copied
there for a while (:data:`FULL_PAUSE_S`).  What goes by reference, per
connection, is the session's policy (``server/protocol/shared.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from tensorshare.disk.areas import write_token
from tensorshare.errors import RemoteError, ZeroCopyUnavailableError

from .spill import Area, ItemFiles
from .store import retier

log = logging.getLogger("tensorshare.server")

FULL_PAUSE_S = 5.0  # after shared memory ran full, no item is copied there for this long


class SharedTier:
    """The areas offered and the shared-memory area's items (see the module docstring).

    ``roots``: the directories that may be offered, in greeting order, as
    ``(attribute, path or None, in_memory)``; ``shm``: the
    :class:`~.shm.ShmArea` (None without one); ``takes_incoming``: whether clients
    may write values there (not with a data directory, whose items are on disk)."""

    def __init__(self, jobs, lifetimes, shm, roots: tuple, takes_incoming: bool):
        self.jobs, self.lifetimes, self.shm = jobs, lifetimes, shm
        self._roots = roots
        self._takes_incoming = takes_incoming
        self.areas: list[Area] = []  # the areas clients may map, in greeting order
        self.token: str | None = None
        self.socket: str | None = None  # the Unix socket same-host clients may connect to (server/app.py)
        self.shm_area = self.spill_area = self.data_area = None
        self._promoting: set = set()
        self._full_until = 0.0

    def share(self, token: str) -> None:
        """Offer the directories to same-host clients: write ``token`` into each.  An
        area whose token cannot be written is not offered."""
        self.token = token
        for attr, root, in_memory in self._roots:
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

    @property
    def takes_incoming(self) -> bool:
        """Whether same-host clients may write values into the shared-memory area."""
        return self.shm_area is not None and self._takes_incoming

    @property
    def takes_rows(self) -> bool:
        """Whether same-host clients may write table rows into the shared-memory area
        (copied into the tables' files: durable ones too)."""
        return self.shm_area is not None

    # -- values a client wrote (§10.4)

    def open_incoming(self, done: Callable[[str | None, BaseException | None], None]) -> None:
        """Make an incoming directory for a same-host connection (on a disk thread);
        ``done(name, error)``."""
        self.jobs.run(None, self.shm.open_connection, (), done)

    def close_incoming(self, incoming: str) -> None:
        """A same-host connection closed: remove its incoming directory (in the background)."""
        if self.shm is not None and self.lifetimes.open:
            self.jobs.run(None, self.shm.close_connection, (incoming,))

    def adopt(self, connection: str, shm_name: object, description: bytes, nbytes: int, limits,
              done: Callable[[ItemFiles | None, RemoteError | None], None]) -> None:
        """Take over the item a client wrote to ``incoming/<connection>/<shm_name>``
        (checked, on a disk thread; :attr:`takes_incoming` is the caller's to check);
        ``done(files, None)``, or ``done(None, ZeroCopyUnavailableError)`` if it
        cannot be taken."""
        def adopted(stored, error) -> None:
            if error is not None:
                done(None, _not_taken(error))
            else:
                done(self._files(stored), None)

        self.jobs.run(None, self.shm.adopt, (connection, shm_name, description, nbytes, limits), adopted)

    def take_rows_now(self, connection: str, shm_name: object, description: bytes, nbytes: int, limits,
                      kept, mapped: bool) -> list:
        """The arrays of the item a client wrote to ``incoming/<connection>/<shm_name>``,
        on the caller's thread (they are in memory): checked as :meth:`adopt` checks
        the first time, then kept open and mapped by ``kept``
        (:meth:`~.shm.ShmArea.take_rows`); raises :class:`ZeroCopyUnavailableError`."""
        try:
            return self.shm.take_rows(connection, shm_name, description, nbytes, limits, kept, mapped)
        except Exception as exc:
            raise _not_taken(exc) from None

    # -- copies into shared memory

    def promote(self, item) -> None:
        """Copy an item held in memory into the shared-memory area, in the background, so
        that same-host readers map it from then on (its chunks are freed once it is
        there; it stays resident).  Does nothing for items that have files, are on
        their way to disk, or while shared memory is full."""
        if not self._may_copy(item) or item in self._promoting:
            return
        self._promoting.add(item)

        def written(stored, error) -> None:
            self._promoting.discard(item)
            if error is not None:
                self._full("copy an item to", error)
                return
            files = self._files(stored)
            if item.stored and item.segments is not None and item.files is None and not item.spilling:
                item.files, item.segments = files, None  # still resident: the accounting stays
                retier(item)
            # else the item changed meanwhile: the new files go when `files` does

        self.jobs.run(None, self.shm.write, (item.description, item.segments, item.nbytes, item.tag), written)

    def promote_now(self, item) -> bool:
        """:meth:`promote` on the caller's thread (a copy into tmpfs, as :meth:`share_rows`).
        True if the item is in shared memory now."""
        if not self._may_copy(item):
            return False
        files = self._write("copy an item to", item.description, item.segments, item.nbytes, item.tag)
        if files is None:
            return False
        item.files, item.segments = files, None  # still resident: the accounting stays
        retier(item)
        return True

    def share_rows(self, description: bytes, buffer, nbytes: int) -> ItemFiles | None:
        """Write the rows a TSAMPLE/TREAD gathered into the shared-memory area as one
        item, for a same-host reader to map; its files, removed once nothing refers to
        them (the reply's pin).  None while shared memory is full.

        Runs on the caller's thread: the area is RAM (tmpfs), so this is a copy into
        the page cache, as the gather itself, with no disk to wait for."""
        if self.shm_area is None or time.monotonic() < self._full_until:
            return None
        return self._write("write sampled rows to", description, [buffer], nbytes, None)

    def _may_copy(self, item) -> bool:
        return (self.shm_area is not None and item.segments is not None and item.files is None
                and not item.spilling and time.monotonic() >= self._full_until)

    def _write(self, what: str, description: bytes, segments, nbytes: int, tag: int | None) -> ItemFiles | None:
        """Write an item into the shared-memory area on the caller's thread (tmpfs: a
        copy into RAM); its watched files, or None if shared memory is full."""
        try:
            stored = self.shm.write(description, segments, nbytes, tag)
        except OSError as exc:
            self._full(what, exc)
            return None
        return self._files(stored)

    def _full(self, what: str, error: BaseException) -> None:
        """A write into shared memory failed (full): say so, and pause writing there."""
        log.info("could not %s shared memory: %s", what, error)
        self._full_until = time.monotonic() + FULL_PAUSE_S

    def _files(self, stored) -> ItemFiles:
        """The files of an item just written into the shared-memory area, watched."""
        files = ItemFiles.of(stored, area=self.shm_area)
        self.lifetimes.watch_shared(files)
        return files


def _not_taken(error: BaseException) -> RemoteError:
    """The reply to a value in shared memory that could not be taken: its own if it
    says why (425), else 425 for an unexpected failure (logged)."""
    if isinstance(error, RemoteError):
        return error
    log.warning("could not take an incoming item: %s", error)
    return ZeroCopyUnavailableError(f"incoming item not taken: {error}")
