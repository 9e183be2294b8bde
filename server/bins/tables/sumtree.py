"""A sum tree over blocks of a table's slots, batched: the prioritized sampler's index.

A complete binary tree in one float64 array (:class:`~.blocks.Blocks`): leaf ``b``
holds the sum of the weights of block ``b``'s slots, each inner node the sum of its
children, recomputed from them (never adjusted by a difference), so rounding errors
do not pile up over millions of updates.  The weights are not stored: ``weights(slots)``
computes them from the table's state (``priority ** exponent`` of a row, 0 for an
empty slot), so the tree costs one float64 per block of slots, and a search ends by
computing the weights of the one block it reached.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .blocks import Blocks, build_levels, in_memory

BLOCK = 16  # slots a leaf sums: a recomputed block costs 16 weights, the tree 1 byte a row


class SumTree:
    """Non-negative weights of ``capacity`` slots, their total, and search by prefix sum."""

    def __init__(self, capacity: int, weights: Callable[[np.ndarray], np.ndarray], block: int = BLOCK,
                 arrays=in_memory, name: str = "tree_sum"):
        self.capacity = capacity
        self.weights = weights  # slots (int64, any shape, or a slice) -> their float64 weights, same shape
        self.layout = Blocks(capacity, block)
        self.leaves = self.layout.leaves
        self.tree = arrays(name, np.float64, 2 * self.leaves, 0.0)
        # The largest weight a slot may hold: every sum in the tree (each rounded up at
        # most half an ulp per level) then stays below the float maximum, so the total
        # is finite and a target never lands on a slot by overflow.
        self.max_weight = float(np.finfo(np.float64).max) / (2 * self.leaves * block)

    @staticmethod
    def bytes_for(capacity: int, block: int = BLOCK) -> int:
        return 2 * Blocks(capacity, block).leaves * 8

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        return self.weights(np.asarray(slots, np.int64))

    def changed(self, slots: np.ndarray) -> None:
        """The weights of ``slots`` changed: their blocks' sums and those above them."""
        self.layout.redo(self.tree, slots, self._block_sums)

    def rebuild(self) -> None:
        """Every sum from the weights of every slot (a table reopened from its files)."""
        layout, tree = self.layout, self.tree
        tree[:] = 0.0
        for first, stop, slots in layout.chunks():  # (a slice of slots: views, no index arrays)
            tree[layout.leaves + first:layout.leaves + stop] = layout.by_block(self.weights(slots), first, stop,
                                                                               0.0).sum(axis=1)
        build_levels(tree, layout.leaves, np.add)

    def find(self, targets: np.ndarray) -> np.ndarray:
        """The slot whose prefix-sum interval holds each of ``targets`` (each in
        ``[0, total)``): the first slot ``s`` with ``sum(weights[:s + 1]) > target``.

        Never a slot of weight zero while the total is positive: a target that rounding
        pushes past a subtree's (or a block's) sum stays on the side that has weight.
        """
        tree, layout = self.tree, self.layout
        nodes = np.ones(np.shape(targets), np.int64)
        u = np.array(targets, np.float64)
        for _ in range(layout.depth):
            left = 2 * nodes
            left_sum = tree[left]
            right = (u >= left_sum) & (tree[left + 1] > 0.0)
            u -= np.where(right, left_sum, 0.0)
            nodes = left + right
        slots, valid = layout.slots_in(nodes - layout.leaves)
        weights = np.where(valid, self.weights(slots), 0.0)
        within = (np.cumsum(weights, axis=1) <= u[:, None]).sum(axis=1)
        past = within >= layout.block  # rounding: the block's last slot that has weight
        if past.any():
            within[past] = layout.block - 1 - np.argmax(weights[past, ::-1] > 0.0, axis=1)
        return slots[np.arange(slots.shape[0]), within]

    def _block_sums(self, blocks: np.ndarray) -> np.ndarray:
        slots, valid = self.layout.slots_in(blocks)
        return np.where(valid, self.weights(slots), 0.0).sum(axis=1)
