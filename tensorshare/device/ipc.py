"""CUDA memory shared by reference on one host: a snapshot exported, opened and copied out (PROTOCOL.md §13).

:func:`export` snapshots a value's payload into one new block of device memory
(:meth:`~.engine.Engine.snapshot`), waits for it, computes a digest of each array
there and makes the block's CUDA IPC handle: the *reference* the server keeps
beside the item.  :func:`load` is the reader's side on the same host: it opens
the reference (the block is mapped into its process), copies the item device to
device into its own memory (or straight into destination tensors), checks the
digests there and lets the mapping go: a reader never keeps a view of memory the
publisher may reuse.  A reference that cannot be opened (a device this process
does not see, a publisher that is gone) or whose digests do not match raises
:class:`~tensorshare.errors.DeviceReferenceError`, and the read is made again for
the item's bytes.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from ..errors import DeviceReferenceError
from ..wire.codec import Encoded, build
from ..wire.description import DEFAULT_LIMITS, DecodeLimits, parse_description
from .engine import DeviceSpan, Engine
from .payload import item_layout


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


def shares(engine: Any) -> bool:
    """Whether ``engine``'s device memory can be shared by reference."""
    return engine is not None and hasattr(engine.streams, "share")


def export(enc: Encoded) -> tuple[dict, Encoded]:
    """``(reference, snapshot)``: a value with device arrays (``enc.engine`` set)
    snapshotted into one block of device memory and shared by CUDA IPC, and the
    snapshot as an encoded value (to upload its bytes, or to send them instead).
    Keep the snapshot until the server says nothing holds the reference."""
    engine: Engine = enc.engine
    index = next(b.index for b in enc.buffers if type(b) is DeviceSpan)
    flat, event = engine.snapshot(enc.buffers, index)
    engine.streams.synchronize(event)  # whole before anyone else may read it
    desc = parse_description(enc.description, enc.nbytes)
    ref = {"id": secrets.randbits(63) or 1, "dev": engine.streams.uuid(index),
           "ipc": engine.streams.share(flat),
           "digest": digests([flat[spec.offset : spec.offset + spec.nbytes] for spec in desc.arrays])}
    span = DeviceSpan(flat, engine, index)
    return ref, Encoded(enc.description, [span], enc.nbytes, enc.arrays, engine)


def load(ref: dict, description: bytes, size: int, device: Any, limits: DecodeLimits = DEFAULT_LIMITS,
         into: Any = None) -> Any:
    """The value of an item a 226 reply refers to by device reference, copied into
    memory of ``device`` (into ``into(description)``'s tensors where they fit)."""
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
    where = streams.local_index(ref.get("dev"))
    if where is None:
        raise DeviceReferenceError(f"device {ref.get('dev')!r} is not visible to this process")
    try:
        source = streams.open_shared(ref["ipc"], where)
    except (RuntimeError, TypeError, ValueError) as exc:  # another device, a publisher gone...
        raise DeviceReferenceError(f"cannot open the device reference: {exc}") from None
    if source.numel() < size:
        raise DeviceReferenceError("the device reference holds fewer bytes than the item")
    targeted = any(target is not None for _o, _n, target in layout)
    payload = engine.copy_in(source, size, index, layout if targeted else None)
    del source  # the publisher's block is mapped no longer
    got = digests([payload.bytes_at(spec.offset, spec.nbytes) for spec in desc.arrays])
    if got != ref.get("digest"):
        raise DeviceReferenceError("the item read by device reference does not match its digest (its publisher's "
                                   "memory changed or is gone)")
    return build(desc, payload)
