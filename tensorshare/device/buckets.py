"""Bucket plans: which bytes of a payload travel together through one staging buffer.

Pure arithmetic (no torch), shared by both directions of the device transfer
engine (:mod:`.engine`):

* :func:`plan` cuts the parts of an outgoing frame into *steps*: a host part sent
  as it is, or a :class:`Bucket` of pieces copied into one pinned buffer.  Device
  parts are always staged; a small host part (alignment padding, a CPU scalar
  tensor) that comes while a bucket is open joins it, so that a state dict of many
  small tensors becomes a few full buckets (one device-to-host copy and one send
  each) instead of one of each per tensor.  Large tensors are split across buckets.
* :func:`windows` and :func:`cut` do the same for a payload arriving into fixed
  windows: which destination ranges each window's bytes belong to.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple, Sequence

PACK = 4096  # host parts up to this size join an open bucket instead of going out on their own


class Piece(NamedTuple):
    """``length`` bytes of part ``part`` from byte ``start``, at byte ``at`` of the bucket."""

    part: int
    start: int
    length: int
    at: int


class Bucket(NamedTuple):
    """Pieces that fill one staging buffer, in payload order (``nbytes`` in all)."""

    pieces: tuple
    nbytes: int


def plan(sizes: Sequence[int], staged: Sequence[bool], bucket: int, pack: int = PACK) -> list:
    """The steps that send parts of ``sizes`` in order: an ``int`` (send part ``i``
    as it is) or a :class:`Bucket` (stage its pieces, send the buffer).  Parts with
    ``staged[i]`` go through buckets of at most ``bucket`` bytes; a host part of at
    most ``pack`` bytes joins an open bucket.  Empty parts are skipped."""
    if bucket <= 0:
        raise ValueError("bucket must be at least one byte")
    steps: list = []
    pieces: list[Piece] = []
    fill = 0
    for i, size in enumerate(sizes):
        if not size:
            continue
        if not staged[i] and not (pieces and size <= pack):
            if pieces:
                steps.append(Bucket(tuple(pieces), fill))
                pieces, fill = [], 0
            steps.append(i)
            continue
        start = 0
        while start < size:
            take = min(size - start, bucket - fill)
            pieces.append(Piece(i, start, take, fill))
            fill += take
            start += take
            if fill == bucket:
                steps.append(Bucket(tuple(pieces), fill))
                pieces, fill = [], 0
    if pieces:
        steps.append(Bucket(tuple(pieces), fill))
    return steps


def windows(nbytes: int, bucket: int) -> list[tuple[int, int]]:
    """``[(start, length), ...]``: the payload's bytes in consecutive windows of at most ``bucket``."""
    if bucket <= 0:
        raise ValueError("bucket must be at least one byte")
    return [(start, min(bucket, nbytes - start)) for start in range(0, nbytes, bucket)]


class Ranges:
    """Disjoint byte ranges of a payload, sorted, each with a destination key:
    :meth:`cut` says which of them a window of the payload touches."""

    def __init__(self, ranges: Sequence[tuple[int, int, object]]):
        ordered = sorted((r for r in ranges if r[1]), key=lambda r: r[0])
        for (start, length, _), (following, _, _) in zip(ordered, ordered[1:]):
            if start + length > following:
                raise ValueError(f"ranges overlap at byte {following}")
        self.ranges = ordered
        self._starts = [r[0] for r in ordered]

    def cut(self, start: int, length: int) -> list[tuple[object, int, int, int]]:
        """``[(key, offset in the range, length, offset in the window), ...]`` for the
        window ``[start, start + length)``; bytes in no range (padding) are left out."""
        end = start + length
        i = max(bisect_right(self._starts, start) - 1, 0)
        out = []
        ranges = self.ranges
        while i < len(ranges):
            r_start, r_length, key = ranges[i]
            if r_start >= end:
                break
            lo, hi = max(start, r_start), min(end, r_start + r_length)
            if lo < hi:
                out.append((key, lo - r_start, hi - lo, lo - start))
            i += 1
        return out


def cut(ranges: Sequence[tuple[int, int, object]], start: int, length: int) -> list:
    """:meth:`Ranges.cut` of a one-off list of ranges."""
    return Ranges(ranges).cut(start, length)
