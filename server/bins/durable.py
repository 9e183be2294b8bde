"""The durable data directory: every acknowledged item on disk, and the bins rebuilt at start.

Layout under the data directory::

    bins/<sha256 of the bin name, 32 hex digits>/
        bin.json                   {"name": the bin's name}
        floor                      items numbered below this were taken by a GET
        00000000000000000042/      an APPENDed item (tensorshare.disk.layout)
        00000000000000000057.put/  a PUT item: every lower-numbered item is superseded
    bins/.swap-<same hash>/        a bin being rewritten (see put_back); "complete" once whole
    held/<random>/                 items a GET took whose reply is not written yet, kept by a DELETE
    trash/                         deleted bins, removed in the background
    .lock                          locked (flock) by the server using the directory; says which one

One server uses a data directory at a time: a second one started on it stops at
once (:class:`~.dirlock.DirLockedError`, naming the holder) instead of serving a
state the first one changes under it.

Item numbers come from one counter that only grows (restarted above the largest
number found), so the order of a bin's directories is the order of its items.
Every change is one atomic rename: an item directory appears whole (written under
a temporary name first), a PUT supersedes the bin's older items by its name alone, a
GET moves the floor (a file replaced by rename), a DELETE moves the bin to the
trash.  So a server killed at any moment restarts into a state that existed, with
every acknowledged item.  Bin names are data: the directory name is a hash, the name
itself is read from ``bin.json``.

Everything here blocks on the file system: the server runs it on its disk threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field

from tensorshare.disk.layout import LayoutError, StoredItem, fsync_dir, read_item, write_item
from tensorshare.wire.description import DEFAULT_LIMITS, DecodeLimits

from .dirlock import DirLock
from .spill import make_private_dir

log = logging.getLogger("tensorshare.server")

BINS_DIR = "bins"  # (the names of the layout above: a multi-worker server moves bins by them too)
BIN_RECORD = "bin.json"
SWAP_PREFIX = ".swap-"
HALF_MADE = ".tmp-"  # a directory being written under a temporary name
_PUT_SUFFIX = ".put"
_NUMBER_DIGITS = 20
_COMPLETE = "complete"  # in a rewritten bin not yet swapped in: every item is there


def _link_tree(source: str, target: str) -> None:
    """Recreate the directory tree ``source`` at ``target`` with hard links to its files."""
    shutil.copytree(source, target, copy_function=os.link)


SEQ_RECORD = "seq.json"  # {"seq": the store's counter at the last clean stop}


@dataclass
class LoadedBin:
    """A bin found in the data directory: its items in order, each with its number."""

    name: str
    items: list[tuple[int, StoredItem]] = field(default_factory=list)


@dataclass
class Loaded:
    """What :meth:`DataDir.load` found."""

    bins: dict[str, LoadedBin]
    next_number: int
    problems: list[str]  # corrupt or foreign entries, reported and skipped
    seq: int = 0  # the store's last sequence number when the server last stopped cleanly (0: not known)


def _atomic_write(path: str, text: str, fsync: bool) -> None:
    tmp = f"{path}{HALF_MADE}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class DataDir:
    """Blocking operations on one data directory (see the module docstring)."""

    def __init__(self, root: str, fsync: bool = False, limits: DecodeLimits = DEFAULT_LIMITS):
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self.limits = limits
        self.bins_dir = os.path.join(self.root, BINS_DIR)
        self.trash = os.path.join(self.root, "trash")
        self.held = os.path.join(self.root, "held")
        make_private_dir(self.root)  # stored tensors and bin names are nobody else's business
        self._lock: DirLock | None = DirLock(self.root).acquire()
        os.makedirs(self.bins_dir, exist_ok=True)
        os.makedirs(self.trash, exist_ok=True)

    def close(self) -> None:
        """The server stops using the directory: another may take it."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @staticmethod
    def bin_key(name: str) -> str:
        """The directory name of bin ``name``: a hash, so that no name is ever a path."""
        return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def bin_path(self, name: str) -> str:
        return os.path.join(self.bins_dir, self.bin_key(name))

    # -- changes (each one atomic)

    def commit(self, name: str, next_number, replace: bool, description: bytes, segments, nbytes: int,
               tag) -> tuple[StoredItem, int]:
        """Write an item of bin ``name``; ``replace`` (a PUT) supersedes the older ones.
        Its number comes from ``next_number()`` now, so numbers follow the order in
        which the bin's changes reach the disk.  Returns the item and its number."""
        bin_path = self.bin_path(name)
        created = not os.path.isdir(bin_path)
        if created:
            self._create_bin(name, bin_path)
        number = next_number()
        item_name = f"{number:0{_NUMBER_DIGITS}d}" + (_PUT_SUFFIX if replace else "")
        try:
            stored = write_item(os.path.join(bin_path, item_name), description, segments, nbytes, tag,
                                fsync=self.fsync, limits=self.limits)
        except BaseException:
            if created:  # a refused first item leaves no bin behind (a restart would list it)
                self._remove_empty_bin(bin_path)
            raise
        return stored, number

    def _remove_empty_bin(self, bin_path: str) -> None:
        """Remove a bin directory that holds only its record (one a failed first write made)."""
        try:
            if os.listdir(bin_path) == [BIN_RECORD]:
                shutil.rmtree(bin_path)
                if self.fsync:
                    fsync_dir(self.bins_dir)
        except OSError:
            pass  # (left as it was: an empty bin, as before)

    def _create_bin(self, name: str, bin_path: str) -> None:
        tmp = os.path.join(self.bins_dir, f"{HALF_MADE}{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            _atomic_write(os.path.join(tmp, BIN_RECORD), json.dumps({"name": name}), self.fsync)
            os.rename(tmp, bin_path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(bin_path):
                raise
        if self.fsync:
            fsync_dir(self.bins_dir)

    def set_floor(self, name: str, number: int) -> None:
        """Mark every item of bin ``name`` numbered below ``number`` as taken."""
        bin_path = self.bin_path(name)
        if os.path.isdir(bin_path):
            _atomic_write(os.path.join(bin_path, "floor"), str(number), self.fsync)

    def delete_bin(self, name: str, keep: tuple = ()) -> dict[str, StoredItem]:
        """Remove bin ``name``: moved to the trash at once, its files deleted after.

        The item directories in ``keep`` (items a GET took whose reply is still
        being written: they may yet go back into the bin) are first linked into
        the held area; returns ``{old path: the item found there now}`` for them."""
        bin_path = self.bin_path(name)
        if not os.path.isdir(bin_path):
            return {}
        kept = {}
        for path in keep:
            if os.path.isdir(path) and os.path.dirname(path) == bin_path:
                target = os.path.join(self.held, uuid.uuid4().hex)
                _link_tree(path, target)
                kept[path] = read_item(target, self.limits)
        doomed = os.path.join(self.trash, uuid.uuid4().hex)
        os.rename(bin_path, doomed)
        if self.fsync:
            fsync_dir(self.bins_dir)
        shutil.rmtree(doomed, ignore_errors=True)
        return kept

    def put_back(self, name: str, item_paths: list[str], next_number) -> dict[str, tuple[StoredItem, int]]:
        """Put the items at ``item_paths`` (item directories anywhere in the data
        directory: a GET took them, its reply was not delivered) back at the front of
        bin ``name``, before the items it holds on disk now, whatever happened to it
        meanwhile (a DELETE, a PUT).  The bin is rewritten: a new directory of hard
        links (no data is copied), numbered by ``next_number()``, swapped in for the
        old one; a crash leaves the old bin or the whole new one (finished at the next
        start).  Returns ``{old path: (the item there now, its number)}``."""
        bin_path = self.bin_path(name)
        live = []
        if os.path.isdir(bin_path):
            found, _top = self._load_bin(bin_path, self.bin_key(name), [], clean=False)
            live = [stored.path for _number, stored in found.items]
        sources = [path for path in item_paths if os.path.isdir(path)] + live
        return dict(zip(sources, self._rewrite_bin(name, sources, [next_number() for _ in sources])))

    def _rewrite_bin(self, name: str, item_paths: list[str], numbers: list[int]) -> list[tuple[StoredItem, int]]:
        """Make bin ``name`` hold exactly the items at ``item_paths``, in that order."""
        bin_path = self.bin_path(name)
        swap = os.path.join(self.bins_dir, f"{SWAP_PREFIX}{self.bin_key(name)}")
        shutil.rmtree(swap, ignore_errors=True)
        os.mkdir(swap, 0o700)
        try:
            _atomic_write(os.path.join(swap, BIN_RECORD), json.dumps({"name": name}), self.fsync)
            entries = []
            for path, number in zip(item_paths, numbers):
                entry = f"{number:0{_NUMBER_DIGITS}d}"
                _link_tree(path, os.path.join(swap, entry))
                entries.append(entry)
            _atomic_write(os.path.join(swap, _COMPLETE), "", self.fsync)
        except BaseException:
            shutil.rmtree(swap, ignore_errors=True)
            raise
        if self.fsync:
            fsync_dir(self.bins_dir)
        doomed = None
        if os.path.isdir(bin_path):
            doomed = os.path.join(self.trash, uuid.uuid4().hex)
            os.rename(bin_path, doomed)
        os.rename(swap, bin_path)
        os.unlink(os.path.join(bin_path, _COMPLETE))
        if self.fsync:
            fsync_dir(self.bins_dir)
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)
        return [(read_item(os.path.join(bin_path, entry), self.limits), number)
                for entry, number in zip(entries, numbers)]

    # -- start-up

    def load(self) -> Loaded:
        """Find every bin and its live items; clean up what a crash left behind.

        Reads each item's small record and stats its files; array bytes stay on
        disk.  A corrupt or foreign entry is reported in ``problems`` and skipped.
        """
        shutil.rmtree(self.trash, ignore_errors=True)
        os.makedirs(self.trash, exist_ok=True)
        shutil.rmtree(self.held, ignore_errors=True)  # taken items a DELETE kept: their GETs are over
        self._finish_swaps()
        bins: dict[str, LoadedBin] = {}
        problems: list[str] = []
        highest = 0
        for entry in sorted(os.listdir(self.bins_dir)):
            path = os.path.join(self.bins_dir, entry)
            if entry.startswith(HALF_MADE) or entry.startswith(SWAP_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                loaded, top = self._load_bin(path, entry, problems)
            except (OSError, ValueError, LayoutError) as exc:
                problems.append(f"{path}: {exc}")
                continue
            highest = max(highest, top)
            if loaded is not None:
                bins[loaded.name] = loaded
        for problem in problems:
            log.warning("data directory: skipped %s", problem)
        return Loaded(bins, highest + 1, problems, self._noted_seq())

    def note_seq(self, seq: int) -> None:
        """The server stops cleanly with the store's counter at ``seq``: the next start
        goes on past it, so that a reader's ``since`` never meets a new change's seq."""
        try:
            _atomic_write(os.path.join(self.root, SEQ_RECORD), json.dumps({"seq": int(seq)}), self.fsync)
        except OSError as exc:
            log.warning("data directory: could not note the last sequence number: %s", exc)

    def _noted_seq(self) -> int:
        try:
            with open(os.path.join(self.root, SEQ_RECORD)) as f:
                seq = json.load(f).get("seq")
        except (OSError, ValueError, AttributeError):
            return 0
        return seq if type(seq) is int and seq >= 0 else 0

    def _finish_swaps(self) -> None:
        """Put in place the bins a crash left rewritten whole but not yet swapped in
        (the disk jobs of one bin run in order, so a complete rewrite holds everything
        the bin it replaces held: it wins over it)."""
        for entry in os.listdir(self.bins_dir):
            if entry.startswith(SWAP_PREFIX):
                path, target = os.path.join(self.bins_dir, entry), os.path.join(self.bins_dir, entry[len(SWAP_PREFIX):])
                if os.path.exists(os.path.join(path, _COMPLETE)):  # it supersedes the bin, if still there
                    if os.path.exists(target):
                        os.rename(target, os.path.join(self.trash, uuid.uuid4().hex))
                    os.rename(path, target)
                    os.unlink(os.path.join(target, _COMPLETE))

    def _load_bin(self, path: str, entry: str, problems: list[str], clean: bool = True) -> tuple[LoadedBin | None, int]:
        """The bin at ``path`` and its highest item number; with ``clean``, what a
        crash left behind (half-written items, superseded or taken ones) is removed."""
        if not os.path.isdir(path):
            raise ValueError("not a bin directory")
        with open(os.path.join(path, BIN_RECORD)) as f:
            name = json.load(f).get("name")
        if not isinstance(name, str) or self.bin_key(name) != entry:
            raise ValueError(f"bin.json names {name!r:.80}, which does not hash to this directory")
        floor = 0
        floor_path = os.path.join(path, "floor")
        if os.path.exists(floor_path):
            with open(floor_path) as f:
                floor = int(f.read().strip())
        numbered = []
        for item_entry in os.listdir(path):
            item_path = os.path.join(path, item_entry)
            if item_entry in (BIN_RECORD, "floor", _COMPLETE):
                continue
            if item_entry.startswith(HALF_MADE) or item_entry.startswith("floor" + HALF_MADE):
                if clean:
                    shutil.rmtree(item_path, ignore_errors=True) if os.path.isdir(item_path) else os.unlink(item_path)
                continue
            digits = item_entry[: -len(_PUT_SUFFIX)] if item_entry.endswith(_PUT_SUFFIX) else item_entry
            if len(digits) != _NUMBER_DIGITS or not digits.isdigit():
                problems.append(f"{item_path}: not an item directory")
                continue
            numbered.append((int(digits), item_entry.endswith(_PUT_SUFFIX), item_path))
        numbered.sort()
        top = numbered[-1][0] if numbered else 0
        puts = [number for number, is_put, _ in numbered if is_put]
        start = max(floor, puts[-1] if puts else 0)
        loaded = LoadedBin(name)
        for number, _is_put, item_path in numbered:
            if number < start:  # superseded by a PUT or taken by a GET: the removal was cut short
                if clean:
                    shutil.rmtree(item_path, ignore_errors=True)
                continue
            try:
                loaded.items.append((number, read_item(item_path, self.limits)))
            except LayoutError as exc:
                problems.append(str(exc))
        return loaded, max(top, floor)
