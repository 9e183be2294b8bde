"""An argmin tree over a table's slots, in numpy, batched: the index of the fifo and
lifo samplers and of the removers.

Each slot has an order value (a number) and a tie-break (an int64: the row's key, so
that of equal values the older row comes first); empty slots hold ``+inf`` / the
largest int64 and come last.  A complete binary tree in one int64 array holds, at
each node, the slot that is smallest (value, then tie-break) under it; the root is
the smallest slot of all.  :meth:`smallest` finds the ``k`` smallest slots in order
with one pass down the tree that keeps at most ``k`` nodes per level.
"""

from __future__ import annotations

import numpy as np

from .sumtree import update_ancestors

INT_EMPTY = np.iinfo(np.int64).max


class MinTree:
    """The slots of a table ordered by ``(value, tie)``, smallest first."""

    def __init__(self, capacity: int, dtype=np.float64):
        self.capacity = capacity
        self.leaves = 1 << max(0, (capacity - 1).bit_length())
        self.empty = np.inf if np.dtype(dtype).kind == "f" else INT_EMPTY
        self.values = np.full(self.leaves, self.empty, dtype)
        self.ties = np.full(self.leaves, INT_EMPTY, np.int64)
        # node -> its smallest slot; leaf node leaves + s holds s
        self.tree = np.empty(2 * self.leaves, np.int64)
        self.tree[self.leaves:] = np.arange(self.leaves)
        self._fix_all()

    @property
    def first(self) -> int:
        """The smallest slot, or -1 if every slot is empty."""
        slot = int(self.tree[1])
        return slot if self.values[slot] != self.empty else -1

    def set(self, slots: np.ndarray, values: np.ndarray, ties: np.ndarray) -> None:
        """Give ``slots`` (distinct) their order ``values`` and ``ties``."""
        self.values[slots] = values
        self.ties[slots] = ties
        self._fix(np.asarray(slots, np.int64))

    def clear(self, slots: np.ndarray) -> None:
        """Empty ``slots`` (distinct): they go last."""
        self.values[slots] = self.empty
        self.ties[slots] = INT_EMPTY
        self._fix(np.asarray(slots, np.int64))

    def smallest(self, k: int) -> np.ndarray:
        """The (at most) ``k`` smallest non-empty slots, smallest first.

        Why one pass is enough: the ``k`` smallest leaves have at most ``k`` ancestors
        on each level, and a node that is none of them has a minimum no smaller than
        any of theirs; so keeping, level after level, the ``k`` children with the
        smallest minima keeps every one of them.
        """
        if k <= 0:
            return np.zeros(0, np.int64)
        if k == 1:
            first = self.first
            return np.array([first] if first >= 0 else [], np.int64)
        tree, values, ties = self.tree, self.values, self.ties
        nodes = np.ones(1, np.int64)
        while nodes[0] < self.leaves:
            children = np.concatenate((2 * nodes, 2 * nodes + 1))
            if children.size > k:
                best = tree[children]
                order = np.lexsort((ties[best], values[best]))[:k]
                children = children[order]
            nodes = children
        slots = tree[nodes]
        order = np.lexsort((ties[slots], values[slots]))
        slots = slots[order]
        return slots[values[slots] != self.empty][:k]

    # -- internals

    def _smaller(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Elementwise: is slot ``a`` before slot ``b``?  (Ties: the left one, ``a``.)"""
        va, vb = self.values[a], self.values[b]
        return (va < vb) | ((va == vb) & (self.ties[a] <= self.ties[b]))

    def _fix(self, slots: np.ndarray) -> None:
        tree, values, ties = self.tree, self.values, self.ties

        def batch(level: np.ndarray) -> None:
            a, b = tree[2 * level], tree[2 * level + 1]
            tree[level] = np.where(self._smaller(a, b), a, b)

        def one(node: int) -> None:
            a, b = tree[2 * node], tree[2 * node + 1]
            va, vb = values[a], values[b]
            tree[node] = a if va < vb or (va == vb and ties[a] <= ties[b]) else b

        if slots.size:
            update_ancestors(slots + self.leaves, batch, one)

    def _fix_all(self) -> None:
        tree = self.tree
        level = self.leaves
        while level > 1:
            half = level // 2
            a, b = tree[level:2 * level:2], tree[level + 1:2 * level:2]
            tree[half:level] = np.where(self._smaller(a, b), a, b)
            level = half
