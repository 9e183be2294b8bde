"""The idle and authentication time limits of one connection, as the session's clock tells them (PROTOCOL.md §8.4-8.5)."""

from __future__ import annotations


class TimeLimits:
    """The idle and authentication time limits of one connection (PROTOCOL.md §8.4-8.5),
    as times given by :meth:`ServerSession.tick`."""

    __slots__ = ("opened_at", "quiet_since", "pinged_at", "heard")

    def __init__(self):
        self.opened_at: float | None = None
        self.quiet_since: float | None = None
        self.pinged_at: float | None = None  # when the last keepalive went to a quiet listener
        self.heard = False  # bytes arrived since the last tick

    def observe(self, now: float, busy: bool) -> None:
        """Start the quiet period afresh if bytes came or went since the last look."""
        if self.opened_at is None:
            self.opened_at = now
        if self.heard or busy or self.quiet_since is None:
            self.heard = False
            self.quiet_since = now
            self.pinged_at = None
