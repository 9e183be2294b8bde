"""What one connection holds back, in one place: requests not handled yet, the one answered later, notifications.

A session handles its requests in order and answers them in order.  It holds:

* ``backlog``: whole requests not handled yet, while the outbox is congested (flow
  control) or an earlier request is answered later;
* ``answering``: the request being answered later (an :class:`Answering`, from a
  handler's :class:`~.outcome.Pending`), which holds every request behind it;
* ``notes``: notifications for this connection that must follow a reply (or a
  streamed frame) not yet queued, the latest per bin, in the order of their last
  change.  ``holds`` counts what holds them: a request being handled, one
  answered later (not while it waits in a lane: others' changes then go out as
  usual), a frame being streamed (:mod:`.gate`).  When it drops to 0 they go out.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from .outcome import Pending


class Holding:
    """A session's holding state (see the module docstring)."""

    __slots__ = ("backlog", "answering", "holds", "notes")

    def __init__(self):
        self.backlog: deque = deque()
        self.answering: Answering | None = None
        self.holds = 0
        self.notes: dict[str, bytes] | None = None  # made when the first notification is held

    def hold(self, name: str, frame: bytes) -> None:
        """Keep a notification until nothing holds them (the latest per bin)."""
        notes = self.notes
        if notes is None:
            notes = self.notes = {}
        else:
            notes.pop(name, None)
        notes[name] = frame

    def take_notes(self) -> dict | None:
        """The notifications held, to send now that nothing holds them."""
        notes, self.notes = self.notes, None
        return notes


class Answering:
    """A request answered later: its id, its :class:`~.outcome.Pending`, and where it is.

    ``key``: the ``(bin, lane)`` it waited in, if any; ``parked``: its handle in
    :class:`~.waits.Waits` while it waits there; ``went``: it went on from its lane
    (the lane is told once it is answered);
    ``returned``: it was not answered before its handler returned (the session then
    resumes what it held once it is); ``closed``: answered, or dropped."""

    __slots__ = ("rid", "pending", "key", "parked", "went", "returned", "closed")

    def __init__(self, rid: int, pending: Pending):
        self.rid, self.pending = rid, pending
        self.key = self.parked = None
        self.went = self.returned = self.closed = False


class Reads(Protocol):
    """The reading side of a connection: a session pauses it while it cannot take more."""

    def pause(self, reason: str) -> None: ...

    def resume(self, reason: str) -> None: ...


class NoReads:
    """Reads of a session with no transport (tests, tools): nothing to pause."""

    def pause(self, reason: str) -> None: ...

    def resume(self, reason: str) -> None: ...
