"""Which requests go out from prepared heads, and the heads this process prepared.

A request that names a bin and otherwise only the shared areas a read asks
references to, or scalar fields (an item's tag; an RL worker's bound and wait), and
carries no value or one whose description is short, is the same bytes but for its
id each time a loop sends it: its head is made once
(:func:`tensorshare.wire.heads.request_head`, the id first as a uint64) and kept
here per verb, bin, fields and value layout, for every sender in the process (both
clients, a relay's upstream connections).  The server reads such a request again
without decoding it (``server/protocol/known.py``).

Scalar fields get a head only once the same ones come twice in a row for the same
request (an RL worker's rollouts carry the version of the parameters it holds, the
same for many of them): a tag that changes with every request (a step count) would
make a head for each, and the server would learn each one only to forget it.
"""

from __future__ import annotations

from typing import Callable

from ..wire.heads import request_head
from .messages import Command, Key

MAX_HEADS = 1024  # heads kept (then forgotten, all at once)
MAX_DESCRIPTION = 512  # longest value description a head holds (bounds what the heads keep)

_heads: dict = {}  # (command, bin, fields, value description or None, payload bytes) -> its head
_last_fields: dict = {}  # (command, bin, value description or None, payload bytes) -> the scalar fields it last had
_SCALARS = (str, int, float, bool)  # field values a head may hold


def bin_alone(fields: dict | None) -> tuple[str, tuple] | None:
    """``(bin, extra)`` when ``fields`` name a bin and besides it only fields a head
    may hold -- the areas a read asks references to, scalars --, else None.  ``extra``:
    ``(key, type, value)`` of each of those in key order (the areas as a tuple; the
    type, so that ``1`` and ``True`` are different heads), ``()`` for none.  The
    caller has checked them (:func:`~tensorshare._client.connection.check_fields`)."""
    if not fields:
        return None
    name = fields.get(Key.BIN)
    if type(name) is not str:
        return None
    if len(fields) == 1:
        return name, ()
    extra = []
    for key, value in fields.items():
        kind = type(value)
        if key == Key.BIN:
            continue
        if kind in _SCALARS:
            extra.append((key, kind, value))
        elif key == Key.REF and kind in (list, tuple) and all(type(x) is int for x in value):
            extra.append((key, tuple, tuple(value)))
        else:
            return None
    extra.sort()
    return name, tuple(extra)


def ref_fields(ref: tuple | None) -> tuple:
    """:func:`bin_alone`'s ``extra`` of a read asking references to the areas ``ref`` (None: none)."""
    return () if ref is None else ((Key.REF, tuple, ref),)


def bin_head(command: Command, name: str, extra: tuple = (), description: bytes | None = None,
             nbytes: int = 0, check: Callable[[Command, dict], None] | None = None) -> Callable[[int], bytes] | None:
    """``head(rid)`` of ``command`` naming bin ``name`` with the fields ``extra``
    (:func:`bin_alone`'s) whose value has ``description`` and ``nbytes`` of payload
    (None, 0: no value); None for a description too long to keep, or scalar fields
    not seen on the last such request (see the module docstring).  ``check(command,
    fields)`` is called before a head is made (a sender's own checks of the bin name:
    they raise)."""
    key = (command, name, extra, description, nbytes)
    head = _heads.get(key)
    if head is None:
        if description is not None and len(description) > MAX_DESCRIPTION:
            return None
        if len(extra) > 1 or extra and extra[0][0] != Key.REF:  # scalars: a head once seen twice in a row
            last = (command, name, description, nbytes)
            if _last_fields.get(last) != extra:
                if len(_last_fields) >= MAX_HEADS:
                    _last_fields.clear()
                _last_fields[last] = extra
                return None
        fields = {Key.BIN: name}
        if check is not None:
            check(command, fields)
        fixed = {Key.OP: command.verb, **fields}
        for field, kind, value in extra:
            fixed[field] = list(value) if kind is tuple else value
        if description is not None:
            fixed[Key.VALUE] = description
        head = request_head(fixed, nbytes)
        if len(_heads) >= MAX_HEADS:
            _heads.clear()
        _heads[key] = head
    return head
