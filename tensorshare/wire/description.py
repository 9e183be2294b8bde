"""Value descriptions: parsing and validating them, with no torch or numpy needed.

A description is the small msgpack blob that travels with a value's payload: the
value's structure and scalars, and a table of its arrays (kind, dtype, shape,
offset, byte count).  :func:`parse_description` checks every offset, length and
shape against the payload before anything is built, and rejects anything but the
types the format allows: no pickle, no eval, no object construction.  The server
validates stored values with it without importing torch; :mod:`.codec` builds the
arrays.  PROTOCOL.md ("Value description") is the normative text.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable


from ..errors import ProtocolError
from .dtypes import NUMPY_WIDTHS, TORCH_WIDTHS
from .unpacking import ContainerBudget, unpack_bounded

ALIGN = 64
"""Every array starts at a multiple of this many bytes of its item's payload."""

EXT_ARRAY = 1  # data: u32 LE index into the array table
EXT_TUPLE = 2  # data: msgpack array of nodes
EXT_BIGINT = 3  # data: signed big-endian two's complement integer
EXT_MAP = 4  # data: msgpack array [key, value, key, value...]: a dict with keys that are not all str
EXT_SET = 5  # data: msgpack array of the members
EXT_FROZENSET = 6  # data: msgpack array of the members
EXT_SCALAR = 7  # data: u8 name length, numpy dtype name (ASCII), the value's bytes (little-endian)
EXT_DTYPE = 8  # data: u8 kind (0 torch, 1 numpy), dtype name (ASCII)
EXT_SIZE = 9  # data: msgpack array of ints (a torch.Size)
EXT_COMPLEX = 10  # data: 16 bytes, real and imaginary parts as float64 little-endian
EXT_TENSORDICT = 11  # data: msgpack array [batch size (array of ints), map of str keys to nodes]

KIND_TORCH = 0
KIND_NUMPY = 1

MAX_DIMS = 32  # numpy's limit before 2.0; torch allows more, the wire does not
MAX_DIM_SIZE = 1 << 48  # bound on one dimension, so that shapes stay within int64 everywhere


def align_up(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds a decoder enforces on a value description before building anything."""

    max_depth: int = 64
    max_nodes: int = 1_000_000
    max_arrays: int = 100_000


DEFAULT_LIMITS = DecodeLimits()



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


class _Special:
    """Base of the tree nodes that only :mod:`.codec` can turn into values (it has
    torch and numpy): one ``isinstance`` check lets the builder pass over plain
    scalars.  Nodes are never mutated once parsed (parsed trees are cached)."""

    __slots__ = ()


class _MapNode(_Special):
    """A dict whose keys are not all str: ``items`` is ``[key, value, key, value...]``."""

    __slots__ = ("items",)

    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)


class _SetNode(_Special):
    """A set (``frozen=False``) or frozenset: ``items`` holds its members."""

    __slots__ = ("items", "frozen")

    def __init__(self, items: list, frozen: bool):
        self.items = items
        self.frozen = frozen

    def __len__(self) -> int:
        return len(self.items)


class _ScalarNode(_Special):
    """A numpy scalar: its dtype's wire name and its bytes (checked to be one element)."""

    __slots__ = ("dtype", "data")

    def __init__(self, dtype: str, data: bytes):
        self.dtype = dtype
        self.data = data


class _DtypeNode(_Special):
    """A ``torch.dtype`` (kind :data:`KIND_TORCH`) or ``numpy.dtype`` (:data:`KIND_NUMPY`)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: int, name: str):
        self.kind = kind
        self.name = name


class _SizeNode(_Special):
    """A ``torch.Size``: ``dims`` is a tuple of ints."""

    __slots__ = ("dims",)

    def __init__(self, dims: tuple):
        self.dims = dims


class _TensorDictNode(_Special):
    """A ``tensordict.TensorDict``: its batch size and its entries (str keys)."""

    __slots__ = ("batch", "entries")

    def __init__(self, batch: tuple, entries: dict):
        self.batch = batch
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)


def _tensordict_node(inner: Any) -> _TensorDictNode:
    if not (isinstance(inner, list) and len(inner) == 2 and isinstance(inner[0], list)
            and isinstance(inner[1], dict) and len(inner[0]) <= MAX_DIMS
            and all(type(d) is int and 0 <= d <= MAX_DIM_SIZE for d in inner[0])):
        raise ProtocolError(f"TensorDict extension must hold [batch size of at most {MAX_DIMS} sizes, map]")
    return _TensorDictNode(tuple(inner[0]), inner[1])


_CONTAINER_EXTS = {EXT_TENSORDICT: "TensorDict", EXT_MAP: "map", EXT_SET: "set", EXT_FROZENSET: "frozenset", EXT_SIZE: "torch.Size"}
_INT64 = (-(1 << 63), 1 << 63)


def _scalar_node(data: bytes) -> _ScalarNode:
    n = data[0] if data else 0
    name = data[1 : 1 + n].decode("ascii", "replace")
    width = NUMPY_WIDTHS.get(name)
    if width is None or len(data) != 1 + n + width:
        raise ProtocolError(f"numpy scalar extension: unknown dtype {name!r:.40} or wrong length {len(data)}")
    raw = data[1 + n :]
    if name == "bool" and raw not in (b"\x00", b"\x01"):
        raise ProtocolError("numpy scalar extension: a bool must be the byte 0 or 1")
    return _ScalarNode(name, raw)


def _dtype_node(data: bytes) -> _DtypeNode:
    kind = data[0] if data else -1
    name = data[1:].decode("ascii", "replace")
    widths = NUMPY_WIDTHS if kind == KIND_NUMPY else TORCH_WIDTHS if kind == KIND_TORCH else {}
    if name not in widths:
        raise ProtocolError(f"dtype extension: unknown dtype {name!r:.40} of kind {kind}")
    return _DtypeNode(kind, name)


def _unpack(blob: bytes, limits: DecodeLimits, depth: int, budget: ContainerBudget | None = None) -> Any:
    if depth > limits.max_depth:
        raise ProtocolError(f"value description nested deeper than {limits.max_depth} levels")

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            if len(data) != 4:
                raise ProtocolError("array reference must be 4 bytes")
            return _ArrayRef(int.from_bytes(data, "little"))
        if code == EXT_TUPLE:
            budget.copied(data)
            inner = _unpack(data, limits, depth + 1, budget)
            if not isinstance(inner, list):
                raise ProtocolError("tuple extension must hold an array")
            return _TupleNode(inner)
        if code == EXT_BIGINT:
            if not data:
                raise ProtocolError("empty big integer")
            return int.from_bytes(data, "big", signed=True)
        if code in _CONTAINER_EXTS:
            budget.copied(data)
            inner = _unpack(data, limits, depth + 1, budget)
            if not isinstance(inner, list):
                raise ProtocolError(f"{_CONTAINER_EXTS[code]} extension must hold an array")
            if code == EXT_MAP:
                if len(inner) % 2:
                    raise ProtocolError("map extension must hold key, value pairs")
                return _MapNode(inner)
            if code == EXT_TENSORDICT:
                return _tensordict_node(inner)
            if code == EXT_SIZE:
                if not all(type(d) is int and _INT64[0] <= d < _INT64[1] for d in inner):
                    raise ProtocolError("torch.Size extension must hold 64-bit integers")
                return budget(_SizeNode(tuple(inner)))
            return _SetNode(inner, code == EXT_FROZENSET)
        # The fixed-size kinds below turn a few bytes into an object: they count as
        # containers, so the same rule bounds the memory they take.
        if code == EXT_SCALAR:
            return budget(_scalar_node(data))
        if code == EXT_DTYPE:
            return budget(_dtype_node(data))
        if code == EXT_COMPLEX:
            if len(data) != 16:
                raise ProtocolError("complex extension must be 16 bytes")
            return budget(complex(*struct.unpack("<dd", data)))
        raise ProtocolError(f"unknown msgpack extension type {code}")

    if budget is None:  # one count for the tuples inside too
        budget = ContainerBudget(len(blob), "value description")
    return unpack_bounded(blob, "value description", budget=budget, ext_hook=ext_hook)


def _checked_spec(i: int, entry: Any, expected_offset: int) -> ArraySpec:
    if not (isinstance(entry, list) and len(entry) == 5):
        raise ProtocolError(f"array #{i}: entry must be [kind, dtype, shape, offset, nbytes]")
    kind, dtype, shape, offset, nbytes = entry
    if kind not in (KIND_TORCH, KIND_NUMPY) or type(kind) is not int:
        raise ProtocolError(f"array #{i}: unknown kind {kind!r}")
    widths = NUMPY_WIDTHS if kind == KIND_NUMPY else TORCH_WIDTHS
    width = widths.get(dtype) if isinstance(dtype, str) else None
    if width is None:
        raise ProtocolError(f"array #{i}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"array #{i}: shape must be a list of at most {MAX_DIMS} sizes")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM_SIZE:
            raise ProtocolError(f"array #{i}: shape {shape!r} must hold non-negative integers of at most 2**48")
    if type(offset) is not int or type(nbytes) is not int:
        raise ProtocolError(f"array #{i}: offset and nbytes must be integers")
    if offset != expected_offset:
        raise ProtocolError(
            f"array #{i}: offset {offset} overlaps or leaves a gap (expected {expected_offset})"
        )
    if math.prod(d or 1 for d in shape) > MAX_DIM_SIZE:  # also bounds zero-size shapes
        raise ProtocolError(f"array #{i}: shape {shape!r} has more than 2**48 elements")
    if nbytes != math.prod(shape) * width:
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


_SCALARS = (type(None), bool, int, float, str, bytes, complex, _ScalarNode, _DtypeNode, _SizeNode)
_KEY_LEAVES = frozenset(_SCALARS)  # what a dict key or a set member may be, besides tuples and frozensets


def _check_tree(tree: Any, n_arrays: int, limits: DecodeLimits) -> None:
    """Bound the depth and size of the tree, allow only the format's types (msgpack
    would also produce timestamps and bytes map keys), check every array reference.

    Only containers wait on the stack (with their depth), so checking a long list
    of scalars costs no memory beyond the list itself."""
    nodes = 1
    if type(tree) not in _CONTAINERS:
        _check_leaf(tree, n_arrays)
        return
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth >= limits.max_depth and node:
            raise ProtocolError(f"value nested deeper than {limits.max_depth} levels")
        if type(node) is dict:
            for key in node:
                if type(key) is not str:
                    raise ProtocolError(f"map keys must be str, got {type(key).__name__} {key!r:.40}")
            children = node.values()
        elif type(node) is _MapNode:
            _check_keys(node.items[::2], "map key")
            children = node.items
        elif type(node) is _SetNode:
            _check_keys(node.items, "set member")
            children = node.items
        elif type(node) is _TensorDictNode:
            for key in node.entries:
                if type(key) is not str:
                    raise ProtocolError(f"TensorDict keys must be str, got {type(key).__name__} {key!r:.40}")
            children = node.entries.values()
        else:
            children = node
        nodes += len(children)
        if nodes > limits.max_nodes:
            raise ProtocolError(f"value has more than {limits.max_nodes} nodes")
        for child in children:
            kind = type(child)
            if kind in _CONTAINERS:
                stack.append((child, depth + 1))
            else:
                _check_leaf(child, n_arrays)


def _check_leaf(node: Any, n_arrays: int) -> None:
    if type(node) is _ArrayRef:
        if node.index >= n_arrays:
            raise ProtocolError(f"reference to array #{node.index}, table has {n_arrays}")
    elif type(node) not in _SCALARS:
        raise ProtocolError(f"value holds a {type(node).__name__}, which the format does not allow")


_CONTAINERS = frozenset((list, _TupleNode, dict, _MapNode, _SetNode, _TensorDictNode))


def _check_keys(keys: list, what: str) -> None:
    """Dict keys and set members must be hashable (scalars, tuples and frozensets of
    them) and distinct: a receiver must not quietly drop entries.  Distinct here is
    checked for plain scalars, which Python compares as it will in the dict
    (1 == 1.0 == True); the builder checks the values it makes too."""
    seen = set()
    for key in keys:
        _check_hashable(key, what)
        if type(key) in _PLAIN_KEYS:
            if key in seen:
                raise ProtocolError(f"duplicate {what} {key!r:.40}")
            seen.add(key)


_PLAIN_KEYS = frozenset((type(None), bool, int, float, str, bytes, complex))


def _check_hashable(node: Any, what: str) -> None:
    kind = type(node)
    if kind in _KEY_LEAVES:
        return
    if kind is _TupleNode or (kind is _SetNode and node.frozen):
        for child in node if kind is _TupleNode else node.items:
            _check_hashable(child, what)  # as deep as the tuples' own nesting limit
        return
    raise ProtocolError(f"a {what} must be a scalar, tuple or frozenset, not {_node_name(node)}")


def _node_name(node: Any) -> str:
    kind = type(node)
    if kind is _ArrayRef:
        return "an array"
    if kind is _MapNode or kind is dict:
        return "a dict"
    if kind is _SetNode:
        return "a set"
    if kind is _TensorDictNode:
        return "a TensorDict"
    return f"a {kind.__name__}"


def template_targets(template: Any) -> Callable[[int, Description], dict]:
    """``into`` for a value shaped like the items (``peek(..., into=...)``): for an
    item's description, ``{array index: tensor}`` with the tensors of ``template``
    where the item has an array at the same place (dict keys, list and tuple
    positions).  Whether each tensor can take its array is the receiver's check."""
    def targets(item: int, desc: Description) -> dict:
        found: dict = {}
        _match(desc.tree, template, found)
        return found
    return targets


def _match(node: Any, template: Any, found: dict) -> None:
    if isinstance(node, _ArrayRef):
        if hasattr(template, "is_contiguous"):  # a tensor
            found[node.index] = template
        return
    if isinstance(node, dict) and isinstance(template, dict):
        for key, value in node.items():
            if key in template:
                _match(value, template[key], found)
    elif isinstance(node, (list, _TupleNode)) and isinstance(template, (list, tuple)):
        for value, slot in zip(node, template):
            _match(value, slot, found)
