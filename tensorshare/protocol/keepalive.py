"""When a client probes a silent server, and when it gives up on it (both clients, and a relay upstream).

:class:`Keepalive` decides; the client engine (:mod:`.engine`) asks it on every
tick of its driver, which keeps the clock and the socket.
"""

from __future__ import annotations

PROBE, DEAD = "probe", "dead"  # what Keepalive.due() asks for


class Keepalive:
    """When to probe a silent server and when to give up on it.

    After ``interval`` seconds with nothing heard from the server (counted from the
    later of the last bytes received and the last request sent) the client sends a
    NOOP; if nothing at all arrives within ``interval`` seconds of that probe, the
    connection is presumed dead.  The clients keep the clock and the socket.
    """

    def __init__(self, interval: float):
        self.interval = interval
        self.probe_at: float | None = None  # when the outstanding probe was sent
        self.held_until = 0.0  # a request may wait in the server until then (PROTOCOL.md §4.5)

    def hold(self, until: float) -> None:
        """A request that asked the server to hold it until ``until`` (monotonic) was
        sent: the connection's later replies, the probe's included, wait behind it,
        so silence until then is no sign of a dead server."""
        self.held_until = max(self.held_until, until)

    def due(self, now: float, last_heard: float, last_sent: float) -> tuple[str | None, float]:
        """``(action, next_check)``: action is :data:`PROBE` (send a NOOP, then call
        :meth:`probed`), :data:`DEAD` (drop the connection) or None."""
        if now < self.held_until:
            self.probe_at = None
            return None, self.held_until
        if self.probe_at is not None:
            if last_heard <= self.probe_at:
                if now - self.probe_at >= self.interval:
                    return DEAD, now
                return None, self.probe_at + self.interval
            self.probe_at = None  # answered (or anything else heard)
        quiet_since = max(last_heard, last_sent)
        if now - quiet_since < self.interval:
            return None, quiet_since + self.interval
        return PROBE, now + self.interval

    def probed(self, now: float) -> None:
        self.probe_at = now
