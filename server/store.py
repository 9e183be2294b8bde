"""The bin store: named, ordered lists of encoded items, held as received.

Pure and synchronous (no Twisted, no I/O): every operation returns at once, and
each change gets a sequence number from one store-wide counter, so a bin's sequence
numbers only grow, even across its deletion and re-creation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tensorshare.errors import NoSuchBinError, TooLargeError


@dataclass(frozen=True)
class Item:
    """One stored value: its description blob and its payload, kept as received."""

    description: bytes
    segments: tuple  # of bytes; concatenated they are the payload
    nbytes: int
    tag: int | None = None  # the sender's optional 64-bit tag (a version, say)


@dataclass(frozen=True)
class Change:
    """What a mutation did to a bin; the store's listeners are told of it."""

    bin: str
    n_items: int
    seq: int
    op: str
    tag: int | None = None  # tag of the bin's last item after the change


@dataclass
class _Bin:
    items: deque = field(default_factory=deque)
    nbytes: int = 0
    seq: int = 0


class BinStore:
    """Named bins of items, with byte accounting and count limits."""

    def __init__(self, max_bins: int = 100_000, max_items_per_bin: int = 1_000_000):
        self.max_bins = max_bins
        self.max_items_per_bin = max_items_per_bin
        self._bins: dict[str, _Bin] = {}
        self._seq = 0
        self.nbytes = 0  # payload bytes held by all bins

    # -- queries

    def peek(self, name: str) -> list[Item]:
        """The items of bin ``name`` (which keeps them)."""
        return list(self._bin(name).items)

    def listing(self) -> dict[str, int]:
        """``{bin: n_items}`` for every bin."""
        return {name: len(b.items) for name, b in self._bins.items()}

    def state(self, name: str) -> tuple[bool, int, int, int | None]:
        """``(exists, n_items, seq, tag)`` of bin ``name``: seq is its last change's
        number, tag its last item's tag."""
        b = self._bins.get(name)
        if b is None:
            return False, 0, self._seq, None
        return True, len(b.items), b.seq, b.items[-1].tag if b.items else None

    # -- mutations

    def put(self, name: str, item: Item) -> Change:
        """Replace the items of bin ``name`` (created if missing) with ``item``."""
        b = self._bins.get(name)
        if b is None:
            b = self._create(name)
        else:
            self.nbytes -= b.nbytes
            b.items.clear()
            b.nbytes = 0
        self._add(b, item)
        return self._changed(name, b, "PUT")

    def append(self, name: str, item: Item) -> Change:
        """Add ``item`` at the end of bin ``name`` (created if missing)."""
        b = self._bins.get(name)
        if b is None:
            b = self._create(name)
        elif len(b.items) >= self.max_items_per_bin:
            raise TooLargeError(f"bin {name!r} already holds {self.max_items_per_bin} items")
        self._add(b, item)
        return self._changed(name, b, "APPEND")

    def get(self, name: str) -> tuple[list[Item], Change]:
        """Take every item out of bin ``name``; the bin stays, empty."""
        b = self._bin(name)
        items = list(b.items)
        b.items.clear()
        self.nbytes -= b.nbytes
        b.nbytes = 0
        return items, self._changed(name, b, "GET")

    def restore(self, name: str, items: list[Item]) -> Change | None:
        """Put ``items`` taken by :meth:`get` back at the front of bin ``name``.

        Used when a get's reply could not be delivered; they came before anything
        appended since, so they go first.  A bin deleted meanwhile is re-created.
        """
        if not items:
            return None
        b = self._bins.get(name)
        if b is None:  # deleted meanwhile: re-create it even past max_bins, losing nothing
            b = self._bins[name] = _Bin()
        b.items.extendleft(reversed(items))
        added = sum(item.nbytes for item in items)
        b.nbytes += added
        self.nbytes += added
        return self._changed(name, b, "RESTORE")

    def delete(self, name: str) -> Change:
        """Remove bin ``name`` and its items."""
        b = self._bin(name)
        del self._bins[name]
        self.nbytes -= b.nbytes
        self._seq += 1
        return Change(name, 0, self._seq, "DELETE")

    # -- internals

    def _bin(self, name: str) -> _Bin:
        b = self._bins.get(name)
        if b is None:
            raise NoSuchBinError(f"no bin named {name!r}")
        return b

    def _create(self, name: str) -> _Bin:
        if len(self._bins) >= self.max_bins:
            raise TooLargeError(f"the server already holds {self.max_bins} bins")
        b = self._bins[name] = _Bin()
        return b

    def _add(self, b: _Bin, item: Item) -> None:
        b.items.append(item)
        b.nbytes += item.nbytes
        self.nbytes += item.nbytes

    def _changed(self, name: str, b: _Bin, op: str) -> Change:
        self._seq += 1
        b.seq = self._seq
        return Change(name, len(b.items), self._seq, op, b.items[-1].tag if b.items else None)
