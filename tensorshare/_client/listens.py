"""What a client listens to: the handles of its listens, by bin.

Listens belong to a connection on the server (PROTOCOL.md §5), so a client that
reconnects listens again to every bin its engine's
:class:`~tensorshare.protocol.engine.Listens` holds and reports the new snapshot to
each handle's callback as a ``LISTEN`` notification.

A handle being stopped keeps hearing until the server has answered the request
that stops it (UNLISTEN, or a NOOP when other handles of the bin still listen):
notifications of changes the server made while it listened may still be on their
way when ``stop()`` is called, and they come before that reply.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..protocol.engine import Notice, Restored
from ..protocol.messages import Key
from .connection import ListenSnapshot, Notification

log = logging.getLogger("tensorshare.client")


class Listening:
    """Handle of a listen: ``snapshot`` is the bin's state when it began, ``stop()``
    ends it (for an :class:`~tensorshare.AsyncClient`, ``stop()`` returns a Deferred)."""

    __slots__ = ("client", "bin", "callback", "snapshot", "every_append", "stopping")

    def __init__(self, client: Any, name: str, callback: Callable[[Notification], Any], every_append: bool = True):
        self.client, self.bin, self.callback = client, name, callback
        self.every_append = every_append
        self.snapshot: ListenSnapshot | None = None
        self.stopping = False  # stop() was called: it hears on until the server's reply (module docstring)

    def stop(self, callback: Callable[[None, BaseException | None], Any] | None = None) -> Any:
        """Stop listening.  With ``callback``, return at once and call it with
        ``(None, error)`` once done (error None on success)."""
        return self.client._unlisten(self, callback)

    close = stop

    def __repr__(self) -> str:
        return f"<Listening {self.bin!r}>"


def notification(notice: Notice) -> Notification:
    """The :class:`Notification` the handles of an engine's :class:`Notice` hear."""
    header = notice.header
    return Notification(notice.bin, header[Key.N], header[Key.SEQ], header[Key.OP], header.get(Key.TAG))


def tell_restored(event: Restored, where: str = "the server") -> None:
    """A bin listened to again after a reconnection: each handle hears of its state
    then, as a ``LISTEN`` notification (if it could not be, a warning says so)."""
    if event.error is not None:
        log.warning("could not listen to %r again after reconnecting to %s: %s", event.bin, where, event.error)
        return
    note = ListenSnapshot.of(event.header).as_notification(event.bin)
    for handle in event.handles:
        try:
            handle.callback(note)
        except Exception:
            log.exception("tensorshare listen callback %r failed", handle.callback)
