"""Samplers (which rows a sample returns) and removers (which row makes room).

Each keeps what it needs in step with the table: the table tells it of rows
``added``, ``removed`` and ``reprioritized`` (slot arrays) and reads the rows' keys
and priorities from :class:`~.slots.Slots`.

* ``uniform``: every row equally likely; no index (a draw indexes the packed
  occupied slots).
* ``prioritized``: row ``i`` with probability ``p_i ** e / sum_j p_j ** e``
  (``e = priority_exponent``), from a :class:`~.sumtree.SumTree`; if every weight is
  zero, uniform.  Independent draws, or stratified (one per equal slice of the
  total: each row's expected count in a batch is the same, its spread smaller).
* ``fifo`` / ``lifo``: the oldest / newest row; a sample of ``n`` is ``n`` such
  picks in a row (see :meth:`Table.sample` for how ``max_times_sampled`` makes them
  move on).
* removers ``fifo`` (oldest first) and ``lowest_priority`` (lowest priority, the
  oldest of equals first), from a :class:`~.mintree.MinTree`.

The fifo sampler and remover share one age index.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

from .errors import PriorityError, TableSpecError
from .blocks import in_memory, is_run, run_of
from .mintree import BLOCK, INT_EMPTY, MinTree
from .slots import LIVE, Slots, runs
from .sumtree import Powers, SumTree

CONSTANT_CHECK = 64  # weights of more priorities than this look for one priority for all first
RUNS = 4  # new rows in more runs of consecutive slots than this update the age orders node by node
SAMPLERS = ("uniform", "prioritized", "fifo", "lifo")
REMOVERS = ("fifo", "lowest_priority")


class _Index:
    """Default hooks: an index that needs to be told of nothing."""

    def added(self, slots: np.ndarray) -> None:
        pass

    def removed(self, slots: np.ndarray) -> None:
        pass

    def reprioritized(self, slots: np.ndarray, before: np.ndarray, ordered: np.ndarray) -> None:
        """The distinct ``slots`` had priorities ``before`` and now have :class:`Slots`'s;
        ``ordered``: the same slots, sorted."""

    def rebuild(self) -> None:
        pass


class OrderIndex(_Index):
    """The rows in one order, kept in a :class:`MinTree`: ``"oldest"`` first,
    ``"newest"`` first, or ``"lowest_priority"`` first (then oldest)."""

    def __init__(self, slots: Slots, by: str, arrays=in_memory, block: int = BLOCK):
        self.slots = slots
        self.by = by
        key, priority = slots.key, slots.priority
        if by == "lowest_priority":
            order, empty, one = self._by_priority, np.inf, lambda slot: (float(priority[slot]), int(key[slot]))
            held = lambda held_slots: (priority[held_slots], key[held_slots])  # noqa: E731
        else:
            order, empty = self._by_age, INT_EMPTY
            one = (lambda slot: int(key[slot])) if by == "oldest" else (lambda slot: -int(key[slot]))
            sign = 1 if by == "oldest" else -1
            held = lambda held_slots: (sign * key[held_slots], None)  # noqa: E731  (keys are distinct: no ties)
        self.tree = MinTree(slots.capacity, order, empty, block=block, order_one=one, arrays=arrays,
                            name=f"tree_{by}", distinct=by != "lowest_priority", held_order=held,
                            lowest=slots if by == "lowest_priority" else None,
                            aged=None if by == "lowest_priority" else slots)

    def _by_age(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = self.slots.key[slots]
        values = keys if self.by == "oldest" else -keys
        return np.where(self.slots.live(slots), values, INT_EMPTY), keys

    def _by_priority(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        state = self.slots
        return np.where(state.live(slots), state.priority[slots], np.inf), state.key[slots]

    def added(self, slots: np.ndarray) -> None:
        """New rows in ``slots`` (:meth:`Slots.fill` gave them keys that grow along
        ``slots``): in the age orders, a run of consecutive slots is in order."""
        found = None if self.by == "lowest_priority" else runs(slots, RUNS)
        if found is None:
            self.tree.changed(slots)
            return
        for first, start, stop in found:
            self.tree.filled_run(first, first + stop - start, self.by == "oldest")

    def removed(self, slots: np.ndarray) -> None:
        self.tree.changed(slots)

    def reprioritized(self, slots: np.ndarray, before: np.ndarray, ordered: np.ndarray) -> None:
        if self.by == "lowest_priority":
            self.tree.changed(ordered)

    def rebuild(self) -> None:
        self.tree.rebuild()

    def first(self, k: int) -> np.ndarray:
        """The first ``k`` rows' slots in this order (fewer if the table holds fewer)."""
        if self.by == "oldest" and k > 1:
            ring = self._ring(k)
            if ring is not None:
                return ring
        return self.tree.smallest(k)

    def _ring(self, k: int) -> np.ndarray | None:
        """The ``k`` oldest rows when they follow the oldest in consecutive slots with
        consecutive seqs (a table filled as a ring buffer): no other row can be older
        than the last of them, since seqs are distinct.  None otherwise."""
        state = self.slots
        oldest = self.tree.first
        if oldest < 0 or k > state.size:
            return None
        capacity = state.capacity
        # key = seq * capacity + slot: one slot and one seq on, a key grows by capacity + 1
        # (past the wrap, less capacity), compared with no division
        if oldest + k <= capacity:  # (no wrap: views of the slots' state, no index arrays)
            at = slice(oldest, oldest + k)
            if is_run(state.key[at], capacity + 1) and np.bitwise_and.reduce(state.flags[at]) & LIVE:
                return run_of(oldest, k)
            return None
        steps = np.arange(k, dtype=np.int64)
        slots = oldest + steps
        expected = int(state.key[oldest]) + steps * (capacity + 1)
        wrapped = slots >= capacity
        slots[wrapped] -= capacity
        expected[wrapped] -= capacity
        at = slots
        if state.live(at).all() and (state.key[at] == expected).all():
            return slots
        return None


# ``(exponent, largest weight)`` a sampler holds priorities to (its ``weight_limits``: the
# rule of its check_priorities, for the compiled check): any finite priority >= 0
ANY_WEIGHT = (1.0, math.inf)


class UniformSampler(_Index):
    name = "uniform"
    ordered = False
    weight_limits = ANY_WEIGHT

    def __init__(self, slots: Slots):
        self.slots = slots

    def check_priorities(self, priorities: np.ndarray) -> None:
        pass

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` independent draws: ``(slots, probability of each)``."""
        return self.slots.draw(n, rng), np.full(n, 1.0 / self.slots.size)


class PrioritizedSampler(UniformSampler):
    name = "prioritized"

    def __init__(self, slots: Slots, exponent: float, stratified: bool = False, arrays=in_memory):
        super().__init__(slots)
        self.exponent = exponent
        self.stratified = stratified
        self.tree = SumTree(slots.capacity, self._slot_weights, arrays=arrays, powers=Powers(slots, exponent))

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        e = self.exponent
        if e == 1.0:
            return np.asarray(priorities, np.float64)
        if e == 0.5:
            return np.sqrt(priorities)
        # Rows often come with one priority for all (the default 1.0, or the largest
        # seen, as TorchRL's and Reverb's writers give): one power instead of a power
        # a row (16,384 rows: 45 us against 6 us for the look at the smallest and largest)
        if priorities.size > CONSTANT_CHECK:
            low = priorities.min()
            if low == priorities.max():
                return np.full(priorities.shape, np.power(low, e))
        return np.power(priorities, e)

    def _slot_weights(self, pick) -> np.ndarray:
        """The tree's weights of the slots ``pick`` selects (:class:`SumTree`)."""
        state = self.slots
        return np.where((pick(state.flags) & LIVE).view(np.bool_), self.weights(pick(state.priority)), 0.0)

    def check_priorities(self, priorities: np.ndarray) -> None:
        """Refuse a weight past :attr:`SumTree.max_weight`: each is finite on its own,
        and the sum of every row's (the tree's total) stays finite too."""
        with np.errstate(over="ignore"):
            weights = self.weights(priorities)
        if not np.isfinite(weights).all():
            bad = priorities[~np.isfinite(weights)][0]
            raise PriorityError(f"priority {bad:g} ** priority_exponent {self.exponent:g} overflows")
        limit = self.tree.max_weight
        if weights.size and weights.max() > limit:
            bad = priorities[weights > limit][0]
            raise PriorityError(f"priority {bad:g} ** priority_exponent {self.exponent:g} is over {limit:g}, the "
                                f"largest weight a table of {self.tree.capacity} rows takes (so that the sum of "
                                f"all weights stays a finite float)")

    @property
    def weight_limits(self) -> tuple[float, float]:
        return self.exponent, self.tree.max_weight

    def added(self, slots: np.ndarray) -> None:
        self.tree.changed(slots)

    removed = added

    def reprioritized(self, slots: np.ndarray, before: np.ndarray, ordered: np.ndarray) -> None:
        self.tree.reweighed(slots, before, ordered)

    def rebuild(self) -> None:
        self.tree.rebuild()

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        total = self.tree.total
        if not total > 0.0:
            return super().draw(n, rng)
        if self.stratified:
            targets = (np.arange(n) + rng.random(n)) * (total / n)
        else:
            targets = rng.random(n) * total
        slots, weights = self.tree.pick(targets)
        return slots, weights / total


class OrderedSampler(_Index):
    """fifo (oldest first) or lifo (newest first)."""

    ordered = True
    weight_limits = ANY_WEIGHT

    def __init__(self, name: str, index: OrderIndex):
        self.name = name
        self.index = index

    def check_priorities(self, priorities: np.ndarray) -> None:
        pass

    def first(self, k: int) -> np.ndarray:
        return self.index.first(k)


class Remover:
    """fifo or lowest_priority: the rows to remove to make room."""

    def __init__(self, name: str, index: OrderIndex):
        self.name = name
        self.index = index

    def victims(self, k: int) -> np.ndarray:
        return self.index.first(k)


def index_bytes(capacity: int, sampler: str, remover: str | None) -> int:
    """The memory the indexes :func:`build` makes for these take (their arrays'
    bytes), before they are made: trees over blocks of slots, a byte and a bit a row or less."""
    orders = int(sampler == "fifo" or remover == "fifo") + (sampler == "lifo") + (remover == "lowest_priority")
    return orders * MinTree.bytes_for(capacity) + (sampler == "prioritized") * SumTree.bytes_for(capacity)


def build(slots: Slots, sampler: str, remover: str | None, priority_exponent: float,
          stratified: bool, arrays=in_memory) -> tuple[object, Remover | None, list[_Index]]:
    """The sampler and remover named, and every index the table must keep in step
    (their trees' arrays made by ``arrays``, as :class:`~.slots.Slots`' are)."""
    if sampler not in SAMPLERS:
        raise TableSpecError(f"unknown sampler {sampler!r} (one of {', '.join(SAMPLERS)})")
    if remover is not None and remover not in REMOVERS:
        raise TableSpecError(f"unknown remover {remover!r} (one of {', '.join(REMOVERS)}, or None)")
    if (isinstance(priority_exponent, bool) or not isinstance(priority_exponent, Real)
            or not math.isfinite(priority_exponent) or priority_exponent < 0):
        raise TableSpecError(f"priority_exponent must be a finite number >= 0, not {priority_exponent!r}")
    indexes: list[_Index] = []
    oldest = None
    if sampler == "fifo" or remover == "fifo":
        oldest = OrderIndex(slots, "oldest", arrays)
        indexes.append(oldest)
    if sampler == "uniform":
        chosen = UniformSampler(slots)
    elif sampler == "prioritized":
        chosen = PrioritizedSampler(slots, float(priority_exponent), stratified, arrays)
        indexes.append(chosen)
    elif sampler == "fifo":
        chosen = OrderedSampler("fifo", oldest)
    else:
        newest = OrderIndex(slots, "newest", arrays)
        indexes.append(newest)
        chosen = OrderedSampler("lifo", newest)
    if remover is None:
        return chosen, None, indexes
    if remover == "fifo":
        return chosen, Remover("fifo", oldest), indexes
    lowest = OrderIndex(slots, "lowest_priority", arrays)
    indexes.append(lowest)
    return chosen, Remover("lowest_priority", lowest), indexes
