"""A table's settings: parsed from a TCREATE's ``spec``, compared, and kept in a durable table's files.

A table is made with a ``spec`` (PROTOCOL.md §12): its capacity, its columns (or
none: a table of items), its sampler and remover and their settings, its rate
limits, and ``meta``, what a client says of its rows, kept and given back as it
came.  :func:`parse_spec` fills in the defaults and refuses what is not a setting;
:func:`fixed` is what cannot change while the table lives (the rate limits can,
with TLIMITS).  A durable table's directory holds ``table.json`` (its name and
settings) and tensordict's ``meta.json`` (:func:`write_files`); :func:`make_table`
makes a table to its settings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import numpy as np

from tensorshare.disk.layout import fsync_dir
from tensorshare.disk.tables import TABLE_RECORD

from tensorshare.errors import StorageFullError

from .tables import MemoryBacking, RateLimiter, Table, TableSpecError, tensordict_metadata
from .tables.table import MAX_CAPACITY
from .tables.columns import parse_columns

# The settings a table is made with: name -> default (PROTOCOL.md §12).
SPEC_DEFAULTS: dict[str, Any] = {
    "capacity": None, "columns": None, "sampler": "uniform", "priority_exponent": 1.0, "remover": "fifo",
    "max_times_sampled": 0, "min_size_to_sample": 1, "samples_per_insert": None, "error_buffer": None,
    "meta": None,
}
# ``meta``: what a client says of the rows (how its values map to columns), kept and
# given back as it came (TINFO), never read by the server: a JSON-able map this large at most.
MAX_META = 64 << 10
LIMIT_KEYS = ("min_size_to_sample", "samples_per_insert", "error_buffer")
# What a slot of a table keeps in memory at most, whatever its columns hold (key,
# priority, count, flags and the samplers' trees over blocks: tables.state_bytes):
# the server's tables have together, by default, as many slots as its memory budget
# holds at this much each (default_max_rows).
STATE_BYTES_PER_ROW = 24


def parse_spec(spec: dict) -> dict:
    """The full settings of a table from a TCREATE's ``spec`` (defaults filled in);
    501 (:class:`TableSpecError`) for an unknown key or a value of the wrong kind."""
    unknown = [k for k in spec if k not in SPEC_DEFAULTS]
    if unknown:
        raise TableSpecError(f"unknown table setting {unknown[0]!r:.60} (known: {', '.join(SPEC_DEFAULTS)})")
    full = {**SPEC_DEFAULTS, **spec}
    capacity = full["capacity"]
    if capacity is None:
        raise TableSpecError("a table needs a capacity")
    if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= MAX_CAPACITY:
        raise TableSpecError(f"capacity must be an int in [1, 2**40], not {capacity!r:.60}")
    eb = full["error_buffer"]
    if isinstance(eb, list):
        full["error_buffer"] = tuple(eb)
    full["columns"] = {s.name: s.as_dict() for s in parse_columns(full["columns"])} or None
    meta = full["meta"]
    if meta is not None:
        try:
            size = len(json.dumps(meta)) if isinstance(meta, dict) else -1
        except (TypeError, ValueError):
            size = -1
        if not 0 <= size <= MAX_META:
            raise TableSpecError(f"meta must be a map of JSON values of at most {MAX_META} bytes")
    return full


def fixed(spec: dict, *but: str) -> dict:
    """The settings of a table that cannot change while it lives (less ``but``)."""
    return {k: v for k, v in spec.items() if k not in LIMIT_KEYS and k not in but}


def column_bytes(columns: dict | None, capacity: int) -> int:
    """The bytes ``capacity`` rows of ``columns`` (``{name: {shape, dtype}}``) take."""
    return capacity * sum(math.prod(c["shape"]) * _width(c["dtype"]) for c in (columns or {}).values())


def default_max_rows(memory_limit: int | None) -> int:
    """The slots all tables of a server may have together when ``--max-table-rows`` is
    not given: what ``memory_limit`` (without one, the machine's memory) holds at
    :data:`STATE_BYTES_PER_ROW` each."""
    budget = physical_memory() if memory_limit is None else memory_limit
    return max(1, budget // STATE_BYTES_PER_ROW)


def physical_memory() -> int:
    """The machine's memory in bytes (16 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def dir_key(name: str) -> str:
    """A table's directory name: names are data, never paths."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def json_spec(full: dict) -> dict:
    """``full`` as ``table.json`` keeps it."""
    spec = dict(full)
    if isinstance(spec["error_buffer"], tuple):
        spec["error_buffer"] = list(spec["error_buffer"])
    return spec


def write_files(directory: str, name: str, spec: dict, columns, capacity: int, tensordict: bool,
                fsync: bool = False) -> None:
    """A durable table's description (blocking: a disk thread): tensordict's
    ``meta.json`` for its columns (``columns``: the table's ColumnSpecs), and
    ``table.json`` (``spec`` as :func:`json_spec` gives it); ``fsync``: on the disk
    before this returns."""
    _write_json(os.path.join(directory, "meta.json"), tensordict_metadata(columns, capacity), fsync)
    saved = {"name": name, "spec": spec}
    if tensordict:
        saved["tensordict"] = True
    _write_json(os.path.join(directory, TABLE_RECORD), saved, fsync)
    if fsync:
        fsync_dir(directory)


def plain(value):
    """``value`` with numpy scalars and tuples made msgpack's plain types; inf as None."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _write_json(path: str, value, fsync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
        if fsync:
            f.flush()
            os.fdatasync(f.fileno())
    os.replace(tmp, path)


def _width(dtype: str) -> int:
    from tensorshare.wire.dtypes import TORCH_WIDTHS

    return TORCH_WIDTHS[dtype]


def check_settings(full: dict) -> None:
    """Raise what :func:`make_table` would raise for the settings ``full`` (501), without
    making a table of their capacity: the engine makes one of a single row with them
    (its rate limits checked apart, as they may need more rows than one)."""
    capacity = full["capacity"]  # (an int in range: parse_spec checked it)
    make_table({**full, "capacity": 1, "min_size_to_sample": 1, "samples_per_insert": None,
                "error_buffer": None}).close()
    min_size = full["min_size_to_sample"]
    RateLimiter(min_size, full["samples_per_insert"], full["error_buffer"])
    if min_size > capacity:
        raise TableSpecError(f"min_size_to_sample {min_size} is above the capacity {capacity}: "
                             f"no sample could ever proceed")


def make_table(full: dict, backing=None) -> Table:
    """A table made to the settings ``full`` (:func:`parse_spec`'s), its columns in
    ``backing`` (None: memory); 452 when there is no memory for it."""
    try:
        return Table(full["capacity"], full["columns"], full["sampler"], full["priority_exponent"],
                     full["remover"], full["max_times_sampled"], full["min_size_to_sample"],
                     full["samples_per_insert"], full["error_buffer"], backing=backing or MemoryBacking())
    except MemoryError:
        raise StorageFullError(f"no memory for a table of {full['capacity']} rows") from None
    except (TypeError, ValueError) as exc:  # a setting of the wrong kind the engine did not name
        raise TableSpecError(f"bad table settings: {exc}") from None
