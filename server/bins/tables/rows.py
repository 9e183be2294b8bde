"""What a table's operations hand back: rows read or sampled, rows written, rows removed.

:class:`Rows` and :class:`Sample` carry the values of the rows handed out (columns
gathered into ``[n, *shape]`` arrays, or a table of items' items), gathered into new
memory or into the caller's buffers (:func:`out_buffer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import compiled
from .columns import ColumnSpec, RawArray
from .errors import ColumnMismatchError

EMPTY = np.zeros(0, np.int64)


@dataclass
class Removed:
    """Rows that left the table: their keys, and for a table of items the items (the
    caller may release what they hold)."""

    keys: np.ndarray = field(default_factory=lambda: EMPTY)
    items: list | None = None


@dataclass
class Written:
    """What an insert or a write did: the new rows' keys and slot indices, and the rows
    that left to make room (or were overwritten)."""

    keys: np.ndarray
    indices: np.ndarray
    removed: Removed


@dataclass
class Rows:
    """Rows read back (or sampled): per row its key, slot index, priority and how many
    times it has been sampled, and its values: ``values`` (``{column: RawArray}`` of
    ``[n, *shape]``) for a table of columns, ``items`` (a list) for a table of items."""

    keys: np.ndarray
    indices: np.ndarray
    priorities: np.ndarray | None  # (None: not asked for, see Table.sample)
    times_sampled: np.ndarray | None
    values: dict[str, RawArray] | None
    items: list | None


@dataclass
class Sample(Rows):
    """A sample: :class:`Rows` plus each row's probability of being drawn, the table's
    size when sampled, and the rows it removed (those that reached
    ``max_times_sampled``, after their values were taken).  A sample of sequences
    has ``n * length`` rows, a probability per sequence (its start's) and each
    sequence's real ``lengths`` (shorter when padded)."""

    probabilities: np.ndarray = field(default_factory=lambda: np.zeros(0))
    table_size: int = 0
    removed: Removed = field(default_factory=Removed)
    lengths: np.ndarray | None = None


def out_buffer(given, n: int, spec: ColumnSpec) -> np.ndarray:
    """A ``[n, row_bytes]`` uint8 view of the start of the caller's buffer ``given``."""
    try:
        flat = given.reshape(-1).view(np.uint8) if isinstance(given, np.ndarray) and given.flags.c_contiguous \
            else np.frombuffer(given, np.uint8)
    except (TypeError, ValueError) as exc:
        raise ColumnMismatchError(f"out[{spec.name!r}] is not a contiguous buffer: {exc}") from None
    need = n * spec.row_bytes
    if flat.size < need or not flat.flags.writeable:
        raise ColumnMismatchError(f"out[{spec.name!r}] must be a writable buffer of at least {need} bytes")
    return flat[:need].reshape(n, spec.row_bytes)


def take_rows(column: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """Rows ``slots`` (int64, valid) of ``column`` (``[rows, row_bytes]`` uint8,
    C-contiguous, in memory or mapped) into ``out`` (``[n, row_bytes]``): compiled,
    with each row asked of memory ahead of its copy, where the loops are built."""
    loops = compiled.loops
    if loops is not None and column.shape[1] and column.flags.c_contiguous and out.flags.c_contiguous:
        loops.gather(column, column.shape[1], slots, out)
    else:  # mode="clip": the slots are valid, and "raise" would gather into a temporary first
        np.take(column, slots, axis=0, out=out, mode="clip")


def out_buffers(columns: tuple[ColumnSpec, ...] | None, out, n: int) -> list[np.ndarray] | None:
    """Per column, a ``[n, row_bytes]`` uint8 array to gather ``n`` rows into: a view
    of the caller's ``out[column]``, or a new one (None for a table of items)."""
    if columns is None:
        return None
    if out is not None:
        unknown = [name for name in out if name not in {spec.name for spec in columns}]
        if unknown:
            raise ColumnMismatchError(f"out names no column {unknown[0]!r}")
    buffers = []
    for spec in columns:
        given = None if out is None else out.get(spec.name)
        buffers.append(np.empty((n, spec.row_bytes), np.uint8) if given is None else out_buffer(given, n, spec))
    return buffers
