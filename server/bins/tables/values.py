"""Table rows <-> the wire's value format, without torch.

An insert or write carries one value (PROTOCOL.md "Value description"): for a
table of columns, a map of column name to array whose first dimension is the rows.
:func:`columns_of` checks its description against the payload and gives the
arrays as :class:`~.columns.RawArray` views of the received bytes, for
:meth:`~.table.Table.insert`.  A sample or read goes back as one value of the same
shape, ``{column: [n, *shape]}``: :func:`gather_target` lays out its payload (each
column at its aligned offset in one buffer, which the table gathers into) and
writes its description.  Keys, indices and probabilities travel beside it as
little-endian byte strings (:func:`int64_bytes`, :func:`float64_bytes`).
"""

from __future__ import annotations

from functools import lru_cache

import msgpack
import numpy as np

from tensorshare.errors import BadRequestError, ProtocolError
from tensorshare.wire.description import (
    EXT_ARRAY, KIND_TORCH, DecodeLimits, _ArrayRef, align_up, parse_description,
)

from .columns import ColumnSpec, RawArray


def payload_array(segments, nbytes: int) -> np.ndarray:
    """The payload as one contiguous uint8 array: a view of a lone segment, else one copy."""
    if not nbytes:
        return np.zeros(0, np.uint8)
    if len(segments) == 1:
        return np.frombuffer(segments[0], np.uint8)
    out = np.empty(nbytes, np.uint8)
    at = 0
    for segment in segments:
        n = len(segment)
        out[at:at + n] = np.frombuffer(segment, np.uint8)
        at += n
    return out


def columns_of(blob: bytes, segments, nbytes: int, limits: DecodeLimits) -> dict[str, RawArray]:
    """``{column: RawArray}`` of a value that is a map of column names to arrays
    (501 for anything else); the arrays view the payload."""
    desc = column_value(blob, nbytes, limits)
    payload = payload_array(segments, nbytes)
    return {name: RawArray(spec.dtype, spec.shape, payload[spec.offset:spec.offset + spec.nbytes])
            for name, _index, spec in _columns(desc)}


def columns_in(desc, arrays) -> dict[str, RawArray]:
    """``{column: RawArray}`` of a value :func:`column_value` accepted, whose arrays are
    ``arrays`` (one buffer per array of the description, in its order: the files a
    same-host client wrote, PROTOCOL.md §10.4)."""
    return {name: RawArray(spec.dtype, spec.shape, arrays[index]) for name, index, spec in _columns(desc)}


def column_value(blob: bytes, nbytes: int, limits: DecodeLimits):
    """The parsed description of a value that is a map of column names to arrays (501
    for anything else)."""
    try:
        desc = parse_description(blob, nbytes, limits)
    except ProtocolError as exc:
        raise BadRequestError(f"bad value: {exc}") from None
    tree = desc.tree
    if type(tree) is not dict or not all(type(v) is _ArrayRef for v in tree.values()):
        raise BadRequestError("a table of columns takes a dict of column name -> tensor (rows first)")
    return desc


def _columns(desc):
    """``(column name, array index, array spec)`` of each column of a :func:`column_value`."""
    arrays = desc.arrays
    return [(name, ref.index, arrays[ref.index]) for name, ref in desc.tree.items()]


class Gathered:
    """The value of ``n`` rows of every column, ready to send: its description, and
    ``out`` (per column, where the table gathers into) inside one ``buffer``."""

    __slots__ = ("description", "buffer", "out", "nbytes")

    def __init__(self, specs: tuple[ColumnSpec, ...], n: int, take=None):
        self.description, spans, self.nbytes = _reply_layout(specs, n)
        # A buffer a recycler hands out again (``take(nbytes)``: pages already touched,
        # no faults while gathering), else fresh memory.
        reused = take(self.nbytes) if take is not None and self.nbytes else None
        buffer = self.buffer = np.empty(self.nbytes, np.uint8) if reused is None else np.frombuffer(reused, np.uint8)
        self.out = {name: buffer[start:start + size] for name, start, size in spans}


@lru_cache(maxsize=256)
def _reply_layout(specs: tuple[ColumnSpec, ...], n: int) -> tuple[bytes, tuple, int]:
    """``(description, spans, nbytes)`` of the value of ``n`` rows of ``specs``: the
    same for every sample of a size from a table, so made once (a learner samples
    the same size over and over: 15 us of a sample's server time, per sample)."""
    table, refs = [], {}
    spans = _layout(specs, n)
    for i, (spec, (_name, offset, size)) in enumerate(zip(specs, spans)):
        table.append([KIND_TORCH, spec.dtype, [n, *spec.shape], offset, size])
        refs[spec.name] = msgpack.ExtType(EXT_ARRAY, i.to_bytes(4, "little"))
    nbytes = gathered_bytes(specs, n)
    return msgpack.packb({"v": refs, "t": table, "n": nbytes}, use_bin_type=True), tuple(spans), nbytes


def _layout(specs: tuple[ColumnSpec, ...], n: int) -> list[tuple[str, int, int]]:
    """``(column, offset, size)`` of each column's ``n`` rows in a gathered buffer."""
    spans, offset = [], 0
    for spec in specs:
        offset = align_up(offset)
        size = n * spec.row_bytes
        spans.append((spec.name, offset, size))
        offset += size
    return spans


def gathered_bytes(specs: tuple[ColumnSpec, ...], n: int) -> int:
    """The size of the buffer ``n`` rows of ``specs`` are gathered into (a reply's payload)."""
    if not specs:
        return 0
    _name, offset, size = _layout(specs, n)[-1]
    return align_up(offset + size)


def int64_bytes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, "<i8").tobytes()


def float64_bytes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, "<f8").tobytes()


def int64_array(blob: bytes, what: str) -> np.ndarray:
    """The little-endian int64s of ``blob`` (501 if its length is not a multiple of 8)."""
    if len(blob) % 8:
        raise BadRequestError(f"{what} must be little-endian int64s: {len(blob)} bytes")
    return np.frombuffer(blob, "<i8")


def float64_array(blob: bytes, what: str) -> np.ndarray:
    """The little-endian float64s of ``blob`` (501 if its length is not a multiple of 8)."""
    if len(blob) % 8:
        raise BadRequestError(f"{what} must be little-endian float64s: {len(blob)} bytes")
    return np.frombuffer(blob, "<f8")
