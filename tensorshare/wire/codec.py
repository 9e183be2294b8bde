"""Values <-> (description blob, raw payload): the tensor-aware value codec.

A value is any nesting of dict (str keys), list, tuple, str, bytes, int, float, bool,
None, ``torch.Tensor`` and ``numpy.ndarray``.  Encoding splits it in two:

* the *description*: a small msgpack blob holding the structure, the scalars, and a
  table of the arrays (kind, dtype, shape, offset, byte count);
* the *payload*: the raw bytes of every array, little-endian, C-contiguous, each
  starting at a multiple of :data:`ALIGN`, exposed as memoryviews (no copy of
  contiguous CPU tensors).

Decoding validates the description against the payload length (every offset,
length and shape is checked before anything is built) and builds arrays as views
onto one payload buffer.  Nothing here can execute code from the bytes: no pickle,
no eval.  PROTOCOL.md ("Value description") is the normative text.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import EncodeError, ProtocolError
from .dtypes import NUMPY_DTYPES, NUMPY_NAMES, TORCH_DTYPES, TORCH_NAMES

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("tensorshare's zero-copy wire format needs a little-endian host")

ALIGN = 64
"""Every array starts at a multiple of this many bytes of its item's payload."""

EXT_ARRAY = 1  # data: u32 LE index into the array table
EXT_TUPLE = 2  # data: msgpack array of nodes
EXT_BIGINT = 3  # data: signed big-endian two's complement integer

KIND_TORCH = 0
KIND_NUMPY = 1

MAX_DIMS = 64
_PAD = bytes(ALIGN)


def _buffer_dtypes() -> dict:
    """Torch dtypes whose CPU tensors export a buffer (``Tensor.numpy()``) that
    ``memoryview.cast("B")`` accepts, mapped to that buffer's numpy dtype.

    For these the encoder takes a contiguous tensor's bytes in one step and the
    decoder builds tensors through numpy, both several times cheaper per array
    than chains of torch view ops (each a dispatcher round trip).
    """
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        for dtype in TORCH_DTYPES.values():
            try:
                array = torch.zeros(2, dtype=dtype).numpy()
                memoryview(array).cast("B")
            except (TypeError, RuntimeError):  # no numpy twin (bfloat16, float8...)
                continue
            found[dtype] = array.dtype
    return found


_BUFFER_DTYPES = _buffer_dtypes()
# ExtType's constructor runs Python-level checks; references to the first arrays of a
# value are built once (ExtType is an immutable tuple, so sharing them is safe).
_ARRAY_REFS = [msgpack.ExtType(EXT_ARRAY, i.to_bytes(4, "little")) for i in range(64)]
_BUFFER_MAX_DIMS = 64  # a memoryview (and a numpy array) has at most this many dimensions
_packers = threading.local()


def _packb(obj: Any) -> bytes:
    # msgpack.packb builds a Packer per call, a large share of a small description's
    # cost; a Packer must not be shared between threads, so keep one per thread.
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds a decoder enforces on a value description before building anything."""

    max_depth: int = 64
    max_nodes: int = 1_000_000
    max_arrays: int = 100_000


DEFAULT_LIMITS = DecodeLimits()


def align_up(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Encoded:
    """An encoded value: its description and the buffers of its payload, in order."""

    description: bytes
    buffers: list  # memoryview | bytes, concatenated they form the payload
    nbytes: int  # total payload length, a multiple of ALIGN

    def payload_bytes(self) -> bytes:
        """The payload as one bytes object (a copy; for tools and tests)."""
        return b"".join(self.buffers)


class _Encoder:
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
            return float(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            out = {}
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise EncodeError(f"dict keys must be str, got {type(key).__name__}: {key!r}")
                out[str(key)] = self.node(value, depth + 1)
            return out
        if isinstance(obj, list):
            return [self.node(x, depth + 1) for x in obj]
        if isinstance(obj, tuple):
            inner = [self.node(x, depth + 1) for x in obj]
            return msgpack.ExtType(EXT_TUPLE, _packb(inner))
        raise EncodeError(f"cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}")

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


def _torch_bytes(t: torch.Tensor) -> tuple[int, str, list[int], memoryview]:
    name = TORCH_NAMES.get(t.dtype)
    if name is None:
        raise EncodeError(f"tensor dtype {t.dtype} has no fixed-width wire form")
    if t.layout != torch.strided:
        raise EncodeError(f"only strided (dense) tensors can be sent, not {t.layout}")
    if t.requires_grad:
        t = t.detach()
    if (t.is_cpu and t.dtype in _BUFFER_DTYPES and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and t.numel() and t.dim() <= _BUFFER_MAX_DIMS):
        # Fast path, the usual case: the tensor's own memory as bytes, no torch op.
        return KIND_TORCH, name, list(t.shape), memoryview(t.numpy()).cast("B")
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    return KIND_TORCH, name, list(t.shape), memoryview(flat.numpy())


def _numpy_bytes(a: np.ndarray) -> tuple[int, str, list[int], memoryview]:
    dtype = a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype
    name = NUMPY_NAMES.get(dtype)
    if name is None:
        raise EncodeError(f"numpy dtype {a.dtype} has no wire form")
    a = np.ascontiguousarray(a, dtype=dtype)
    return KIND_NUMPY, name, list(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def encode(value: Any, *, limits: DecodeLimits = DEFAULT_LIMITS) -> Encoded:
    """Split ``value`` into a description blob and zero-copy payload buffers.

    Raises :class:`EncodeError` for values that have no wire form.  Contiguous CPU
    tensors are not copied: the payload buffers view their memory, so the caller
    must not modify them until the buffers have been written out.
    """
    if type(value) is torch.Tensor and limits.max_depth >= 0:
        # A lone tensor, the most common value: what the general path below makes,
        # without building the encoder and walking a tree.
        kind, dtype, shape, view = _torch_bytes(value)
        nbytes = view.nbytes
        total = align_up(nbytes)
        buffers = [view] if nbytes else []
        if total != nbytes:
            buffers.append(_PAD[: total - nbytes])
        description = _packb({"v": _ARRAY_REFS[0], "t": [[kind, dtype, shape, 0, nbytes]], "n": total})
        return Encoded(description, buffers, total)
    enc = _Encoder(limits.max_depth)
    tree = enc.node(value, 0)
    total = align_up(enc.offset)
    if total != enc.offset:
        enc.buffers.append(_PAD[: total - enc.offset])
    description = _packb({"v": tree, "t": enc.table, "n": total})
    return Encoded(description, enc.buffers, total)


# --------------------------------------------------------------------------- decode


@dataclass
class ArraySpec:
    """One validated entry of a description's array table."""

    kind: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Description:
    """A parsed and validated value description (before arrays are built)."""

    tree: Any
    arrays: list[ArraySpec]
    nbytes: int


class _ArrayRef:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _TupleNode(list):
    """A tuple in the tree, kept as a list until its children are resolved."""


def _unpack(blob: bytes, limits: DecodeLimits, depth: int) -> Any:
    if depth > limits.max_depth:
        raise ProtocolError(f"value description nested deeper than {limits.max_depth} levels")

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            if len(data) != 4:
                raise ProtocolError("array reference must be 4 bytes")
            return _ArrayRef(int.from_bytes(data, "little"))
        if code == EXT_TUPLE:
            inner = _unpack(data, limits, depth + 1)
            if not isinstance(inner, list):
                raise ProtocolError("tuple extension must hold an array")
            return _TupleNode(inner)
        if code == EXT_BIGINT:
            if not data:
                raise ProtocolError("empty big integer")
            return int.from_bytes(data, "big", signed=True)
        raise ProtocolError(f"unknown msgpack extension type {code}")

    size = len(blob)
    try:
        return msgpack.unpackb(
            blob, raw=False, use_list=True, strict_map_key=True, ext_hook=ext_hook,
            max_str_len=size, max_bin_len=size,
            max_array_len=size, max_map_len=size, max_ext_len=size,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise ProtocolError(f"malformed value description: {exc}") from None


def _checked_spec(i: int, entry: Any, expected_offset: int) -> ArraySpec:
    if not (isinstance(entry, list) and len(entry) == 5):
        raise ProtocolError(f"array #{i}: entry must be [kind, dtype, shape, offset, nbytes]")
    kind, dtype, shape, offset, nbytes = entry
    if kind not in (KIND_TORCH, KIND_NUMPY) or type(kind) is not int:
        raise ProtocolError(f"array #{i}: unknown kind {kind!r}")
    table = NUMPY_DTYPES if kind == KIND_NUMPY else TORCH_DTYPES
    dtype_obj = table.get(dtype) if isinstance(dtype, str) else None
    if dtype_obj is None:
        raise ProtocolError(f"array #{i}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"array #{i}: shape must be a list of at most {MAX_DIMS} sizes")
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"array #{i}: shape {shape!r} must hold non-negative integers")
    if type(offset) is not int or type(nbytes) is not int:
        raise ProtocolError(f"array #{i}: offset and nbytes must be integers")
    if offset != expected_offset:
        raise ProtocolError(
            f"array #{i}: offset {offset} overlaps or leaves a gap (expected {expected_offset})"
        )
    if nbytes != math.prod(shape) * dtype_obj.itemsize:
        raise ProtocolError(f"array #{i}: {nbytes} bytes do not match shape {shape} of {dtype}")
    return ArraySpec(kind, dtype, tuple(shape), offset, nbytes)


# Recently parsed descriptions.  A program sends values of the same structure and
# shapes over and over, so servers (validating PUTs) and clients (decoding replies)
# see the same few blobs again and again; parsing one is most of the cost of a
# small value.  Parsing is a pure function of (blob, payload length, limits), so a
# hit returns exactly what parsing would: a new Description with new ArraySpecs,
# sharing only the tree, which nothing mutates (build() only reads it).
_PARSED_MAX = 1024  # entries remembered, then forgotten all at once
_PARSED_BLOB_MAX = 2048  # longer descriptions are parsed every time
_parsed: dict = {}


def parse_description(blob: bytes, payload_nbytes: int, limits: DecodeLimits = DEFAULT_LIMITS) -> Description:
    """Parse and validate a description against the payload length it travels with.

    Checks that the arrays tile the payload in order (each at the next aligned
    offset, no overlap, no gap, nothing past the end) and that every reference in
    the tree points into the table.  Raises :class:`ProtocolError` otherwise.
    """
    if type(blob) is not bytes or len(blob) > _PARSED_BLOB_MAX or type(payload_nbytes) is not int:
        return _parse_description(blob, payload_nbytes, limits)
    # Every field of DecodeLimits belongs in the key (hashing the dataclass itself
    # would run its Python-level __hash__ and __eq__ on every call).
    key = (blob, payload_nbytes, limits.max_depth, limits.max_nodes, limits.max_arrays)
    hit = _parsed.get(key)
    if hit is None:
        desc = _parse_description(blob, payload_nbytes, limits)  # raises if invalid: never cached
        if len(_parsed) >= _PARSED_MAX:
            _parsed.clear()
        _parsed[key] = (desc.tree, [(s.kind, s.dtype, s.shape, s.offset, s.nbytes) for s in desc.arrays])
        return desc
    tree, specs = hit
    return Description(tree, [ArraySpec(*spec) for spec in specs], payload_nbytes)


def check_description(blob: bytes, payload_nbytes: int, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
    """Validate like :func:`parse_description`, without building its result.

    For a server that stores descriptions as they came: a description seen before
    costs one dictionary lookup.
    """
    if (type(blob) is bytes and type(payload_nbytes) is int
            and (blob, payload_nbytes, limits.max_depth, limits.max_nodes, limits.max_arrays) in _parsed):
        return
    parse_description(blob, payload_nbytes, limits)


def _parse_description(blob: Any, payload_nbytes: Any, limits: DecodeLimits) -> Description:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ProtocolError("value description must be a byte string")
    doc = _unpack(blob if type(blob) is bytes else bytes(blob), limits, 0)
    if not (isinstance(doc, dict) and len(doc) == 3 and "v" in doc and "t" in doc and "n" in doc):
        raise ProtocolError("value description must be a map with keys v, t, n")
    table, total = doc["t"], doc["n"]
    if not isinstance(table, list) or len(table) > limits.max_arrays:
        raise ProtocolError(f"array table must be a list of at most {limits.max_arrays} entries")
    if type(total) is not int or total != payload_nbytes:
        raise ProtocolError(f"description declares {total!r} payload bytes, frame carries {payload_nbytes}")
    arrays = []
    end = 0
    for i, entry in enumerate(table):
        spec = _checked_spec(i, entry, align_up(end))
        end = spec.offset + spec.nbytes
        if end > total:
            raise ProtocolError(f"array #{i} ends at byte {end}, past the payload's {total}")
        arrays.append(spec)
    if align_up(end) != total:
        raise ProtocolError(f"payload has {total} bytes but its arrays cover {align_up(end)}")
    _check_tree(doc["v"], len(arrays), limits)
    return Description(doc["v"], arrays, total)


def _check_tree(tree: Any, n_arrays: int, limits: DecodeLimits) -> None:
    """Bound the depth and size of the tree and check every array reference."""
    stack = [(tree, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ProtocolError(f"value has more than {limits.max_nodes} nodes")
        if depth > limits.max_depth:
            raise ProtocolError(f"value nested deeper than {limits.max_depth} levels")
        if isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, _ArrayRef) and node.index >= n_arrays:
            raise ProtocolError(f"reference to array #{node.index}, table has {n_arrays}")


def build(desc: Description, payload: torch.Tensor, base: int = 0, device: Any = None) -> Any:
    """Build the value of ``desc`` with arrays viewing ``payload[base:]``.

    ``payload`` is a 1-D uint8 CPU tensor whose storage is ALIGN-aligned at ``base``.
    Tensors are moved to ``device`` if one is given; numpy arrays stay on the CPU.
    """
    if desc.arrays:
        # Slicing and viewing a numpy twin of the payload costs a fraction of the
        # same torch ops; the arrays still view the payload's memory.
        flat = payload.numpy()
        arrays = [_build_array(spec, payload, flat, base, device) for spec in desc.arrays]
    else:
        arrays = []

    def resolve(node: Any) -> Any:
        if isinstance(node, _ArrayRef):
            return arrays[node.index]
        if isinstance(node, _TupleNode):
            return tuple(resolve(x) for x in node)
        if isinstance(node, list):
            return [resolve(x) for x in node]
        if isinstance(node, dict):
            return {k: resolve(v) for k, v in node.items()}
        return node

    return resolve(desc.tree)


def _build_array(spec: ArraySpec, payload: torch.Tensor, flat: np.ndarray, base: int, device: Any) -> Any:
    start = base + spec.offset
    if spec.kind == KIND_NUMPY:
        return flat[start : start + spec.nbytes].view(NUMPY_DTYPES[spec.dtype]).reshape(spec.shape)
    dtype = TORCH_DTYPES[spec.dtype]
    twin = _BUFFER_DTYPES.get(dtype)
    if twin is not None:
        tensor = torch.from_numpy(flat[start : start + spec.nbytes].view(twin).reshape(spec.shape))
    else:
        tensor = payload[start : start + spec.nbytes].view(dtype).reshape(spec.shape)
    if device is not None:
        tensor = tensor.to(device)
    return tensor


def as_payload_tensor(data: Any) -> torch.Tensor:
    """A 1-D uint8 tensor over ``data``, copied once only if unaligned or read-only."""
    view = memoryview(data).cast("B")
    if not view.readonly and view.nbytes:
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        if tensor.data_ptr() % ALIGN == 0:
            return tensor
    tensor = torch.empty(view.nbytes, dtype=torch.uint8)
    if view.nbytes:
        tensor.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
    return tensor
