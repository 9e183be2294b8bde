"""A table's slots: which hold a row, and each row's key, priority and sample count.

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

The occupied slots are kept packed at the front of one permutation of all slots
(``order[:size]``, with each slot's place in ``position``): a uniform sample is an
index into it, and free slots are found at ``order[size:]``.  Moving a batch of
slots in or out swaps only the slots on the wrong side of the boundary.
"""

from __future__ import annotations

import numpy as np

from .errors import BadArgumentError, SlotIndexError, TableFullError

KEY_LIMIT = np.iinfo(np.int64).max


class Slots:
    """Occupancy and per-row state of ``capacity`` slots."""

    BYTES_PER_SLOT = 41  # key, priority, times_sampled, order, position (8 bytes each) and a mark

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.key = np.full(capacity, -1, np.int64)  # -1: empty
        self.priority = np.zeros(capacity, np.float64)
        self.times_sampled = np.zeros(capacity, np.int64)
        self.order = np.arange(capacity, dtype=np.int64)
        self.position = np.arange(capacity, dtype=np.int64)
        self.size = 0
        self.next_seq = 0  # seq of the next row
        self._max_seq = (KEY_LIMIT - (capacity - 1)) // capacity  # past it a key would overflow int64
        self._mark = np.zeros(capacity, bool)

    # -- queries

    def free(self, n: int) -> np.ndarray:
        """``n`` free slots (there must be that many): the first of the free region, so a
        table that never lost a row fills its slots in index order."""
        return self.order[self.size:self.size + n].copy()

    def find(self, keys) -> np.ndarray:
        """The slot of each of ``keys``, or -1 where no row has that key (any more)."""
        keys = int_array(keys, "keys")
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

    def keys_for(self, slots: np.ndarray) -> np.ndarray:
        """The keys :meth:`fill` will give new rows in ``slots``."""
        return (np.arange(self.next_seq, self.next_seq + slots.size, dtype=np.int64) * self.capacity) + slots

    def fill(self, slots: np.ndarray, priorities: np.ndarray) -> np.ndarray:
        """New rows in the free ``slots`` (distinct): give them keys; returns the keys."""
        keys = self.keys_for(slots)
        self.next_seq += slots.size
        # the key last: in a durable table's files a slot holds a row from then on
        self.priority[slots] = priorities
        self.times_sampled[slots] = 0
        self.key[slots] = keys
        self._move(slots, into_live=True)
        return keys

    def vacate(self, slots: np.ndarray) -> None:
        """Take the occupied ``slots`` (distinct) out of the occupied set; their keys,
        priorities and counts stay readable until :meth:`forget`."""
        self._move(slots, into_live=False)

    def forget(self, slots: np.ndarray) -> None:
        """Clear the state of vacated ``slots``."""
        self.key[slots] = -1
        self.priority[slots] = 0.0
        self.times_sampled[slots] = 0

    # -- internals

    def _move(self, slots: np.ndarray, into_live: bool) -> None:
        """Move ``slots`` (all on the other side) across the boundary at ``size``.

        The region they must end in is ``order[size:size + k]`` (in) or
        ``order[size - k:size]`` (out): the slots in it that are not theirs take the
        places of those of them outside it, and they fill it.
        """
        k = slots.size
        if k == 0:
            return
        lo, hi = (self.size, self.size + k) if into_live else (self.size - k, self.size)
        pos = self.position[slots]
        outside = slots[(pos < lo) | (pos >= hi)]
        if outside.size:
            mark = self._mark
            mark[slots] = True
            region = self.order[lo:hi]
            others = region[~mark[region]]
            mark[slots] = False
            out_pos = self.position[outside]
            self.order[out_pos] = others
            self.position[others] = out_pos
        # in the order given: the slots removed first are the first free() hands out,
        # so a full fifo table puts row i at index i % capacity, as a ring buffer does
        self.order[lo:hi] = slots
        self.position[slots] = np.arange(lo, hi)
        self.size += k if into_live else -k


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
