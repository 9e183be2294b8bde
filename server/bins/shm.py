"""The shared-memory area: item payloads that clients on the same host map instead of receiving.

Layout (one directory per server run, private to the server's user)::

    <root>/tensorshare-<pid>-<random>/   root: --shm-dir, /dev/shm by default
        .lock                flock held while the server runs: a free lock means its server died
        .tensorshare-token   the token the greeting advertises (tensorshare.disk.areas)
        items/<n>/           stored items, in the layout of tensorshare.disk.layout, files read-only
        incoming/<conn>/     one per same-host connection: its client writes PUT/APPEND values
                             here, and the server adopts them (a rename, no copy)

Cleanup: the directory is removed when the server stops; a server that starts
removes the directories of servers that died (their lock is free); a connection's
incoming directory goes when the connection closes, so a client that died before
sending its PUT leaves nothing.  Items' files are removed once nothing refers to
them (:mod:`.storage`); clients that still map them keep their pages.

Everything here blocks on the file system and runs on the server's disk threads
(set-up and clean-up at start and stop excepted).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import shutil
import time

from tensorshare.disk.areas import AreaError, check_item_tree, not_open_for_writing, valid_name
from tensorshare.errors import ZeroCopyUnavailableError
from tensorshare.disk.layout import RECORD, LayoutError, StoredItem, read_item, write_item
from tensorshare.wire.description import DEFAULT_LIMITS, DecodeLimits

from .dirlock import lock_file
from .keptrows import KeptRows

log = logging.getLogger("tensorshare.server")

PREFIX = "tensorshare-"
_NEW_PREFIX = ".tensorshare-new-"  # a directory being set up (renamed once its lock is held)
_STALE_NEW_S = 60.0  # a set-up directory this old without a held lock was left by a crash
_METADATA_MAX = 64 << 20  # bytes of record and meta.json files an adopted item may carry


class ShmArea:
    """This server's directory in shared memory (see the module docstring)."""

    def __init__(self, root: str = "/dev/shm"):
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root} is not a directory")
        self.owner = os.geteuid()
        _remove_orphans(root, self.owner)
        # Set up under a name no other server sweeps, lock, then rename into place.
        new = os.path.join(root, f"{_NEW_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(new, 0o700)
        try:
            self._lock = lock_file(new, blocking=True)
            os.mkdir(os.path.join(new, "items"), 0o700)
            os.mkdir(os.path.join(new, "incoming"), 0o700)
            self.path = os.path.join(root, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
            os.rename(new, self.path)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        self.items = os.path.join(self.path, "items")
        self.incoming = os.path.join(self.path, "incoming")
        self._names = itertools.count()
        self._connections = itertools.count()

    # -- connections (reactor thread)

    def open_connection(self) -> str:
        """Make the incoming directory of a new connection; returns its path relative to the area."""
        relative = f"incoming/{next(self._connections)}"
        os.mkdir(os.path.join(self.path, relative), 0o700)
        return relative

    def close_connection(self, relative: str) -> None:
        """Remove a connection's incoming directory and whatever its client left there (blocking).

        It is renamed first, so that a client still writing cannot start another item
        in it (it writes no parent directories); anything such a writer finishes
        meanwhile is removed with the next connection that closes, or at exit."""
        closed = os.path.join(self.incoming, f".closed-{os.path.basename(relative)}")
        try:
            os.rename(os.path.join(self.path, relative), closed)
        except OSError:
            pass
        try:
            entries = os.listdir(self.incoming)
        except OSError:  # the whole area is going (the server stops)
            return
        for entry in entries:
            if entry.startswith(".closed-"):
                shutil.rmtree(os.path.join(self.incoming, entry), ignore_errors=True)

    # -- items (disk threads)

    def write(self, description: bytes, segments, nbytes: int, tag) -> StoredItem:
        """Write an item held in memory into the area (blocking); its files are made read-only."""
        stored = write_item(os.path.join(self.items, str(next(self._names))), description, segments, nbytes, tag)
        for _offset, _length, file in stored.files:
            os.chmod(file, 0o400)
        return stored

    def adopt(self, connection: str, name: object, description: bytes, nbytes: int,
              limits: DecodeLimits = DEFAULT_LIMITS) -> StoredItem:
        """Take the item a client wrote to ``incoming/<connection>/<name>`` into the area, without copying.

        Raises :class:`ZeroCopyUnavailableError` unless it passes :meth:`_checked`;
        then the directory is renamed into ``items/``.  A refused directory stays
        where it is (its client, or the connection's end, removes it).
        """
        source, stored = self._checked(connection, name, description, nbytes, limits)
        target = os.path.join(self.items, str(next(self._names)))
        os.rename(source, target)
        moved = tuple((offset, length, target + file[len(source):]) for offset, length, file in stored.files)
        return StoredItem(target, stored.description, stored.tag, stored.nbytes, moved)

    def take_rows(self, connection: str, name: object, description: bytes, nbytes: int, limits: DecodeLimits,
                  kept: KeptRows, mapped: bool) -> list:
        """The arrays of the item a client wrote to ``incoming/<connection>/<name>``
        for a table insert (PROTOCOL.md §10.4), one uint8 array per array of the
        description, in its order: checked as :meth:`adopt` checks the first time,
        then its files kept open and mapped by ``kept`` (:mod:`.keptrows`) for the
        client's next rows, which it writes into the same pages once the insert is
        answered; :class:`~.tables.columns.MappedRows` if ``mapped`` (for a table that
        copies them with system calls only), else read out with ``preadv``.  The
        directory stays until the connection's end removes it.  On the reactor's
        thread; raises :class:`ZeroCopyUnavailableError`."""
        if not valid_name(name):
            raise ZeroCopyUnavailableError(f"bad incoming item name {name!r:.80}")

        def check() -> list[tuple[int, str]]:
            _source, stored = self._checked(connection, name, description, nbytes, limits)
            return [(length, file) for _offset, length, file in stored.files]

        try:
            return kept.arrays(name, description, nbytes, check, mapped)
        except (ValueError, OSError) as exc:  # (changed since it was checked)
            raise ZeroCopyUnavailableError(f"incoming item unreadable: {exc}") from None

    def _checked(self, connection: str, name: object, description: bytes, nbytes: int,
                 limits: DecodeLimits) -> tuple[str, StoredItem]:
        """``(path, item)`` of the item a client wrote to ``incoming/<connection>/<name>``,
        its array files made read-only.

        Raises :class:`ZeroCopyUnavailableError` unless it is a whole item in the
        layout, made of plain files and directories of the server's user, whose
        record holds exactly ``description`` and ``nbytes`` (checked as any value
        is), with no other files than the layout's, and no file still open for
        writing (nobody can change it from now on but by making it writable again)."""
        if not valid_name(name):
            raise ZeroCopyUnavailableError(f"bad incoming item name {name!r:.80}")
        source = os.path.join(self.path, connection, name)
        try:
            files = check_item_tree(source, self.owner)
            stored = read_item(source, limits)
        except (AreaError, LayoutError) as exc:
            raise ZeroCopyUnavailableError(f"incoming item refused: {exc}") from None
        except OSError as exc:
            raise ZeroCopyUnavailableError(f"incoming item unreadable: {exc.strerror or exc}") from None
        if stored.description != description or stored.nbytes != nbytes:
            raise ZeroCopyUnavailableError("incoming item's record does not match the request's value")
        arrays = {file for _offset, _length, file in stored.files}
        extra = 0
        for file in files:
            if file in arrays:
                continue
            if os.path.basename(file) not in (RECORD, "meta.json"):
                raise ZeroCopyUnavailableError(f"incoming item holds a file the layout does not make: {file}")
            extra += os.stat(file).st_size
        if extra > _METADATA_MAX:
            raise ZeroCopyUnavailableError(f"incoming item's metadata takes {extra} bytes")
        for file in arrays:
            os.chmod(file, 0o400)  # nobody but root may open it for writing from now on...
            if not not_open_for_writing(file):  # ...and nobody still has it open or mapped so
                raise ZeroCopyUnavailableError(f"{file} is still open for writing")
        return source, stored

    def close(self) -> None:
        """Remove the whole area (the server is stopping)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _remove_orphans(root: str, owner: int) -> None:
    """Remove the areas of servers of this user that died (nobody holds their lock)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith((PREFIX, _NEW_PREFIX)):
            continue
        path = os.path.join(root, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != owner:
            continue
        if entry.startswith(_NEW_PREFIX) and time.time() - st.st_mtime < _STALE_NEW_S:
            continue  # another server is setting it up right now
        lock = lock_file(path, blocking=False, create=False)
        if lock is None and (entry.startswith(PREFIX) or os.path.exists(os.path.join(path, ".lock"))):
            continue  # its server holds the lock: alive
        log.info("removing %s, left by a server that is gone", path)
        shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)
