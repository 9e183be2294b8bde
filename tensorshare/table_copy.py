"""A table's rows copied whole: read page by page, written to a table checkpoint, made again from one.

``Client.save`` of a table writes its checkpoint (:mod:`tensorshare.disk.tables`:
tensordict's memmap layout, the table's settings and each row's slot, key,
priority and sample count); ``Client.load_table`` makes the table again from one,
each row at its slot with its priority, episode mark and sample count (so that
``max_times_sampled`` counts on from where it was), written in the order of the
rows' keys so that they keep their age.  Rows
are read in pieces of about :data:`PIECE` bytes, so a table larger than memory is
copied in the memory of one piece.  A row that changes while a copy is made (replaced
by an insert, sampled out) is left out of it, and every row in it is whole; pause the
writers for an exact copy.  A checkpoint's settings and rows are checked before the
table it replaces is touched (:func:`~tensorshare.disk.tables.read_checkpoint`).

The client's ``TableCopies`` (``tensorshare/_client/table_copy.py``) gives ``Client``
those two methods; ``AsyncClient.load_table`` runs the same steps (:func:`loading`)
with Deferreds; TorchRL's storage, the command line tool and checkpoints use the rest.
"""

from __future__ import annotations

from typing import Any, Generator, Iterator

import numpy as np
import torch

from .disk.tables import CheckpointWriter, read_checkpoint
from .errors import UsageError

PIECE = 32 << 20  # bytes of rows per read


def table_spec(info: dict) -> dict:
    """``create_table``'s keywords for a table like the one ``info`` (``table_info``) describes."""
    limiter = info.get("rate_limiter") or {}
    spec = {"capacity": info["capacity"], "columns": info.get("columns"), "sampler": info["sampler"],
            "remover": info["remover"], "max_times_sampled": info["max_times_sampled"],
            "min_size_to_sample": limiter.get("min_size_to_sample", 1),
            "samples_per_insert": limiter.get("samples_per_insert"), "error_buffer": limiter.get("error_buffer"),
            "meta": info.get("meta")}
    if info.get("priority_exponent") is not None:
        spec["priority_exponent"] = info["priority_exponent"]
    return spec


def occupied(client, name: str, capacity: int | None = None) -> dict[str, torch.Tensor]:
    """Every row's ``indices`` (slot order), ``keys``, ``priorities``, ``times_sampled``
    and ``ends``: where no sequence runs past a row, because its episode ends (a
    server without episode marks: none) or, given the table's ``capacity``, because
    the row in the next slot does not follow it in the table's stream (PROTOCOL.md
    §12.6), but for the newest row (the next insert follows it, in a copy as in the
    table).  Rows written back in the order of their keys (:func:`write_rows`) keep
    their age order, and so form the same sequences: once rows between two have
    left, the two are marked apart."""
    pages, start = [], 0
    while start is not None:
        page = client.table_info(name, slots=start)["slots"]
        page.setdefault("ends", torch.zeros(page["indices"].numel(), dtype=torch.bool))
        pages.append(page)
        start = page["next"]
    state = {what: torch.cat([page[what] for page in pages]) for what in ("indices", "keys", "priorities",
                                                                           "times_sampled", "ends")}
    if capacity is not None and state["indices"].numel():
        index, seq = state["indices"], state["keys"] // capacity
        follows = ((index + 1) % capacity == index.roll(-1)) & (seq.roll(-1) == seq + 1)
        follows[state["keys"].argmax()] = True
        state["ends"] = state["ends"] | ~follows
    return state


def pieces(client, name: str, indices: torch.Tensor, keys: torch.Tensor,
           row_bytes: int) -> Iterator[tuple[int, int, dict, torch.Tensor]]:
    """``(start, stop, {column: tensor}, same)``: of the rows :func:`occupied` found at
    ``indices[start:stop]`` with ``keys``, those still there (``same``, a mask over the
    piece) and their columns, a piece at a time.  A row that left meanwhile, or was
    replaced by another, is left out: every row given is whole, its state the one
    ``keys`` came with (rows change while a copy is made: TINSERT, a sample's
    ``max_times_sampled``)."""
    step = max(1, PIECE // max(row_bytes, 1))
    for start in range(0, indices.numel(), step):
        stop = min(start + step, indices.numel())
        values, same = _read_still_held(client, name, indices[start:stop], keys[start:stop])
        yield start, stop, values, same


def _read_still_held(client, name: str, indices: torch.Tensor, keys: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The rows at ``indices`` that still have ``keys``: their columns and a mask of
    which (a slot emptied since reads as key -1, ``read(..., empty=True)``: left out too)."""
    values, found = client.read(name, indices, with_keys=True, empty=True)
    same = found == keys
    if bool(same.all()):  # (the usual case: no copy of the piece's columns)
        return values, same
    return {column: tensor[same] for column, tensor in values.items()}, same


def save_table(client, name: str, path, *, overwrite: bool = False) -> int:
    """Write table ``name``'s rows and settings to the checkpoint directory ``path``;
    returns how many rows."""
    info = client.table_info(name)
    if not info.get("columns"):
        raise UsageError(f"table {name!r} holds items, not columns: only tables of columns are saved")
    spec = table_spec(info)
    state = occupied(client, name, info["capacity"])
    writer = CheckpointWriter(path, name, spec, int(state["indices"].numel()), overwrite=overwrite)
    try:
        arrays = {key: writer.state(what) for what, key in (("index", "indices"), ("key", "keys"),
                                                            ("priority", "priorities"),
                                                            ("times_sampled", "times_sampled"), ("ends", "ends"))}
        files = {c.name: (c, writer.column(c)) for c in writer.columns}
        row_bytes = sum(c.row_bytes for c in writer.columns)
        rows = 0  # rows written: those that changed while the copy was made are left out
        for start, stop, values, same in pieces(client, name, state["indices"], state["keys"], row_bytes):
            n = int(same.sum())
            for key, array in arrays.items():
                array[rows:rows + n] = state[key][start:stop][same].numpy()
            for column, (spec_, array) in files.items():
                array[rows:rows + n] = _bytes(values[column]).reshape(n, spec_.row_bytes)
            rows += n
        writer.finish(rows)
    except BaseException:
        writer.abort()
        raise
    return rows


def load_table(client, path, name: str | None = None, *, replace: bool = True) -> int:
    """Make table ``name`` (the saved table's name by default) from the checkpoint at
    ``path``: the same settings, each row at its slot with its priority and sample count.  A table
    already there is replaced once the server has accepted the checkpoint's settings
    (a refusal leaves it as it was; ``replace=False``: refused instead).  Returns how
    many rows.  (The blocking client's; the AsyncClient runs :func:`loading` as
    inlineCallbacks.)"""
    steps = loading(client, path, name, replace)
    result = None
    while True:  # each step is a call's result: hand it back
        try:
            result = steps.send(result)
        except StopIteration as done:
            return done.value


def loading(client, path, name: str | None, replace: bool) -> Generator[Any, Any, int]:
    """The calls of :func:`load_table`, each yielded: a blocking client's results are
    sent back as they are, an AsyncClient's Deferreds by ``inlineCallbacks``."""
    checkpoint = read_checkpoint(path)
    name = checkpoint.name if name is None else name
    if not replace and name in (yield client.list()):
        raise UsageError(f"{name!r} exists (replace=True replaces it)")
    state = checkpoint.state
    yield client.create_table(name, replace=True, **checkpoint.spec)
    for indices, columns, priorities, ends, counts in row_pieces(
            state["index"], _columns(checkpoint), state["priority"], state.get("ends"), state["key"],
            state.get("times_sampled")):
        yield client.write(name, indices, columns, priorities, ends=ends, times_sampled=counts)
    return checkpoint.rows


def write_rows(client, name: str, indices, columns: dict[str, torch.Tensor], priorities=None, ends=None,
               keys=None, times_sampled=None) -> None:
    """Write rows at their slot ``indices`` (with their ``priorities``, episode ``ends``
    and sample counts), a piece at a time, in the order of their old ``keys`` if given."""
    for indices, columns, priorities, ends, counts in row_pieces(indices, columns, priorities, ends, keys,
                                                                 times_sampled):
        client.write(name, indices, columns, priorities, ends=ends, times_sampled=counts)


def row_pieces(indices, columns: dict[str, torch.Tensor], priorities=None, ends=None, keys=None,
               times_sampled=None) -> Iterator[tuple]:
    """``(indices, columns, priorities, ends, times_sampled)`` of about :data:`PIECE`
    bytes of rows each (None for what was not given); with the rows' old ``keys``, in
    their order: the table gives keys in the order rows are written, so the rows keep
    their age (a fifo table removes, and a fifo sampler draws, the oldest first, as
    before)."""
    indices = torch.as_tensor(np.asarray(indices), dtype=torch.int64)
    n = indices.numel()
    if not n:
        return
    order = None
    if keys is not None:
        keys = np.asarray(keys)
        if not (keys[1:] > keys[:-1]).all():  # (in order already, as a table not yet wrapped is: slices)
            order = np.argsort(keys, kind="stable")
    row_bytes = sum(t[:1].numel() * t.element_size() for t in columns.values())
    step = max(1, PIECE // max(row_bytes, 1))
    for start in range(0, n, step):
        stop = min(start + step, n)
        part = slice(start, stop) if order is None else order[start:stop]
        rows = part if order is None else torch.from_numpy(part)
        yield (indices[rows], {k: v[rows] for k, v in columns.items()},
               None if priorities is None else torch.as_tensor(np.asarray(priorities)[part]),
               None if ends is None else np.asarray(ends)[part],
               None if times_sampled is None else np.asarray(times_sampled)[part])


def mapped_columns(path) -> dict[str, torch.Tensor]:
    """A checkpoint's columns as tensors ``[rows, *shape]`` mapping its files (copy-on-write)."""
    return _columns(read_checkpoint(path))


def _columns(checkpoint) -> dict[str, torch.Tensor]:
    return {name: _tensor(array, column.shape, column.dtype, checkpoint.rows)
            for name, (column, array) in checkpoint.columns.items()}


def _tensor(array: np.ndarray, shape: tuple, dtype: str, rows: int) -> torch.Tensor:
    flat = torch.from_numpy(np.asarray(array).reshape(-1)) if array.size else torch.zeros(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(rows, *shape)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


__all__ = ["save_table", "load_table", "loading", "row_pieces", "occupied", "pieces", "write_rows", "table_spec", "mapped_columns"]
