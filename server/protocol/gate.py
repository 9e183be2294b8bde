"""A frame streamed to a connection as its payload arrives, with everything else held behind it.

A relay passes a copy on to the relays that follow it while the copy still arrives
(``server/relay/stream.py``): the frame's head goes out at once and its payload in
pieces.  Nothing may come between the pieces, so while a :class:`StreamGate` is
open on a session every other frame it sends waits behind it, its notifications
are held (latest per bin) and its requests are not read; :meth:`StreamGate.close`
lets them go, in order.  A stream that cannot be finished is cut off
(:meth:`~.session.ServerSession.cut_off`): the connection closes with the frame
short, never completed by other bytes.
"""

from __future__ import annotations


def open_stream(session) -> "StreamGate | None":
    """Begin a streamed frame on ``session``; None if one is already going out there
    (or the connection is closed): then none is begun."""
    if session.closed or session.stream is not None:
        return None
    gate = session.stream = StreamGate(session)
    session.holding.holds += 1
    session.reads.pause("stream")
    return gate


class StreamGate:
    """One streamed frame of one session (see the module docstring); ``behind``: the
    frames waiting for it, as ``(parts, on_abandon, on_written)``."""

    __slots__ = ("session", "behind")

    def __init__(self, session):
        self.session = session
        self.behind: list = []

    def piece(self, parts: list) -> None:
        """Queue the next piece of the streamed frame."""
        session = self.session
        if not session.closed:
            session.outbox.send(parts)

    def close(self) -> None:
        """The streamed frame is whole: what waited goes out after it."""
        session = self.session
        if session.stream is not self:
            return
        session.stream = None
        session.reads.resume("stream")
        behind, self.behind = self.behind, []
        for parts, on_abandon, on_written in behind:
            session.send(parts, on_abandon, on_written)
        session.release_notes()

    def abandon(self) -> None:
        """The frames waiting behind it will never go (the connection is gone): run their abandon hooks."""
        behind, self.behind = self.behind, []
        for _parts, on_abandon, _written in behind:
            if on_abandon is not None:
                on_abandon()
