"""Replies into device memory: a large reply to a call that wants its tensors on a device goes there as it arrives.

A call wants a device when the client was made with one (``Client(device="cuda")``)
or the call names one (``sample(..., device="cuda")``).  Its connection's decoder
then receives a large items reply (226) through the device engine
(:class:`~tensorshare.device.engine.Incoming`): the socket reads into pinned
windows, and each full window is copied to device memory while the next one
arrives, instead of the whole reply landing in host memory first and moving
tensor by tensor.  ``into`` (``peek(..., into=...)``) names destination tensors,
a model's own parameters say: the arrays that match one (dtype, shape, device,
contiguous) are received straight into it.

Replies that hold numpy arrays, and small ones, are received as before and moved.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..errors import ProtocolError, UsageError
from ..protocol.messages import ITEMS, Key
from ..wire.description import DEFAULT_LIMITS, parse_description, template_targets
from ..protocol.items import item_table

log = logging.getLogger("tensorshare.client")

DEVICE_MIN = 1 << 20  # replies from this many payload bytes arrive into device memory directly


def device_sink(call, default_device: Any, header: dict, nbytes: int):
    """The engine's sink for a reply to ``call`` (in flight; None: nobody waits for it)
    if it wants a device (its own, else ``default_device``), or None (the plain sink:
    not an items reply, no device wanted, or arrays the device cannot hold)."""
    if header.get(Key.CODE) != ITEMS or call is None:
        return None
    device = call.device if call.device is not None else default_device
    from ..device import engine_for

    engine = engine_for(device)
    if engine is None:
        return None
    index = engine.streams.index(device)
    try:
        layout = payload_layout(header, nbytes, call.into, engine, index)
    except ProtocolError:  # the reply is malformed: decoding it says so
        return None
    if layout is False:
        return None
    return engine.incoming(nbytes, index, layout, call.caller)


def check_device(device: Any) -> Any:
    """``device`` if replies can be built there, else :class:`UsageError` (before
    anything is sent: a take whose items cannot be built would lose them)."""
    if device is None:
        return None
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise UsageError(f"device {device!r} is not a torch device: {exc}") from None
    if where.type == "cpu":
        return device
    from ..device import engine_for

    if engine_for(where) is not None:
        return device
    if where.type == "cuda":
        raise UsageError(f"device {device!r}: this torch sees no CUDA device")
    module = getattr(torch, where.type, None)
    available = getattr(module, "is_available", None)
    if where.type == "meta" or available is None or not available():
        raise UsageError(f"device {device!r} cannot hold the values of a reply")
    return device


def pinned(device: Any) -> Any:
    """``device`` with its index where it names a CUDA device without one (``"cuda"``):
    the caller's current device (``torch.cuda.device(1)``), read on the caller's
    thread, since the reply may be read on another, whose current device differs."""
    if device is None or isinstance(device, torch.device) and device.index is not None:
        return device
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        return device  # (the call says what is wrong with it)
    if where.type != "cuda" or where.index is not None:
        return device
    from ..device import engine_for

    engine = engine_for(where)
    return device if engine is None else torch.device("cuda", engine.streams.index(where))


def caller_of(device: Any, with_mark: bool) -> Any:
    """The :class:`~tensorshare.device.payload.Caller` of a call whose reply goes to
    ``device`` (its current stream, and with ``with_mark`` the point that stream has
    reached, for writes into its tensors to wait for); None where ``device`` has no
    engine.  Taken at the call, on the caller's thread: the reply may be read on
    another."""
    from ..device import engine_for

    engine = engine_for(device)
    if engine is None:
        return None
    return engine.caller(engine.streams.index(device), with_mark)


def payload_layout(header: dict, nbytes: int, into: Callable | None, engine, index: int):
    """The layout (:meth:`Engine.incoming`) of an items reply's payload: None (one
    buffer laid out as the payload) unless ``into`` gives destinations; False when
    an array cannot go to the device (a numpy array)."""
    from ..device.payload import item_layout

    entries, base = [], 0
    for i, (blob, size, ref) in enumerate(item_table(header, nbytes)):
        if ref is not None:  # not in the payload (shared memory, CUDA IPC)
            continue
        desc = parse_description(blob, size, DEFAULT_LIMITS)
        found = item_layout(desc, base, into(i, desc) if into is not None else {}, engine, index)
        if found is None:
            return False
        entries += found
        base += size
    return entries if any(target is not None for _o, _n, target in entries) else None


def as_into(into: Any) -> Callable | None:
    """A call's ``into``: a callable ``(item index, description) -> {array index: tensor}``
    as it is, or a template value (:func:`template_targets`)."""
    if into is None or callable(into):
        return into
    return template_targets(into)
