"""Which requests go out from prepared heads, and the heads this process prepared.

A request that names a bin and nothing else -- but the shared areas a read asks
references to -- and carries no value or one whose description is short is the
same bytes but for its id each time a loop sends it: its head is made once
(:func:`tensorshare.wire.heads.request_head`, the id first as a uint64) and kept
here per verb, bin, areas and value layout, for every sender in the process (both
clients, a relay's upstream connections).  The server reads such a request again
without decoding it (``server/protocol/known.py``).
"""

from __future__ import annotations

from typing import Callable

from ..wire.heads import request_head
from .messages import Command, Key

MAX_HEADS = 1024  # heads kept (then forgotten, all at once)
MAX_DESCRIPTION = 512  # longest value description a head holds (bounds what the heads keep)

_heads: dict = {}  # (command, bin, ref, value description or None, payload bytes) -> its head


def bin_alone(fields: dict | None) -> tuple[str, tuple | None] | None:
    """``(bin, ref)`` when ``fields`` name a bin and nothing else but the areas a read
    asks references to (``ref``: a tuple, or None), else None."""
    if not fields:
        return None
    name = fields.get(Key.BIN)
    if type(name) is not str:
        return None
    if len(fields) == 1:
        return name, None
    ref = fields.get(Key.REF)
    return (name, tuple(ref)) if len(fields) == 2 and type(ref) in (list, tuple) else None


def bin_head(command: Command, name: str, ref: tuple | None = None, description: bytes | None = None,
             nbytes: int = 0, check: Callable[[Command, dict], None] | None = None) -> Callable[[int], bytes] | None:
    """``head(rid)`` of ``command`` naming bin ``name`` (and the areas ``ref``) whose
    value has ``description`` and ``nbytes`` of payload (None, 0: no value); None for
    a description too long to keep.  ``check(command, fields)`` is called before a
    head is made (a sender's own checks of the bin name: they raise)."""
    key = (command, name, ref, description, nbytes)
    head = _heads.get(key)
    if head is None:
        if description is not None and len(description) > MAX_DESCRIPTION:
            return None
        fields = {Key.BIN: name}
        if check is not None:
            check(command, fields)
        fixed = {Key.OP: command.verb, **fields}
        if ref is not None:
            fixed[Key.REF] = list(ref)
        if description is not None:
            fixed[Key.VALUE] = description
        head = request_head(fixed, nbytes)
        if len(_heads) >= MAX_HEADS:
            _heads.clear()
        _heads[key] = head
    return head
