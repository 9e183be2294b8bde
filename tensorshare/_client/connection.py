"""Requests and replies in the user clients' terms: values in, tensors out.

The engine (:mod:`tensorshare.protocol.engine`) moves raw values; this is what the
two user clients' value layer (:mod:`.values`) builds on: :func:`request_frame`
builds a request from a declared :class:`~tensorshare.protocol.messages.Command`
and a value (encoded here); :func:`read_reply` checks a reply against its command
and :func:`decode_items` builds the values an items reply carries; and the
notifications and listen snapshots a user hears.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..errors import ProtocolError, TooLargeError, ZeroCopyError
from ..protocol.items import item_table
from ..protocol.messages import ITEMS, Command, Key
from ..protocol.prepared import bin_alone, bin_head
from ..protocol.schema import check_tag
from ..wire.build import build_item
from ..wire.codec import Encoded, empty_payload, encode
from ..wire.description import DEFAULT_LIMITS, DecodeLimits
from ..wire.frames import Frame, frame_head
from ..wire.recycle import Recycler

class _NoValue(enum.Enum):
    NO_VALUE = "no value"

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE = _NoValue.NO_VALUE  # "this request carries no value" (None is a value)


@dataclass(frozen=True)
class Notification:
    """A change to a bin this client listens to.

    ``op`` is the verb that changed it (``PUT``, ``APPEND``, ``GET``, ``DELETE``,
    ``RESTORE``), or ``LISTEN`` for the state found when listening (re)started.
    ``tag`` is the tag of the bin's last item after the change (None if untagged
    or empty): for a put or an append, the tag that was sent with it.
    """

    bin: str
    n_items: int
    seq: int
    op: str
    tag: int | None = None

    def as_dict(self) -> dict:
        return {"bin": self.bin, "n_items": self.n_items, "seq": self.seq, "op": self.op, "tag": self.tag}


@dataclass(frozen=True)
class ListenSnapshot:
    """The state of a bin at the moment listening to it started."""

    exists: bool
    n_items: int
    seq: int
    tag: int | None = None  # tag of the bin's last item

    @classmethod
    def of(cls, header: dict) -> "ListenSnapshot":
        """The snapshot a (checked) LISTEN reply carries."""
        return cls(header[Key.EXISTS], header[Key.N], header[Key.SEQ], header.get(Key.TAG))

    def as_notification(self, name: str) -> Notification:
        """The locally made ``LISTEN`` notification that reports this snapshot."""
        return Notification(name, self.n_items, self.seq, "LISTEN", self.tag)


class Reply:
    """A successful reply, checked against its command: the header, and the values
    an items reply (226) carries, decoded (None if it carries none, or if it was
    not decoded).  An undecoded reply that refers to items' files has ``stored``:
    per item, its checked files (a ``StoredItem``) or None (its bytes are in the
    payload); ``held`` is then the reply's id, told to the server as released once
    the caller is done with the files."""

    __slots__ = ("command", "header", "values", "frame", "stored", "held")

    def __init__(self, command: Command, header: dict, values: list | None, frame: Frame):
        self.command, self.header, self.values, self.frame = command, header, values, frame
        self.stored: list | None = None
        self.held: int | None = None

    @property
    def result(self) -> Any:
        """What a call returns by default (:func:`reply_result`)."""
        return reply_result(self.command, self.header, self.values)


def reply_result(command: Command, header: dict, values: list | None) -> Any:
    """What a call of ``command`` returns by default: the decoded ``values`` of an items
    reply, else the field of ``header`` the command names as its result (None if it
    names none)."""
    if values is not None:
        return values
    key = command.result
    return None if key is None else header.get(key)


DEFAULT_REUSE = 1 << 30  # bytes of received reply memory a client keeps for reuse
REUSE_IDLE = 10.0  # seconds an unused array is kept


def reply_buffers(max_bytes: int) -> Recycler | None:
    """A client's :class:`~..wire.recycle.Recycler` of reply arrays (None for 0: always new memory)."""
    if max_bytes < 0:
        raise ValueError("reuse must be 0 (off) or more bytes")
    return Recycler(max_bytes, _reply_array, REUSE_IDLE) if max_bytes else None


def _reply_array(nbytes: int):
    # torch's memory, always: the numpy array over it is what every value built on
    # it refers to.  (payload_buffer's small arrays are slices of a numpy array that
    # owns its memory; views refer to that owner, and the slice would look free
    # while they live.)
    return empty_payload(nbytes).numpy()


_checked_names: set = set()  # bin names already found valid (programs reuse a few)


def check_fields(command: Command, fields: dict) -> None:
    """Raise :class:`UsageError` for a bin name or tag the server would refuse (bin
    names already found valid are remembered: programs reuse a few; a tag, which
    changes from call to call, is checked alone, not with every field of the verb)."""
    name = fields.get(Key.BIN)
    if (Key.BIN in fields and (type(name) is not str or name not in _checked_names)
            or Key.TAG in fields and check_tag(fields[Key.TAG]) is not None):
        command.check_arguments(fields)
        if type(name) is str:
            if len(_checked_names) >= 4096:
                _checked_names.clear()
            _checked_names.add(name)


def request_frame(rid: int, command: Command, fields: dict | None = None, value: Any = NO_VALUE,
                  max_payload: int | None = None) -> list:
    """The parts of a request frame: header bytes, then the value's payload buffers.

    ``fields`` are the command's header fields (a bin, a tag, same-host zero-copy
    fields...); ``value`` may be given already encoded (an :class:`Encoded`).  A
    value holding device arrays gives a :class:`~..device.engine.StagedParts`,
    which the sender sends through its engine.  Raises :class:`UsageError` for an
    argument the server would refuse (a bad bin name or tag), :class:`EncodeError`
    for a value with no wire form and :class:`TooLargeError` for one of more than
    ``max_payload`` bytes (the server's ``max_frame``, from its greeting), sent or
    named in shared memory, before anything is sent.

    A request naming a bin alone (:func:`~tensorshare.protocol.prepared.bin_alone`)
    with no value or one on the CPU goes out from a prepared head
    (:func:`bin_request`).
    """
    if fields:
        check_fields(command, fields)
        alone = bin_alone(fields)
        if alone is not None:
            if value is not NO_VALUE and type(value) is not Encoded:
                value = encode(value)
            if value is NO_VALUE or value.engine is None:
                return bin_request(rid, command, alone[0], value, max_payload, alone[1])
    return _mapped(rid, command, fields, value, max_payload)


def _mapped(rid: int, command: Command, fields: dict | None, value: Any, max_payload: int | None) -> list:
    """:func:`request_frame`'s parts with the header packed as a map, anew."""
    header = command.request(rid, fields)
    if value is NO_VALUE:
        if max_payload is not None and fields and type(fields.get(Key.SIZE)) is int:
            _check_size(fields[Key.SIZE], max_payload)
        return [frame_head(header, 0)]
    enc = value if type(value) is Encoded else encode(value)
    if max_payload is not None:
        _check_size(enc.nbytes, max_payload)
    header[Key.VALUE] = enc.description
    if enc.engine is not None:  # device arrays: senders stage them (tensorshare.device)
        from ..device.engine import StagedParts

        return StagedParts([frame_head(header, enc.nbytes), *enc.buffers], enc.engine)
    return [frame_head(header, enc.nbytes), *enc.buffers]


def bin_request(rid: int, command: Command, name: str, value: Any = NO_VALUE, max_payload: int | None = None,
                extra: tuple = ()) -> list:
    """:func:`request_frame` of ``command`` with no field but the bin ``name`` and
    ``extra`` (:func:`~tensorshare.protocol.prepared.bin_alone`'s: the shared areas a
    read asks references to, scalars) and
    ``value`` (NO_VALUE, or an :class:`Encoded` on the CPU), its head from a template
    prepared per verb, bin, areas and value layout
    (:func:`~tensorshare.protocol.prepared.bin_head`): one ``struct.pack`` instead of a
    map built and packed; the same checks, before anything is sent."""
    description = None if value is NO_VALUE else value.description
    head = bin_head(command, name, extra, description, 0 if description is None else value.nbytes, check_fields)
    if head is None:  # (a value description too long to keep a head of, or fields new here)
        fields = {Key.BIN: name}
        for key, kind, held in extra:
            fields[key] = list(held) if kind is tuple else held
        return _mapped(rid, command, fields, value, max_payload)
    if description is None:
        return [head(rid)]
    if max_payload is not None:
        _check_size(value.nbytes, max_payload)
    return [head(rid), *value.buffers]


def _check_size(nbytes: int, max_payload: int) -> None:
    if nbytes > max_payload:
        raise TooLargeError(f"a value of {nbytes} bytes is more than the {max_payload} bytes the server takes "
                            f"in one request (its --max-frame)")


def read_reply(command: Command, frame: Frame, device: Any = None, limits: DecodeLimits = DEFAULT_LIMITS,
               areas: Any = None, decode: bool = True, into: Any = None, caller: Any = None) -> Reply:
    """The checked reply to ``command`` (its values decoded if it carries items and
    ``decode``); raises the :class:`RemoteError` of an error reply.  ``areas``: the
    connection's :class:`~.zerocopy.SharedAreas`, to map items the reply refers to;
    ``into``: destination tensors of the arrays, ``caller``: whose stream gets
    them (:mod:`.devices`)."""
    header = command.check_reply(frame.header)
    values = None
    if decode and header.get(Key.CODE) == ITEMS:
        values = decode_items(header, frame.payload, frame.payload_len, device, limits, areas, into, caller)
    return Reply(command, header, values, frame)


def decode_items(header: dict, payload, payload_len: int, device: Any = None,
                 limits: DecodeLimits = DEFAULT_LIMITS, areas: Any = None, into: Any = None, caller: Any = None) -> list:
    """The values of an ITEMS (226) reply; their arrays view the one payload buffer, or,
    for items the reply refers to, the server's files mapped copy-on-write (``areas``;
    on a ``device``: copied there, into ``into``'s tensors where given)."""
    values, base = [], 0
    for i, (blob, size, ref) in enumerate(item_table(header, payload_len)):
        if ref is not None:
            if type(ref) is dict:  # in a publisher's GPU memory: copied device to device
                from ..device.ipc import load

                values.append(load(ref, blob, size, device, limits, None if into is None else partial(into, i), caller))
                continue
            if areas is None:
                raise ZeroCopyError("the reply refers to shared memory this connection cannot map")
            values.append(areas.load(ref, blob, size, device, limits, None if into is None else partial(into, i),
                                     caller))
            continue
        try:
            values.append(build_item(blob, size, payload, base, device, limits))
        except (ValueError, TypeError, RuntimeError) as exc:  # e.g. a shape numpy cannot hold
            raise ProtocolError(f"cannot build item {len(values)}: {exc}") from None
        base += size
    return values
