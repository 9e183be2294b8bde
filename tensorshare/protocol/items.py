"""The item table of an ITEMS (226) reply or a relay's INCOMING notification, checked: one parser for every reader.

A frame that carries items names them in its header: ``items`` (each item's
description blob), ``sizes`` (each item's payload bytes) and, for a same-host
reader, ``refs`` (per item, a reference to its files or nil: its bytes are in the
payload), and ``cuda`` (per item, a device reference or nil, where the reader asked
for them, PROTOCOL.md §13.2).  The clients decode values from it, a relay installs copies from it and
hands a GET's items on (PROTOCOL.md §4.3, §10.3, §11).  Torch-free: the server
imports it.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

from ..errors import ProtocolError
from .schema import Key


def item_table(header: dict, payload_len: int) -> list[tuple[Any, int, Any]]:
    """``[(description blob, payload bytes, reference or None), ...]`` of a frame
    carrying items, checked: the items without a reference fill the payload.  A
    reference is ``[area, path]`` (the server's files) or a dict (a device reference)."""
    blobs, sizes = header.get(Key.ITEMS), header.get(Key.SIZES)
    if not (isinstance(blobs, list) and isinstance(sizes, list) and len(blobs) == len(sizes)):
        raise ProtocolError("items reply needs equally long 'items' and 'sizes' lists")
    refs = header.get(Key.REFS)
    if refs is None and Key.CUDA not in header:  # every item in the payload, the usual reply: checked in one loop
        if len(sizes) == 1 and type(sizes[0]) is int and sizes[0] == payload_len:  # (one item: no loop)
            return [(blobs[0], payload_len, None)]
        total = 0
        for size in sizes:
            if type(size) is not int or size < 0:
                total = -1
                break
            total += size
        if total != payload_len:
            raise ProtocolError(f"item sizes {sizes!r} do not add up to the payload's {payload_len} bytes")
        return list(zip(blobs, sizes, repeat(None)))
    if refs is None:
        refs = [None] * len(sizes)
    elif not (isinstance(refs, list) and len(refs) == len(sizes)):
        raise ProtocolError("items reply needs a 'refs' list as long as 'items'")
    cuda = header.get(Key.CUDA)
    if cuda is not None:  # device references (a dict each, PROTOCOL.md §13.2)
        if not (isinstance(cuda, list) and len(cuda) == len(sizes)
                and all(c is None or (type(c) is dict and r is None) for c, r in zip(cuda, refs))):
            raise ProtocolError("items reply needs a 'cuda' list as long as 'items', beside no file reference")
        refs = [r if c is None else c for r, c in zip(refs, cuda)]
    if (not all(type(s) is int and s >= 0 for s in sizes)
            or sum(s for s, ref in zip(sizes, refs) if ref is None) != payload_len):
        raise ProtocolError(f"item sizes {sizes!r} do not add up to the payload's {payload_len} bytes")
    return list(zip(blobs, sizes, refs))


def item_tags(header: dict, count: int) -> list:
    """Each item's tag, from the ``tags`` list a reply carries when asked (§11); None for
    every item when it has none or one of another length."""
    tags = header.get(Key.TAGS)
    return tags if isinstance(tags, list) and len(tags) == count else [None] * count
