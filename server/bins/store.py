"""The bin store: named, ordered lists of encoded items, held as received.

Pure and synchronous (no Twisted, no I/O): every operation returns at once, and
each change gets a sequence number from one store-wide counter, so a bin's sequence
numbers only grow, even across its deletion and re-creation.

It also keeps the memory accounting of the disk tier: which items hold their
payload in RAM (``resident_bytes``: received chunks, or files in the shared-memory
area, which are RAM too), in least-recently-used order, and which of them should
move to disk to get back under ``memory_limit``.  Moving them is the caller's job
(:mod:`.storage`); the store only swaps an item's payload for its files.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from tensorshare.errors import NoSuchBinError, TooLargeError

# Where an item's payload lives (the operations pages count items and bytes by these).
MEMORY, SHM, SPILLED, DURABLE = TIERS = ("memory", "shm", "spilled", "durable")


def tier_of(item) -> str:
    """Where an item's payload lives: ``memory`` (received chunks), ``shm`` (the
    shared-memory area), ``spilled`` (a spill file) or ``durable`` (the data
    directory, whether or not also cached in memory)."""
    files = item.files
    if files is None:
        return MEMORY
    if files.in_memory:
        return SHM
    if files.number is not None:
        return DURABLE
    return MEMORY if item.segments is not None else SPILLED


class Reference:
    """What an item put by device reference (PROTOCOL.md §13) holds besides its
    description: the reference readers are given (``value``; None once its
    publisher left), and the memory that takes, counted with the descriptions."""

    __slots__ = ("value", "nbytes")

    def __init__(self, value: dict, nbytes: int):
        self.value, self.nbytes = value, nbytes

    @property
    def lost(self) -> bool:
        return self.value is None


class Item:
    """One stored value: its description blob and its payload, kept as received.

    The payload is in memory (``segments``, the received chunks), in files
    (``files``: spilled or durable on disk, or in the shared-memory area), or both
    (a durable item still cached).  An item put by reference to a client's device
    memory (``device``, PROTOCOL.md §13) has neither until its bytes come.
    """

    __slots__ = ("description", "segments", "nbytes", "tag", "files", "stored", "spilling", "unspillable",
                 "device", "home", "tier", "__weakref__")

    def __init__(self, description: bytes, segments: tuple | None, nbytes: int, tag: int | None = None,
                 files=None):
        self.description = description
        self.segments = segments  # received chunks (bytes, read-only views of pool chunks) forming the payload, or None
        self.nbytes = nbytes
        self.tag = tag  # the sender's optional 64-bit tag (a version, say)
        self.files = files  # spill.ItemFiles when the payload is also (or only) on disk
        self.stored = False  # in a bin of the store right now
        self.spilling = False  # being written to the spill area
        self.unspillable = False  # writing it to disk failed for a reason of its own: it stays in memory
        self.device: Reference | None = None  # put by device reference (server/protocol/devices.py)
        self.home: _Bin | None = None  # the bin holding it (None when in none)
        self.tier = MEMORY  # where its payload was when last counted (tier_of): in memory until it has files

    @property
    def resident(self) -> bool:
        """True while the payload takes RAM: received chunks, or files in shared memory."""
        return self.segments is not None or (self.files is not None and self.files.in_memory)

    def parts(self) -> list:
        """The payload as frame parts: the chunks in memory, else spans of its mapped files."""
        return list(self.segments) if self.segments is not None else self.files.open_parts()

    def __repr__(self) -> str:
        where = "memory" if self.resident else "disk"
        return f"Item({self.nbytes} bytes in {where}, tag={self.tag})"


class Change(NamedTuple):
    """What a mutation did to a bin; the store's listeners are told of it.  (A named
    tuple: one is made per request, and a frozen dataclass costs several times more
    to make.)"""

    bin: str
    n_items: int
    seq: int
    op: str
    tag: int | None = None  # tag of the bin's last item after the change


class BinState(NamedTuple):
    """What a listener's snapshot holds of a bin: whether it exists, its item count,
    its last change's number (the store's last if it does not exist) and its last
    item's tag."""

    exists: bool
    n_items: int
    seq: int
    tag: int | None


_state = tuple.__new__  # BinState(...) without the Python-level __new__


@dataclass
class _Bin:
    items: deque = field(default_factory=deque)
    nbytes: int = 0  # payload bytes of its items
    described: int = 0  # bytes of its items' descriptions
    seq: int = 0
    # tier -> [items, payload bytes] of its items whose payload is elsewhere than in
    # memory (the rest of items and nbytes is in memory): kept as items come, go and
    # move, so that the operations pages never walk the items
    placed: dict = field(default_factory=dict)

    def tiers(self) -> dict[str, tuple[int, int]]:
        """``{tier: (items, payload bytes)}`` of the tiers that hold any of its items."""
        out = {tier: (n, nbytes) for tier, (n, nbytes) in self.placed.items()}
        in_memory = len(self.items) - sum(n for n, _ in out.values())
        if in_memory > 0:
            out[MEMORY] = (in_memory, self.nbytes - sum(nbytes for _, nbytes in out.values()))
        return out


def _place(b: _Bin, item: Item, tier: str) -> None:
    """Count ``item`` (in ``b``) in ``tier``."""
    item.tier = tier
    if tier is not MEMORY:
        counted = b.placed.get(tier)
        if counted is None:
            counted = b.placed[tier] = [0, 0]
        counted[0] += 1
        counted[1] += item.nbytes


def _unplace(b: _Bin, item: Item) -> None:
    """Stop counting ``item`` (in ``b``) in its tier.  (Never raises: on the request
    path a count gone wrong must cost a wrong figure on the status page, not a GET.)"""
    if item.tier is not MEMORY:
        counted = b.placed.get(item.tier)
        if counted is None:
            return
        counted[0] -= 1
        counted[1] -= item.nbytes
        if counted[0] <= 0:
            del b.placed[item.tier]


def retier(item: Item) -> None:
    """``item``'s payload moved (into the shared-memory area, out of memory to disk):
    count it where it is now.  Whoever changes a stored item's ``files`` or
    ``segments`` calls this."""
    b = item.home
    tier = tier_of(item)
    if b is not None and tier != item.tier:
        _unplace(b, item)
        _place(b, item, tier)


class BinStore:
    """Named bins of items, with byte accounting and count limits."""

    def __init__(self, max_bins: int = 100_000, max_items_per_bin: int = 1_000_000,
                 memory_limit: int | None = None):
        self.max_bins = max_bins
        self.max_items_per_bin = max_items_per_bin
        self.memory_limit = memory_limit  # payload bytes to keep in RAM (None: no limit)
        self._bins: dict[str, _Bin] = {}
        self._seq = 0
        self.nbytes = 0  # payload bytes held by all bins
        self.resident_bytes = 0  # of which in memory
        self.description_bytes = 0  # of the stored items' descriptions, always in memory
        self.in_flight_bytes = 0  # payload in memory of items taken by GETs whose replies are still being written
        self.table_bytes = 0  # memory the tables hold (.tablestore: per-slot state, columns in memory, items)
        self._lru: OrderedDict[Item, None] = OrderedDict()  # resident items, least recently used first
        self._ordered = memory_limit is not None  # (without a limit nothing is evicted: no order is kept)
        self._evicting_bytes = 0  # of resident_bytes, on their way to disk

    # -- queries

    def peek(self, name: str) -> list[Item]:
        """The items of bin ``name`` (which keeps them)."""
        items = list(self._bin(name).items)
        if self.memory_limit is not None:  # (without a limit the order is never asked for)
            lru = self._lru
            for item in items:
                if item.resident:
                    lru.move_to_end(item)
        return items

    def items_of(self, name: str) -> list[Item]:
        """The items of bin ``name`` ([] if there is none), as :meth:`peek` gives them
        but without counting it as a use."""
        b = self._bins.get(name)
        return [] if b is None else list(b.items)

    def listing(self) -> dict[str, int]:
        """``{bin: n_items}`` for every bin."""
        return {name: len(b.items) for name, b in self._bins.items()}

    def walk(self):
        """``(name, items, payload bytes, seq, tiers)`` of every bin (:meth:`_Bin.tiers`),
        for tools that report on the store (the status page); the items are the bin's
        own deque: read it, do not change it."""
        for name, b in self._bins.items():
            yield name, b.items, b.nbytes, b.seq, b.tiers()

    def state(self, name: str) -> BinState:
        """The :class:`BinState` of bin ``name``."""
        b = self._bins.get(name)
        if b is None:
            return _state(BinState, (False, 0, self._seq, None))
        return _state(BinState, (True, len(b.items), b.seq, b.items[-1].tag if b.items else None))

    def count(self, name: str) -> int:
        """Items in bin ``name`` (0 if there is none): the state's ``n_items``, for the request path."""
        b = self._bins.get(name)
        return 0 if b is None else len(b.items)

    def seq(self, name: str) -> int:
        """Bin ``name``'s last change's number (the store's last if there is none): the state's ``seq``."""
        b = self._bins.get(name)
        return self._seq if b is None else b.seq

    def exists(self, name: str) -> bool:
        return name in self._bins

    # -- mutations

    def attach(self, item: Item) -> None:
        """``item``, stored without its payload (a device reference), holds it now."""
        if item.stored and item.resident and item not in self._lru:
            if self._ordered:
                self._lru[item] = None
            self.resident_bytes += item.nbytes

    def check_add(self, name: str, replace: bool) -> None:
        """Raise what :meth:`put` (``replace``) or :meth:`append` would for the count limits."""
        b = self._bins.get(name)
        if b is None:
            if len(self._bins) >= self.max_bins:
                raise TooLargeError(f"the server already holds {self.max_bins} bins")
        elif not replace and len(b.items) >= self.max_items_per_bin:
            raise TooLargeError(f"bin {name!r} already holds {self.max_items_per_bin} items")

    def put(self, name: str, item: Item) -> Change:
        """Replace the items of bin ``name`` (created if missing) with ``item``."""
        b = self._bins.get(name)
        if b is None:
            self.check_add(name, True)
            b = self._create(name)
        elif b.items:
            self._clear(b)
        self._add(b, item)
        return self._changed(name, b, "PUT")

    def append(self, name: str, item: Item) -> Change:
        """Add ``item`` at the end of bin ``name`` (created if missing)."""
        b = self._bins.get(name)
        if b is None:
            self.check_add(name, False)
            b = self._create(name)
        elif len(b.items) >= self.max_items_per_bin:
            self.check_add(name, False)  # (refuses it)
        self._add(b, item)
        return self._changed(name, b, "APPEND")

    def get(self, name: str, limit: int | None = None) -> tuple[list[Item], Change]:
        """Take every item (the first ``limit``, if given) out of bin ``name``; the bin
        stays, empty or with the rest."""
        b = self._bin(name)
        items = self._clear(b, limit)
        return items, self._changed(name, b, "GET")

    def next_seq(self) -> int:
        """The number of a change made beside the bins (a table's, :mod:`.tablestore`),
        or reserved for one (a relay's copy announced while it arrives)."""
        self._seq += 1
        return self._seq

    @property
    def last_seq(self) -> int:
        """The number of the last change made (the store-wide counter)."""
        return self._seq

    def continue_from(self, seq: int) -> None:
        """Number the next change above ``seq`` (a restarted store continues its numbering)."""
        self._seq = max(self._seq, seq)

    def load(self, name: str, items: list[Item]) -> None:
        """Add a bin found on disk at start-up, with its items (no limits, no change)."""
        b = self._bins.get(name) or self._bins.setdefault(name, _Bin())
        for item in items:
            self._add(b, item)

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
        for item in reversed(items):
            self._add(b, item, front=True)
        return self._changed(name, b, "RESTORE")

    def mirror(self, name: str, items: list[Item], op: str, seq: int | None = None) -> Change:
        """Make bin ``name`` hold exactly ``items`` (created if missing), in one change
        named ``op``: a relay's copy of another server's bin (server/relay/).  ``seq``:
        the change's number, taken earlier with :meth:`next_seq` (a copy announced
        while it was still arriving), above the bin's last."""
        b = self._bins.get(name)
        if b is None:
            self.check_add(name, True)
            b = self._create(name)
        else:
            self._clear(b)
        for item in items:
            self._add(b, item)
        if seq is not None and seq > b.seq:
            b.seq = seq
            return Change(name, len(b.items), seq, op, b.items[-1].tag if b.items else None)
        return self._changed(name, b, op)

    def delete(self, name: str) -> Change:
        """Remove bin ``name`` and its items."""
        b = self._bin(name)
        del self._bins[name]
        self._clear(b)
        self._seq += 1
        return Change(name, 0, self._seq, "DELETE")

    # -- the memory budget

    def over_limit(self) -> bool:
        """Whether memory is over ``memory_limit`` (the store's fast path does no budget
        work otherwise)."""
        limit = self.memory_limit
        return limit is not None and self.resident_bytes + self.unspillable_bytes > limit

    def over_budget(self) -> int:
        """Bytes in memory above ``memory_limit`` (0 if none or no limit): resident
        payload, descriptions, taken items whose replies are still being written, and
        the tables' memory."""
        if self.memory_limit is None:
            return 0
        return max(0, self.resident_bytes + self.unspillable_bytes - self.memory_limit)

    @property
    def unspillable_bytes(self) -> int:
        """Memory the budget counts that spilling bins cannot free (descriptions,
        replies in flight, tables)."""
        return self.description_bytes + self.in_flight_bytes + self.table_bytes

    def to_evict(self) -> list[Item]:
        """Resident items to move to disk, least recently used first, enough (with
        those already on their way) to bring ``resident_bytes`` under the limit.
        They are marked ``spilling`` until :meth:`evict` is called for them."""
        excess = self.over_budget() - self._evicting_bytes
        chosen = []
        for item in self._lru:
            if excess <= 0:
                break
            if not item.spilling and not item.unspillable:
                item.spilling = True
                self._evicting_bytes += item.nbytes
                excess -= item.nbytes
                chosen.append(item)
        return chosen

    def evict(self, item: Item, files=None) -> bool:
        """Drop ``item``'s payload from memory; from now on it is served from ``files``
        on disk (or the disk files it already has).  False if it left the store
        meanwhile.  Also ends its ``spilling`` state when called with ``files=None``
        after a failed write.  Files in shared memory it had are let go."""
        if item.spilling:
            item.spilling = False
            self._evicting_bytes -= item.nbytes
        if not item.stored:
            return False
        was_resident = item.resident
        if files is not None:
            item.files = files
        if item.files is not None and not item.files.in_memory:
            item.segments = None
            if was_resident:
                self._lru.pop(item, None)
                self.resident_bytes -= item.nbytes
        retier(item)
        return True

    # -- internals

    def _bin(self, name: str) -> _Bin:
        b = self._bins.get(name)
        if b is None:
            raise NoSuchBinError(f"no bin named {name!r}")
        return b

    def _create(self, name: str) -> _Bin:
        b = self._bins[name] = _Bin()
        return b

    def _add(self, b: _Bin, item: Item, front: bool = False) -> None:
        if front:
            b.items.appendleft(item)
        else:
            b.items.append(item)
        b.nbytes += item.nbytes
        self.nbytes += item.nbytes
        described = len(item.description) if item.device is None else len(item.description) + item.device.nbytes
        b.described += described
        self.description_bytes += described
        item.stored = True
        item.home = b
        if item.files is not None:  # (else in memory, as Item() counts it)
            item.files.dropped = False
            _place(b, item, tier_of(item))
        if item.segments is not None or item.resident:  # (the usual case first: chunks in memory)
            if self._ordered:
                self._lru[item] = None
            self.resident_bytes += item.nbytes

    def _clear(self, b: _Bin, limit: int | None = None) -> list[Item]:
        """Empty bin ``b`` (take its first ``limit`` items); those items leave the
        store (their files may go once unused)."""
        if limit is None or limit >= len(b.items):  # the usual case: the bin's totals go
            items = list(b.items)
            b.items.clear()
            nbytes, described = b.nbytes, b.described
        else:
            items = []
            for _ in range(limit):  # (a loop: a comprehension here made a cell for b on every call)
                items.append(b.items.popleft())
            nbytes = sum(item.nbytes for item in items)
            described = sum(len(item.description) + (item.device.nbytes if item.device is not None else 0)
                            for item in items)
        self.nbytes -= nbytes
        b.nbytes -= nbytes
        self.description_bytes -= described
        b.described -= described
        ordered = self._ordered
        whole = not b.items
        if whole:
            b.placed.clear()
        for item in items:
            item.stored = False
            if not whole:
                _unplace(b, item)
            item.home = None
            if item.files is not None:
                item.files.dropped = True
            if item.segments is not None or item.resident:
                if ordered:
                    self._lru.pop(item, None)
                self.resident_bytes -= item.nbytes
        return items

    def _changed(self, name: str, b: _Bin, op: str) -> Change:
        seq = self._seq = b.seq = self._seq + 1
        items = b.items
        return _state(Change, (name, len(items), seq, op, items[-1].tag if items else None))
