"""Descriptions and payloads back into values: the decoding half of the codec (:mod:`.codec`).

:func:`build` makes a value's arrays as views onto one received payload buffer
(numpy arrays and CPU tensors alike, without a copy) and puts the structure the
description holds around them; a payload received into device memory gives
tensors there.  The description was checked against the payload's length before
(:mod:`.description`).  :func:`payload_buffer` and :func:`empty_payload` give the
aligned memory a payload is received into.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from ..errors import ProtocolError
from .description import (
    ALIGN, DEFAULT_LIMITS, KIND_NUMPY, KIND_TORCH, ArraySpec, DecodeLimits, Description, _ArrayRef, _DtypeNode,
    _MapNode, _ScalarNode, _SetNode, _SizeNode, _Special, _TensorDictNode, _TupleNode, parse_description,
)
from .torch_dtypes import BUFFER_DTYPES, NUMPY_DTYPES, TORCH_DTYPES


def build(desc: Description, payload: np.ndarray | torch.Tensor, base: int = 0, device: Any = None) -> Any:
    """Build the value of ``desc`` with arrays viewing ``payload[base:]``.

    ``payload`` is a 1-D uint8 numpy array or CPU tensor, ALIGN-aligned at ``base``.
    Tensors are moved to ``device`` if one is given; numpy arrays stay on the CPU.
    A payload that arrived into device memory (a
    :class:`~tensorshare.device.payload.DevicePayload`) gives tensors viewing it
    there, handed to the caller's stream.
    """
    if desc.arrays:
        # Slicing and viewing a numpy twin of the payload costs a fraction of the
        # same torch ops; the arrays still view the payload's memory.
        if isinstance(payload, np.ndarray):
            flat = payload
        elif isinstance(payload, torch.Tensor):
            flat = payload.numpy()
        else:
            return _build_on_device(desc, payload, base)
        arrays = [array_view(spec, flat, base + spec.offset, device) for spec in desc.arrays]
    else:
        arrays = []
    return assemble(desc, arrays)


_LONE: dict = {}  # (description blob, payload bytes) -> (numpy twin, count, shape or None, dtype) of a lone tensor
_LONE_MAX = 1024


def build_item(blob: bytes, size: int, payload: Any, base: int = 0, device: Any = None,
               limits: DecodeLimits = DEFAULT_LIMITS) -> Any:
    """The value of one item: its description ``blob`` parsed against its ``size`` bytes
    at ``payload[base:]``, then :func:`build`.  A lone CPU tensor whose dtype has a
    numpy twin, the most common item, seen before: one view and one ``from_numpy``
    (a fifth of the general path's cost)."""
    if device is None and limits is DEFAULT_LIMITS and type(payload) is np.ndarray:
        lone = _LONE.get((blob, size))
        if lone is not None:
            twin, count, shape, _ = lone
            array = np.frombuffer(payload, twin, count, base)
            return torch.from_numpy(array if shape is None else array.reshape(shape))
    desc = parse_description(blob, size, limits)
    if type(desc.tree) is _ArrayRef and len(desc.arrays) == 1 and type(blob) is bytes and limits is DEFAULT_LIMITS:
        _remember_lone(blob, size, desc.arrays[0])
    return build(desc, payload, base, device)


def _remember_lone(blob: bytes, size: int, spec: ArraySpec) -> None:
    twin = BUFFER_DTYPES.get(TORCH_DTYPES.get(spec.dtype)) if spec.kind == KIND_TORCH else None
    if twin is None or not spec.nbytes or spec.offset:
        return
    if len(_LONE) >= _LONE_MAX:
        _LONE.clear()
    _LONE[(blob, size)] = (twin, spec.nbytes // twin.itemsize, None if len(spec.shape) == 1 else tuple(spec.shape),
                           TORCH_DTYPES[spec.dtype])


def lone_copy(blob: bytes, size: int, data) -> torch.Tensor | None:
    """A lone CPU tensor :func:`build_item` has built before from this description,
    made from a copy of ``data`` (a small payload still in a read buffer): one
    ``bytearray`` and one ``frombuffer``, instead of an aligned array and a view of
    it.  None where it has not (:func:`build_item` then builds it)."""
    lone = _LONE.get((blob, size))
    if lone is None:
        return None
    _, count, shape, dtype = lone
    tensor = torch.frombuffer(bytearray(data), dtype=dtype, count=count)  # (the padding after it left out)
    return tensor if shape is None else tensor.reshape(shape)


def _build_on_device(desc: Description, payload: Any, base: int) -> Any:
    """The value of ``desc`` over a device payload: each array a view of its bytes
    there, or the destination tensor they were received into."""
    payload.deliver()
    arrays = []
    for spec in desc.arrays:
        start = base + spec.offset
        target = payload.target(start) if spec.nbytes else None  # (an empty array shares the next one's offset)
        if target is not None:
            arrays.append(target)
            continue
        dtype = TORCH_DTYPES.get(spec.dtype)
        if dtype is None or spec.kind != KIND_TORCH:
            raise ProtocolError(f"array of {spec.dtype} cannot be built in device memory")
        data = payload.bytes_at(start, spec.nbytes)
        if spec.nbytes:
            arrays.append(data.view(dtype).reshape(spec.shape))
        else:
            arrays.append(data.new_empty(spec.shape, dtype=dtype))
    return assemble(desc, arrays)


def assemble(desc: Description, arrays: list) -> Any:
    """The value of ``desc``, with ``arrays[i]`` wherever it refers to array ``i``."""
    return _resolve(desc.tree, arrays)


def _resolve(node: Any, arrays: list) -> Any:
    # A module-level function, not a closure: a nested function that calls itself
    # is a reference cycle (function -> cell -> function) that would keep ``arrays``,
    # and the received payload they view, alive until the cyclic collector runs.
    if isinstance(node, _ArrayRef):
        return arrays[node.index]
    if isinstance(node, _TupleNode):
        return tuple(_resolve(x, arrays) for x in node)
    if isinstance(node, list):
        return [_resolve(x, arrays) for x in node]
    if isinstance(node, dict):
        return {k: _resolve(v, arrays) for k, v in node.items()}
    if isinstance(node, _Special):
        return _BUILDERS[type(node)](node, arrays)
    return node


def _build_map(node: _MapNode, arrays: list) -> dict:
    items = node.items
    out = {_resolve(items[i], arrays): _resolve(items[i + 1], arrays) for i in range(0, len(items), 2)}
    if 2 * len(out) != len(items):
        raise ProtocolError("map extension holds equal keys")
    return out


def _build_set(node: _SetNode, arrays: list) -> set | frozenset:
    out = (frozenset if node.frozen else set)(_resolve(x, arrays) for x in node.items)
    if len(out) != len(node.items):
        raise ProtocolError("set extension holds equal members")
    return out


def _build_scalar(node: _ScalarNode, arrays: list) -> np.generic:
    return np.frombuffer(node.data, dtype=NUMPY_DTYPES[node.dtype])[0]


def _build_dtype(node: _DtypeNode, arrays: list) -> torch.dtype | np.dtype:
    if node.kind == KIND_NUMPY:
        return NUMPY_DTYPES[node.name]
    dtype = TORCH_DTYPES.get(node.name)
    if dtype is None:
        raise ProtocolError(f"dtype {node.name} is not supported by this torch build ({torch.__version__})")
    return dtype


def _build_tensordict(node: _TensorDictNode, arrays: list) -> Any:
    entries = {key: _resolve(value, arrays) for key, value in node.entries.items()}
    try:
        from tensordict import TensorDict, TensorDictBase
    except ImportError:  # optional: without it the entries arrive, as a dict
        return entries
    try:
        td = TensorDict({}, batch_size=node.batch)
        for key, value in entries.items():
            if isinstance(value, (torch.Tensor, TensorDictBase)):
                td.set(key, value)
            else:
                td.set_non_tensor(key, value)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:  # shapes that do not match the batch size
        raise ProtocolError(f"TensorDict extension: {exc}") from None
    return td


_BUILDERS = {
    _MapNode: _build_map, _SetNode: _build_set, _ScalarNode: _build_scalar, _DtypeNode: _build_dtype,
    _SizeNode: lambda node, arrays: torch.Size(node.dims), _TensorDictNode: _build_tensordict,
}


def array_view(spec: ArraySpec, flat: np.ndarray, start: int, device: Any = None) -> Any:
    """The array ``spec`` describes, viewing ``flat[start:start + spec.nbytes]`` (uint8)."""
    data = flat[start : start + spec.nbytes]
    if spec.kind == KIND_NUMPY:
        return data.view(NUMPY_DTYPES[spec.dtype]).reshape(spec.shape)
    dtype = TORCH_DTYPES.get(spec.dtype)
    if dtype is None:
        raise ProtocolError(f"dtype {spec.dtype} is not supported by this torch build ({torch.__version__})")
    twin = BUFFER_DTYPES.get(dtype)
    if twin is not None:
        tensor = torch.from_numpy(data.view(twin).reshape(spec.shape))
    elif spec.nbytes:
        tensor = torch.from_numpy(data).view(dtype).reshape(spec.shape)
    else:  # numpy gives an empty array stride 0, which torch will not view as another width
        tensor = torch.empty(spec.shape, dtype=dtype)
    if device is not None:
        tensor = tensor.to(device)
    return tensor


_SMALL_PAYLOAD = 1 << 20  # payload_buffer() takes numpy's memory up to this size, torch's above


def payload_buffer(nbytes: int) -> np.ndarray:
    """A new 1-D uint8 array of ``nbytes``, ALIGN-aligned, to receive a payload into.

    A small one is a slice of a numpy array ALIGN bytes longer: ``torch.empty`` and
    ``.numpy()`` cost several times as much, and each releases the GIL, which costs
    a thread switch whenever another thread waits for it.  A large one views a tensor from :func:`empty_payload`.
    """
    if nbytes > _SMALL_PAYLOAD:
        return empty_payload(nbytes).numpy()
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -_address(raw) % ALIGN
    return raw[start : start + nbytes]


def _address(array: np.ndarray) -> int:
    """Where ``array``'s (writable, non-empty) memory starts: a third of the cost of
    ``__array_interface__``, which builds a dict each time."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array))


def empty_payload(nbytes: int) -> torch.Tensor:
    """A new 1-D uint8 tensor of ``nbytes``, ALIGN-aligned, for receiving a payload.

    ``torch.empty`` aligns to 64 bytes.  (Not numpy's allocator: it asks for huge
    pages, which the kernel compacts memory for on first touch: docs/design.md.)
    """
    return torch.empty(nbytes, dtype=torch.uint8)


def as_payload_tensor(data: Any) -> torch.Tensor:
    """A 1-D uint8 tensor over ``data``, copied once only if unaligned or read-only."""
    view = memoryview(data).cast("B")
    if not view.readonly and view.nbytes:
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        if tensor.data_ptr() % ALIGN == 0:
            return tensor
    tensor = empty_payload(view.nbytes)
    if view.nbytes:
        tensor.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
    return tensor
