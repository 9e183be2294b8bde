"""A small pool of pinned host buffers, reused from transfer to transfer.

Page-locked memory is what lets a copy between host and device run at the link's
speed without blocking the host, but allocating it is slow (the kernel locks every
page) and the amount a process should lock is small.  So the engine stages every
transfer through a few buffers of one size (a bucket), taken from here and given
back with the event after which the device no longer reads or writes them: a
buffer is handed out again only once that event has happened, oldest first, so the
copy of one bucket runs while the next fills.

Taking never blocks on other transfers: when every kept buffer is in use, a new
one is made (and kept, up to ``keep``), so a receive waiting for the network can
never hold up a send that would unblock it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class Pool:
    """Pinned buffers of ``size`` bytes from ``streams.host``; at most ``keep`` kept."""

    def __init__(self, streams, size: int, keep: int):
        self.streams, self.size, self.keep = streams, size, keep
        self._free: deque = deque()  # (buffer, event or None), oldest first
        self._lock = threading.Lock()
        self.made = 0  # buffers allocated so far (reuse shows as few)

    def take(self) -> Any:
        """A buffer of :attr:`size` bytes that nothing reads or writes any more."""
        with self._lock:
            entry = self._free.popleft() if self._free else None
            if entry is None:
                self.made += 1
        if entry is None:
            return self.streams.host(self.size)
        buffer, event = entry
        if event is not None:
            self.streams.synchronize(event)
        return buffer

    def give(self, buffer: Any, event: Any = None) -> None:
        """Take ``buffer`` back; the device may use it until ``event`` (None: not at all)."""
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append((buffer, event))
                return
        if event is not None:  # not kept: let it go only once the device is done with it
            self.streams.synchronize(event)

    def clear(self) -> None:
        """Let every kept buffer go (after the device is done with it)."""
        with self._lock:
            entries, self._free = list(self._free), deque()
        for _buffer, event in entries:
            if event is not None:
                self.streams.synchronize(event)

    def __len__(self) -> int:
        return len(self._free)
