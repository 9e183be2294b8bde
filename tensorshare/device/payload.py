"""A payload that arrived into device memory, where each item's arrays go there, and for whom.

The engine's receives (:class:`~.engine.Incoming`, :meth:`~.engine.Engine.copy_in`,
:meth:`~.engine.Engine.upload`) give a :class:`DevicePayload`; the codec builds
tensors viewing it (:func:`tensorshare.wire.build.build`).  :func:`item_layout` says,
before the bytes come, which arrays go straight into a caller's own tensors.
A :class:`Caller`, taken on the caller's thread when it calls, says which stream
gets the result, whatever thread receives it.
"""

from __future__ import annotations

import torch

from ..wire.description import KIND_TORCH


class Caller:
    """Who a receive is for, taken on the calling thread at the call (the reply may be
    read on another thread, whose current stream is not the caller's): ``stream``,
    the caller's current stream, is handed what arrives; ``mark``, where that stream
    was, is what writes into the caller's own tensors wait for (None when the call
    names none).  Receives under way register here, so that a call that fails
    stops writing into those tensors before its error reaches the caller
    (:meth:`abandon`)."""

    __slots__ = ("streams", "index", "stream", "mark", "_receiving")

    def __init__(self, streams, index: int, with_mark: bool):
        self.streams, self.index = streams, index
        self.stream = streams.current(index)
        self.mark = streams.mark(index) if with_mark else None
        self._receiving: list = []

    def receiving(self, sink) -> None:
        self._receiving.append(sink)

    def abandon(self) -> None:
        """The call failed: wait until nothing queued for it writes any more."""
        receiving, self._receiving = self._receiving, []
        for sink in receiving:
            sink.abandon()


class DevicePayload:
    """A payload that arrived into device memory (a reply's, or an item uploaded from
    the server's files), complete once ``event`` has happened on the engine's stream.

    An array is a view of ``buffer`` (laid out as the payload when no layout was
    given, else compact) or the destination tensor the layout gave for it.
    :meth:`deliver` makes the caller's stream (``caller``'s, else the current
    stream of the thread that delivers) wait for the copies before anything uses
    them; the codec's :func:`~tensorshare.wire.build.build` does so."""

    __slots__ = ("streams", "index", "buffer", "starts", "event", "caller", "delivered")

    def __init__(self, streams, index: int, buffer, starts: dict, event, caller: Caller | None = None):
        self.streams, self.index, self.buffer, self.starts, self.event = streams, index, buffer, starts, event
        self.caller = caller
        self.delivered = False

    def deliver(self) -> None:
        """Hand the memory to the caller's stream (once)."""
        if self.delivered:
            return
        self.delivered = True
        streams = self.streams
        stream = self.caller.stream if self.caller is not None else streams.current(self.index)
        if self.buffer is not None:
            streams.hand_over(self.event, self.buffer, stream)
        for _flat, _at, target in self.starts.values():
            if target is not None:
                streams.hand_over(self.event, target, stream)

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
    from ..wire.torch_dtypes import TORCH_DTYPES

    streams, entries = engine.streams, []
    for j, spec in enumerate(desc.arrays):
        if spec.kind != KIND_TORCH:
            return None
        target = targets.get(j) if spec.nbytes else None
        if target is not None and not (
                TORCH_DTYPES.get(spec.dtype) == target.dtype and tuple(target.shape) == tuple(spec.shape)
                and target.is_contiguous() and streams.owns(target) and streams.index(target.device) == index):
            target = None
        entries.append((base + spec.offset, spec.nbytes, target))
    return entries
