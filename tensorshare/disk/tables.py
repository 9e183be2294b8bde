"""A table's rows in files: tensordict's memmap layout, the table's settings and each row's slot state.

Both ends use it, torch-free.  The server keeps a durable table's columns so (rows
at their slots, ``[capacity]``); ``Client.save`` of a table writes a *table
checkpoint* so (the rows it held, in slot order, ``[rows]``), and
``Client.load_table`` makes the table again from one::

    table.json           {"name", "spec": the table's settings, "rows": n, "format"}
    meta.json            tensordict's: a tensor [rows, *shape] per column, batch size [rows]
    <column>.memmap      the column's bytes, C order, little-endian
    _slots/<state>.bin   a checkpoint's per-row state: index, key (int64), priority (float64), times_sampled (int64),
                         ends (a byte: 1 where the row ends its episode)

``TensorDict.load_memmap(directory)`` and ``tensorshare.load_memmap(directory)``
open the columns; nothing in the files is ever executed.  A checkpoint is
written under a hidden temporary name and renamed into place whole.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import shutil
import uuid
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..wire.dtypes import TORCH_WIDTHS
from .layout import LayoutError, _TENSORDICT_TYPE, _tensor_meta

TABLE_RECORD = "table.json"
CHECKPOINT_FORMAT = 1
SLOT_STATE = {"index": "<i8", "key": "<i8", "priority": "<f8", "times_sampled": "<i8"}
OPTIONAL_STATE = {"ends": "u1"}  # (a checkpoint written before episode marks has none)


def table_metadata(columns: Iterable, rows: int) -> dict:
    """tensordict's ``meta.json`` for columns (objects with ``name``, ``shape`` and
    ``dtype``, a wire dtype name) of ``rows`` rows: batch size ``[rows]``."""
    meta: dict = {c.name: _tensor_meta([rows, *c.shape], c.dtype) for c in columns}
    meta.update({"shape": [rows], "device": "cpu", "_type": _TENSORDICT_TYPE})
    return meta


@dataclass(frozen=True)
class ColumnFile:
    name: str
    shape: tuple
    dtype: str  # wire dtype name

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * TORCH_WIDTHS[self.dtype]


def columns_of(spec: dict) -> list[ColumnFile]:
    """The columns of a table's settings (``spec["columns"]``), checked."""
    columns = spec.get("columns") or {}
    if not isinstance(columns, dict):
        raise LayoutError("a table checkpoint's columns are not a map")
    out = []
    for name, column in columns.items():
        shape = column.get("shape") if isinstance(column, dict) else None
        dtype = column.get("dtype") if isinstance(column, dict) else None
        if (not isinstance(dtype, str) or dtype not in TORCH_WIDTHS or not isinstance(shape, list)
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise LayoutError(f"a table checkpoint's column {name!r:.60} is not (shape, dtype)")
        if (not isinstance(name, str) or not name or os.sep in name or "\0" in name or name.startswith(".")):
            raise LayoutError(f"a table checkpoint's column name {name!r:.60} is not a file name")
        out.append(ColumnFile(name, tuple(shape), dtype))
    return out


# the settings a table checkpoint may hold (``table_spec``'s), and no other
SPEC_KEYS = frozenset({"capacity", "columns", "sampler", "remover", "max_times_sampled", "min_size_to_sample",
                       "samples_per_insert", "error_buffer", "meta", "priority_exponent"})


def _check_rows(path: str, spec: dict, rows: int, state: dict) -> None:
    """LayoutError unless the checkpoint's settings and rows are ones a server takes:
    known settings, columns, at most ``capacity`` rows at distinct slots in range,
    finite priorities >= 0 (so that a load is not refused halfway, the table it
    replaces already emptied)."""
    unknown = sorted(str(k) for k in spec if k not in SPEC_KEYS)
    if unknown:
        raise LayoutError(f"{path}: a table checkpoint's setting {unknown[0]!r:.60} is not a table's")
    capacity = spec.get("capacity")
    if type(capacity) is not int or capacity < 1 or rows > capacity:
        raise LayoutError(f"{path}: {rows} rows for a capacity of {capacity!r:.60}")
    if not spec.get("columns"):
        raise LayoutError(f"{path}: a table checkpoint holds a table of columns")
    index = np.asarray(state["index"])
    if rows and (index.min() < 0 or index.max() >= capacity or np.unique(index).size != rows):
        raise LayoutError(f"{path}: the rows' slots are not distinct slots of a table of {capacity}")
    priority = np.asarray(state["priority"])
    if rows and not (np.isfinite(priority).all() and (priority >= 0).all()):
        raise LayoutError(f"{path}: a row's priority is not a finite number >= 0")


class CheckpointWriter:
    """Writes a table checkpoint of ``rows`` rows to ``path``: fill :meth:`column`'s
    and :meth:`state`'s arrays, then :meth:`finish` (or :meth:`abort`)."""

    def __init__(self, path: str | os.PathLike, name: str, spec: dict, rows: int, *, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        if os.path.exists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists (overwrite=True replaces it)")
        self.name, self.spec, self.rows = name, spec, rows
        self.columns = columns_of(spec)
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self._tmp = os.path.join(parent, f".{os.path.basename(self.path)}.{uuid.uuid4().hex}.tmp")
        os.makedirs(os.path.join(self._tmp, "_slots"))
        self._arrays: list[np.memmap] = []
        self._files: list[tuple[str, int]] = []  # (path, bytes a row) of each array's file

    def column(self, column: ColumnFile) -> np.ndarray:
        """A writable uint8 ``[rows, row_bytes]`` array backed by the column's file."""
        return self._array(os.path.join(self._tmp, f"{column.name}.memmap"), np.uint8, (self.rows, column.row_bytes))

    def state(self, what: str) -> np.ndarray:
        """A writable ``[rows]`` array of the per-row state ``what`` (a key of SLOT_STATE or OPTIONAL_STATE)."""
        dtype = SLOT_STATE.get(what) or OPTIONAL_STATE[what]
        return self._array(os.path.join(self._tmp, "_slots", f"{what}.bin"), np.dtype(dtype), (self.rows,))

    def _array(self, path: str, dtype, shape: tuple) -> np.ndarray:
        self._files.append((path, math.prod(shape[1:]) * np.dtype(dtype).itemsize))
        if math.prod(shape) == 0:
            open(path, "wb").close()
            return np.zeros(shape, dtype)
        array = np.memmap(path, dtype, "w+", shape=shape)
        self._arrays.append(array)
        return array

    def finish(self, rows: int | None = None) -> None:
        """Write the checkpoint's records and rename it into place; ``rows`` (at most
        the rows it was made for): only its first ``rows`` rows are kept."""
        for array in self._arrays:
            array.flush()
        self._arrays = []
        if rows is not None and rows != self.rows:
            if not 0 <= rows <= self.rows:
                raise ValueError(f"a checkpoint of {self.rows} rows cannot keep {rows}")
            self.rows = rows
            for path, row_bytes in self._files:
                os.truncate(path, rows * row_bytes)
        _write_json(os.path.join(self._tmp, "meta.json"), table_metadata(self.columns, self.rows))
        _write_json(os.path.join(self._tmp, TABLE_RECORD), {"name": self.name, "spec": self.spec, "rows": self.rows,
                                                            "format": CHECKPOINT_FORMAT})
        if os.path.exists(self.path):
            old = self._tmp + ".old"
            os.rename(self.path, old)
            os.rename(self._tmp, self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self._tmp, self.path)

    def abort(self) -> None:
        self._arrays = []
        shutil.rmtree(self._tmp, ignore_errors=True)


@dataclass
class Checkpoint:
    """A table checkpoint, mapped: its name and settings, each column as a read-only
    uint8 ``[rows, row_bytes]`` array, each per-row state as an array."""

    name: str
    spec: dict
    rows: int
    columns: dict[str, tuple[ColumnFile, np.ndarray]]
    state: dict[str, np.ndarray]


def is_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), TABLE_RECORD))


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Map the table checkpoint at ``path`` (copy-on-write); LayoutError if it is not one, or not whole.

    Its files must be regular files in it: a symbolic link (to a file of whoever loads
    the checkpoint, which would be uploaded as a column) is refused, never followed."""
    path = os.fspath(path)
    try:
        with os.fdopen(_open_in(os.path.join(path, TABLE_RECORD)), "r") as f:
            record = json.load(f)
        name, spec, rows = record["name"], record["spec"], record["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LayoutError(f"{path}: not a table checkpoint ({exc})") from None
    if (record.get("format") != CHECKPOINT_FORMAT or type(rows) is not int or rows < 0 or not isinstance(spec, dict)
            or not isinstance(name, str)):
        raise LayoutError(f"{path}: a table checkpoint of another format, or a table's own directory")
    columns = {c.name: (c, _map(os.path.join(path, f"{c.name}.memmap"), np.uint8, (rows, c.row_bytes)))
               for c in columns_of(spec)}
    slots = os.path.join(path, "_slots")
    if not os.path.isdir(slots) or os.path.islink(slots):
        raise LayoutError(f"{slots}: not a directory of the table checkpoint")
    state = {what: _map(os.path.join(slots, f"{what}.bin"), np.dtype(dtype), (rows,))
             for what, dtype in SLOT_STATE.items()}
    for what, dtype in OPTIONAL_STATE.items():
        if os.path.exists(os.path.join(path, "_slots", f"{what}.bin")):
            state[what] = _map(os.path.join(path, "_slots", f"{what}.bin"), np.dtype(dtype), (rows,))
    _check_rows(path, spec, rows, state)
    return Checkpoint(name, spec, rows, columns, state)


def _open_in(path: str) -> int:
    """A descriptor of the regular file ``path`` of a checkpoint, read-only; OSError
    for a symbolic link (ELOOP) or anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # (a FIFO would block the open)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def _map(path: str, dtype, shape: tuple) -> np.ndarray:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    try:
        fd = _open_in(path)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise LayoutError(f"{path}: not a file of the table checkpoint ({why})") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise LayoutError(f"{path}: {size} bytes, {nbytes} expected")
        if nbytes == 0:
            return np.zeros(shape, dtype)
        return np.memmap(f, dtype, "c", shape=shape)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
