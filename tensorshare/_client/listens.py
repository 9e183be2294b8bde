"""What a client listens to: the handles of its listens, by bin.

Listens belong to a connection on the server (PROTOCOL.md §5), so a client that
reconnects listens again to every bin in :class:`Subscriptions` and reports the
new snapshot to each handle's callback as a ``LISTEN`` notification.

A handle being stopped keeps hearing until the server has answered the request
that stops it (UNLISTEN, or a NOOP when other handles of the bin still listen):
notifications of changes the server made while it listened may still be on their
way when ``stop()`` is called, and they come before that reply.
"""

from __future__ import annotations

from typing import Any, Callable

from .connection import ListenSnapshot, Notification


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


class Subscriptions:
    """The listen handles of one client, by bin (no locking: the client guards it)."""

    def __init__(self):
        self._by_bin: dict[str, list[Listening]] = {}

    def add(self, handle: Listening) -> None:
        self._by_bin.setdefault(handle.bin, []).append(handle)

    def stop(self, handle: Listening) -> bool | None:
        """Mark ``handle`` as stopping (it still hears until :meth:`remove`).  True if
        no other handle of its bin listens on (so the server should stop notifying),
        False if some do, None if it was not listening (or already stopping)."""
        handles = self._by_bin.get(handle.bin)
        if handles is None or handle not in handles or handle.stopping:
            return None
        handle.stopping = True
        return not self._active(handle.bin)

    def remove(self, handle: Listening) -> None:
        """Forget ``handle``: it hears no more."""
        handles = self._by_bin.get(handle.bin)
        if handles is not None and handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_bin[handle.bin]

    def handles(self, name: str) -> tuple[Listening, ...]:
        """Every handle of bin ``name`` that hears its notifications (stopping ones too)."""
        return tuple(self._by_bin.get(name, ()))

    def names(self) -> list[str]:
        """The bins some handle listens to (not only stopping ones)."""
        return [name for name in self._by_bin if self._active(name)]

    def first_append_only(self, name: str, adding: Listening | None = None) -> bool:
        """Whether the server may skip APPENDs to bin ``name`` that find it holding
        items: no handle of it (``adding`` included) wants every append."""
        handles = self._active(name)
        if adding is not None and adding.every_append:
            return False
        return (adding is not None or bool(handles)) and not any(h.every_append for h in handles)

    def _active(self, name: str) -> list[Listening]:
        return [h for h in self._by_bin.get(name, ()) if not h.stopping]

    def clear(self) -> None:
        self._by_bin.clear()

    def __contains__(self, name: str) -> bool:
        return bool(self._active(name))

    def __bool__(self) -> bool:
        return bool(self._by_bin)
