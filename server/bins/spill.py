"""Items whose payload lives in files: serving them from memory maps, and the spill area.

An item on disk (spilled, or durable in the data directory) is a directory in the
layout of :mod:`tensorshare.disk.layout`.  :class:`ItemFiles` says where its arrays are;
:meth:`ItemFiles.open_parts` opens them and cuts them into :class:`FileSpan` parts
that the connection's writer has the kernel send (or copies out) one span at a time,
so a reply never holds a spilled item in RAM whole.  The functions here block on the
file system: the server calls them from its disk thread pool (:mod:`.jobs`);
``open_parts`` only opens (no reads: the kernel sends or reads the spans' pages as
the socket takes them, with read-ahead asked for).
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field

from tensorshare.disk.layout import StoredItem, mapped_parts, write_item

from .dirlock import lock_file

SPAN = 4 << 20  # bytes of a file per part (what the TLS path copies out at once)


class FileSpan:
    """``length`` bytes of an open file, sent by the kernel when the socket wants them.

    On a plain TCP connection the writer hands spans to :mod:`server.net.sendfile`,
    which passes them from the page cache to the socket (``os.sendfile``) on a
    thread; elsewhere (TLS) :meth:`tobytes` reads them with one ``pread``.  The
    span keeps its file open, so a span stays valid after the item's directory is
    removed (an item taken or deleted while its reply is being sent)."""

    __slots__ = ("file", "start", "stop")

    def __init__(self, file, start: int, stop: int):
        self.file, self.start, self.stop = file, start, stop  # file: an open, unbuffered binary file

    def __len__(self) -> int:
        return self.stop - self.start

    def fileno(self) -> int:
        return self.file.fileno()

    def tobytes(self) -> bytes:
        """The span's bytes (one copy out of the page cache, no mapping: the server's
        RSS does not grow with the spilled items it serves)."""
        data = os.pread(self.file.fileno(), self.stop - self.start, self.start)
        if len(data) != self.stop - self.start:
            raise OSError(f"stored file {self.file.name} is shorter than its item says")
        return data


@dataclass(frozen=True)
class Area:
    """A directory of items that same-host clients may map (see :mod:`tensorshare.disk.areas`).

    ``index`` is its place in the greeting's list; ``in_memory`` is True for the
    shared-memory area, whose files are RAM and count against the memory budget."""

    index: int
    root: str
    in_memory: bool = False


@dataclass(eq=False)
class ItemFiles:
    """Where an item's payload lives on disk, and whether the store still wants it."""

    path: str
    spans: tuple  # ((payload offset, byte count, file path), ...) in payload order
    nbytes: int
    lane: str | None = None  # the disk lane (a bin, for the data directory) its removal goes through
    number: int | None = None  # its number in the data directory (None when spilled)
    dropped: bool = field(default=False)  # set by the store when the item leaves it
    area: Area | None = None  # the shared area holding it, if clients may map it
    _ref: list | None = field(default=None, repr=False)  # ref(), once computed

    @classmethod
    def of(cls, stored: StoredItem, lane: str | None = None, number: int | None = None,
           area: Area | None = None) -> "ItemFiles":
        return cls(stored.path, stored.files, stored.nbytes, lane, number, area=area)

    @property
    def in_memory(self) -> bool:
        """True when the files are in the shared-memory area (RAM, not disk)."""
        return self.area is not None and self.area.in_memory

    def ref(self) -> list:
        """The item's reference in a 226 reply: ``[area index, path relative to the area]``."""
        ref = self._ref
        if ref is None:
            ref = self._ref = [self.area.index, os.path.relpath(self.path, self.area.root).replace(os.sep, "/")]
        return ref

    def open_parts(self) -> list:
        """The payload as frame parts: zero padding as ``bytes``, array bytes as
        :class:`FileSpan` parts of their open files (blocking: opens, reads nothing;
        the kernel is asked to start reading ahead)."""
        parts, pos = [], 0
        for offset, length, path in self.spans:
            if offset > pos:
                parts.append(bytes(offset - pos))
            if length:
                file = open(path, "rb", buffering=0)
                try:
                    if os.fstat(file.fileno()).st_size < length:
                        raise OSError(f"stored file {path} is shorter than its item says")
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(file.fileno(), 0, length, os.POSIX_FADV_WILLNEED)
                except BaseException:
                    file.close()
                    raise
                parts.extend(FileSpan(file, i, min(i + SPAN, length)) for i in range(0, length, SPAN))
            pos = offset + length
        if self.nbytes > pos:
            parts.append(bytes(self.nbytes - pos))
        return parts

    def buffers(self) -> list:
        """The payload as buffers (padding and read-only mappings), e.g. to write it elsewhere."""
        return mapped_parts(self.spans, self.nbytes)


def remove(files: ItemFiles) -> None:
    """Delete an item's directory (blocking; mappings already open stay valid)."""
    remove_dir(files.path)


def remove_dir(path: str) -> None:
    """Delete a directory tree, ignoring errors (blocking; mappings already open stay valid)."""
    shutil.rmtree(path, ignore_errors=True)


class SpillArea:
    """A directory of spilled items, one subdirectory each, private to the server's user.

    Each server process works in its own ``spill-<pid>`` subdirectory of ``root``
    and holds a lock on it; subdirectories whose lock is free belong to servers
    that died, and are removed when the next server starts.  The default root is
    one directory per user in the temporary directory, so that the next server
    finds what a killed one left.  The root is made private (0700): spilled items
    hold tensors and bin names.
    """

    def __init__(self, root: str | None = None):
        self.root = default_root() if root is None else os.path.abspath(root)
        make_private_dir(self.root)
        self._remove_orphans()
        self.items = os.path.join(self.root, f"spill-{os.getpid()}")
        shutil.rmtree(self.items, ignore_errors=True)
        os.makedirs(self.items)
        self._lock = lock_file(self.items, blocking=True)
        self._names = itertools.count()

    def _remove_orphans(self) -> None:
        for entry in os.listdir(self.root):
            path = os.path.join(self.root, entry)
            if entry.startswith("spill-") and os.path.isdir(path):
                lock = lock_file(path, blocking=False)
                if lock is not None:  # nobody holds it: its server is gone
                    shutil.rmtree(path, ignore_errors=True)
                    os.close(lock)

    def write(self, description: bytes, segments, nbytes: int, tag) -> StoredItem:
        """Write an item to a new directory (blocking)."""
        return write_item(os.path.join(self.items, str(next(self._names))), description, segments, nbytes, tag)

    def close(self) -> None:
        """Remove every spilled file (the server is stopping)."""
        shutil.rmtree(self.items, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def default_root() -> str:
    """The spill root shared by this user's servers: ``<tmp>/tensorshare-spill-<uid>``."""
    return os.path.join(tempfile.gettempdir(), f"tensorshare-spill-{os.geteuid()}")


def make_private_dir(path: str) -> None:
    """Create ``path`` (with its parents) and make it private to this user (0700).

    An existing directory must be a real directory of this user (not a link, not
    someone else's): a server never writes into a directory another user prepared."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)

