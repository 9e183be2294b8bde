"""A payload that arrived into device memory, and where each item's arrays go there.

The engine's receives (:class:`~.engine.Incoming`, :meth:`~.engine.Engine.copy_in`,
:meth:`~.engine.Engine.upload`) give a :class:`DevicePayload`; the codec builds
tensors viewing it (:func:`tensorshare.wire.build.build`).  :func:`item_layout` says,
before the bytes come, which arrays go straight into a caller's own tensors.
"""

from __future__ import annotations

import torch

from ..wire.description import KIND_TORCH


class DevicePayload:
    """A payload that arrived into device memory (a reply's, or an item uploaded from
    the server's files), complete once ``event`` has happened on the engine's stream.

    An array is a view of ``buffer`` (laid out as the payload when no layout was
    given, else compact) or the destination tensor the layout gave for it.
    :meth:`deliver` makes the caller's current stream wait for the copies before
    anything uses them; the codec's :func:`~tensorshare.wire.build.build` does so."""

    __slots__ = ("streams", "buffer", "starts", "event", "delivered")

    def __init__(self, streams, buffer, starts: dict, event):
        self.streams, self.buffer, self.starts, self.event = streams, buffer, starts, event
        self.delivered = False

    def deliver(self) -> None:
        """Hand the memory to the caller's current stream (once)."""
        if self.delivered:
            return
        self.delivered = True
        if self.buffer is not None:
            self.streams.hand_over(self.event, self.buffer)
        for _flat, _at, target in self.starts.values():
            if target is not None:
                self.streams.hand_over(self.event, target)

    def bytes_at(self, start: int, nbytes: int) -> torch.Tensor:
        """The 1-D uint8 device tensor of the array at payload offset ``start``."""
        if not self.starts:
            return self.buffer[start : start + nbytes]
        tensor, base, _target = self.starts[start]
        return tensor[base : base + nbytes]

    def target(self, start: int) -> torch.Tensor | None:
        """The destination tensor the array at payload offset ``start`` went into (None: new memory)."""
        entry = self.starts.get(start)
        return None if entry is None else entry[2]


def item_layout(desc, base: int, targets: dict, engine, index: int) -> list | None:
    """The :meth:`~.engine.Engine.incoming` layout entries of one item's arrays (its payload at
    ``base``), each going into ``targets[array index]`` where that tensor can take it
    in place (same dtype and shape, contiguous, on device ``index``); None when an
    array cannot live in device memory (a numpy array)."""
    from ..wire.codec import TORCH_DTYPES

    streams, entries = engine.streams, []
    for j, spec in enumerate(desc.arrays):
        if spec.kind != KIND_TORCH:
            return None
        target = targets.get(j)
        if target is not None and not (
                TORCH_DTYPES.get(spec.dtype) == target.dtype and tuple(target.shape) == tuple(spec.shape)
                and target.is_contiguous() and streams.owns(target) and streams.index(target.device) == index):
            target = None
        entries.append((base + spec.offset, spec.nbytes, target))
    return entries
