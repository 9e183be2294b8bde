"""Column specs, and the arrays that go in and out of a table's columns.

A column has a fixed per-row shape and a wire dtype name (:mod:`tensorshare.wire.dtypes`).
The table stores it as bytes, ``row_bytes`` per row, so dtypes numpy lacks (bfloat16,
float8, complex32) are stored and moved like any other: values go in and come out as
:class:`RawArray` (dtype name, shape, little-endian C-order bytes), as the wire carries
them.  Plain numpy arrays are accepted too, for the dtypes numpy has.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorshare.wire.dtypes import TORCH_WIDTHS

from .errors import ColumnMismatchError, TableSpecError

# Column names become file names (``<name>.memmap``) and tensordict keys: identifiers
# only, a subset of the dict keys tensorshare.disk.layout accepts as file names.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_DIMS = 32  # as the wire allows


@dataclass(frozen=True)
class ColumnSpec:
    """One column: its name, the shape of one row and its wire dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property  # (asked for several times a batch: kept once known)
    def itemsize(self) -> int:
        return TORCH_WIDTHS[self.dtype]

    @functools.cached_property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class RawArray:
    """An array as bytes: wire dtype name, shape, and its little-endian C-order bytes.

    ``data`` is any buffer (bytes, memoryview, numpy array) of exactly
    ``prod(shape) * itemsize`` bytes.  What a table returns holds a uint8 numpy array
    of shape ``[rows, row_bytes]`` there.
    """

    dtype: str
    shape: tuple[int, ...]
    data: Any

    def to_numpy(self) -> np.ndarray:
        """The array as numpy sees it (a view of ``data``); TypeError for a dtype numpy lacks."""
        dt = numpy_dtype(self.dtype)
        if dt is None:
            raise TypeError(f"numpy has no dtype {self.dtype}")
        return np.frombuffer(self.data, np.uint8).view(dt).reshape(self.shape)


def numpy_dtype(name: str) -> np.dtype | None:
    """The little-endian numpy dtype of wire dtype ``name``, or None where numpy has none."""
    if name in ("bfloat16", "complex32") or name.startswith("float8"):
        return None
    return np.dtype(name).newbyteorder("<")


def parse_columns(columns: Mapping[str, Any] | None) -> tuple[ColumnSpec, ...]:
    """Check a table's column specs: ``{name: (shape, dtype)}`` or ``{name: {"shape":, "dtype":}}``."""
    if not columns:
        return ()
    if not isinstance(columns, Mapping):
        raise TableSpecError(f"columns must be a dict of name -> (shape, dtype), not {type(columns).__name__}")
    specs = []
    for name, spec in columns.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise TableSpecError(f"column name {name!r} is not an identifier of at most 128 characters")
        if isinstance(spec, Mapping):
            shape, dtype = spec.get("shape"), spec.get("dtype")
        elif isinstance(spec, (tuple, list)) and len(spec) == 2:
            shape, dtype = spec
        else:
            raise TableSpecError(f"column {name!r}: expected (shape, dtype), got {spec!r}")
        if isinstance(dtype, str) and dtype.startswith("torch."):
            dtype = dtype[len("torch."):]
        if not isinstance(dtype, str) or dtype not in TORCH_WIDTHS:
            raise TableSpecError(f"column {name!r}: unknown dtype {dtype!r}")
        if isinstance(shape, int):
            shape = (shape,)
        if (not isinstance(shape, (tuple, list)) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise TableSpecError(f"column {name!r}: shape must be a tuple of at most {MAX_DIMS} "
                                 f"non-negative ints, not {shape!r}")
        specs.append(ColumnSpec(name, tuple(shape), dtype))
    return tuple(specs)


class MappedRows(np.ndarray):
    """A batch's bytes mapped from a file another process may cut short (a
    same-host writer's, :mod:`server.bins.keptrows`): read them only with system
    calls, where such a file is an error (EFAULT), never a SIGBUS.  Views and
    reshapes keep the type, so a backing that copies rows can tell
    (:attr:`~.backing.MemmapBacking.takes_mapped_rows`)."""


def batch_rows(specs: tuple[ColumnSpec, ...], batch: Mapping[str, Any]) -> tuple[int, list[np.ndarray]]:
    """Check ``batch`` (``{column: RawArray or numpy array}``, rows along the first
    dimension) against the columns; returns the row count and, per column in spec
    order, a uint8 view of shape ``[rows, row_bytes]``."""
    if type(batch) is not dict and not isinstance(batch, Mapping):  # (typing's Mapping took 2-13 us a check)
        raise ColumnMismatchError(f"a batch is a dict of column -> array, not {type(batch).__name__}")
    unknown = [k for k in batch if k not in {s.name for s in specs}]
    if unknown:
        raise ColumnMismatchError(f"no column named {', '.join(map(repr, unknown))} "
                                  f"(columns: {', '.join(s.name for s in specs)})")
    n = None
    views = []
    for spec in specs:
        if spec.name not in batch:
            raise ColumnMismatchError(f"column {spec.name!r} is missing from the batch")
        dtype, shape, data = _parts(spec, batch[spec.name])
        if dtype != spec.dtype:
            raise ColumnMismatchError(f"column {spec.name!r} holds {spec.dtype}, not {dtype}")
        if len(shape) != len(spec.shape) + 1 or tuple(shape[1:]) != spec.shape:
            raise ColumnMismatchError(f"column {spec.name!r}: rows of shape {list(spec.shape)} expected, "
                                      f"got an array of shape {list(shape)}")
        if n is None:
            n = int(shape[0])
        elif shape[0] != n:
            raise ColumnMismatchError(f"column {spec.name!r} has {shape[0]} rows, the batch's other columns {n}")
        if data.nbytes != n * spec.row_bytes:
            raise ColumnMismatchError(f"column {spec.name!r}: {data.nbytes} bytes for {n} rows of "
                                      f"{spec.row_bytes} bytes")
        views.append(data.reshape(n, spec.row_bytes))
    return n, views


def _parts(spec: ColumnSpec, value: Any) -> tuple[str, tuple, np.ndarray]:
    """``(dtype name, shape, flat uint8 array)`` of one column's value in a batch."""
    if isinstance(value, RawArray):
        try:
            flat = np.frombuffer(value.data, np.uint8) if not isinstance(value.data, np.ndarray) \
                else value.data.reshape(-1).view(np.uint8)
        except (TypeError, ValueError) as exc:
            raise ColumnMismatchError(f"column {spec.name!r}: data is not a contiguous buffer: {exc}") from None
        return value.dtype, tuple(value.shape), flat
    if isinstance(value, np.ndarray):
        if value.dtype.byteorder == ">" or value.dtype.kind not in "biufc":
            raise ColumnMismatchError(f"column {spec.name!r}: numpy dtype {value.dtype.str} cannot be stored")
        if value.ndim == 0:
            raise ColumnMismatchError(f"column {spec.name!r}: a batch needs a leading dimension of rows")
        value = np.ascontiguousarray(value)
        return value.dtype.name, value.shape, value.reshape(-1).view(np.uint8)
    raise ColumnMismatchError(f"column {spec.name!r}: expected a RawArray or a numpy array, "
                              f"not {type(value).__name__}")
