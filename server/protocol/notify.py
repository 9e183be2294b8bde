"""Change notifications: who listens to which bin, and what one connection is told.

:class:`ListenerRegistry` fans a change out to every connection listening to its
bin: it is the sink the storage publishes its changes to
(:class:`~..bins.storage.ChangeSink`), so every change is told, whoever made it.  :class:`Notifier` applies the protocol's coalescing rule for one connection
(PROTOCOL.md §5): while its outbox is congested, a new notification replaces the
one for the same bin that has not been written yet, and goes to the back of the
queue, so it still follows every frame queued before it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

from tensorshare.protocol.messages import NOTIFICATION
from tensorshare.wire.frames import frame_head

from ..bins.store import Change


class Listener(Protocol):
    def notify(self, name: str, frame: bytes) -> None:
        """Tell the listener's peer about a change of bin ``name`` (``frame``: the 151)."""


def notification_frame(change: Change) -> bytes:
    """The bytes of the 151 frame that tells a listener about ``change``."""
    header = NOTIFICATION.build(bin=change.bin, n=change.n_items, seq=change.seq, op=change.op, tag=change.tag)
    return frame_head(header, 0)


class ListenerRegistry:
    """Maps bin names to the connections listening to them.

    A listener registered with ``first_append`` is not told of an APPEND to a bin
    that already held items (PROTOCOL.md §5): a reader that takes everything at
    once only needs to learn that the bin is no longer empty."""

    def __init__(self):
        self._by_bin: dict[str, dict[Listener, bool]] = defaultdict(dict)
        self._watchers: list = []  # (watcher, the bins it wants told or None: every bin), waits.py's

    def watch(self, watcher, wanted=None) -> None:
        """Call ``watcher(bin_name)`` after every change is published to a bin in
        ``wanted`` (a live container the watcher keeps up to date; None: every bin)."""
        self._watchers.append((watcher, wanted))

    def add(self, name: str, listener: Listener, first_append: bool = False) -> None:
        self._by_bin[name][listener] = first_append

    def listened(self, name: str) -> bool:
        """Whether any connection listens to bin ``name``."""
        return name in self._by_bin

    def discard(self, name: str, listener: Listener) -> None:
        listeners = self._by_bin.get(name)
        if listeners is not None:
            listeners.pop(listener, None)
            if not listeners:
                del self._by_bin[name]

    def publish(self, change: Change | None) -> None:
        """Send one notification of ``change`` to every listener of its bin that
        wants it; the watchers are told."""
        if change is None:
            return
        listeners = self._by_bin.get(change.bin)
        if listeners:
            frame = notification_frame(change)
            later_append = change.op == "APPEND" and change.n_items > 1
            for listener, first_append in tuple(listeners.items()):
                if not (later_append and first_append):
                    listener.notify(change.bin, frame)
        for watcher, wanted in self._watchers:
            if wanted is None or change.bin in wanted:  # (the usual change: no call)
                watcher(change.bin)

    def touched(self, name: str) -> None:
        """Something only the watchers care about changed on bin ``name`` (no notification)."""
        for watcher, wanted in self._watchers:
            if wanted is None or name in wanted:
                watcher(name)


class Outbox(Protocol):
    """Where a session's frames go, whole and in order (the connection's writer)."""

    congested: bool  # too much is queued: take no more requests until it is not (net/flow.py)

    def send(self, parts: list, on_abandon: Any = None, on_written: Any = None) -> Any:
        """Queue one frame; returns a ticket for :meth:`withdraw`.  ``on_written`` runs
        once it is written whole, ``on_abandon`` if the connection dies first."""

    def send_reply(self, parts: list, on_abandon: Any = None, on_written: Any = None) -> None:
        """Queue one frame that will never be withdrawn (a reply): the outbox may send it at once."""

    def reply(self, data: bytes) -> None:
        """``send_reply([data])``: a handler's usual outcome, one small frame."""

    def withdraw(self, ticket: Any) -> bool:
        """Take a queued frame back if none of it has been written yet (True if so)."""

    def close(self) -> None:
        """Close the connection once everything queued has been written."""

    def peer_gone(self) -> bool:
        """Whether the peer has closed its end already (False where it cannot tell)."""


class Notifier:
    """The notifications of one connection, coalesced per bin while it is congested."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self._unwritten: dict[str, Any] = {}  # bin -> ticket of its last queued notification
        self.coalesced = 0  # notifications replaced by a newer one, over the connection's life

    def notify(self, name: str, frame: bytes) -> None:
        outbox = self.outbox
        if outbox.congested:
            ticket = self._unwritten.get(name)
            if ticket is not None and outbox.withdraw(ticket):
                self.coalesced += 1
        self._unwritten[name] = outbox.send([frame])

    def forget(self, name: str) -> None:
        """The connection stopped listening to bin ``name``."""
        self._unwritten.pop(name, None)
