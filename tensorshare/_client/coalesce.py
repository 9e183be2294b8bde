"""Coalescing small requests: holding them back while earlier ones await their replies.

Nagle's rule, applied to whole requests.  A client that pipelines small
non-blocking calls (``Client.submit``, the callback-style ``TensorShare``) would
otherwise pay one ``send()`` per call, and on loopback a send is most of a small
call's cost: the kernel runs the receiving side's TCP work in the sender's system
call and wakes the server for every request.  So a small request made while an
earlier one is on the wire and unanswered waits here instead, already encoded (its
bytes copied, so the caller may change the value at once); whoever next reads a
reply, or sends anything, sends everything held in one system call, ahead of its
own frame, so requests still leave in the order they were made.  The server answers
in request order, so a held request loses at most the one-way trip it waited for a
reply to come back, and a lone call, with nothing in flight, is sent at once.

:class:`Coalescer` is the bookkeeping only (no socket calls, no locks): the client
holds its send lock around every use, and ties what is held to the connection it
is meant for (its :class:`~.sockets.Link`), so frames of a connection that was lost are never sent on the next one
(their calls have failed with the connection).
"""

from __future__ import annotations

from typing import Any


class Coalescer:
    """The requests of one socket that are on the wire and unanswered, and the frames
    held back meanwhile (``limit`` bytes at most); the first held frame may be the
    unsent rest of one whose start a send already took."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sock: Any = None
        self._in_flight: set[int] = set()  # ids of requests sent (or being sent), not yet answered
        self.frames: list = []  # bytes, or a memoryview: the rest of a partly sent frame
        self._rids: list[int] = []  # ids of the held frames
        self._size = 0
        self.partial = False  # the first held frame is the rest of one already started

    def __bool__(self) -> bool:
        return bool(self.frames)

    def awaiting(self, sock: Any) -> bool:
        """Whether a request sent on ``sock`` (a connection) still awaits its reply."""
        return self._sock is sock and bool(self._in_flight)

    def hold(self, sock: Any, rid: int, data: bytes) -> bool:
        """Hold ``data``, the whole frame of request ``rid``, if a request sent on
        ``sock`` awaits its reply and there is room; False: the caller sends it (after
        what is held, see :meth:`take`)."""
        if not self.awaiting(sock) or self._size + len(data) > self.limit:
            return False
        self.frames.append(data)
        self._rids.append(rid)
        self._size += len(data)
        return True

    def take(self, sock: Any, rid: int | None = None) -> list:
        """The frames held for ``sock``, to be sent now (ahead of request ``rid``'s
        frame, if one is given), emptying it: from here on they count as
        sent.  A new socket starts afresh: what was held for the last is dropped."""
        if self._sock is not sock:
            self._sock, self._in_flight = sock, set()
            self.frames, self._rids, self._size, self.partial = [], [], 0, False
        frames = self.frames
        if frames:
            self._in_flight.update(self._rids)
            self.frames, self._rids, self._size, self.partial = [], [], 0, False
        if rid is not None:
            self._in_flight.add(rid)
        return frames

    def keep_rest(self, rest: memoryview) -> None:
        """Hold the unsent end of what :meth:`take` gave, to go first next time."""
        if len(rest):
            self.frames.insert(0, rest)
            self._size += len(rest)
            self.partial = True

    def answered(self, rid: int) -> None:
        """The reply to request ``rid`` arrived (safe without the send lock: one set
        operation, and request ids are never reused)."""
        self._in_flight.discard(rid)
