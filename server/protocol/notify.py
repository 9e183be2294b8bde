"""Who listens to which bin, and the fan-out of change notifications to them."""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from tensorshare.protocol import messages as protocol
from tensorshare.wire.frames import frame_head

from ..bins.store import Change


class Listener(Protocol):
    def notify(self, name: str, frame: bytes) -> None:
        """Queue the notification ``frame`` about bin ``name`` (it may replace an
        unsent one about the same bin if the listener's connection is congested)."""


def notification_frame(change: Change) -> bytes:
    """The bytes of the 151 frame that tells a listener about ``change``."""
    return frame_head(
        {"code": protocol.NOTIFY, "id": 0, "bin": change.bin, "n": change.n_items,
         "seq": change.seq, "op": change.op, "tag": change.tag},
        0,
    )


class ListenerRegistry:
    """Maps bin names to the connections listening to them."""

    def __init__(self):
        self._by_bin: dict[str, set[Listener]] = defaultdict(set)

    def add(self, name: str, listener: Listener) -> None:
        self._by_bin[name].add(listener)

    def discard(self, name: str, listener: Listener) -> None:
        listeners = self._by_bin.get(name)
        if listeners is not None:
            listeners.discard(listener)
            if not listeners:
                del self._by_bin[name]

    def publish(self, change: Change | None) -> None:
        """Send one notification of ``change`` to every listener of its bin."""
        if change is None:
            return
        listeners = self._by_bin.get(change.bin)
        if not listeners:
            return
        frame = notification_frame(change)
        for listener in tuple(listeners):
            listener.notify(change.bin, frame)
