"""When a client probes a silent server, and when it gives up on it (both clients, and a relay upstream).

:class:`Keepalive` decides; the blocking client keeps its own clock and socket, and
the Twisted ends (the AsyncClient, a relay's upstream connection) keep a
:class:`Traffic` per connection, which also learns when their writes are backed up.
"""

from __future__ import annotations

from typing import Callable

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


class Traffic:
    """What a Twisted end's keepalive judges one connection by: when it last heard and
    sent, and whether its own writes are backed up.

    It is registered as the transport's streaming producer only to learn the last
    (it holds nothing back): while a large value is still going out, silence is no
    sign of a dead server, which answers a probe only after reading everything sent
    before it.  ``clock()`` is the reactor's ``seconds``."""

    def __init__(self, clock: Callable[[], float], interval: float | None):
        self.clock = clock
        self.keepalive = None if interval is None else Keepalive(interval)
        self.last_heard = self.last_sent = clock()
        self.write_blocked = False

    def heard(self) -> None:
        self.last_heard = self.clock()

    def sent(self) -> None:
        self.last_sent = self.clock()

    # IPushProducer: writes are not held back, only watched
    def pauseProducing(self) -> None:
        self.write_blocked = True

    def resumeProducing(self) -> None:
        self.write_blocked = False
        self.sent()

    def stopProducing(self) -> None:
        pass

    def check(self, probe: Callable[[], None], drop: Callable[[], None]) -> float | None:
        """Do what the keepalive asks now: ``probe()`` (send a NOOP, whose reply is
        dropped on arrival) or ``drop()`` (the connection is presumed dead).  Returns
        the seconds until the next check (None after a drop)."""
        keepalive = self.keepalive
        if self.write_blocked:  # our own bytes are still going out: nothing to judge yet
            return keepalive.interval
        now = self.clock()
        action, wake = keepalive.due(now, self.last_heard, self.last_sent)
        if action == DEAD:
            drop()
            return None
        if action == PROBE:
            probe()
            keepalive.probed(now)
        return max(wake - now, 0.01)
