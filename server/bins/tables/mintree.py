"""An argmin tree over blocks of a table's slots, batched: the index of the fifo and
lifo samplers and of the removers.

Each slot has an order value and a tie-break (an int64: the row's key, so that of
equal values the older row comes first), computed from the table's state by
``order(slots)``; empty slots have the value ``empty`` and come last.  A complete
binary tree in one int64 array (:class:`~.blocks.Blocks`) holds, at each node, the
slot that is smallest (value, then tie-break) under it, -1 where every slot under
it is empty; the root is the smallest slot of all.  :meth:`smallest` finds the
``k`` smallest slots in order with one pass down the tree that keeps at most ``k``
nodes per level.  The lowest-priority order's scattered changes (a priority update's)
are redone by a compiled loop where setup.py built one (:mod:`.compiled`, as the sum
tree's); numpy's path stays the reference and the fallback.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import compiled
from .blocks import Blocks, each_chunk, in_memory

INT_EMPTY = np.iinfo(np.int64).max
BLOCK = 32  # slots under a leaf: the tree costs half a byte a row
SCALAR_NODES = 8  # a level's nodes set one at a time up to this many (numpy's per-call cost would dominate)


class MinTree:
    """The slots of a table ordered by ``(value, tie)``, smallest first."""

    def __init__(self, capacity: int, order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], empty,
                 block: int = BLOCK, order_one: Callable[[int], tuple] | None = None, arrays=in_memory,
                 name: str = "tree_min", distinct: bool = False, held_order=None, lowest=None, aged=None):
        self.capacity = capacity
        # the table's slots (``priority``, ``key``, ``flags``) when the order is the
        # lowest priority, then the oldest among live rows: scattered changes are then
        # redone by the compiled loop (None: numpy's path only; so is every call while
        # ``compiled.loops`` is None)
        self.lowest = lowest
        # the table's slots when the order is by age (the oldest or the newest row first):
        # a ring buffer's insert is then redone by the compiled loop (None: numpy's path)
        self.aged = aged
        self.order = order  # slots -> (values, ties), ``empty`` values for empty slots
        # slots that hold rows -> (values, ties): what the nodes above the leaves compare
        # (a node holds a slot with a row or -1), with no look at which are empty
        self.held_order = held_order or order
        # one slot that holds a row -> (value, tie) as Python numbers: the few nodes near
        # the root are compared one at a time, where numpy's per-call cost would dominate
        self.order_one = order_one or (lambda slot: tuple(a[0] for a in order(np.array([slot], np.int64))))
        self.empty = empty
        self.distinct = distinct  # the values of rows are never equal (then ties never matter)
        self.layout = Blocks(capacity, block)
        self.leaves = self.layout.leaves
        self.tree = arrays(name, np.int64, 2 * self.leaves, -1)

    @staticmethod
    def bytes_for(capacity: int, block: int = BLOCK) -> int:
        return 2 * Blocks(capacity, block).leaves * 8

    @property
    def first(self) -> int:
        """The smallest slot, or -1 if every slot is empty."""
        return int(self.tree[1])

    def changed(self, slots: np.ndarray) -> None:
        """The order values of ``slots`` changed (or they became empty)."""
        blocks = self.layout.blocks_of(slots) if np.size(slots) else None
        loops = compiled.loops
        if loops is not None and self.lowest is not None and blocks is not None and self.layout.run(blocks) is None:
            state, layout = self.lowest, self.layout  # (a run of blocks stays with numpy: its levels are slices)
            loops.refresh_lowest(self.tree, layout.depth, state.priority, state.key, state.flags, layout.block,
                                 self.capacity, blocks)
            return
        tree, pick = self.tree, self._pick

        def batch(level: np.ndarray) -> None:
            tree[level] = pick(tree[2 * level], tree[2 * level + 1])

        self.layout.redo(tree, slots, self._block_best, pick, batch, self._one, blocks=blocks)

    def filled_run(self, first: int, stop: int, rising: bool) -> None:
        """Slots ``first`` to ``stop`` (exclusive) were all just given rows whose order
        values rise with the slot (``rising``; else fall): a ring buffer's insert in
        the age order.  A node all of whose slots are among them then holds its first
        slot (its last), known with no look at the rows; only the two nodes a level
        where the run starts and ends are compared (:meth:`changed` compares every
        node above the run: 0.17 ms for 16,384 slots, a third of the insert).  The
        compiled loop does the same in a few microseconds, where numpy's path took
        60 us for one slot (its nodes one at a time) and 160-190 us for 16,384, at
        2x10^6 rows."""
        loops = compiled.loops
        if loops is not None and self.aged is not None:
            state = self.aged
            loops.filled_run(self.tree, self.layout.depth, state.key, state.flags, self.layout.block, self.capacity,
                             first, stop, not rising)
            return
        tree, capacity, one = self.tree, self.capacity, self._one
        base, width = self.leaves, self.layout.block  # nodes of a level are base + i; each spans width slots
        low, high = first // width, (stop - 1) // width  # the level's nodes the run touches
        while True:
            full_low = -(-first // width)
            full_high = high if stop == capacity else stop // width - 1  # (the last node may be short)
            if full_high - full_low >= SCALAR_NODES:
                nodes = np.arange(full_low, full_high + 1, dtype=np.int64)
                tree[base + full_low:base + full_high + 1] = (
                    nodes * width if rising else np.minimum((nodes + 1) * width, capacity) - 1)
            else:
                for i in range(full_low, full_high + 1):
                    tree[base + i] = i * width if rising else min((i + 1) * width, capacity) - 1
            # the nodes the run covers in part: at most its first and its last
            partial = [i for i in ((low,) if low == high else (low, high)) if i < full_low or i > full_high]
            if partial and base == self.leaves:  # blocks: their slots compared
                blocks = np.array(partial, np.int64)
                tree[base + blocks] = self._block_best(blocks)
            else:
                for i in partial:
                    one(base + i)
            if base == 1:
                return
            base, width, low, high = base >> 1, width << 1, low >> 1, high >> 1

    def _one(self, node: int) -> None:
        """Node ``node`` from its children (one at a time: numpy's per-call cost would dominate)."""
        # a node holds a slot with a row or -1: every node above a changed block is redone
        tree, order_one = self.tree, self.order_one
        a, b = int(tree[2 * node]), int(tree[2 * node + 1])
        tree[node] = a if b < 0 or (a >= 0 and order_one(a) <= order_one(b)) else b

    def rebuild(self) -> None:
        """Every node from the order of every slot (a table reopened from its files).
        Each level is chosen from the one below with the values and ties of its
        nodes' slots carried along (an array per level, halving): no look back at
        the rows' state above the leaves."""
        layout, tree = self.layout, self.tree
        tree[:] = -1
        values = np.full(layout.leaves, self.empty, np.result_type(self.empty))
        ties = None if self.distinct else np.full(layout.leaves, INT_EMPTY, np.int64)

        def leaves(first: int, stop: int, slots: slice) -> None:
            best, values[first:stop], tie = self._run_best(first, stop, slots)
            tree[layout.leaves + first:layout.leaves + stop] = best
            if ties is not None:
                ties[first:stop] = tie

        each_chunk(layout, leaves)
        level = layout.leaves
        while level > 1:  # (as _pick: the left child unless the right one is smaller)
            va, vb = values[0::2], values[1::2]
            if ties is None:
                left = va <= vb
            else:
                ta, tb = ties[0::2], ties[1::2]
                left = (va < vb) | ((va == vb) & (ta <= tb))
                ties = np.where(left, ta, tb)
            tree[level // 2:level] = np.where(left, tree[level:2 * level:2], tree[level + 1:2 * level:2])
            values = np.where(left, va, vb)
            level //= 2

    def smallest(self, k: int) -> np.ndarray:
        """The (at most) ``k`` smallest non-empty slots, smallest first.

        Why one pass is enough: the ``k`` smallest slots lie under at most ``k``
        nodes of each level, and a node that is none of those has a minimum no
        smaller than any of theirs; so keeping, level after level, the ``k``
        children with the smallest minima keeps every one of them.
        """
        if k <= 0 or self.first < 0:
            return np.zeros(0, np.int64)
        if k == 1:
            return np.array([self.first], np.int64)
        tree, leaves = self.tree, self.leaves
        nodes = np.ones(1, np.int64)
        while nodes[0] < leaves:
            children = np.concatenate((2 * nodes, 2 * nodes + 1))
            children = children[tree[children] >= 0]
            if children.size > k:
                values, ties = self._keys(tree[children])
                children = children[np.lexsort((ties, values))[:k]]
            nodes = children
        slots, valid = self.layout.slots_in(nodes - leaves)
        values, ties = self.order(slots)
        held = valid & (values != self.empty)
        slots, values, ties = slots[held], values[held], ties[held]
        return slots[np.lexsort((ties, values))[:k]]

    # -- internals

    def _keys(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(values, ties)`` of ``slots``, where -1 (no slot) is empty."""
        none = slots < 0
        values, ties = self.held_order(np.where(none, 0, slots) if none.any() else slots)
        if ties is None:  # (distinct values: they are their own tie-break)
            ties = values
        if none.any():
            values = np.where(none, self.empty, values)
            ties = np.where(none, INT_EMPTY, ties)
        return values, ties

    def _pick(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Elementwise the smaller of slots ``a`` and ``b`` (ties: ``a``; -1: none)."""
        va, ta = self._keys(a)
        vb, tb = self._keys(b)
        if self.distinct:
            return np.where(va <= vb, a, b)
        return np.where((va < vb) | ((va == vb) & (ta <= tb)), a, b)

    def _block_best(self, blocks: np.ndarray) -> np.ndarray:
        """The smallest slot of each of ``blocks`` (-1: all empty)."""
        run = self.layout.run(blocks)
        if run is not None:
            return self._run_best(*run)[0]
        slots, valid = self.layout.slots_in(blocks)
        values, ties = self.order(slots)
        return self._best(np.where(valid, values, self.empty), ties, blocks)[0]

    def _run_best(self, first: int, stop: int, slots: slice) -> tuple:
        """:meth:`_best` of the consecutive blocks ``first`` to ``stop`` (``slots``: their
        slots), from views of the state: no gathers."""
        layout = self.layout
        values, ties = self.order(slots)
        return self._best(layout.by_block(values, first, stop, self.empty), layout.by_block(ties, first, stop, INT_EMPTY),
                          np.arange(first, stop))

    def _best(self, values: np.ndarray, ties: np.ndarray, blocks: np.ndarray) -> tuple:
        """Per row of ``[blocks, block]`` values and ties of the slots of ``blocks``: the
        smallest slot (-1: none), its value and its tie (``empty`` and ``INT_EMPTY``: none)."""
        if self.distinct:  # no two rows share a value (keys): the smallest value decides
            at = values.argmin(axis=1)
            low = np.take_along_axis(values, at[:, None], axis=1)[:, 0]
            return np.where(low == self.empty, -1, blocks * self.layout.block + at), low, low
        low = values.min(axis=1)
        ties = np.where(values == low[:, None], ties, INT_EMPTY)
        at = ties.argmin(axis=1)
        none = low == self.empty
        tie = np.where(none, INT_EMPTY, np.take_along_axis(ties, at[:, None], axis=1)[:, 0])
        return np.where(none, -1, blocks * self.layout.block + at), low, tie
