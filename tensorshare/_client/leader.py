"""The blocking client's reading: the thread that waits reads the socket itself, if nobody else does.

"Leader/follower": a thread waiting for its reply becomes the reader when no other
thread reads (:meth:`LeaderFollower._await`), reads once at a time
(:meth:`LeaderFollower._read_some`: polling a little before sleeping while that
pays, and checking the keepalive) and hands each frame of a read to the thread
waiting for it, to the dispatcher thread (callbacks, notifications) or to itself
(inline callbacks) (:meth:`LeaderFollower._dispatch`).  A mixin of
:class:`tensorshare.Client`, whose state (the lock and condition, the current
link, the coalescer, the reply spin) it uses.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from ..errors import ConnectionLostError, ProtocolError, TimeoutError
from .calls import Call
from .progress import Progress
from .sockets import wait


class LeaderFollower:
    """The reading half of :class:`tensorshare.Client` (see the module docstring)."""

    def _await(self, call: Call, deadline: float | None, progress: Progress | None = None) -> Any:
        """Wait for ``call``'s outcome, reading the socket ourselves when nobody else is."""
        with self._cond:
            while True:
                if call.outcome is not None:
                    return call.outcome
                if not self._reading:
                    self._reading = True
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no reply from {self._where} in time")
                self._cond.wait(remaining)
        try:
            while call.outcome is None:
                self._read_some(deadline, spin=progress is None)
                if progress is not None and call.outcome is None:
                    link = self._link
                    if link is not None:
                        progress.received(link.conn.decoder.receiving)
            if progress is not None:
                progress.finished(call.outcome)
            return call.outcome
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _read_some(self, deadline: float | None, spin: bool = False) -> None:
        """Read once from the socket and dispatch the frames it completes (leader only;
        ``spin``: a caller waiting for its own reply, who may poll before sleeping)."""
        link = self._link
        if link is None:
            raise ConnectionLostError(f"not connected to {self._where}")
        poller = link.readable
        if self._coalescer:  # requests held while earlier ones awaited the replies we read
            self._send_held(link)
            if self._coalescer.partial:  # the socket is full: wake when it takes more, too
                poller, spin = link.readwrite, False
        wake = self._keepalive(link)
        until = deadline if wake is None or (deadline is not None and deadline <= wake) else wake
        conn = link.conn
        try:
            if spin and not link.tls:
                within = None if until is None else until - time.monotonic()
                started = self._spin.poll(partial(poller.poll, 0), within)
                if started is not None:  # not there yet: sleep until it is
                    wait(poller, until)
                    self._spin.waited(started)
                n = link.recv_ready(conn.decoder.get_buffer())
            else:
                n = link.recv_into(conn.decoder.get_buffer(), until, poller)
            if n == 0:
                raise ConnectionResetError("server closed the connection")
            self._last_heard = time.monotonic()
            frames = conn.decoder.buffer_updated(n)
        except BlockingIOError:
            return
        except TimeoutError:  # our TimeoutError is an OSError too: the connection is fine
            if until is deadline:
                raise
            return  # time for the next keepalive check, not the caller's deadline
        except (OSError, ValueError, ProtocolError) as exc:
            raise self._lost(link, exc) from None
        jobs: list = []  # callbacks of this read, handed to the dispatcher in one go
        inline: list = []  # calls whose callbacks run here, on the reading thread
        try:
            self._dispatch(frames, conn, jobs, inline)
        except ProtocolError as exc:  # the server sent nonsense: nothing it says can be trusted
            err = ConnectionLostError(f"bad reply from {self._where}: {exc}")
            self._drop_connection(link, err)
            raise err from None
        if jobs:
            self._callbacks().submit_all(jobs)
        for call, frame in inline:
            self._complete_inline(call, frame)

    def _dispatch(self, frames: list, conn, jobs: list, inline: list) -> None:
        """Hand each frame of a read to the thread waiting for it, or queue its
        callbacks in ``jobs`` (the dispatcher's) or ``inline`` (under one hold of
        the lock for the whole read)."""
        woken = False
        coalescer = self._coalescer
        with self._cond:
            for frame in frames:
                rid = frame.header.get("id")
                if rid and type(rid) is int:
                    coalescer.answered(rid)
                call = self._sort(frame, conn, jobs)
                if call is None:
                    continue
                if call.callback is None:
                    call.outcome = frame
                    woken = True
                elif call.inline:
                    inline.append((call, frame))
                else:
                    jobs.append((self._complete, (call, frame)))
            if woken:
                self._cond.notify_all()
