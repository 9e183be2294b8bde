"""A table's slots: which hold a row, and each row's key, priority, sample count and marks.

Slots and keys, the two ways to name a row:

* a slot *index* in ``[0, capacity)`` is where a row lives: its bytes in every column
  and its entries here.  It stays the row's for the row's lifetime and is reused
  once the row leaves.  Datasets address rows by index (``read``/``write``).
* a *key* names one row for good: ``key = seq * capacity + index``, where ``seq``
  counts the rows the table took before it.  Keys only grow, a key never comes
  back, ``index = key % capacity``, and a key whose row has left matches nothing
  (its slot's current key differs).  Replay addresses rows by key
  (``update_priorities``, ``remove``).  Finding a key's slot is one modulo and one
  comparison, vectorised, with no dictionary.

Per slot, 21 bytes (so that 10^8 rows keep about 2 GB of state): the key (int64),
the priority (float64), the times sampled (uint32, saturating) and one byte of flags:
``LIVE`` (the row is in the occupied set every sampler and remover sees) and
``END`` (the row ends its episode: no sequence runs past it).  Which slots are live
is counted over blocks (:class:`~.occupancy.CountTree`): a uniform draw, and the
free slots an insert takes, are walks down it.
"""

from __future__ import annotations

import numpy as np

from . import compiled
from .errors import BadArgumentError, SlotIndexError, TableFullError, TableSpecError
from .blocks import Blocks, each_chunk, in_memory, is_run, run_of
from .occupancy import CountTree

KEY_LIMIT = np.iinfo(np.int64).max
COUNT_LIMIT = np.iinfo(np.uint32).max  # times_sampled stays there once reached
LIVE, END = np.uint8(1), np.uint8(2)
RESTORE_CHUNK = 1 << 22
FREE_WINDOW = 256  # slots looked at past the first free one, at least, for free ones (an actor adds a few rows)
# per-slot state: name -> (dtype, value of an empty slot); a durable table keeps each in a file
STATE = {"key": (np.int64, -1), "priority": (np.float64, 0.0), "times_sampled": (np.uint32, 0),
         "flags": (np.uint8, 0)}


class Slots:
    """Occupancy and per-row state of ``capacity`` slots; ``arrays(name, dtype, length,
    fill)`` makes the arrays :data:`STATE` names and the count tree's (in memory, or in
    files for a durable table)."""

    BYTES_PER_SLOT = sum(np.dtype(dtype).itemsize for dtype, _ in STATE.values())

    def __init__(self, capacity: int, arrays=in_memory):
        self.capacity = capacity
        state = {name: arrays(name, dtype, capacity, fill) for name, (dtype, fill) in STATE.items()}
        self.key = state["key"]
        self.priority = state["priority"]
        self.times_sampled = state["times_sampled"]
        self.flags = state["flags"]
        self.count = CountTree(capacity, self.live, arrays=arrays)
        self.size = 0
        # the seq of the next row, kept with the state (a file of a durable table): a
        # restart after a kill goes on from it, not from the newest key held, whose row
        # may not be the newest the table gave a key (those that left after it)
        self._next_seq = arrays("next_seq", np.int64, 1, 0)
        self._max_seq = (KEY_LIMIT - (capacity - 1)) // capacity  # past it a key would overflow int64

    @property
    def next_seq(self) -> int:
        """The seq of the next row: keys given so far are below ``next_seq * capacity``."""
        return int(self._next_seq[0])

    @next_seq.setter
    def next_seq(self, seq: int) -> None:
        self._next_seq[0] = seq

    @staticmethod
    def bytes_for(capacity: int) -> int:
        """The memory of the state of ``capacity`` slots (the arrays and the count tree)."""
        return capacity * Slots.BYTES_PER_SLOT + CountTree.bytes_for(capacity)

    # -- queries

    def live(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` hold a row of the occupied set."""
        return (self.flags[slots] & LIVE).view(np.bool_)  # (LIVE is 1: the bytes are bools already)

    def ends(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` end their episode."""
        return (self.flags[slots] & END).astype(bool)

    def free(self, n: int) -> np.ndarray:
        """The first ``n`` free slots in index order (there must be that many), so a
        table that never lost a row fills its slots in index order."""
        found, got = [np.zeros(0, np.int64)], 0
        while got < n:
            first = int(self.count.find(np.array([got]), free=True)[0])
            stop = min(self.capacity, first + max(2 * (n - got), FREE_WINDOW))
            window = np.arange(first, stop, dtype=np.int64)
            free = ~self.live(window)
            if not got and free.size >= n and free[:n].all():  # (a table filling in order: the first n, a run)
                return run_of(first, n)
            slots = window[free][:n - got]
            found.append(slots)
            got += slots.size
        return found[-1] if len(found) <= 2 else np.concatenate(found)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` independent uniform draws among the live slots (there must be some)."""
        size, capacity = self.size, self.capacity
        if size == capacity:
            return rng.integers(0, capacity, n)
        if 2 * size >= capacity:  # at least half the slots hold rows: draw slots, keep the live ones
            taken, got = [], 0
            for _ in range(64):
                slots = rng.integers(0, capacity, 2 * (n - got) + 8)
                slots = slots[self.live(slots)][:n - got]
                taken.append(slots)
                got += slots.size
                if got == n:
                    return np.concatenate(taken)
            ranks = rng.integers(0, size, n - got)
            return np.concatenate(taken + [self.count.find(ranks)])
        return self.count.find(rng.integers(0, size, n))

    def occupied_from(self, start: int, limit: int) -> np.ndarray:
        """The (at most ``limit``) first live slots from index ``start`` on, in order."""
        found, got, position = [], 0, start
        step = max(limit, 1 << 16)
        while got < limit and position < self.capacity:
            window = np.arange(position, min(self.capacity, position + step), dtype=np.int64)
            slots = window[self.live(window)][:limit - got]
            found.append(slots)
            got += slots.size
            position += step
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def page(self, start: int, limit: int) -> dict:
        """The occupied slots from index ``start`` on, in index order, at most ``limit``
        of them: ``indices``, ``keys``, ``priorities``, ``times_sampled``, ``ends``
        (arrays) and ``next``, the index to ask from for the rest (None: no more)."""
        found = self.occupied_from(start, limit)
        after = int(found[-1]) + 1 if found.size == limit else self.capacity
        more = after < self.capacity and self.count.before(after) < self.size
        return {"indices": found, "keys": self.key[found], "priorities": self.priority[found],
                "times_sampled": self.times_sampled[found].astype(np.int64), "ends": self.ends(found),
                "next": after if more else None}

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The keys of ``slots`` (int64, valid): ``key[slots]``, compiled where it is built,
        each slot's line asked of memory ahead (a sample's rows are scattered)."""
        loops = compiled.loops
        if loops is None or not slots.flags.c_contiguous or slots.dtype != np.int64:
            return self.key[slots]
        keys = np.empty(slots.size, np.int64)
        loops.gather(self.key, 8, slots, keys)
        return keys

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> np.ndarray:
        """``priority[slots] = priorities`` (float64; of distinct slots), compiled where it
        is built, as :meth:`keys_at`.  Returns the priorities they replaced."""
        loops = compiled.loops
        if loops is None or not slots.flags.c_contiguous or slots.dtype != np.int64:
            before = self.priority[slots]
            self.priority[slots] = priorities
            return before
        before = np.empty(slots.size, np.float64)
        loops.scatter(self.priority, slots, np.ascontiguousarray(priorities, np.float64), before)
        return before

    def find(self, keys) -> np.ndarray:
        """The slot of each of ``keys``, or -1 where no row has that key (any more)."""
        keys = int_array(keys, "keys")
        loops = compiled.loops
        if loops is not None:  # (the same, each key's row asked of memory ahead of its read)
            slots = np.empty(keys.size, np.int64)
            loops.locate(self.key, np.ascontiguousarray(keys), slots)
            return slots
        slots = np.remainder(keys, self.capacity)
        return np.where((keys >= 0) & (self.key[slots] == keys), slots, -1)

    def check_indices(self, indices, unique: bool) -> np.ndarray:
        """``indices`` as an int64 array of valid slots (distinct if ``unique``)."""
        idx = int_array(indices, "indices")
        bad = idx[(idx < 0) | (idx >= self.capacity)]
        if bad.size:
            raise SlotIndexError(f"index {int(bad[0])} out of range [0, {self.capacity})"
                                 + (f" ({bad.size} such indices)" if bad.size > 1 else ""))
        if unique and idx.size > 1:
            uniq, counts = np.unique(idx, return_counts=True)
            if uniq.size != idx.size:
                raise SlotIndexError(f"index {int(uniq[counts > 1][0])} appears more than once in one write")
        return idx

    def check_keys_left(self, n: int) -> None:
        """Raise if ``n`` more rows would need keys past the int64 range."""
        if self.next_seq + n > self._max_seq + 1:
            raise TableFullError(f"the table has used all {self._max_seq + 1} keys it can form "
                                 f"(capacity {self.capacity})")

    # -- changes

    def keys_for(self, slots: np.ndarray, at=None) -> np.ndarray:
        """The keys :meth:`fill` will give new rows in ``slots`` (``at``: their
        :func:`as_index`, if known)."""
        at = as_index(slots) if at is None else at
        if isinstance(at, slice):  # a run: one slot and one seq on, a key grows by capacity + 1
            first = self.next_seq * self.capacity + at.start
            return run_of(first, slots.size, self.capacity + 1)
        return (np.arange(self.next_seq, self.next_seq + slots.size, dtype=np.int64) * self.capacity) + slots

    def fill(self, slots: np.ndarray, priorities: np.ndarray, ends: np.ndarray | None = None,
             recount: np.ndarray | None = None, counts: np.ndarray | None = None) -> np.ndarray:
        """New rows in the free ``slots`` (distinct): give them keys; returns the keys.
        ``ends``: which of them end their episode.  ``recount``: those of ``slots`` whose
        blocks' counts change (None: all); the others were vacated by this same change
        without a recount (:meth:`vacate`), so their counts are right again once filled
        (a full ring buffer's insert recounts nothing).  ``counts``: the times each row
        was sampled already (at most :data:`COUNT_LIMIT`; None: 0)."""
        at = as_index(slots)
        keys = self.keys_for(slots, at)
        n = slots.size
        self.next_seq += n
        # the key last: in a durable table's files a slot holds a row from then on
        self.priority[at] = priorities
        self.times_sampled[at] = 0 if counts is None else counts
        self.flags[at] = LIVE if ends is None else (np.asarray(ends, bool).view(np.uint8) << 1) | LIVE  # (END is 2)
        self.key[at] = keys
        self.size += n
        self.count.changed(slots if recount is None else recount)
        return keys

    def skip(self, n: int) -> None:
        """``n`` rows were taken and left at once (a ring buffer's overwritten rows):
        their seqs are used."""
        self.next_seq += n

    def vacate(self, slots: np.ndarray, recount: bool = True) -> None:
        """Take the occupied ``slots`` (distinct) out of the occupied set; their keys,
        priorities and counts stay readable until :meth:`forget`.  ``recount`` False:
        :meth:`fill` gives them rows before anything is drawn, and recounts them."""
        if slots.size:
            self.flags[as_index(slots)] &= ~LIVE
            self.size -= slots.size
            if recount:
                self.count.changed(slots)

    def revive(self, slots: np.ndarray) -> None:
        """Undo :meth:`vacate` of ``slots`` (distinct, not forgotten since): occupied again."""
        if slots.size:
            self.flags[as_index(slots)] |= LIVE
            self.size += slots.size
            self.count.changed(slots)

    def forget(self, slots: np.ndarray) -> None:
        """Clear the state of vacated ``slots``."""
        at = as_index(slots)
        self.key[at] = -1
        self.priority[at] = 0.0
        self.times_sampled[at] = 0
        self.flags[at] = 0

    def sampled(self, slots: np.ndarray, counts: np.ndarray) -> None:
        """The distinct ``slots`` were sampled ``counts`` times more (saturating)."""
        total = self.times_sampled[slots].astype(np.int64) + counts
        self.times_sampled[slots] = np.minimum(total, COUNT_LIMIT)

    def count_sampled(self, slots: np.ndarray) -> None:
        """Each of ``slots`` (repeats allowed) was sampled once more (saturating)."""
        loops = compiled.loops
        if loops is not None:
            loops.count(self.times_sampled, np.ascontiguousarray(slots, np.int64), COUNT_LIMIT)
        else:
            self.sampled(*np.unique(slots, return_counts=True))

    def allowance(self, m: int) -> int:
        """The samples the rows held may still give under ``max_times_sampled`` ``m``."""
        total = 0
        for first in range(0, self.capacity, RESTORE_CHUNK):
            part = slice(first, first + RESTORE_CHUNK)
            left = m - np.asarray(self.times_sampled[part]).astype(np.int64)
            total += int(np.maximum(left, 0)[(np.asarray(self.flags[part]) & LIVE) != 0].sum())
        return total

    def restore(self, max_times_sampled: int = 0) -> None:
        """Take the state found in the arrays (a table reopened from its files): every
        slot with a key is live again (a row a killed server was removing included),
        but for rows already sampled ``max_times_sampled`` times (a killed server was
        taking them out: they leave now, else no sample could pass them); the keys go
        on from the seq kept, or after the newest key held if that is later.  A piece
        at a time (a few at once): no temporary of the table's size."""
        def piece(first: int, stop: int, part: slice) -> tuple[int, int]:
            key = np.asarray(self.key[part])
            has_key = key >= 0
            newest = int(key.max()) if has_key.any() else -1
            if max_times_sampled:
                spent = has_key & (np.asarray(self.times_sampled[part]) >= max_times_sampled)
                if spent.any():
                    self.forget(np.flatnonzero(spent) + first)
                    has_key &= ~spent
            flags = self.flags[part]
            fixed = np.where(has_key, flags | LIVE, flags & ~LIVE)
            if (fixed != flags).any():  # (a clean table's flags are right: its pages stay clean)
                flags[:] = fixed
            return int(np.count_nonzero(has_key)), newest

        pieces = each_chunk(Blocks(self.capacity, 1), piece)
        self.size = sum(held for held, _ in pieces)
        newest = max(newest for _, newest in pieces)
        self.next_seq = max(self.next_seq, newest // self.capacity + 1 if newest >= 0 else 0)
        head = np.asarray(self.key[:1 << 16])  # (a look at the first slots' keys: each names its own slot)
        if ((head % self.capacity) != np.arange(head.size))[head >= 0].any():
            raise TableSpecError("the table's files are not of this capacity")
        self.count.rebuild()

    def adopt(self, note: dict) -> bool:
        """Take the row count and next seq a clean stop noted (the count tree as its
        file holds it); False for a note of another capacity."""
        if note.get("capacity") != self.capacity:
            return False
        self.size, self.next_seq = int(note["size"]), max(self.next_seq, int(note["next_seq"]))
        return True


def as_index(slots: np.ndarray):
    """``slots`` as a slice when they are consecutive and ascending (a ring buffer's
    inserts mostly are; one slot is), else as they are: a copy into a slice is a
    ``memcpy``, into an index array a scatter (16,384 rows of 64 B: 0.05 ms against
    0.4 ms), and a run's trees and keys take shortcuts."""
    n = slots.size
    if n and is_run(slots):
        first = int(slots[0])
        return slice(first, first + n)
    return slots


def runs(slots: np.ndarray, most: int) -> list[tuple[int, int, int]] | None:
    """``(first slot, first position, stop position)`` of each run of consecutive
    ascending ``slots`` (a ring buffer's batch is one, or two where it wraps); None
    for more than ``most`` runs."""
    n = slots.size
    if not n:
        return []
    if isinstance(as_index(slots), slice):
        return [(int(slots[0]), 0, n)]
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    if breaks.size >= most:
        return None
    starts = [0, *breaks.tolist()]
    stops = [*starts[1:], n]
    return [(int(slots[a]), a, b) for a, b in zip(starts, stops)]


def flags_of(values, n: int) -> np.ndarray | None:
    """Per-row flags (``ends``) as a bool array of ``n``, or None."""
    if values is None:
        return None
    try:
        flags = np.asarray(values).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise BadArgumentError(f"ends must be one flag per row: {exc}") from None
    if flags.dtype.kind not in "biu":
        raise BadArgumentError(f"ends must be flags (bool or integers), not {flags.dtype}")
    if flags.size != n:
        raise BadArgumentError(f"{flags.size} ends for {n} rows")
    return flags.astype(bool)


def int_array(values, what: str) -> np.ndarray:
    """``values`` (a sequence or array of integers) as a flat int64 array."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise BadArgumentError(f"{what} must be integers: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise BadArgumentError(f"{what} must be integers, not {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=False)
