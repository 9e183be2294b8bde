"""CUDA memory shared by reference on one host: a snapshot exported, opened and copied out (PROTOCOL.md §13).

:func:`snapshot` copies a value's payload into one new block of device memory
(:meth:`~.engine.Engine.snapshot`: queued, the host does not wait) and
:func:`share` makes it the *reference* the server keeps beside the item, once the
copies are done: the block's CUDA IPC handle and a digest of each array there
(:func:`export` does both at once).  :func:`load` is the reader's side on the same
host: it opens the reference (the block is mapped into its process), copies the
item device to device into its own memory (or straight into destination
tensors), checks the digests there and lets the mapping go: a reader never keeps
a view of memory the publisher may reuse.  CUDA opens no handle in the process
that exported it, so a reader in the publisher's own process (an evaluator, a
worker beside the trainer) copies from the snapshot itself, found by its
handle.  A reference that cannot be opened (a device this process does not see, a
publisher that is gone), that names memory beyond its device, or whose digests do
not match raises :class:`~tensorshare.errors.DeviceReferenceError`, and the read
is made again for the item's bytes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ..errors import DeviceReferenceError
from ..wire.codec import Encoded, build
from ..wire.description import DEFAULT_LIMITS, DecodeLimits, parse_description
from .engine import DeviceSpan, Engine
from .payload import item_layout

log = logging.getLogger("tensorshare.device")

MIN_HANDLE = 64  # bytes of a cudaIpcMemHandle_t: torch reads that many
MAX_HANDLE = 64 << 10  # what the server takes (PROTOCOL.md §13.1): an expandable segment's handle is longer

# This process's shared snapshots, by (device UUID, handle, offset): what its own readers copy from.
_exported: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()
_exported_lock = threading.Lock()
_fallback_told = [False]


def digests(arrays: list[torch.Tensor]) -> list[int]:
    """A 64-bit checksum of each array (a 1-D uint8 tensor), computed where the arrays
    are, with one wait for all: the wrapping sum of its whole 8-byte words (as
    little-endian int64) and of each of its last ``n % 8`` bytes.  Enough to tell a
    copy of freed or reused memory from the snapshot; not a defence against a forger."""
    sums = []
    for array in arrays:
        whole = array.numel() // 8 * 8
        words = array[:whole]
        if words.storage_offset() % 8:  # (a destination tensor at an odd offset: rare)
            words = words.clone()
        total = words.view(torch.int64).sum()
        if whole != array.numel():
            total = total + array[whole:].to(torch.int64).sum()
        sums.append(total)
    return torch.stack(sums).tolist() if sums else []


class Unshareable(RuntimeError):
    """Torch cannot share this block of device memory (an expandable segment, say)."""


def shares(engine: Any) -> bool:
    """Whether ``engine``'s device memory can be shared by reference."""
    return engine is not None and hasattr(engine.streams, "share")


class Snapshot(NamedTuple):
    """A value's payload being copied into one block of device memory (:func:`snapshot`)."""

    enc: Encoded  # the value, its payload in that block (one device span)
    index: int  # the device
    event: Any  # the copies are done once it has happened


def snapshot(enc: Encoded) -> Snapshot:
    """Queue the copy of ``enc``'s payload (a value with device arrays, ``enc.engine``
    set) into one new block of device memory: later changes to the tensors do not
    reach it, and the host does not wait (the caller's stream runs its later work
    after the copies)."""
    engine: Engine = enc.engine
    index = next(b.index for b in enc.buffers if type(b) is DeviceSpan)
    flat, event = engine.snapshot(enc.buffers, index)
    span = DeviceSpan(flat, engine, index)
    span.mark = event
    return Snapshot(Encoded(enc.description, [span], enc.nbytes, enc.arrays, engine), index, event)


def share(taken: Snapshot) -> tuple[dict, Encoded]:
    """``(reference, snapshot)``: the block of ``taken``, once its copies are done (the
    host waits for them: readers do not), shared by CUDA IPC.  Keep the snapshot
    until the server says nothing holds the reference.  Raises RuntimeError where
    torch cannot share the block (:class:`Unshareable`)."""
    enc, index = taken.enc, taken.index
    engine: Engine = enc.engine
    streams = engine.streams
    streams.synchronize(taken.event)  # whole before anyone else may read it
    flat = enc.buffers[0].tensor
    desc = parse_description(enc.description, enc.nbytes)
    try:
        ipc = streams.share(flat)
    except RuntimeError as exc:
        raise Unshareable(str(exc)) from None
    uuid = streams.uuid(index)
    # (on the engine's stream: not behind the caller's queued work)
    sums = engine.on_side(index, lambda: digests([flat[s.offset : s.offset + s.nbytes] for s in desc.arrays]))
    with _exported_lock:
        _exported[(uuid, bytes(ipc[1]), ipc[3])] = flat
    return {"id": secrets.randbits(63) or 1, "dev": uuid, "ipc": ipc, "digest": sums}, enc


def export(enc: Encoded) -> tuple[dict, Encoded]:
    """:func:`share` of :func:`snapshot`: ``enc`` shared by reference at once."""
    return share(snapshot(enc))


def cannot_share(exc: BaseException) -> None:
    """Say once per process why values are put by their bytes instead of by reference."""
    level = logging.DEBUG if _fallback_told[0] else logging.WARNING
    _fallback_told[0] = True
    log.log(level, "device memory cannot be shared by reference (%s): values are put by their bytes, and same-host "
                   "readers copy them from the server (with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                   "torch shares memory only between processes that may trace each other)", exc)


def load(ref: dict, description: bytes, size: int, device: Any, limits: DecodeLimits = DEFAULT_LIMITS,
         into: Any = None, caller: Any = None) -> Any:
    """The value of an item a 226 reply refers to by device reference, copied into
    memory of ``device`` (into ``into(description)``'s tensors where they fit) and
    handed to ``caller``'s stream (a :class:`~.payload.Caller`; None: the current
    stream)."""
    from . import engine_for

    engine = engine_for(device)
    if not shares(engine):
        raise DeviceReferenceError(f"device {device!r} cannot open device references")
    streams = engine.streams
    index = streams.index(device)
    desc = parse_description(description, size, limits)
    layout = item_layout(desc, 0, into(desc) if into is not None else {}, engine, index)
    if layout is None:
        raise DeviceReferenceError("an item holding numpy arrays is not read by device reference")
    uuid = ref.get("dev")
    where = streams.local_index(uuid)
    if where is None:
        raise DeviceReferenceError(f"device {uuid!r} is not visible to this process")
    ipc = _checked(ref.get("ipc"), size, streams.total_memory(where))
    targeted = any(target is not None for _o, _n, target in layout)
    with _exported_lock:
        own = _exported.get((uuid, ipc[1], ipc[3]))
    source = [own if own is not None and own.numel() >= size else None]
    try:
        if source[0] is None:
            try:
                source[0] = streams.open_shared(ipc, where)
            except (RuntimeError, TypeError, ValueError) as exc:  # another device, a publisher gone...
                raise DeviceReferenceError(f"cannot open the device reference: {exc}") from None
            if source[0].numel() < size:
                raise DeviceReferenceError("the device reference holds fewer bytes than the item")
        try:
            payload = engine.copy_in(source[0], size, index, layout if targeted else None, caller)
        except RuntimeError as exc:  # no room on the device, say: the bytes are read instead
            raise DeviceReferenceError(f"cannot copy the item by device reference: {exc}") from None
        got = engine.on_side(index, lambda: digests([payload.bytes_at(s.offset, s.nbytes) for s in desc.arrays]))
    finally:
        # Let the mapping go with the engine's stream current: torch's clean-up of a
        # received block synchronises the current stream, which is the engine's
        # (its copies are done by now), not the caller's with its queued work.
        engine.on_side(index, source.clear)
    if got != ref.get("digest"):
        raise DeviceReferenceError("the item read by device reference does not match its digest (its publisher's "
                                   "memory changed or is gone)")
    return build(desc, payload)


def _checked(ipc: Any, size: int, device_bytes: int) -> list:
    """The IPC fields of a reference, refused unless torch can be handed them: a
    handle of a size torch reads, and a block within the device's memory that
    holds the item (torch maps what it is told, and reading past the block is a
    fault of this process's CUDA context)."""
    if type(ipc) is not list or len(ipc) != 8:
        raise DeviceReferenceError("a device reference's ipc has 8 fields")
    handle, block, offset = ipc[1], ipc[2], ipc[3]
    if type(handle) is not bytes or not MIN_HANDLE <= len(handle) <= MAX_HANDLE:
        raise DeviceReferenceError(f"a CUDA IPC handle has {MIN_HANDLE} to {MAX_HANDLE} bytes")
    if type(block) is not int or type(offset) is not int or not size <= block <= device_bytes or \
            not 0 <= offset <= device_bytes - block:
        raise DeviceReferenceError(f"a device reference names {block!r} bytes at {offset!r}: not the item's "
                                   f"{size} bytes within the device's {device_bytes}")
    return ipc
