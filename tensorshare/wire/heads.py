"""Prepared request heads: the frame head of a request whose id is the one part that changes.

Most requests of a loop are alike: the same verb on the same bin, the same value
layout, only the request id new.  :func:`request_head` makes the head of such a
request once (a msgpack map whose first entry is the id, as a uint64, followed by
the fixed fields); each request is then one ``struct.pack``.  The frame is an
ordinary one: every decoder reads the same header from it (map order means nothing
in a header).

:class:`KnownHeads` is the other end: a receiver that has once decoded and accepted
a head of that layout remembers what it found under the head's constant bytes;
the next frame whose bytes are the same but for the id is read with one
``struct.unpack`` and a dict lookup, no map decoded.  Any byte that differs is a
different key (decoded the general way); nothing is ever read from a head but its
id.  Torch- and schema-free: what a receiver remembers is its own business.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import msgpack

from .frames import MAGIC, PLAIN_START, PREFIX, PREFIX_SIZE, VERSION, FrameLimits

ID_ENTRY = b"\xa2id\xcf"  # "id": uint64 (the id, first: the constant part of a head is around it)
ID_ENTRY_AT = PREFIX_SIZE + 1  # where it is in a frame (after the map's first byte)
_ID_AT = ID_ENTRY_AT + len(ID_ENTRY)  # where the id's 8 bytes begin
TAIL_AT = _ID_AT + 8  # where the fixed fields begin
_LENGTHS = struct.Struct("<IQ")  # header_len, payload_len (at offset 8 of the prefix)
_HEADER_LEN = struct.Struct("<I")
_ID = struct.Struct(">Q")
MAX_FIXED = 14  # fields besides the id (a fixmap holds 15)


def request_head(fixed: dict, payload_len: int = 0) -> Callable[[int], bytes]:
    """``head(rid)``: the frame head (prefix and header) of the request
    ``{"id": rid, **fixed}`` whose payload of ``payload_len`` bytes follows; ``rid``
    in 1..2**64-1.  ``fixed`` holds msgpack-able values (the verb, a bin name, a value
    description...)."""
    if not 0 < len(fixed) <= MAX_FIXED:
        raise ValueError(f"a request head has 1 to {MAX_FIXED} fixed fields")
    packer = msgpack.Packer(use_bin_type=True)
    tail = b"".join(packer.pack(key) + packer.pack(value) for key, value in fixed.items())
    start = (PREFIX.pack(MAGIC, VERSION, 0, 0, TAIL_AT - PREFIX_SIZE + len(tail), payload_len)
             + bytes([0x80 | (len(fixed) + 1)]) + ID_ENTRY)
    pack = struct.Struct(f">{len(start)}sQ{len(tail)}s").pack

    def head(rid: int) -> bytes:
        return pack(start, rid, tail)
    return head


class KnownHeads:
    """The request heads a receiver has accepted once, by their constant bytes (see
    the module docstring), at most ``limit`` of them (then forgotten, all at once)."""

    __slots__ = ("_known", "limit")

    def __init__(self, limit: int = 256):
        self._known: dict[bytes, tuple[bytes, int, Any]] = {}  # tail -> (start, payload_len, what was found)
        self.limit = limit

    def read(self, data: bytes, pos: int = 0) -> tuple[Any, int, int, int] | None:
        """``(found, rid, body, stop)`` of the frame at ``pos`` of ``data`` when it is
        whole there and its bytes are those of a known head but for a non-zero id
        (``found``: what :meth:`learn` was given; its payload is ``data[body:stop]``),
        else None."""
        if len(data) - pos < TAIL_AT:
            return None
        body = pos + PREFIX_SIZE + _HEADER_LEN.unpack_from(data, pos + 8)[0]
        known = self._known.get(data[pos + TAIL_AT:body])
        if known is None:
            return None
        start, payload_len, found = known
        stop = body + payload_len
        if stop > len(data) or data[pos:pos + _ID_AT] != start:
            return None
        rid = _ID.unpack_from(data, pos + _ID_AT)[0]
        return (found, rid, body, stop) if rid else None

    def candidate(self, data: bytes, pos: int, limits: FrameLimits) -> tuple[bytes, int, int] | None:
        """``(header, body, stop)`` of the frame at ``pos`` when it is whole in
        ``data``, small (within ``limits.whole``) and laid out as :func:`request_head`
        lays one out (its header bytes to decode: :meth:`learn` it once accepted),
        else None."""
        if (len(data) - pos < TAIL_AT or data[pos + ID_ENTRY_AT:pos + _ID_AT] != ID_ENTRY
                or data[pos:pos + len(PLAIN_START)] != PLAIN_START):  # (magic, version, no flags, reserved 0)
            return None
        header_len, payload_len = _LENGTHS.unpack_from(data, pos + 8)
        body = pos + PREFIX_SIZE + header_len
        stop = body + payload_len
        max_header, most = limits.whole
        if not TAIL_AT - PREFIX_SIZE < header_len <= max_header or stop > len(data) or stop - pos > most:
            return None
        return data[pos + PREFIX_SIZE:body], body, stop

    def learn(self, data: bytes, pos: int, found: Any) -> None:
        """Remember the head of the frame at ``pos`` (one :meth:`candidate` returned,
        whose header was decoded and accepted) with ``found``."""
        header_len, payload_len = _LENGTHS.unpack_from(data, pos + 8)
        known = self._known
        if len(known) >= self.limit:
            known.clear()
        known[bytes(data[pos + TAIL_AT:pos + PREFIX_SIZE + header_len])] = (bytes(data[pos:pos + _ID_AT]),
                                                                            payload_len, found)
