"""Which rows a sample of ``n`` picks, with the table's sampler and its ``max_times_sampled``.

As ``n`` single samples in a row would: with ``max_times_sampled`` ``m``, no row is
handed out more than it may still be, so fifo and lifo move on to the next row
once one is spent, and uniform and prioritized draws beyond a row's allowance are
drawn again once the rows that reached it are out of the draw (the sampler's
probabilities change as they would between single samples).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .rows import EMPTY
from .slots import Slots


def in_order(sampler, state: Slots, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """fifo/lifo: the first row in order as often as it may be sampled, then the next."""
    if m == 0:
        slots = np.repeat(sampler.first(1), n)
    else:
        candidates = sampler.first(min(n, state.size))
        allowed = m - state.times_sampled[candidates].astype(np.int64)
        reach = np.cumsum(allowed)
        last = int(np.searchsorted(reach, n))
        counts = allowed[:last + 1].copy()
        counts[-1] -= reach[last] - n
        slots = np.repeat(candidates[:last + 1], counts)
    return slots, np.ones(n)


def drawn(sampler, state: Slots, m: int, n: int, rng: np.random.Generator,
          unlink: Callable[[np.ndarray], None]) -> tuple[np.ndarray, np.ndarray]:
    """uniform/prioritized: ``n`` independent draws; with ``m``, the draws beyond a
    row's allowance are redrawn once the rows that reached it are out of the draw
    (``unlink``)."""
    slots, probabilities = sampler.draw(n, rng)
    if m == 0:
        return slots, probabilities
    accepted, accepted_p = EMPTY, np.zeros(0)
    while True:
        every = np.concatenate((accepted, slots))
        order = np.argsort(every, kind="stable")  # earlier picks first among equals
        ranked = every[order]
        first = np.ones(ranked.size, bool)
        np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
        starts = np.maximum.accumulate(np.where(first, np.arange(ranked.size), 0))
        within = np.empty(ranked.size, bool)
        within[order] = np.arange(ranked.size) - starts < m - state.times_sampled[ranked].astype(np.int64)
        fresh = within[accepted.size:]
        accepted = np.concatenate((accepted, slots[fresh]))
        accepted_p = np.concatenate((accepted_p, probabilities[fresh]))
        if accepted.size == n:
            return accepted, accepted_p
        uniq, counts = np.unique(accepted, return_counts=True)
        spent = uniq[counts >= m - state.times_sampled[uniq].astype(np.int64)]
        unlink(spent[state.live(spent)])
        slots, probabilities = sampler.draw(n - accepted.size, rng)
