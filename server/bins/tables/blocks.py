"""Trees over blocks of a table's slots: the layout they share and their batched update.

A table of 10^8 rows cannot keep a tree node per row beside its 24 bytes of state
(a float64 sum tree alone is 16 bytes a row).  So the trees here have a leaf per
*block* of ``block`` consecutive slots, and what a block holds is computed from the
per-slot state when it changes (a sum of weights, the smallest slot, a count of
rows): a tree costs ``16 / block`` bytes a row, and a search ends with one
vectorised look at the ``block`` slots of the leaf it reached.

Updates and searches take whole batches: one numpy operation per tree level for
the batch, O(log capacity) levels, until a level holds a few nodes: those take a
scalar path, where numpy's per-call cost would dominate.
"""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tensorshare.protocol.pacing import usable_cpus

from . import compiled

SCALAR_MAX = 4  # levels of up to this many nodes are updated one node at a time
CHUNK = 1 << 20  # slots looked at per step when a whole tree is rebuilt (bounds its temporaries)
REBUILD_THREADS = 4  # at most: chunks of a rebuild done at once (numpy lets go of the GIL on whole chunks)


FEW = 32  # values: up to this many, :func:`is_run` without the compiled loop looks at them as Python ints
# Runs made as runs (:func:`run_of`) are remembered, the last few of them, so that the
# checks an insert makes of its slots and keys again as they pass through the table
# (seven for a ring buffer's batch, 2-9 us each for 16,384) are a lookup.  Weakly: a
# remembered run holds no memory once the table is done with it.
_KNOWN_RUNS: dict[int, tuple[weakref.ref, int]] = {}
KNOWN_RUNS = 8


def run_of(first: int, n: int, step: int = 1) -> np.ndarray:
    """``first, first + step, ...`` (``n`` of them) as an int64 array :func:`is_run`
    knows to be a run without looking: it is read-only (so it stays one) and owns its
    data (no view of it is written either)."""
    values = np.arange(first, first + n * step, step, dtype=np.int64) if n else np.zeros(0, np.int64)
    values.flags.writeable = False
    if n > FEW:
        known = _KNOWN_RUNS
        if len(known) >= KNOWN_RUNS:
            try:
                del known[next(iter(known))]  # (the oldest)
            except (KeyError, RuntimeError, StopIteration):  # (another thread's change meanwhile)
                known.clear()
        known[id(values)] = (weakref.ref(values), step)
    return values


def is_run(values: np.ndarray, step: int = 1) -> bool:
    """Whether ``values`` (1-D, not empty) go up by ``step`` from each to the next:
    consecutive slots, or a ring's keys.  The compiled loop where it is built, however
    many: one pass, against numpy's three (16,384 slots: 2 us against 8-29 us, seven
    times an insert of a ring buffer's), and a call costs 0.2-0.3 us (32 values as
    Python ints: 1.3 us).  Without it a few are compared as Python ints (for an
    actor's insert of a handful of rows numpy's per-call cost was most of the check),
    more with numpy.  An array :func:`run_of` made is known to be one."""
    known = _KNOWN_RUNS.get(id(values))
    if known is not None and known[0]() is values and known[1] == step:
        return True
    loops = compiled.loops
    if loops is not None and values.dtype == np.int64 and values.flags.c_contiguous:
        return loops.is_run(values, step)  # (32 values: 0.3 us, against 1.3 us as Python ints)
    n = values.size
    if n <= FEW:
        listed = values.tolist()
        return listed == list(range(listed[0], listed[0] + n * step, step))
    if step == 1:  # (a comparison's bool temporary, not np.diff's int64 one: 42 us for 16,384 slots)
        return bool(values[-1] - values[0] == n - 1 and (values[1:] > values[:-1]).all())
    return bool((np.diff(values) == step).all())


class Blocks:
    """``capacity`` slots in blocks of ``block``: leaf ``b`` of a tree of ``leaves``
    (a power of two) is node ``leaves + b``; node 1 is the root, node ``i`` has
    children ``2i`` and ``2i + 1``."""

    def __init__(self, capacity: int, block: int):
        self.capacity, self.block = capacity, block
        self.nblocks = max(1, -(-capacity // block))
        self.leaves = 1 << max(0, (self.nblocks - 1).bit_length())
        self.depth = self.leaves.bit_length() - 1  # levels below the root
        self._offsets = np.arange(block, dtype=np.int64)
        # a power of two is shifted by: numpy's int64 division by a scalar took 1-2 ns a slot
        self._shift = block.bit_length() - 1 if block & (block - 1) == 0 else None

    def blocks_of(self, slots: np.ndarray) -> np.ndarray:
        """The distinct blocks of ``slots``, sorted."""
        if not (type(slots) is np.ndarray and slots.dtype == np.int64 and slots.ndim == 1):
            slots = np.asarray(slots, np.int64).reshape(-1)  # (a new view: a known run is known by its array)
        n = slots.size
        if n > 1 and is_run(slots):  # (an insert's)
            return np.arange(int(slots[0]) // self.block, int(slots[-1]) // self.block + 1, dtype=np.int64)
        loops = compiled.loops
        if loops is not None and self._shift is not None and slots.flags.c_contiguous:
            # one pass where the slots rise (an update's, sorted): see distinct_rising
            out = np.empty(n, np.int64)
            k = loops.distinct_rising(slots, self._shift, out)
            if k >= 0:
                return out[:k]
        return distinct(slots >> self._shift if self._shift is not None else slots // self.block)

    def slots_in(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, valid)``, both ``[len(blocks), block]``: every slot of each block
        (past the capacity: the last slot, and ``valid`` False)."""
        slots = blocks[:, None] * self.block + self._offsets
        valid = slots < self.capacity
        return np.minimum(slots, self.capacity - 1), valid

    def take(self, array: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """``array``'s values (one per slot) of every slot of each of ``blocks``, as
        ``[len(blocks), block]``; zero past the capacity.  A block's slots are
        consecutive: taking whole rows of the array seen as ``[blocks, block]`` costs a
        third of gathering each slot by index (1,024 blocks of 16 float64: 5 us
        against 17, and no index arrays to build; mode="clip": the blocks are valid, and
        "raise" would gather into a temporary first)."""
        block, full = self.block, self.capacity // self.block
        if full == self.nblocks:
            return np.take(array[:full * block].reshape(full, block), blocks, axis=0, mode="clip")
        rows = np.zeros((np.size(blocks), block), array.dtype)
        whole = blocks < full
        if full:
            rows[whole] = np.take(array[:full * block].reshape(full, block), blocks[whole], axis=0, mode="clip")
        rows[~whole, :self.capacity - full * block] = array[full * block:]
        return rows

    def run(self, blocks: np.ndarray) -> tuple[int, int, slice] | None:
        """``(first, stop, slots)`` when ``blocks`` (sorted, distinct) are consecutive,
        as a ring buffer's inserts make them (``slots``: the slice of their slots), so
        that their values are views of the arrays, not gathered; else None."""
        first, stop = int(blocks[0]), int(blocks[-1]) + 1
        if stop - first != blocks.size:
            return None
        return first, stop, slice(first * self.block, min(stop * self.block, self.capacity))

    def chunks(self):
        """``(first block, stop block, slots)`` pieces of every block, CHUNK slots at a
        time; ``slots`` is the slice of the slots in them (the last may be short)."""
        per = max(1, CHUNK // self.block)
        for first in range(0, self.nblocks, per):
            stop = min(first + per, self.nblocks)
            yield first, stop, slice(first * self.block, min(stop * self.block, self.capacity))

    def redo(self, tree: np.ndarray, slots: np.ndarray, leaf_values, combine=np.add, batch=None, one=None,
             blocks: np.ndarray | None = None) -> None:
        """The leaves of the blocks of ``slots`` from ``leaf_values(blocks)``, then every
        node above them (:func:`update_ancestors`): a node is ``combine(left child,
        right child)``, elementwise over arrays; ``batch(level)`` and ``one(node)``
        may do the same faster for a level's nodes or for one node.  ``blocks``:
        ``blocks_of(slots)``, where the caller has it already."""
        if not np.size(slots):
            return
        if blocks is None:
            blocks = self.blocks_of(slots)
        tree[self.leaves + blocks] = leaf_values(blocks)
        if batch is None:
            def batch(level: np.ndarray) -> None:
                left = 2 * level
                tree[level] = combine(tree[left], tree[left + 1])

        if one is None and combine is np.add:
            def one(node: int) -> None:  # (Python numbers: numpy's ufunc on two scalars cost 1-2 us a node)
                tree[node] = tree.item(2 * node) + tree.item(2 * node + 1)
        elif one is None:
            def one(node: int) -> None:
                tree[node] = combine(tree[2 * node], tree[2 * node + 1])

        if blocks.size > SCALAR_MAX and self.run(blocks) is not None:
            update_span(tree, self.leaves + int(blocks[0]), self.leaves + int(blocks[-1]), combine, one)
        else:
            update_ancestors(blocks + self.leaves, batch, one, lambda width: build_levels(tree, 2 * width, combine))

    def by_block(self, values: np.ndarray, first: int, stop: int, fill) -> np.ndarray:
        """``values`` of the slots of blocks ``first`` to ``stop`` as ``[blocks, block]``,
        ``fill`` past the capacity."""
        if values.size == (stop - first) * self.block:
            return values.reshape(-1, self.block)
        whole = np.full((stop - first) * self.block, fill, values.dtype)
        whole[:values.size] = values
        return whole.reshape(-1, self.block)


def in_memory(name: str, dtype, length: int, fill) -> np.ndarray:
    """A table's arrays where it keeps them by default: new memory (see ``Table``'s
    ``arrays``: a durable table keeps them in files)."""
    return np.full(length, fill, dtype)


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct ``values``, sorted; without a sort when they come sorted (an
    insert's slots mostly do: ``numpy.unique`` took 0.4 ms for 16,384 of them)."""
    if values.size > 1 and not (values[1:] >= values[:-1]).all():
        values = np.sort(values)
    keep = np.empty(values.size, bool)
    if values.size:
        keep[0] = True
        np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def update_ancestors(nodes: np.ndarray, batch, one, whole) -> None:
    """Recompute the distinct ancestors of leaf ``nodes`` (sorted, distinct), a level at a time from their
    parents up to the root: ``batch(level)`` (an int64 array) while a level holds more
    than ``SCALAR_MAX`` nodes, one numpy operation per step for the level; then
    ``one(node)`` for each node, where numpy's per-call cost would dominate.  A batch
    of neighbouring slots (an insert's) meets in a few levels, so most levels of a
    tree are a node or two.  Where a level's nodes are a quarter or more of its width
    (a batch scattered over the table reaches such levels near the root),
    ``whole(width)`` redoes that level, nodes ``[width, 2 * width)``, and every level
    above it from contiguous slices: cheaper than gathering and scattering by index."""
    level = nodes
    while level.size > SCALAR_MAX and level[0] > 1:
        level = level >> 1
        span = int(level[-1] - level[0]) + 1
        if span < level.size:  # repeats (sorted as halved: adjacent, found with no sort)
            keep = np.empty(level.size, bool)
            keep[0] = True
            np.not_equal(level[1:], level[:-1], out=keep[1:])
            level = level[keep]
        width = 1 << (int(level[0]).bit_length() - 1)
        if 4 * level.size >= width:
            whole(width)
            return
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
        few = [few[0] >> 1] if len(few) == 1 else list({node >> 1 for node in few})


def each_chunk(layout: Blocks, work) -> list:
    """``work(first block, stop block, slots)`` for each of ``layout.chunks()``, a few
    at a time on threads (a restart after a kill rebuilds every tree of a table from
    its rows: 10^8 rows are 96 chunks, and numpy's operations on a whole chunk let
    go of the GIL); returns what each returned, in order.  An error raises here."""
    chunks = list(layout.chunks())
    threads = min(REBUILD_THREADS, usable_cpus(), len(chunks))
    if threads < 2:
        return [work(*chunk) for chunk in chunks]
    with ThreadPoolExecutor(threads, thread_name_prefix="table-rebuild") as pool:
        return list(pool.map(lambda chunk: work(*chunk), chunks))


def update_span(tree: np.ndarray, low: int, high: int, combine, one) -> None:
    """Recompute the ancestors of the consecutive leaves ``low`` to ``high``: at each
    level they are consecutive too, so a level is one ``combine`` of two strided
    slices (no index arrays, no search for repeats), and ``one(node)`` once a level
    is down to a few nodes."""
    while low > 1:
        low, high = low >> 1, high >> 1
        if high - low < SCALAR_MAX:
            for node in range(low, high + 1):
                one(node)
        else:
            tree[low:high + 1] = combine(tree[2 * low:2 * high + 2:2], tree[2 * low + 1:2 * high + 2:2])


def build_levels(tree: np.ndarray, leaves: int, combine) -> None:
    """Every inner node of ``tree`` from its children, level by level up to the root:
    ``tree[parents] = combine(left children, right children)``."""
    level = leaves
    while level > 1:
        half = level // 2
        tree[half:level] = combine(tree[level:2 * level:2], tree[level + 1:2 * level:2])
        level = half
