"""A sum tree over a table's slots, in numpy, batched: the prioritized sampler's index.

A complete binary tree in one float64 array: node 1 is the root, node ``i`` has
children ``2i`` and ``2i + 1``, and slot ``s`` is the leaf ``leaves + s``.  Each inner
node holds the sum of its children, recomputed from them (never adjusted by a
difference), so rounding errors do not pile up over millions of updates.

Updates and searches take whole batches: one numpy operation per tree level for the
batch, O(log capacity) levels, until a level holds a few nodes: those take a
scalar path, where numpy's per-call cost would dominate.
"""

from __future__ import annotations

import numpy as np

SCALAR_MAX = 4  # levels of up to this many nodes are updated one node at a time


def update_ancestors(nodes: np.ndarray, batch, one) -> None:
    """Recompute the distinct ancestors of leaf ``nodes``, a level at a time from their
    parents up to the root: ``batch(level)`` (an int64 array) while a level holds more
    than ``SCALAR_MAX`` nodes, one numpy operation per step for the level; then
    ``one(node)`` for each node, where numpy's per-call cost would dominate.  A batch
    of neighbouring slots (an insert's) meets in a few levels, so most levels of a
    tree are a node or two."""
    level = np.unique(nodes)
    while level.size > SCALAR_MAX and level[0] > 1:
        level >>= 1
        # nodes stay sorted as they are halved: dropping repeats needs no sort
        keep = np.empty(level.size, bool)
        keep[0] = True
        np.not_equal(level[1:], level[:-1], out=keep[1:])
        level = level[keep]
        if level.size <= SCALAR_MAX:
            few = level.tolist()
            break
        batch(level)
    else:
        if level[0] <= 1:  # the root is done (or is the only leaf)
            return
        few = list({node >> 1 for node in level.tolist()})
    while True:
        for node in few:
            one(node)
        if few[0] == 1:
            return
        few = list({node >> 1 for node in few})


class SumTree:
    """Non-negative weights of ``capacity`` slots, their total, and search by prefix sum."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.leaves = 1 << max(0, (capacity - 1).bit_length())
        self.tree = np.zeros(2 * self.leaves, np.float64)
        # The largest weight a leaf may hold: every sum in the tree (each rounded up at
        # most half an ulp per level) then stays below the float maximum, so the total
        # is finite and a target never lands on a slot by overflow.
        self.max_weight = float(np.finfo(np.float64).max) / (2 * self.leaves)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        return self.tree[self.leaves + slots]

    def set(self, slots: np.ndarray, weights: np.ndarray) -> None:
        """Give ``slots`` (distinct) their ``weights``, and update their ancestors."""
        tree = self.tree
        nodes = np.asarray(slots, np.int64) + self.leaves
        tree[nodes] = weights

        def batch(level: np.ndarray) -> None:
            left = 2 * level
            tree[level] = tree[left] + tree[left + 1]

        def one(node: int) -> None:
            tree[node] = tree[2 * node] + tree[2 * node + 1]

        if nodes.size:
            update_ancestors(nodes, batch, one)

    def rebuild(self, weights: np.ndarray) -> None:
        """Set every leaf from ``weights`` (``capacity`` of them) and every sum at once."""
        tree = self.tree
        tree[:] = 0.0
        tree[self.leaves:self.leaves + self.capacity] = weights
        level = self.leaves
        while level > 1:
            half = level // 2
            tree[half:level] = tree[level:2 * level:2] + tree[level + 1:2 * level:2]
            level = half

    def find(self, targets: np.ndarray) -> np.ndarray:
        """The slot whose prefix-sum interval holds each of ``targets`` (each in
        ``[0, total)``): the first slot ``s`` with ``sum(weights[:s + 1]) > target``.

        Never a slot of weight zero while the total is positive: a target that rounding
        pushes past a subtree's sum stays on the side that has weight.
        """
        tree = self.tree
        nodes = np.ones(targets.shape, np.int64)
        u = np.array(targets, np.float64)
        for _ in range(self.leaves.bit_length() - 1):
            left = 2 * nodes
            left_sum = tree[left]
            right = (u >= left_sum) & (tree[left + 1] > 0.0)
            u -= np.where(right, left_sum, 0.0)
            nodes = left + right
        return nodes - self.leaves
