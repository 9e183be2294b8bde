"""The blocking client's writing: one frame at a time on the socket, small ones sent together, keepalive probes.

A mixin of :class:`tensorshare.Client` (whose reading half is :mod:`.leader`): a
request's frame goes out whole under the send lock (:meth:`Sender._send`), behind
the small requests the coalescer held while earlier ones awaited their replies
(:mod:`.coalesce`), or bucket by bucket as the device engine stages it; a request
after a quiet spell first reads what the server sent meanwhile
(:meth:`Sender._before_request`); a silent server is probed with NOOP and a dead
connection dropped (:meth:`Sender._keepalive`, :mod:`tensorshare.protocol.keepalive`).
It uses the client's state: the lock and condition, the current link, the
coalescer, the keepalive state.
"""

from __future__ import annotations

import time

from ..errors import ConnectionLostError, TimeoutError
from ..protocol.keepalive import DEAD, PROBE
from ..protocol.messages import NOOP
from .connection import next_request_id, request_frame
from .progress import Progress
from .sockets import SMALL_FRAME, Link

_IDLE_CHECK = 1.0  # seconds of quiet after which a request first reads what the server sent meanwhile


class Sender:
    """The writing half of :class:`tensorshare.Client` (see the module docstring)."""

    def _send(self, parts: list, deadline: float | None, rid: int, may_hold: bool = False,
              progress: Progress | None = None) -> None:
        """Send request ``rid``'s frame; ``may_hold``: a small one may wait in the
        coalescer while an earlier request awaits its reply (see :mod:`._client.coalesce`)."""
        link = self._ensure_connected(deadline)
        with self._send_lock:
            coalescer = self._coalescer
            if type(parts) is not list:  # StagedParts: device arrays, staged bucket by bucket as they go
                self._send_staged(link, parts, deadline, rid, progress)
                return
            if not (may_hold and not link.tls and coalescer.awaiting(link)
                    and sum(map(len, parts)) <= SMALL_FRAME and coalescer.hold(link, rid, b"".join(parts))):
                if progress is None:
                    self._send_locked(link, parts, deadline, rid)
                else:  # piece by piece, reporting each
                    for i, piece in enumerate(progress.pieces(parts)):
                        self._send_locked(link, piece, deadline, rid if i == 0 else None)
                        progress.sent(piece)
                return
        # Held.  The replies it waits for may all have come while we held the lock,
        # and a reader that then found the lock taken did not send what is held: do.
        if not coalescer.awaiting(link):
            with self._send_lock:
                if coalescer and link is self._link:
                    self._send_locked(link, [], deadline)

    def _send_staged(self, link: Link, parts, deadline: float | None, rid: int,
                     progress: Progress | None) -> None:
        """Send a frame holding device arrays (the caller holds the send lock): each
        bucket the engine stages goes out before the next is asked for (its buffer
        is then reused), while the buckets after it are being copied."""
        pending, first = [], True
        for view, staged in parts.engine.pieces(parts):
            pending.append(view)
            if staged:
                self._send_locked(link, pending, deadline, rid if first else None)
                if progress is not None:
                    progress.sent(pending)
                pending, first = [], False
        if pending or first:
            self._send_locked(link, pending, deadline, rid if first else None)
            if progress is not None:
                progress.sent(pending)

    def _send_held(self, link: Link) -> None:
        """Send what the coalescer holds, as far as the socket takes it now (a reader:
        never waits for the socket, nor for a sender, which sends it first anyway)."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            if link is not self._link or not self._coalescer:
                return
            frames = self._coalescer.take(link)
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            try:
                sent = link.send_now(data)
            except OSError as exc:
                raise self._lost(link, exc) from None
            if sent < len(data):
                self._coalescer.keep_rest(memoryview(data)[sent:])
        finally:
            self._send_lock.release()

    def _send_locked(self, link: Link, parts: list, deadline: float | None, rid: int | None = None) -> None:
        """Write what the coalescer holds, then request ``rid``'s whole frame (the caller
        holds the send lock).  With keepalive on, a server that takes no byte for
        twice ``keepalive`` seconds is presumed dead."""
        if link is not self._link:
            # Replaced since the caller picked it up: what the coalescer holds now is
            # the new connection's, and must not be taken for this one.
            raise ConnectionLostError(f"connection to {self._where} lost")
        held = self._coalescer.take(link, rid)
        if held:  # many small frames: one part (one iovec) for all of them
            parts = [held[0] if len(held) == 1 else b"".join(held), *parts]
        stall = None if self.keepalive is None else 2 * self.keepalive
        try:
            link.send_all(parts, deadline, stall)
        except TimeoutError:
            # A partly sent frame leaves the stream unusable: start afresh.
            self._drop_connection(link, ConnectionLostError("send timed out; connection reset"))
            raise
        except (OSError, ValueError, AttributeError) as exc:  # ValueError/AttributeError: closed by another thread
            raise self._lost(link, exc) from None

    def _before_request(self) -> None:
        """Note that a request is about to go out (the keepalive counts silence from
        it) and, on a connection quiet for a while, first read what the server sent
        meanwhile (late replies, or the 421 it sends before closing an idle
        connection), so that a connection it has closed is replaced by the request
        instead of failing it.  Called before the request is registered, so that
        dropping the connection does not fail the request too."""
        now = time.monotonic()
        quiet = now - max(self._last_heard, self._last_sent)
        self._last_sent = now
        link = self._link
        if quiet <= _IDLE_CHECK or link is None:
            return
        with self._cond:
            if self._reading or link is not self._link:
                return  # another thread reads: it will notice a close itself
            self._reading = True
        try:
            while self._link is link and link.data_waiting():
                self._read_some(time.monotonic() + 0.1)
        except (TimeoutError, ConnectionLostError):
            pass  # half a TLS record (read on later), or the connection is gone (the request reconnects)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _server_holds(self, wait: float) -> None:
        state = self._keepalive_state
        if state is not None:
            state.hold(time.monotonic() + wait + 1.0)

    def _keepalive(self, link: Link) -> float | None:
        """Probe a server silent for ``keepalive`` seconds with a NOOP, and drop the
        connection (ConnectionLostError) if nothing comes for as long after the
        probe.  Returns when to check next (None: keepalive is off)."""
        state = self._keepalive_state
        if state is None:
            return None
        now = time.monotonic()
        action, wake = state.due(now, self._last_heard, self._last_sent)
        if action == DEAD:
            err = ConnectionLostError(f"{self._where} sent nothing for {self.keepalive:g}s after a "
                                      f"keepalive probe: connection presumed dead")
            self._drop_connection(link, err)
            raise err
        if action == PROBE:
            if not self._send_lock.acquire(blocking=False):
                return now + 0.5  # a request is going out: the server has that to read first
            try:
                # No deadline: a probe that cannot go out trips the stall limit (ConnectionLostError).
                probe = next_request_id()
                self._send_locked(link, request_frame(probe, NOOP), None, probe)
            finally:
                self._send_lock.release()
            state.probed(now)  # its reply has an id nobody waits for: it is dropped on arrival
        return wake
