"""Sequences: ``n`` runs of ``length`` consecutive rows, drawn by their first row.

A table's rows are a stream: the row after the one at slot ``s`` is the one at slot
``s + 1`` (the next slot, modulo the capacity, as a ring buffer fills) when it was
inserted right after it (its seq is the next), and no row follows one marked as
ending its episode (``END``).  A *sequence* is ``length`` rows so following each
other, named by its first row: its *start*.

Starts are drawn by the table's sampler, and a start whose run is shorter than
``length`` is drawn again (rejection), so that every start of a whole sequence is
as likely as the sampler makes its row: uniform over the sequences there are, or
in proportion to the start row's priority (*the sequence's priority*: a learner
sets it with the start's key, as R2D2 sets one priority per sequence).  With
``pad``, every row is a start: a run cut short by an episode's end (or by the
stream's) is padded with its last row, as TorchRL's ``SliceSampler(pad_output=True)``
does, and its real length comes back.  Nothing here is proportional to the table's
size: a draw costs ``n * length`` look-ups per round, whatever the rows held.
"""

from __future__ import annotations

import numpy as np

from .errors import EmptyTableError
from .slots import END, LIVE, Slots

MAX_DRAWN = 64  # starts drawn per sequence asked for, at most, before giving up


def runs(state: Slots, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(run, slots)``: for each of ``starts``, how many of the ``length`` rows from it
    follow each other (:mod:`this module <.sequences>`), and the ``[len(starts),
    length]`` slots they would be in."""
    steps = np.arange(length, dtype=np.int64)
    slots = (starts[:, None] + steps) % state.capacity
    seqs = state.key[slots] // state.capacity  # (an empty slot's key, -1, gives -1)
    flags = state.flags[slots]
    follows = ((flags & LIVE) != 0) & (seqs == seqs[:, :1] + steps)
    follows[:, 1:] &= (flags[:, :-1] & END) == 0
    return np.logical_and.accumulate(follows, axis=1).sum(axis=1), slots


def draw(sampler, state: Slots, n: int, length: int, pad: bool,
         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` sequences: ``(slots [n * length], probability of each start [n], real
    length of each [n])``; a padded sequence repeats its last row's slot.  Raises
    :class:`EmptyTableError` when ``MAX_DRAWN * n`` starts gave fewer whole ones."""
    need = length if not pad else 1
    taken, chances, lengths = [], [], []
    got, drawn, rate = 0, 0, 1.0
    while got < n:
        want = n - got
        k = min(int(want / rate) + 8, MAX_DRAWN * n - drawn) if drawn else want
        if k <= 0:
            raise EmptyTableError(f"no sequence of {length} rows among {drawn} starts drawn (episodes shorter "
                                  f"than {length} rows? pad=True draws them padded)")
        starts, probabilities = sampler.draw(k, rng)
        drawn += k
        run, slots = runs(state, starts, length)
        whole = np.flatnonzero(run >= need)[:want]
        taken.append(slots[whole])
        chances.append(probabilities[whole])
        lengths.append(run[whole])
        got += whole.size
        rate = max(got / drawn, 1.0 / MAX_DRAWN)
    slots, run = np.concatenate(taken), np.concatenate(lengths)
    if pad:  # past its run, a sequence repeats its last row
        steps = np.minimum(np.arange(length), run[:, None] - 1)
        slots = np.take_along_axis(slots, steps, axis=1)
    return slots.reshape(-1), np.concatenate(chances), np.minimum(run, length)
