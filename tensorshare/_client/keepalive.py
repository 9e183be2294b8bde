"""When a client probes a silent server, and when it gives up on it (both clients)."""

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

    def due(self, now: float, last_heard: float, last_sent: float) -> tuple[str | None, float]:
        """``(action, next_check)``: action is :data:`PROBE` (send a NOOP, then call
        :meth:`probed`), :data:`DEAD` (drop the connection) or None."""
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
