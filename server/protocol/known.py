"""A connection's usual requests, read again without decoding them.

A client's loop sends the same few requests over and over, each the same bytes but
for its id when the client makes them from a prepared head
(:func:`tensorshare.wire.heads.request_head`).  The first of each is decoded and
checked the general way (:func:`~tensorshare.wire.frames.unpack_header`, the verb's
declared checks, :meth:`~tensorshare.protocol.schema.Command.parse_request`); what
they found -- the verb and the values of its fields -- is remembered under the
head's constant bytes, and a later request with those bytes is made from it
(:meth:`~tensorshare.protocol.schema.Command.again`): one ``struct.unpack`` and a
dict lookup, every check the declaration asks for already passed by the same bytes.
Only the id is read from a known head, and an id of 0 is left to the general way
(which refuses it), as is every request not laid out so, naming a field its verb
does not declare, a release list, or a value that is neither a plain scalar nor a
list of them (the values are shared by every request made from them: a list is
made a tuple), or one the checks refuse.
"""

from __future__ import annotations

from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.protocol.messages import AUTH, ID_MAX, Key
from tensorshare.wire.frames import FrameLimits, unpack_header
from tensorshare.wire.heads import KnownHeads

_SCALARS = frozenset((str, bytes, int, float, bool, type(None)))  # field values a known head may share
_UNSHARED = object()


def _frozen(value):
    """``value`` as every request made from a known head may share it: a scalar as it
    is, a list of scalars (same-host areas a read can map) as a tuple; else _UNSHARED."""
    if type(value) in _SCALARS:
        return value
    if type(value) is list and _SCALARS.issuperset(map(type, value)):
        return tuple(value)
    return _UNSHARED


_SPARE = frozenset((Key.OP, Key.ID))  # keys of every request, not declared per verb


class KnownRequests:
    """The requests of one connection whose heads were seen before (see the module
    docstring); ``verbs``: the session's ``verb -> (command, handler, parser)``,
    ``limits``: its frame limits once authenticated, ``max_bin_name``: its limit
    on bin names."""

    __slots__ = ("_heads", "_verbs", "_limits", "_max_bin_name")

    def __init__(self, verbs: dict, limits: FrameLimits, max_bin_name: int):
        self._heads = KnownHeads()
        self._verbs, self._limits, self._max_bin_name = verbs, limits, max_bin_name

    def read(self, data: bytes, pos: int = 0) -> tuple[tuple, object, int] | None:
        """``(entry, request, stop)`` of the whole request at ``pos`` of ``data`` when
        its head is known, or is one to know and its request is right (``entry``: its
        verb's entry in ``verbs``; the request ends at ``stop``), else None: the
        general way reads it."""
        known = self._heads.read(data, pos)
        if known is None:
            known = self._learn(data, pos)
            if known is None:
                return None
        (entry, values), rid, body, stop = known
        command, payload_len = entry[0], stop - body
        payload = None if not command.payload else [data[body:stop]] if payload_len else []
        return entry, command.again(values, rid, payload, payload_len), stop

    def _learn(self, data: bytes, pos: int) -> tuple | None:
        """:meth:`KnownHeads.read`'s answer for the frame at ``pos`` when it is laid
        out as a prepared head and its request is one to remember (see the module
        docstring), now remembered; None otherwise."""
        heads = self._heads
        candidate = heads.candidate(data, pos, self._limits)
        if candidate is None:
            return None
        raw, body, stop = candidate
        try:
            header = unpack_header(raw, self._limits)
        except ProtocolError:
            return None
        op, rid = header.get(Key.OP), header.get(Key.ID)
        entry = self._verbs.get(op) if type(op) is str else None
        if entry is None or entry[0] is AUTH or type(rid) is not int or not 0 < rid <= ID_MAX:
            return None
        command = entry[0]
        if Key.RELEASE in header or not (command.keys | _SPARE).issuperset(header):
            return None
        try:
            request = command.parse_request(header, rid, None, stop - body, self._max_bin_name)
        except RemoteError:
            return None
        values = tuple(map(_frozen, command.fields_of(request)))
        if _UNSHARED in values:
            return None
        heads.learn(data, pos, (entry, values))
        return (entry, values), rid, body, stop
