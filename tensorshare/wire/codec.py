"""Values <-> (description blob, raw payload): the tensor-aware value codec.

A value is any nesting of dict (str keys), list, tuple, str, bytes, int, float, bool,
None, ``torch.Tensor`` and ``numpy.ndarray``.  Encoding splits it in two:

* the *description*: a small msgpack blob holding the structure, the scalars, and a
  table of the arrays (kind, dtype, shape, offset, byte count);
* the *payload*: the raw bytes of every array, little-endian, C-contiguous, each
  starting at a multiple of :data:`ALIGN`, exposed as memoryviews (no copy of
  contiguous CPU tensors).

Decoding (:mod:`.description`) validates the description against the payload
length before anything is built; :func:`build` then makes the arrays as views onto
one payload buffer (:mod:`.build`, the decoding half, whose names this module gives
too).  Nothing here can execute code from the bytes: no pickle, no eval.
PROTOCOL.md ("Value description") is the normative text.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import EncodeError
from .build import array_view, as_payload_tensor, assemble, build, empty_payload, payload_buffer
from .description import (
    ALIGN, DEFAULT_LIMITS, EXT_ARRAY, EXT_BIGINT, EXT_COMPLEX, EXT_DTYPE, EXT_FROZENSET, EXT_MAP, EXT_SCALAR,
    EXT_SET, EXT_SIZE, EXT_TENSORDICT, EXT_TUPLE, KIND_NUMPY, KIND_TORCH, MAX_DIMS, ArraySpec, DecodeLimits, Description,
    align_up, check_description, parse_description,
)
from .torch_dtypes import BUFFER_DTYPES, NUMPY_DTYPES, NUMPY_NAMES, TORCH_DTYPES, TORCH_NAMES

__all__ = [
    "encode", "Encoded", "TORCH_DTYPES", "NUMPY_DTYPES",
    # re-exported from .build and .description, so that one module names the whole codec
    "build", "assemble", "array_view", "empty_payload", "payload_buffer", "as_payload_tensor",
    "ALIGN", "DecodeLimits", "DEFAULT_LIMITS", "Description", "ArraySpec", "parse_description",
    "check_description", "align_up", "KIND_TORCH", "KIND_NUMPY", "MAX_DIMS",
]

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("tensorshare's zero-copy wire format needs a little-endian host")

_PAD = bytes(ALIGN)


# ExtType's constructor runs Python-level checks; references to the first arrays of a
# value are built once (ExtType is an immutable tuple, so sharing them is safe).
_ARRAY_REFS = [msgpack.ExtType(EXT_ARRAY, i.to_bytes(4, "little")) for i in range(64)]
_packers = threading.local()
_LONE_DESCRIPTIONS: dict[tuple, bytes] = {}  # (dtype name, *shape) -> description of a lone tensor
_LONE_DESCRIPTIONS_MAX = 256
_SMALL_LONE: dict[tuple, tuple] = {}  # (numpy dtype, shape) -> (description, payload bytes, padding) of a small one


def _packb(obj: Any) -> bytes:
    # msgpack.packb builds a Packer per call, a large share of a small description's
    # cost; a Packer must not be shared between threads, so keep one per thread.
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        return packer.pack(obj)
    except UnicodeEncodeError as exc:  # lone surrogates: not text the wire can carry
        packer.reset()
        raise EncodeError(f"str values and keys must be valid Unicode text: {exc}") from None


@dataclass(slots=True)  # (one per value sent: no __dict__ to make for each)
class Encoded:
    """An encoded value: its description and the buffers of its payload, in order."""

    description: bytes
    buffers: list  # memoryview | bytes (| device spans), concatenated they form the payload
    nbytes: int  # total payload length, a multiple of ALIGN
    arrays: int = 0  # entries of the array table
    engine: Any = None  # the device engine whose spans some buffers are (tensorshare.device), or None

    def payload_bytes(self) -> bytes:
        """The payload as one bytes object (a copy; for tools and tests)."""
        return b"".join(self.buffers)


class _Encoder:
    finding = False  # True in an encoder that only looks for the member that fails

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.table: list[list] = []
        self.buffers: list = []
        self.offset = 0

    def node(self, obj: Any, depth: int) -> Any:
        if depth > self.max_depth:
            raise EncodeError(f"value nested deeper than {self.max_depth} levels")
        # Arrays first: the common case, and no scalar type below subclasses them.
        if isinstance(obj, torch.Tensor):
            return self.array(*_torch_bytes(obj))
        if isinstance(obj, np.ndarray):
            return self.array(*_numpy_bytes(obj))
        if obj is None or obj is True or obj is False:
            return obj
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, int):
            obj = int(obj)
            if -(1 << 63) <= obj < (1 << 64):
                return obj
            nbytes = (obj.bit_length() + 8) // 8
            return msgpack.ExtType(EXT_BIGINT, obj.to_bytes(nbytes, "big", signed=True))
        if isinstance(obj, float):
            if type(obj) is not float and isinstance(obj, np.generic):  # numpy.float64
                return _numpy_scalar(obj)
            return float(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            out = {}
            items = iter(obj.items())
            try:
                for key, value in items:
                    if type(key) is not str:
                        if not isinstance(key, str):  # then the dict travels as key, value pairs
                            break
                        key = str(key)
                    out[key] = self.node(value, depth + 1)
                else:
                    return out
            except EncodeError as exc:
                raise exc.inside(key) from None
            return self.keyed_map(out, key, value, items, depth)
        if isinstance(obj, list):
            try:
                return [self.node(x, depth + 1) for x in obj]
            except EncodeError as exc:
                raise exc.inside(self.failing_index(obj, depth)) from None
        if isinstance(obj, tuple):
            if type(obj) is torch.Size:
                if obj and depth >= self.max_depth:  # its sizes count one level deeper
                    raise EncodeError(f"value nested deeper than {self.max_depth} levels")
                return msgpack.ExtType(EXT_SIZE, _packb([int(d) for d in obj]))
            if type(obj) is not tuple:
                _plain_tuple_warning(type(obj))
            try:
                inner = [self.node(x, depth + 1) for x in obj]
            except EncodeError as exc:
                raise exc.inside(self.failing_index(obj, depth)) from None
            return msgpack.ExtType(EXT_TUPLE, _packb(inner))
        return self.other(obj, depth)

    def other(self, obj: Any, depth: int) -> Any:
        """The rarer kinds: numpy scalars, dtypes, sets, complex numbers."""
        if isinstance(obj, np.generic):
            return _numpy_scalar(obj)
        if isinstance(obj, torch.dtype):
            name = TORCH_NAMES.get(obj)
            if name is None:
                raise EncodeError(f"{obj} has no fixed-width wire form")
            return msgpack.ExtType(EXT_DTYPE, bytes([KIND_TORCH]) + name.encode())
        if isinstance(obj, np.dtype):
            name = NUMPY_NAMES.get(obj)
            if name is None:
                raise EncodeError(f"numpy dtype {obj!r} has no wire form")
            return msgpack.ExtType(EXT_DTYPE, bytes([KIND_NUMPY]) + name.encode())
        if isinstance(obj, (set, frozenset)):
            members = [self.hashable(x, depth + 1, "set member") for x in obj]
            return msgpack.ExtType(EXT_FROZENSET if isinstance(obj, frozenset) else EXT_SET, _packb(members))
        if isinstance(obj, complex):
            return msgpack.ExtType(EXT_COMPLEX, struct.pack("<dd", obj.real, obj.imag))
        if type(obj).__module__.startswith("tensordict."):
            return self.tensordict(obj, depth)
        raise EncodeError(f"cannot send a value of type {_type_name(obj)}{_what_to_send(obj)}")

    def tensordict(self, td: Any, depth: int) -> msgpack.ExtType:
        """A ``tensordict.TensorDict``: its batch size and entries (nested TensorDicts
        and non-tensor data included), so that it comes back as one."""
        from tensordict import TensorDict

        if type(td) is not TensorDict:
            raise EncodeError(f"cannot send a value of type {_type_name(td)} (a TensorDict can be sent: "
                              f"convert it with .to_tensordict())")
        entries = {}
        try:
            for key in td.keys():
                entries[key] = self.node(td[key], depth + 1)
        except EncodeError as exc:
            raise exc.inside(key) from None
        return msgpack.ExtType(EXT_TENSORDICT, _packb([list(td.batch_size), entries]))

    def hashable(self, obj: Any, depth: int, what: str) -> Any:
        """A dict key or set member: a scalar, or a tuple or frozenset of them."""
        if depth > self.max_depth:
            raise EncodeError(f"value nested deeper than {self.max_depth} levels")
        frozen = isinstance(obj, frozenset)
        if frozen or (isinstance(obj, tuple) and type(obj) is not torch.Size):  # named tuples too
            inner = [self.hashable(x, depth + 1, what) for x in obj]
            return msgpack.ExtType(EXT_FROZENSET if frozen else EXT_TUPLE, _packb(inner))
        if isinstance(obj, _UNHASHABLE):
            raise EncodeError(f"{what} of type {_type_name(obj)} cannot be sent (a {what} must be a scalar, "
                              f"or a tuple or frozenset of them)")
        return self.node(obj, depth)

    def keyed_map(self, done: dict, key: Any, value: Any, rest, depth: int) -> msgpack.ExtType:
        """A dict with a key that is not a str, as ``[key, value, ...]`` (``done``: its
        str-keyed entries encoded so far, ``key``/``value`` the first other one)."""
        pairs = [x for item in done.items() for x in item]
        while True:
            try:
                pairs.append(self.hashable(key, depth + 1, "dict key"))
            except EncodeError as exc:
                raise EncodeError(f"dict key {key!r:.60}: {exc.reason}", exc.path) from None
            try:
                pairs.append(self.node(value, depth + 1))
            except EncodeError as exc:
                raise exc.inside(key) from None
            try:
                key, value = next(rest)
            except StopIteration:
                return msgpack.ExtType(EXT_MAP, _packb(pairs))

    def failing_index(self, seq: Any, depth: int) -> int:
        """The index of the first member of ``seq`` that cannot be sent (for the
        error's path; found again on the error path so that the usual path stays a
        comprehension).  The search encodes members with an encoder that finds no
        paths itself, so each level of a deep failure scans its subtree once."""
        if self.max_depth < 0 or self.finding:
            return -1
        probe = _Encoder(self.max_depth)
        probe.finding = True
        for i, x in enumerate(seq):
            try:
                probe.node(x, depth + 1)
            except EncodeError:
                return i
        return -1

    def array(self, kind: int, dtype: str, shape: list[int], view: memoryview) -> msgpack.ExtType:
        start = align_up(self.offset)
        if start != self.offset:
            self.buffers.append(_PAD[: start - self.offset])
        nbytes = view.nbytes
        if nbytes:
            self.buffers.append(view)
        self.offset = start + nbytes
        index = len(self.table)
        self.table.append([kind, dtype, shape, start, nbytes])
        if index < len(_ARRAY_REFS):
            return _ARRAY_REFS[index]
        return msgpack.ExtType(EXT_ARRAY, index.to_bytes(4, "little"))


def _nested_error() -> EncodeError:
    return EncodeError("nested tensors cannot be sent: send a list of its tensors (t.unbind()), or a padded "
                       "dense tensor (t.to_padded_tensor(0))")


def _plain_tuple_warning(cls: type) -> None:
    """Tell once per type that a tuple subclass (a namedtuple, torch.return_types...)
    comes back as a plain tuple: the wire carries no classes (nothing received may
    choose what code runs)."""
    named = hasattr(cls, "_asdict")
    warnings.warn(f"{cls.__module__}.{cls.__qualname__} ({'a namedtuple' if named else 'a tuple subclass'}) is "
                  f"sent as a plain tuple: its type and field names do not travel (send "
                  f"{'value._asdict()' if named else 'a dict'} to keep the names)", stacklevel=2)


def _what_to_send(obj: Any) -> str:
    """How to send what ``obj`` holds instead (the wire carries no classes)."""
    if isinstance(obj, torch.nn.Module):
        return ": send its parameters, module.state_dict()"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ": send its fields, dataclasses.asdict(value)"
    if isinstance(obj, enum.Enum):
        return ": send its .value or .name"
    return (": the wire carries tensors, arrays, numbers, strings, bytes, None and dicts, lists, tuples and "
            "sets of those, never classes (send the object's fields as a dict)")


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# What a dict key or set member must not be: containers and arrays (tensors hash by
# identity, which means nothing in another process).
_UNHASHABLE = (list, dict, set, bytearray, memoryview, np.ndarray, torch.Tensor)


def _numpy_scalar(obj: np.generic) -> msgpack.ExtType:
    name = NUMPY_NAMES.get(obj.dtype)
    if name is None:
        raise EncodeError(f"numpy scalar of dtype {obj.dtype} has no wire form")
    return msgpack.ExtType(EXT_SCALAR, bytes([len(name)]) + name.encode() + obj.tobytes())


def _own_bytes(t: torch.Tensor) -> tuple[int, str, list[int], memoryview] | None:
    """The usual tensor's encoding, its own memory as bytes, in one torch call (as
    :func:`small_lone`'s): ``numpy()`` refuses whatever :func:`_torch_bytes` must
    resolve or refuse (another device, autograd, conjugate or negative bits, other
    layouts, dtypes without a numpy twin), and the rest is asked of its array.  Each
    torch call costs about what the rest of encoding a tensor does (seven made the
    checks before), and torch releases the GIL in some: with other threads waiting
    for it, each release is a thread switch.  None: not such a tensor."""
    try:
        array = t.numpy()
    except (TypeError, RuntimeError):
        return None
    name = _NUMPY_TWIN_NAMES.get(array.dtype)
    if name is None or not array.size or array.ndim > MAX_DIMS or not array.flags.c_contiguous:
        return None
    return KIND_TORCH, name, list(array.shape), memoryview(array).cast("B")


def _torch_bytes(t: torch.Tensor) -> tuple[int, str, list[int], memoryview]:
    found = _own_bytes(t)
    if found is not None:
        return found
    name = TORCH_NAMES.get(t.dtype)
    if name is None:
        raise EncodeError(f"tensor dtype {t.dtype} has no fixed-width wire form")
    if t.layout != torch.strided:
        if t.is_nested:
            raise _nested_error()
        raise EncodeError(f"only strided (dense) tensors can be sent, not {t.layout}: send t.to_dense(), or its "
                          f"parts as dense tensors")
    if t.dim() > MAX_DIMS:
        raise EncodeError(f"tensors may have at most {MAX_DIMS} dimensions, not {t.dim()}")
    if t.requires_grad:
        t = t.detach()
        found = _own_bytes(t)
        if found is not None:
            return found
    if t.is_nested:  # strided layout, but no one flat view of its memory
        raise _nested_error()
    if not t.is_cpu:
        if t.is_cuda:  # its bytes stay where they are: the device engine stages them when sent
            return KIND_TORCH, name, list(t.shape), _device_span(t)
        try:
            t = t.to("cpu")
        except (NotImplementedError, RuntimeError) as exc:  # meta tensors have no data
            raise EncodeError(f"cannot read a tensor on device {t.device}: {exc}") from None
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    # A one-element tensor can be "contiguous" with any stride, which view() refuses.
    t = t.clone(memory_format=torch.contiguous_format) if t.numel() == 1 else t.contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    return KIND_TORCH, name, list(t.shape), memoryview(flat.numpy())


_SPANS = [0]  # device spans made so far (an encode that made none skips looking for them)


def _device_span(t: torch.Tensor) -> Any:
    """A :class:`~tensorshare.device.engine.DeviceSpan` standing for ``t``'s bytes (the
    device package is imported only once a device tensor is sent)."""
    from ..device import engine_of

    _SPANS[0] += 1
    return engine_of(t).span(t)


def _with_spans(enc: Encoded) -> Encoded:
    """``enc`` once its device spans are prepared (:meth:`Engine.prepare`): marked on the
    caller's streams, or staged at once when small."""
    from ..device.engine import DeviceSpan

    spans = [b for b in enc.buffers if type(b) is DeviceSpan]
    if not spans:
        return enc
    engine = spans[0].engine
    enc.buffers = engine.prepare(enc.buffers)
    if any(type(b) is DeviceSpan for b in enc.buffers):
        enc.engine = engine
    return enc


def _numpy_bytes(a: np.ndarray) -> tuple[int, str, list[int], memoryview]:
    dtype = a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype
    name = NUMPY_NAMES.get(dtype)
    if name is None:
        raise EncodeError(f"numpy.ndarray of {a.dtype} dtype has no wire form")
    if a.ndim > MAX_DIMS:
        raise EncodeError(f"arrays may have at most {MAX_DIMS} dimensions, not {a.ndim}")
    shape = list(a.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
    a = np.ascontiguousarray(a, dtype=dtype)
    return KIND_NUMPY, name, shape, memoryview(a.reshape(-1).view(np.uint8))


def encode(value: Any, *, limits: DecodeLimits = DEFAULT_LIMITS, views: bool = False) -> Encoded:
    """Split ``value`` into a description blob and zero-copy payload buffers.

    Raises :class:`EncodeError` for values that have no wire form.  Contiguous CPU
    tensors are not copied: the payload buffers view their memory, so the caller
    must not modify them until the buffers have been written out.  CUDA tensors are
    not read here: their buffers are device spans that the sender stages through
    the device engine (:mod:`tensorshare.device`), reading the tensors after the
    work queued on the caller's current stream until now; ``Encoded.engine`` is then
    set.  A lone CPU tensor of up to :data:`SMALL_COPY` bytes is copied instead
    (cheaper), unless ``views`` asks for views of every array (to find the arrays that
    are the server's shared memory).
    """
    spans = _SPANS[0]
    if type(value) is torch.Tensor and limits.max_depth >= 0:
        # A lone tensor, the most common value: what the general path below makes,
        # without building the encoder and walking a tree.
        small = None if views else small_lone(value)
        if small is not None:
            return small
        kind, dtype, shape, view = _torch_bytes(value)
        nbytes = view.nbytes
        total = align_up(nbytes)
        buffers = [view] if nbytes else []
        if total != nbytes:
            buffers.append(_PAD[: total - nbytes])
        # A lone tensor's description depends on its dtype and shape only, and the
        # same ones come again and again (a parameter vector, a rollout step):
        # packing it anew was a fifth of encoding a small tensor.
        key = (dtype, *shape)
        description = _LONE_DESCRIPTIONS.get(key)
        if description is None:
            description = _packb({"v": _ARRAY_REFS[0], "t": [[kind, dtype, shape, 0, nbytes]], "n": total})
            if len(_LONE_DESCRIPTIONS) >= _LONE_DESCRIPTIONS_MAX:
                _LONE_DESCRIPTIONS.clear()
            _LONE_DESCRIPTIONS[key] = description
        encoded = Encoded(description, buffers, total, 1)
        return encoded if _SPANS[0] == spans else _with_spans(encoded)
    enc = _Encoder(limits.max_depth)
    tree = enc.node(value, 0)
    return _finish(enc, tree, spans)


SMALL_COPY = 64 << 10  # bytes: a lone CPU tensor this small is copied into the frame at once


def small_lone(t: torch.Tensor) -> Encoded | None:
    """A lone small CPU tensor's encoding, its bytes copied (None: not one, the usual
    path encodes it).  ``numpy()`` is the one torch call: it refuses every tensor the
    usual path must resolve or refuse (another device, autograd, conjugate or negative
    bits, other layouts, dtypes without a numpy twin); each torch call costs as much
    as the rest of encoding a small tensor, and more in a process that lost its
    caches to others.  The copy is cheaper than a view of the tensor's memory, and
    takes any strides."""
    try:
        array = t.numpy()
    except (TypeError, RuntimeError):
        return None
    made = _SMALL_LONE.get((array.dtype, array.shape))
    if made is None:  # (a dtype and shape not seen before)
        made = _small_layout(array)
        if made is None:
            return None
    description, total, padding = made
    data = array.tobytes()
    return Encoded(description, [data, padding] if padding else [data], total, 1)


def _small_layout(array) -> tuple | None:
    """``(description, payload bytes, padding)`` of a small lone tensor whose numpy twin
    is ``array``, remembered by its dtype and shape; None if it is not one."""
    nbytes = array.nbytes
    name = _NUMPY_TWIN_NAMES.get(array.dtype)
    if name is None or not 0 < nbytes <= SMALL_COPY or array.ndim > MAX_DIMS:
        return None
    total = (nbytes + ALIGN - 1) & -ALIGN
    description = _packb({"v": _ARRAY_REFS[0], "t": [[KIND_TORCH, name, list(array.shape), 0, nbytes]], "n": total})
    if len(_SMALL_LONE) >= _LONE_DESCRIPTIONS_MAX:
        _SMALL_LONE.clear()
    made = _SMALL_LONE[(array.dtype, array.shape)] = (description, total, _PAD[: total - nbytes])
    return made


def _twin_names() -> dict:
    """numpy dtype of a tensor's ``numpy()`` -> the tensor's wire dtype name (where one
    numpy dtype stands for one torch dtype only)."""
    names: dict = {}
    for dtype, twin in BUFFER_DTYPES.items():
        names[twin] = None if twin in names else TORCH_NAMES[dtype]
    return {twin: name for twin, name in names.items() if name is not None}


_NUMPY_TWIN_NAMES = _twin_names()


def _finish(enc: _Encoder, tree: Any, spans: int) -> Encoded:
    total = align_up(enc.offset)
    if total != enc.offset:
        enc.buffers.append(_PAD[: total - enc.offset])
    description = _packb({"v": tree, "t": enc.table, "n": total})
    encoded = Encoded(description, enc.buffers, total, len(enc.table))
    return encoded if _SPANS[0] == spans else _with_spans(encoded)
