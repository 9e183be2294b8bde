"""The idle and authentication time limits of one connection, as the session's clock tells them (PROTOCOL.md §8.4-8.5).

:meth:`TimeLimits.due` decides, the session acts: close it (530 or 421) or send a
listener a keepalive.
"""

from __future__ import annotations


AUTH_EXPIRED, KEEPALIVE, IDLE = "auth", "keepalive", "idle"  # what :meth:`TimeLimits.due` may ask for


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

    def due(self, now: float, sending: bool, config, authenticated: bool, listening: bool) -> str | None:
        """What the limits ask of the connection at ``now`` (None: nothing):
        :data:`AUTH_EXPIRED` (not authenticated within ``auth_timeout``),
        :data:`KEEPALIVE` (a quiet listener: a 110 frame, again every ``idle_timeout``)
        or :data:`IDLE` (nothing received, no reply waiting, for ``idle_timeout``)."""
        self.observe(now, sending)
        if not authenticated and config.auth_timeout and now - self.opened_at >= config.auth_timeout:
            return AUTH_EXPIRED
        if not config.idle_timeout or now - self.quiet_since < config.idle_timeout:
            return None
        if not listening:
            return IDLE
        if self.pinged_at is None or now - self.pinged_at >= config.idle_timeout:
            self.pinged_at = now
            return KEEPALIVE
        return None
