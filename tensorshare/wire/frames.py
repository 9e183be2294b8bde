"""Framing: the fixed prefix, the msgpack header, and a sans-IO incremental decoder.

A frame on the wire is::

    prefix (20 bytes, little-endian)   magic b"TSHR", version u8, flags u8,
                                       reserved u16, header_len u32, payload_len u64
    header (header_len bytes)          a msgpack map with str keys
    payload (payload_len bytes)        raw bytes (the arrays of the values it carries)

:class:`FrameDecoder` takes bytes in any split (``feed``) or lends a buffer to read
into (``get_buffer``/``buffer_updated``, the ``recv_into`` style) and returns whole
:class:`Frame` objects.  It validates the prefix and the header before asking for a
payload sink, so a declared size over the limit never allocates.  Where the payload
goes is the caller's choice (:class:`BufferSink`: one preallocated array;
:class:`SegmentSink`: the received ``bytes`` chunks kept as they are, for servers
that only forward them; a sink may also lend memory to read into, as the server's
pooled sink does for large payloads).
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from ..errors import ProtocolError
from .unpacking import FREE_CONTAINERS, UNPACK_ERRORS, ContainerBudget, unpack_bounded

MAGIC = b"TSHR"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")
PREFIX_SIZE = PREFIX.size  # 20
PLAIN_START = PREFIX.pack(MAGIC, VERSION, 0, 0, 0, 0)[:8]  # magic, version, no flags, reserved 0
_START_LENGTHS = struct.Struct("<8sIQ")  # the prefix: its first 8 bytes, header_len, payload_len


@dataclass(frozen=True)
class FrameLimits:
    """Sizes a decoder refuses before allocating anything, and what a decoded header
    may cost."""

    max_header: int = 16 << 20
    max_payload: int = 1 << 40
    # A header of more than FREE_CONTAINERS bytes that decodes to more than this many
    # bytes of objects per byte is refused (None: not measured).  For servers, which
    # may keep a decoded request waiting while its connection is congested.
    header_memory: int | None = None
    # (longest header, most bytes) of a frame whole_frames parses, from the above
    whole: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # (larger headers are measured: the decoder's job)
        object.__setattr__(self, "whole", (min(self.max_header, FREE_CONTAINERS), min(SMALL_FRAME, self.max_payload)))


SMALL_FRAME = 64 << 10  # most bytes (prefix, header, payload) of a frame :func:`whole_frames` parses
DEFAULT_FRAME_LIMITS = FrameLimits()


_packers = threading.local()


def _packer() -> msgpack.Packer:
    # msgpack.packb builds a Packer per call, which is half of its cost for a small
    # header; a Packer is not safe to share between threads, so keep one per thread.
    try:
        return _packers.packer
    except AttributeError:
        _packers.packer = msgpack.Packer(use_bin_type=True)
        return _packers.packer


def frame_head(header: dict, payload_len: int) -> bytes:
    """Prefix + header of a frame whose payload (``payload_len`` bytes) follows."""
    packed = _packer().pack(header)
    return PREFIX.pack(MAGIC, VERSION, 0, 0, len(packed), payload_len) + packed


def head_template(fixed: dict, keys: tuple[str, ...]) -> Callable[..., bytes]:
    """``head(*values)``: the frame head (prefix and header, no payload) of the
    header ``{**fixed, keys[0]: values[0], ...}``, from a template prepared here
    once: one ``struct.pack`` per frame instead of building and packing a map.

    The values are non-negative integers, packed as msgpack uint64 (a longer form
    than the shortest, which every msgpack decoder reads as the same integer); one
    that is not (a negative or larger one) gets the frame :func:`frame_head` makes.
    Up to three keys (the replies the server sends most).

    ``head.read(data)``, the other way: the values of a frame head this template
    made (exactly those bytes), or None for any other bytes (decode those as usual):
    the receiver of a prepared reply reads it with one ``struct.unpack``; a
    template's bytes are a well-formed frame whose header holds ``fixed`` and the
    integers, so nothing is left to check.  ``head.keys``: ``keys``."""
    packer = msgpack.Packer(use_bin_type=True)
    entries = len(fixed) + len(keys)
    if not 0 < len(keys) <= 3 or entries > 15:
        raise ValueError("a head template has 1 to 3 integer fields and at most 15 in all")
    pieces = [bytes([0x80 | entries]) + b"".join(packer.pack(k) + packer.pack(v) for k, v in fixed.items())]
    for i, key in enumerate(keys):
        if i:
            pieces.append(b"")
        pieces[-1] += packer.pack(key) + b"\xcf"  # uint64 follows
    header_len = sum(map(len, pieces)) + 8 * len(keys)
    pieces[0] = PREFIX.pack(MAGIC, VERSION, 0, 0, header_len, 0) + pieces[0]
    layout = struct.Struct(">" + "".join(f"{len(piece)}sQ" for piece in pieces))
    pack, unpack, size, constant = layout.pack, layout.unpack, layout.size, tuple(pieces)

    def read(data) -> tuple | None:
        if len(data) != size:
            return None
        fields = unpack(data)
        return fields[1::2] if fields[0::2] == constant else None

    def slow(*values) -> bytes:  # a value that is not a uint64
        return frame_head({**fixed, **dict(zip(keys, values))}, 0)

    head = _TEMPLATE_ARITY[len(keys)](pack, slow, *pieces)
    head.__doc__ = f"The frame head of {{{', '.join([*map(repr, fixed), *keys])}}}."
    head.read, head.keys = read, keys
    return head


def _head_of_1(pack: Callable, slow: Callable, a: bytes) -> Callable[..., bytes]:
    def head(x):
        try:
            return pack(a, x)
        except struct.error:
            return slow(x)
    return head


def _head_of_2(pack: Callable, slow: Callable, a: bytes, b: bytes) -> Callable[..., bytes]:
    def head(x, y):
        try:
            return pack(a, x, b, y)
        except struct.error:
            return slow(x, y)
    return head


def _head_of_3(pack: Callable, slow: Callable, a: bytes, b: bytes, c: bytes) -> Callable[..., bytes]:
    def head(x, y, z):
        try:
            return pack(a, x, b, y, c, z)
        except struct.error:
            return slow(x, y, z)
    return head


# (each spelled out: one call per frame, no list of values to build)
_TEMPLATE_ARITY: dict[int, Callable[..., Callable[..., bytes]]] = {1: _head_of_1, 2: _head_of_2, 3: _head_of_3}


def one_item_template(fixed: dict, keys: tuple[str, str, str, str]) -> Callable[..., bytes]:
    """``head(rid, seq, blob, nbytes)``: the frame head of a reply carrying one item,
    ``{**fixed, id: rid, seq: seq, sizes: [nbytes], items: [blob]}`` (``keys``: the
    names of those four fields), its payload of ``nbytes`` to follow: two
    ``struct.pack`` from a template prepared here once, the item's description
    ``blob`` (bytes) the one part of variable length, as a msgpack bin 32.  The
    integers are uint64 as :func:`head_template`'s; values it cannot pack get the
    frame :func:`frame_head` makes.

    ``head.read(data, limits)``, the other way: ``(rid, seq, blob, nbytes, start)``
    of ``data`` when it is exactly one whole frame this template made, within
    ``limits`` as :func:`whole_frames` takes them (``start``: where its payload
    begins), else None (decode those bytes as usual).  Such a frame is well formed
    and holds exactly those fields, so nothing is left to check but the item's
    description, which the receiver decodes (or finds already decoded) as any."""
    id_key, seq_key, items_key, sizes_key = keys
    packer = msgpack.Packer(use_bin_type=True)
    entries = len(fixed) + 4
    if entries > 15:
        raise ValueError("a one-item template has at most 15 fields")
    pieces = (bytes([0x80 | entries]) + b"".join(packer.pack(k) + packer.pack(v) for k, v in fixed.items())
              + packer.pack(id_key) + b"\xcf",
              packer.pack(seq_key) + b"\xcf",
              packer.pack(sizes_key) + b"\x91\xcf",  # [uint64]
              packer.pack(items_key) + b"\x91\xc6")  # [bin 32]
    body = struct.Struct(">{}sQ{}sQ{}sQ{}sI".format(*map(len, pieces)))  # (msgpack is big-endian, the prefix not)
    pack_prefix, pack_body, unpack_body = PREFIX.pack, body.pack, body.unpack_from
    head_len, size = body.size, PREFIX_SIZE + body.size
    a, b, c, d = pieces

    def head(rid: int, seq: int, blob: bytes, nbytes: int) -> bytes:
        try:
            return (pack_prefix(MAGIC, VERSION, 0, 0, head_len + len(blob), nbytes)
                    + pack_body(a, rid, b, seq, c, nbytes, d, len(blob)) + blob)
        except struct.error:
            return frame_head({**fixed, id_key: rid, seq_key: seq, items_key: [blob], sizes_key: [nbytes]}, nbytes)

    def read(data, limits: FrameLimits) -> tuple | None:
        n = len(data)
        if n < size:
            return None
        first, header_len, payload_len = _START_LENGTHS.unpack_from(data)
        a_, rid, b_, seq, c_, nbytes, d_, blob_len = unpack_body(data, PREFIX_SIZE)
        start = size + blob_len
        if (first != PLAIN_START or a_ != a or b_ != b or c_ != c or d_ != d or header_len != head_len + blob_len
                or nbytes != payload_len or start + nbytes != n or header_len > limits.whole[0]
                or n > limits.whole[1]):
            return None
        return rid, seq, bytes(data[size:start]), nbytes, start

    head.read = read
    return head


@dataclass(slots=True)  # (one per frame received: no __dict__ to make for each)
class Frame:
    """One decoded frame: its header map and its payload as the sink produced it."""

    header: dict
    payload: Any
    payload_len: int
    # Why the request is refused whole (its header decoded to more than the limits
    # allow: :class:`CostlyHeader`); its header then holds only its op and id, and
    # its payload was read and dropped.
    refused: str | None = None


class CostlyHeader(ProtocolError):
    """A well-formed header that decodes to more memory than ``header_memory``
    allows.  The frame's bounds are known, so the stream goes on: a decoder turns it
    into a :class:`Frame` whose ``refused`` says why (the receiver answers it as a
    bad request), with ``stand_in`` (the header's op and id) as its header."""

    def __init__(self, message: str, stand_in: dict):
        super().__init__(message)
        self.stand_in = stand_in


# ------------------------------------------------------------------- payload sinks


_NO_VIEW = memoryview(b"")


def _payload_buffer(nbytes: int):
    """:func:`~.build.payload_buffer`, imported on the first call, which puts it in this
    name's place: an import statement run on every payload cost as much as a tenth of
    a small reply's decoding (the server's decoder never gets here: no torch for it)."""
    global _payload_buffer
    from .build import payload_buffer

    _payload_buffer = payload_buffer
    return payload_buffer(nbytes)


class BufferSink:
    """Receives a payload into one preallocated, aligned uint8 numpy array
    (:func:`~.codec.payload_buffer`), which the decoded arrays then view.

    (The array maker is imported on first use, not at module level: the server uses
    this module's decoder with :class:`SegmentSink` only and never needs torch.)
    """

    _no_bytes = None  # shared empty array, made on first use

    def __init__(self, nbytes: int, array=None):
        if array is not None:  # one of nbytes made by payload_buffer earlier, reused
            self.array = array
            self._view = memoryview(array)
        elif nbytes:
            self.array = _payload_buffer(nbytes)
            self._view = memoryview(self.array)
        else:
            # Most replies carry no payload; allocating an empty array for each one
            # costs as much as the rest of decoding the reply.  One shared empty
            # array serves them all (it has no bytes to share).
            if BufferSink._no_bytes is None:
                BufferSink._no_bytes = _payload_buffer(0)
            self.array = BufferSink._no_bytes
            self._view = _NO_VIEW
        self._filled = 0

    def get_buffer(self) -> memoryview:
        return self._view[self._filled :]

    def buffer_updated(self, n: int) -> None:
        self._filled += n

    def write(self, data: memoryview | bytes) -> None:
        n = len(data)
        self._view[self._filled : self._filled + n] = data
        self._filled += n

    def finish(self):
        """The payload: a 1-D uint8 numpy array."""
        return self.array


class SegmentSink:
    """Keeps the payload as a list of ``bytes`` chunks, as they were received.

    Chunks that arrive whole are kept without a copy; runs of small chunks are
    coalesced so that a peer sending one byte at a time cannot make many objects.
    """

    COALESCE = 256 << 10

    def __init__(self, nbytes: int):
        self.segments: list[bytes] = []
        self._small = bytearray()
        self._nbytes = nbytes

    def write(self, data: memoryview | bytes) -> None:
        if len(data) == self._nbytes:  # the whole payload in one piece (small requests)
            self.segments.append(data if type(data) is bytes else bytes(data))
            return
        if len(data) >= self.COALESCE and not self._small:
            self.segments.append(data if type(data) is bytes else bytes(data))
            return
        self._small += data
        if len(self._small) >= self.COALESCE:
            self.segments.append(bytes(self._small))
            self._small.clear()

    def finish(self) -> list[bytes]:
        if self._small:
            self.segments.append(bytes(self._small))
            self._small = bytearray()
        return self.segments


class DiscardSink:
    """Reads a payload and drops it (the request is refused but the stream stays in step)."""

    def __init__(self, nbytes: int):
        pass

    def write(self, data: Any) -> None:
        pass

    def finish(self) -> None:
        return None


SinkFactory = Callable[[dict, int], Any]


REUSE_MIN = 1 << 20  # payloads from this size on may be received into a reused array


def buffer_sink(header: dict, nbytes: int, reuse: Any = None) -> BufferSink:
    """Sink factory: every payload into its own preallocated array.

    ``reuse``, a :class:`~tensorshare.wire.recycle.Recycler` of ``payload_buffer``
    arrays, gives a payload of ``REUSE_MIN`` bytes or more an array of its size that
    an earlier reply was received into and that nothing refers to any more (its
    values were dropped): memory already touched, much quicker to receive into than
    new pages.  Arrays come in size classes (:func:`~tensorshare.wire.recycle.size_class`),
    so payloads whose size varies a little share them."""
    try:
        if reuse is not None and nbytes >= REUSE_MIN:
            from .recycle import size_class

            reuse.maybe_trim()
            array = reuse.take(size_class(nbytes))
            if array is not None:
                return BufferSink(nbytes, array[:nbytes])
        return BufferSink(nbytes)
    except (RuntimeError, MemoryError) as exc:  # a declared size this process cannot hold
        raise ProtocolError(f"cannot allocate {nbytes} bytes for a payload: {exc}") from None


def discard_sink(header: dict, nbytes: int) -> DiscardSink:
    """Sink factory: drop every payload (the caller reads it elsewhere)."""
    return DiscardSink(nbytes)


# ---------------------------------------------------------------- whole small frames

def whole_frames(data: bytes, limits: FrameLimits = DEFAULT_FRAME_LIMITS,
                 pos: int = 0) -> tuple[list[tuple[dict, bytes, int]], int]:
    """The whole small frames at ``pos`` of ``data`` (a read), each parsed in one
    step where it arrives, prefix and header together: ``([(header, payload,
    payload_len), ...], end)``, the payload a ``bytes`` slice of ``data``.

    It stops at ``end``, the first frame that is not whole in ``data``, is over
    :data:`SMALL_FRAME` bytes, has a header longer than :data:`FREE_CONTAINERS` bytes or is
    not a plain, well-formed frame within ``limits``: :class:`FrameDecoder` takes
    the rest (and refuses what is wrong, with its reasons).  A frame it returns
    is one that decoder would return with the same header, and its payload is the
    bytes that decoder's sink would be given.
    """
    found = []
    end = len(data)
    max_header, most = limits.whole
    while end - pos >= PREFIX_SIZE:
        first, header_len, payload_len = _START_LENGTHS.unpack_from(data, pos)
        start = pos + PREFIX_SIZE
        body = start + header_len
        stop = body + payload_len
        if first != PLAIN_START or not 0 < header_len <= max_header or stop > end or stop - pos > most:
            break
        try:  # (unpack_header's way for a header of at most FREE_CONTAINERS bytes)
            header = _unpack_small(data[start:body])
        except _SMALL_ERRORS:  # (the decoder raises it again, once the frames before it are served)
            break
        if type(header) is not dict:
            break
        found.append((header, data[body:stop], payload_len))
        pos = stop
    return found, pos


# ------------------------------------------------------------------------- decoder

_HEADER, _PAYLOAD, _BROKEN = range(3)


class FrameDecoder:
    """Incremental, sans-IO frame decoder.

    ``sink_factory(header, payload_len)`` is called once the header is complete and
    valid; it returns the object that receives the payload.  After a
    :class:`ProtocolError` the decoder refuses further input: the stream cannot be
    resynchronised and the connection should be closed.
    """

    SCRATCH = 256 << 10

    def __init__(self, sink_factory: SinkFactory = buffer_sink, limits: FrameLimits = DEFAULT_FRAME_LIMITS):
        self.sink_factory = sink_factory
        self.limits = limits
        self._state = _HEADER
        self._pending = bytearray()  # prefix + header bytes gathered so far
        self._need = PREFIX_SIZE
        self._header: dict | None = None
        self._payload_len = 0
        self._remaining = 0
        self._sink: Any = None
        self._scratch: memoryview | None = None  # (of a bytearray) made on the first get_buffer()
        self._lent = False  # the last buffer handed out was the sink's own memory
        self._refused: str | None = None  # the frame being read is refused whole (CostlyHeader)

    @property
    def idle(self) -> bool:
        """True between frames (no partial frame buffered)."""
        return self._state == _HEADER and not self._pending

    @property
    def payload_remaining(self) -> int:
        """Bytes still expected for the payload being received (0 between payloads)."""
        return self._remaining if self._state == _PAYLOAD else 0

    @property
    def between_frames(self) -> bool:
        """Whether the next byte fed starts a frame (no frame is partly received)."""
        return self._state == _HEADER and not self._pending

    @property
    def receiving(self) -> tuple[dict, int, int] | None:
        """``(header, payload bytes received, payload length)`` of the frame whose
        payload is arriving, or None (progress reports of large replies)."""
        if self._state != _PAYLOAD:
            return None
        return self._header, self._payload_len - self._remaining, self._payload_len

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        """Consume ``data``; return the frames it completed, in order."""
        if self._state == _BROKEN:
            raise ProtocolError("decoder already failed; close the connection")
        self._lent = False  # a buffer lent before and not used is not accounted for
        frames: list[Frame] = []
        pos, end = 0, len(data)
        view = data if type(data) is memoryview else memoryview(data)  # (slices of it copy nothing)
        try:
            while pos < end:
                if self._state == _HEADER:
                    if not self._pending and end - pos >= PREFIX_SIZE:
                        # Fast path (a read holding whole prefixes, the usual case):
                        # parse in place instead of gathering into _pending first.
                        first, header_len, payload_len = _START_LENGTHS.unpack_from(data, pos)
                        if first == PLAIN_START:
                            limits = self.limits
                            if not 0 < header_len <= limits.max_header or payload_len > limits.max_payload:
                                self._check_prefix(PREFIX.unpack_from(data, pos))  # raises
                        else:
                            header_len, payload_len = self._check_prefix(PREFIX.unpack_from(data, pos))
                        self._payload_len = payload_len
                        start = pos + PREFIX_SIZE
                        pos = start + header_len
                        if pos > end:  # the header continues in a later read
                            self._pending += data[start - PREFIX_SIZE : end]
                            self._need = PREFIX_SIZE + header_len
                            pos = end
                        elif payload_len:
                            header = self._header_of(view[start:pos])
                            stop = pos + payload_len
                            if stop <= end and self._refused is None:  # the whole payload here too (small
                                sink = self.sink_factory(header, payload_len)  # replies): one step, no state
                                sink.write(view[pos:stop])
                                frames.append(Frame(header, sink.finish(), payload_len))
                                pos = stop
                            else:
                                self._start_payload(header, frames)
                        else:  # no payload (most replies and many requests): done here
                            header = self._header_of(view[start:pos])
                            if self._refused is None:
                                frames.append(Frame(header, self.sink_factory(header, 0).finish(), 0))
                            else:
                                self._header = header
                                self._finish(frames)
                        continue
                    take = min(self._need - len(self._pending), end - pos)
                    self._pending += data[pos : pos + take]
                    pos += take
                    if len(self._pending) == self._need:
                        self._advance_header(frames)
                else:
                    take = min(self._remaining, end - pos)
                    whole = take == end and pos == 0
                    self._sink.write(data if whole else view[pos : pos + take])
                    pos += take
                    self._remaining -= take
                    if not self._remaining:
                        self._finish(frames)
        except ProtocolError as exc:
            self._state = _BROKEN
            exc.frames = frames  # completed before the error: the caller still answers them
            raise
        return frames

    def get_buffer(self) -> memoryview:
        """A writable buffer for the next read (``sock.recv_into``).

        While a payload is arriving into a sink that lends its memory, this is that
        memory itself (no copy: :meth:`lent_buffer`); otherwise a scratch buffer
        whose content :meth:`buffer_updated` feeds in.
        """
        if self._state == _PAYLOAD:
            buf = self.lent_buffer()
            if buf is not None:
                return buf
        else:  # (between payloads, the usual read of a small reply: no sink to ask)
            self._lent = False
        scratch = self._scratch
        if scratch is None:
            self._scratch = scratch = memoryview(bytearray(self.SCRATCH))
        return scratch

    def lent_buffer(self) -> memoryview | None:
        """The memory of the payload's sink to read the next bytes into, or None when
        the sink lends none now (no payload is arriving, or the sink takes only
        :meth:`feed`).  A sink lends by having ``get_buffer()`` return a writable
        buffer (or None to decline) and ``buffer_updated(n)``.  Either way the next
        :meth:`buffer_updated` accounts for the buffer this returned."""
        self._lent = False
        if self._state == _PAYLOAD:
            lend = getattr(self._sink, "get_buffer", None)
            buf = lend() if lend is not None else None
            if buf is not None:
                self._lent = True
                return buf[: self._remaining]
        return None

    def buffer_updated(self, n: int) -> list[Frame]:
        """Account for ``n`` bytes read into the buffer from :meth:`get_buffer` or
        :meth:`lent_buffer`."""
        if self._lent:
            self._lent = False
            self._sink.buffer_updated(n)
            self._remaining -= n
            frames: list[Frame] = []
            if not self._remaining:
                self._finish(frames)
            return frames
        if self._scratch is None:  # nothing was lent: only an error state gets here
            return self.feed(b"")
        return self.feed(self._scratch[:n])

    # -- internals

    def _advance_header(self, frames: list[Frame]) -> None:
        if self._need == PREFIX_SIZE:
            header_len, self._payload_len = self._check_prefix(PREFIX.unpack(self._pending))
            self._need = PREFIX_SIZE + header_len
            return
        header = self._header_of(memoryview(self._pending)[PREFIX_SIZE:])
        self._pending = bytearray()
        self._need = PREFIX_SIZE
        self._start_payload(header, frames)

    def _check_prefix(self, fields: tuple) -> tuple[int, int]:
        """``(header_len, payload_len)`` of a valid prefix; ProtocolError otherwise."""
        magic, version, flags, _reserved, header_len, payload_len = fields
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}: not a tensorshare frame")
        if version != VERSION:
            raise ProtocolError(f"unsupported format version {version} (this side speaks {VERSION})")
        if flags:
            raise ProtocolError(f"unknown frame flags {flags:#x}")
        if not 0 < header_len <= self.limits.max_header:
            raise ProtocolError(f"header length {header_len} outside 1..{self.limits.max_header}")
        if payload_len > self.limits.max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes over the limit of {self.limits.max_payload}")
        return header_len, payload_len

    def _header_of(self, data: memoryview) -> dict:
        """The frame's header; for a :class:`CostlyHeader`, its stand-in (the frame is
        then refused: ``_refused`` says why until it is finished)."""
        try:
            return unpack_header(data, self.limits)
        except CostlyHeader as exc:
            self._refused = str(exc)
            return exc.stand_in

    def _start_payload(self, header: dict, frames: list[Frame]) -> None:
        self._header = header
        self._sink = discard_sink(header, self._payload_len) if self._refused is not None \
            else self.sink_factory(header, self._payload_len)
        self._remaining = self._payload_len
        self._state = _PAYLOAD
        if not self._remaining:
            self._finish(frames)

    def _finish(self, frames: list[Frame]) -> None:
        if self._refused is not None:
            frames.append(Frame(self._header, None, self._payload_len, refused=self._refused))
            self._refused = None
        else:
            frames.append(Frame(self._header, self._sink.finish(), self._payload_len))
        self._header = self._sink = None
        self._state = _HEADER


def unpack_header(data: bytes | memoryview, limits: FrameLimits = DEFAULT_FRAME_LIMITS) -> dict:
    """Decode and check a frame header: a msgpack map with str keys, nothing after
    it, within :mod:`.unpacking`'s rule on containers and ``limits.header_memory``."""
    size = len(data)
    factor = limits.header_memory
    if size <= FREE_CONTAINERS:  # the usual header: nothing to count or measure (see .unpacking)
        try:  # (checked as it is decoded: see _unpack_small)
            header = _unpack_small(data)
        except UNPACK_ERRORS as exc:
            raise ProtocolError(f"malformed header: {exc or type(exc).__name__}") from None
        if type(header) is not dict:
            raise ProtocolError("header must be a msgpack map with str keys")
        return header
    measured = None if factor is None else ContainerBudget(size, "header", measure=True)
    header = unpack_bounded(data, "header", budget=measured)
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map with str keys")
    _check_header_values(header)
    if measured is not None:
        held = measured.held_bytes(header)
        if held > factor * size:
            op, rid = header.get("op"), header.get("id")
            stand_in = {"op": op if type(op) is str and len(op) <= 64 else None, "id": rid if type(rid) is int else 0}
            raise CostlyHeader(f"header of {size} bytes decodes to {held} bytes of objects, over {factor} times "
                               f"its size", stand_in)
    return header


_ONLY_STR = frozenset((str,))


def _str_keys(node: dict) -> dict:
    if not _ONLY_STR.issuperset(map(type, node)):
        raise ProtocolError("header must be a msgpack map with str keys, at every level")
    return node


def _no_extension(code: int, data: bytes):
    raise ProtocolError("headers may not hold msgpack extension types")


# A header of at most FREE_CONTAINERS bytes, checked as it is decoded: every map's keys
# by _str_keys, extension types by _no_extension (max_ext_len=0 lets only empty ones
# through), no walk after.  unpackb bounds every other declared length by the size of
# what it decodes (its max_*_len default to that): nothing larger is ever allocated.
_unpack_small = functools.partial(msgpack.unpackb, raw=False, strict_map_key=True, max_ext_len=0,
                                  object_hook=_str_keys, ext_hook=_no_extension)
_SMALL_ERRORS = (ProtocolError, *UNPACK_ERRORS)


_CONTAINER_TYPES = frozenset({dict, list, msgpack.ExtType, msgpack.Timestamp})  # what the walk looks into


def _check_header_values(header: dict) -> None:
    """Map keys are str at every level; no extension types (msgpack's max_ext_len=0
    still lets a zero-length one through, and strict_map_key allows bytes keys)."""
    stack: list = [header]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            for key, value in node.items():
                if type(key) is not str:
                    raise ProtocolError("header must be a msgpack map with str keys, at every level")
                if type(value) in _CONTAINER_TYPES:
                    stack.append(value)
        elif type(node) is list:
            stack.extend(x for x in node if type(x) in _CONTAINER_TYPES)
        else:
            raise ProtocolError("headers may not hold msgpack extension types")
