"""Which slots of a table hold a row, counted over blocks: uniform draws and free slots.

A count tree (:class:`~.blocks.Blocks`, int64 counts) over the ``live`` flags of the
slots: leaf ``b`` counts the rows of block ``b``, each inner node the rows under it.
Finding the ``r``-th row (a uniform draw is a random ``r``) or the ``r``-th free slot
(in index order) is one walk down it and a look at one block; a block's free slots
are its slots within the capacity less its rows, so one tree serves both.  It
replaces a permutation of every slot and its inverse (16 bytes a row) with an
eighth of a byte a row.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .blocks import Blocks, build_levels, each_chunk, in_memory

BLOCK = 64
FEW_RANKS = 4  # ranks up to this many: each walks the tree with Python ints (:meth:`CountTree._find_one`)


class CountTree:
    """The number of live slots of ``capacity``, under every node; ``live(slots)``
    says which slots hold a row."""

    def __init__(self, capacity: int, live: Callable[[np.ndarray], np.ndarray], block: int = BLOCK,
                 arrays=in_memory, name: str = "tree_count"):
        self.capacity = capacity
        self.live = live
        self.layout = Blocks(capacity, block)
        self.tree = arrays(name, np.int64, 2 * self.layout.leaves, 0)

    @staticmethod
    def bytes_for(capacity: int, block: int = BLOCK) -> int:
        return 2 * Blocks(capacity, block).leaves * 8

    @property
    def total(self) -> int:
        return int(self.tree[1])

    def changed(self, slots: np.ndarray) -> None:
        """Which of ``slots`` hold rows changed."""
        self.layout.redo(self.tree, slots, self._counts)

    def rebuild(self) -> None:
        layout, tree = self.layout, self.tree
        tree[:] = 0

        def leaves(first: int, stop: int, slots: slice) -> None:
            tree[layout.leaves + first:layout.leaves + stop] = self._run_counts(first, stop, slots)

        each_chunk(layout, leaves)
        build_levels(tree, layout.leaves, np.add)

    def find(self, ranks: np.ndarray, free: bool = False) -> np.ndarray:
        """The slot of each of ``ranks`` among the live slots (``free``: among the free
        ones), in index order; each rank must be below their number."""
        r = np.array(ranks, np.int64).reshape(-1)
        if r.size <= FEW_RANKS:  # (an insert's first free slot: numpy per level cost 0.4-1 ms)
            return np.array([self._find_one(rank, free) for rank in r.tolist()], np.int64)
        layout, tree = self.layout, self.tree
        nodes = np.ones(r.shape, np.int64)
        start = np.zeros(r.shape, np.int64)  # the first slot under each node
        width = layout.leaves * layout.block  # slots under a node of this level
        for _ in range(layout.depth):
            width //= 2
            left = 2 * nodes
            below = tree[left]
            if free:  # (the slots under the left child, less its rows)
                below = np.minimum(np.maximum(self.capacity - start, 0), width) - below
            right = r >= below
            r -= np.where(right, below, 0)
            start += np.where(right, width, 0)
            nodes = left + right
        slots, valid = layout.slots_in(nodes - layout.leaves)
        wanted = valid & (self.live(slots) != free)
        within = (np.cumsum(wanted, axis=1) <= r[:, None]).sum(axis=1)
        return slots[np.arange(slots.shape[0]), np.minimum(within, layout.block - 1)]

    def _find_one(self, rank: int, free: bool) -> int:
        """:meth:`find` of one rank, down the tree with Python ints: a few microseconds,
        where a level's numpy operations on one node cost more than the walk."""
        layout, tree, capacity = self.layout, self.tree, self.capacity
        node, start, width = 1, 0, layout.leaves * layout.block
        for _ in range(layout.depth):
            width >>= 1
            node <<= 1
            below = tree.item(node)
            if free:
                below = min(max(capacity - start, 0), width) - below
            if rank >= below:
                rank -= below
                start += width
                node += 1
        first = (node - layout.leaves) * layout.block
        slots = np.arange(first, min(first + layout.block, capacity), dtype=np.int64)
        wanted = np.flatnonzero(self.live(slots) != free) if slots.size else slots
        # (a rank past the block's last wanted slot, as the vectorised walk: its last slot)
        return int(slots[wanted[rank]]) if rank < wanted.size else int(slots[-1] if slots.size else capacity - 1)

    def before(self, position: int) -> int:
        """The live slots below ``position``."""
        if position >= self.capacity:
            return self.total
        layout, tree = self.layout, self.tree
        block = position // layout.block
        count = 0
        first = block * layout.block
        if first < position:
            part = np.arange(first, position, dtype=np.int64)
            count += int(np.count_nonzero(self.live(part)))
        node = layout.leaves + block
        while node > 1:
            if node & 1:
                count += int(tree[node - 1])
            node >>= 1
        return count

    def _counts(self, blocks: np.ndarray) -> np.ndarray:
        run = self.layout.run(blocks)
        if run is not None:
            return self._run_counts(*run)
        slots, valid = self.layout.slots_in(blocks)
        return np.count_nonzero(valid & self.live(slots), axis=1)

    def _run_counts(self, first: int, stop: int, slots: slice) -> np.ndarray:
        """The rows of each of the consecutive blocks ``first`` to ``stop`` (``slots``: their slots)."""
        return np.count_nonzero(self.layout.by_block(self.live(slots), first, stop, False), axis=1)
