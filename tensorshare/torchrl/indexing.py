"""TorchRL's indices into a storage as the table's slots: which elements, and the shape they come back in.

A storage of ``ndim`` dimensions is a grid ``[rows along dim 0, *inner]`` of
elements, each one slot of the table (slot ``i0 * prod(inner) + ...``, C order).
TorchRL indexes it as a tensor is indexed: an int, a slice, a sequence, a mask or
a tensor along the first dimension, or a tuple of those across the dimensions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import UsageError


def slots(index: Any, grid: tuple[int, ...]) -> tuple[torch.Tensor, tuple]:
    """The flat slots (int64) ``index`` selects in a storage whose elements form
    ``grid`` (its first dimension as long as the storage holds, or its capacity),
    and the leading shape of the result (``()``: one element)."""
    index = _plain(index)
    if len(grid) == 1:  # the usual case, without a grid of every slot
        return _along_one(index, grid[0])
    flat = torch.arange(math.prod(grid), dtype=torch.int64).reshape(grid)
    try:
        chosen = flat[index]
    except (IndexError, TypeError, RuntimeError) as exc:
        raise IndexError(f"index {index!r:.80} does not fit a storage of shape {list(grid)}: {exc}") from None
    return chosen.reshape(-1), tuple(chosen.shape)


def _along_one(index: Any, n: int) -> tuple[torch.Tensor, tuple]:
    if isinstance(index, int):
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a storage of {n} elements")
        return torch.tensor([index % n]), ()
    if isinstance(index, slice):
        chosen = torch.arange(*index.indices(n))
        return chosen, (chosen.numel(),)
    if isinstance(index, tuple):
        if len(index) != 1:
            raise IndexError(f"index {index!r:.80} has {len(index)} dimensions, the storage 1")
        return _along_one(index[0], n)
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        if index.shape != (n,):
            raise IndexError(f"a mask of shape {list(index.shape)} for a storage of {n} elements")
        chosen = index.nonzero().reshape(-1)
        return chosen, (chosen.numel(),)
    if index.dtype.is_floating_point or index.dtype.is_complex:
        raise IndexError(f"indices must be integers, not {index.dtype}")
    index = index.to(torch.int64)
    if index.numel() and (index.min() < -n or index.max() >= n):
        raise IndexError(f"index {int(index.max() if index.max() >= n else index.min())} is out of range "
                         f"for a storage of {n} elements")
    return torch.remainder(index, max(n, 1)).reshape(-1), tuple(index.shape)


def _plain(index: Any) -> Any:
    """Indices as ints, slices, tensors (numpy arrays, lists and ranges become tensors)."""
    if isinstance(index, (bool, np.bool_)):
        raise UsageError("a storage is not indexed by a bool")
    if isinstance(index, (int, np.integer)):
        return int(index)
    if isinstance(index, torch.Tensor) and index.ndim == 0 and not index.dtype.is_floating_point \
            and index.dtype != torch.bool:
        return int(index)
    if isinstance(index, range):
        return torch.arange(index.start, index.stop, index.step)
    if isinstance(index, np.ndarray):
        return torch.from_numpy(index)
    if isinstance(index, list):
        return torch.as_tensor(index)
    if isinstance(index, tuple):
        return tuple(_plain(i) if not isinstance(i, slice) and i is not None and i is not Ellipsis else i
                     for i in index)
    return index


def last_wins(slots: torch.Tensor) -> torch.Tensor:
    """Positions in ``slots`` to keep so that each slot is written once, by its last
    occurrence (as writing in order would leave it), in their order."""
    if slots.numel() < 2:
        return torch.arange(slots.numel())
    unique, inverse = torch.unique(slots, return_inverse=True)
    if unique.numel() == slots.numel():
        return torch.arange(slots.numel())
    last = torch.full((unique.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(slots.numel()), "amax")
    return last.sort().values
