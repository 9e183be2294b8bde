"""A sum tree over blocks of a table's slots, batched: the prioritized sampler's index.

A complete binary tree in one float64 array (:class:`~.blocks.Blocks`): leaf ``b``
holds the sum of the weights of block ``b``'s slots, each inner node the sum of its
children, recomputed from them (never adjusted by a difference), so rounding errors
do not pile up over millions of updates.  The weights are not stored: ``weights(pick)``
computes them from the table's state (``priority ** exponent`` of a row, 0 for an
empty slot), where ``pick(array)`` gives a per-slot array's values at the slots in
question (any shape; 0 past the capacity), so the tree costs one float64 per block of
slots, and a search ends by computing the weights of the one block it reached.

A priority update (:meth:`SumTree.reweighed`) is the exception, in the compiled loops:
it moves a leaf by the change in one slot's weight instead of summing its block again
(two powers for the slot, not sixteen for its block, and one line of memory, not
four: at 10^8 rows most of an update's refresh), within bounds that keep the leaf
within 1.4e-14 of its block's sum (see ``adjust`` in ``_loops.c``): a leaf moves at
most 31 times, and only while it stays at half the largest value it has held or more,
since its block was last summed (16 bits a block keep both, beside the tree); else the
block is summed again, as it is where a move would leave it no weight.  The nodes above are
recomputed from their children as always.

Where the weights are powers of the slots' priorities (:class:`Powers`, the
prioritized sampler's), a search and the refresh of scattered blocks run in compiled
loops (:mod:`.compiled`, where setup.py could build them) that compute
the same weights themselves: numpy costs a few calls per tree level for a batch, and
a power for every slot of every block reached.  The numpy path stays the reference
(the tests hold the two to the same answers) and the fallback.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from . import compiled
from .blocks import Blocks, build_levels, each_chunk, in_memory

BLOCK = 16  # slots a leaf sums: a recomputed block costs 16 weights, the tree 1 byte a row
# A search starts at this level (4,096 nodes): one binary search of its prefix sums
# instead of a numpy step per level above it (each costs a few calls whatever the
# batch: 12 levels took about 0.1 ms of a sample of 256).
TOP_LEVEL = 12


class Powers(NamedTuple):
    """Weights the compiled loops compute themselves: ``slots.priority ** exponent``
    (float64) where bit 1 (``LIVE``) of ``slots.flags`` (uint8) is set, else 0; read
    from ``slots`` at each call."""

    slots: object
    exponent: float


class SumTree:
    """Non-negative weights of ``capacity`` slots, their total, and search by prefix sum."""

    def __init__(self, capacity: int, weights: Callable[[Callable[[np.ndarray], np.ndarray]], np.ndarray],
                 block: int = BLOCK, arrays=in_memory, name: str = "tree_sum", top: int = TOP_LEVEL,
                 powers: Powers | None = None):
        self.capacity = capacity
        self.top = top  # the level a search starts from (see TOP_LEVEL)
        # pick -> the float64 weights of the slots pick selects (see the module docstring)
        self.weights = weights
        # the same weights, described for the compiled loops (None: numpy's path only;
        # so is every call while ``compiled.loops`` is None)
        self.powers = powers
        self.layout = Blocks(capacity, block)
        self.leaves = self.layout.leaves
        self.tree = arrays(name, np.float64, 2 * self.leaves, 0.0)
        # what bounds each moved leaf's error since its block was last summed
        # (:meth:`reweighed`; numpy's path sums every block it changes): its moves and
        # the largest value it has held, kept beside the tree, so that a durable table
        # reopened with its tree as it was has them as they were
        self.bounds = arrays(f"{name}_bounds", np.uint16, self.layout.nblocks, 0) if powers is not None else None
        # The largest weight a slot may hold: every sum in the tree (each rounded up at
        # most half an ulp per level) then stays below the float maximum, so the total
        # is finite and a target never lands on a slot by overflow.
        self.max_weight = float(np.finfo(np.float64).max) / (2 * self.leaves * block)

    @staticmethod
    def bytes_for(capacity: int, block: int = BLOCK) -> int:
        layout = Blocks(capacity, block)
        return 2 * layout.leaves * 8 + 2 * layout.nblocks  # (the tree, and its leaves' bounds)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, np.int64)
        return self.weights(lambda array: array[slots])

    def changed(self, slots: np.ndarray) -> None:
        """The weights of ``slots`` changed: their blocks' sums and those above them."""
        blocks = self.layout.blocks_of(slots) if np.size(slots) else None
        loops = compiled.loops
        if loops is not None and self.powers is not None and blocks is not None:
            # compiled: the blocks' weights a chunk at a time, then their ancestors a level
            # at a time for the batch (a priority update's scattered blocks, an insert's run)
            layout, state = self.layout, self.powers.slots
            loops.refresh(self.tree, layout.depth, state.priority, state.flags, self.powers.exponent,
                          layout.block, self.capacity, blocks)
            return
        tree, pairs = self.tree, self.tree.reshape(-1, 2)

        def batch(level: np.ndarray) -> None:  # (a node's children are a row of ``pairs``)
            children = np.take(pairs, level, axis=0, mode="clip")
            tree[level] = children[:, 0] + children[:, 1]

        def one(node: int) -> None:
            tree[node] = tree[2 * node] + tree[2 * node + 1]

        self.layout.redo(tree, slots, self._block_sums, np.add, batch, one, blocks=blocks)

    def reweighed(self, slots: np.ndarray, before: np.ndarray, ordered: np.ndarray) -> None:
        """The distinct ``slots``' priorities changed from ``before`` (float64, the same
        order), their flags did not; ``ordered``: the same slots, sorted.  Compiled: each
        slot's leaf moved by its weight's change (see the module docstring); else as
        :meth:`changed`."""
        loops = compiled.loops
        if loops is None or self.powers is None or not slots.size:
            self.changed(ordered)
            return
        layout, state = self.layout, self.powers.slots
        loops.adjust(self.tree, layout.depth, state.priority, state.flags, self.powers.exponent, layout.block,
                     self.capacity, np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(before, np.float64),
                     np.ascontiguousarray(ordered, np.int64), self.bounds)

    def rebuild(self) -> None:
        """Every sum from the weights of every slot (a table reopened from its files)."""
        layout, tree = self.layout, self.tree
        tree[:] = 0.0
        if self.bounds is not None:
            self.bounds[:] = 0

        def leaves(first: int, stop: int, slots: slice) -> None:  # (a slice of slots: views, no index arrays)
            tree[layout.leaves + first:layout.leaves + stop] = _row_sums(self._of_run(first, stop, slots))

        each_chunk(layout, leaves)
        build_levels(tree, layout.leaves, np.add)

    def pick(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, weights)``: :meth:`find`'s slots, and the weight of each."""
        loops = compiled.loops
        if loops is None or self.powers is None:
            slots = self.find(targets)
            return slots, self.get(slots)
        layout, state = self.layout, self.powers.slots
        u = np.array(targets, np.float64).reshape(-1)  # (a copy: the loop leaves what is left of each target in it)
        slots, weights = np.empty(u.size, np.int64), np.empty(u.size, np.float64)
        loops.find(self.tree, layout.depth, state.priority, state.flags, self.powers.exponent, layout.block,
                   self.capacity, u, slots, weights)
        return slots, weights

    def find(self, targets: np.ndarray) -> np.ndarray:
        """The slot whose prefix-sum interval holds each of ``targets`` (each in
        ``[0, total)``): the first slot ``s`` with ``sum(weights[:s + 1]) > target``.

        Never a slot of weight zero while the total is positive: a target that rounding
        pushes past a subtree's (or a block's) sum stays on the side that has weight.
        """
        if self.powers is not None and compiled.loops is not None:
            return self.pick(targets)[0]
        tree, layout = self.tree, self.layout
        u = np.array(targets, np.float64).reshape(-1)
        top = min(self.top, layout.depth)
        width = 1 << top
        level = tree[width:2 * width]  # the nodes of level ``top``, left to right
        sums = np.cumsum(level)
        at = np.searchsorted(sums, u, side="right")  # (a node of weight zero never: its sum is the one before's)
        past = at >= width  # rounding: the total is summed in another order than the tree's
        if past.any():
            at[past] = width - 1 - int(np.argmax(level[::-1] > 0.0))  # the last node that has weight
        u -= np.where(at > 0, sums[at - 1], 0.0)
        nodes = width + at
        for _ in range(layout.depth - top):
            left = 2 * nodes
            left_sum = tree[left]
            right = (u >= left_sum) & (tree[left + 1] > 0.0)
            u -= np.where(right, left_sum, 0.0)
            nodes = left + right
        blocks = nodes - layout.leaves
        weights = self._of_blocks(blocks)
        within = (np.cumsum(weights, axis=1) <= u[:, None]).sum(axis=1)
        past = within >= layout.block  # rounding: the block's last slot that has weight
        if past.any():
            within[past] = layout.block - 1 - np.argmax(weights[past, ::-1] > 0.0, axis=1)
        return np.minimum(blocks * layout.block + within, self.capacity - 1)

    def _of_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """The weights of every slot of ``blocks``, ``[len(blocks), block]`` (0 past the capacity)."""
        layout = self.layout
        return self.weights(lambda array: layout.take(array, blocks))

    def _block_sums(self, blocks: np.ndarray) -> np.ndarray:
        run = self.layout.run(blocks)
        return _row_sums(self._of_blocks(blocks) if run is None else self._of_run(*run))

    def _of_run(self, first: int, stop: int, slots: slice) -> np.ndarray:
        """The weights of every slot of the consecutive blocks ``first`` to ``stop``
        (``slots``: their slots), ``[stop - first, block]``: from views, no gathers."""
        return self.layout.by_block(self.weights(lambda array: array[slots]), first, stop, 0.0)


def _row_sums(values: np.ndarray) -> np.ndarray:
    """The sum of each row of ``[n, block]`` values: ``einsum`` takes a sixth of
    ``.sum(axis=1)``'s time on rows this short, and unlike a product with a vector of
    ones it starts no BLAS threads (which spin on a busy machine)."""
    return np.einsum("ij->i", values)
