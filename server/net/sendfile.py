"""Spans of stored files sent to a socket by the kernel (``os.sendfile``), off the reactor thread.

A spilled or durable item's reply is made of :class:`~server.bins.spill.FileSpan`
parts.  Copying them through Python (a read into fresh ``bytes``, then
``transport.write``, then ``send``) cost the reactor two copies and a page fault
per 4 KiB; ``sendfile`` passes the page cache's pages to the socket in the kernel.
It may also block on the disk when the pages are not cached, so it runs on a
small pool of threads (:class:`SpanSender`), never on the reactor thread.

While a :class:`SpanSend` is under way the connection's writer
(:mod:`.writer`) writes nothing else to the socket, so bytes keep frame order.
The thread sends on its own duplicate of the socket's descriptor: if the
reactor closes the connection meanwhile, the number cannot be reused for another
client's socket under the thread's feet.  A peer that stops reading makes the
thread give the connection back after :data:`PATIENCE` seconds; the writer then
waits for a writable event on the reactor (as for any other part) and hands the
rest over again, so a slow reader never holds a thread for long.

Only plain TCP connections are eligible (TLS must encrypt in user space: the
writer copies spans out there, :meth:`FileSpan.tobytes`).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import threading
from typing import Callable

from twisted.python.threadpool import ThreadPool

log = logging.getLogger("tensorshare.server")

AVAILABLE = hasattr(os, "sendfile") and hasattr(select, "poll")
PATIENCE = 0.5  # seconds a thread waits for a full socket before giving the connection back
_POLL_MS = 50  # its polls: how soon it sees that the connection was lost
_CALL_MAX = 1 << 30  # most bytes asked of one sendfile() (the kernel takes what the socket has room for)


class SpanSend:
    """One hand-off: ``spans`` (FileSpan parts, in order) from ``offset`` bytes into the
    first, sent on a duplicate ``fd`` of a connection's socket.

    The thread fills in ``sent`` (bytes so far, read by the reactor's stall watch),
    ``parts_done`` and ``offset`` (where it stopped) and ``error``; the reactor sets
    ``cancelled`` when the connection is lost."""

    __slots__ = ("fd", "spans", "offset", "sent", "parts_done", "error", "cancelled")

    def __init__(self, fd: int, spans: list, offset: int):
        self.fd = fd
        self.spans = spans  # holds the spans, and so their open files, until the thread is done
        self.offset = offset
        self.sent = 0
        self.parts_done = 0
        self.error: BaseException | None = None
        self.cancelled = False

    @property
    def finished(self) -> bool:
        """True when every span was sent."""
        return self.parts_done == len(self.spans)


def send_spans(job: SpanSend) -> SpanSend:
    """Send ``job``'s spans (blocking, on a pool thread); returns ``job`` with where it stopped.

    Stops early when the socket stays full for :data:`PATIENCE` seconds, when the
    connection is cancelled, or on an error (the peer is gone, a file shorter than
    its span).  Closes ``job.fd`` in every case."""
    fd = job.fd
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        waited = 0
        spans = job.spans
        while job.parts_done < len(spans) and not job.cancelled:
            span = spans[job.parts_done]
            pos = span.start + job.offset
            if pos >= span.stop:
                job.parts_done += 1
                job.offset = 0
                continue
            try:
                n = os.sendfile(fd, span.fileno(), pos, min(span.stop - pos, _CALL_MAX))
            except BlockingIOError:
                if poller.poll(_POLL_MS):
                    continue
                waited += _POLL_MS
                if waited >= PATIENCE * 1000:
                    break  # the reactor waits for the socket instead of this thread
                continue
            if n == 0:
                raise OSError(f"stored file {getattr(span.file, 'name', '?')} ended before its span")
            job.offset += n
            job.sent += n
            waited = 0
    except OSError as exc:  # the peer went away, or a file is broken: the writer ends the connection
        job.error = exc
    finally:
        os.close(fd)
    return job


class SpanSender:
    """The threads that run :func:`send_spans`, and what they sent (``bytes_sent``).

    One per server (its factory); the pool starts with the first send and stops with
    the reactor.  ``done`` callbacks run on the reactor thread."""

    def __init__(self, reactor, max_threads: int = 4, counters=None):
        self.reactor = reactor
        self.max_threads = max_threads
        self.counters = counters  # the server's counters (sendfile_bytes), or None
        self.bytes_sent = 0
        self._pool: ThreadPool | None = None
        self._active: set[SpanSend] = set()  # sends under way (cancelled when the server stops)

    def start(self, sock, spans: list, offset: int, done: Callable[[SpanSend], None]) -> SpanSend:
        """Send ``spans`` from ``offset`` on ``sock`` on a thread; ``done(job)`` on the
        reactor thread afterwards (also if the connection was cancelled meanwhile).
        Raises ``OSError`` if the socket cannot be duplicated (no descriptor left)."""
        job = SpanSend(os.dup(sock.fileno()), spans, offset)
        self._active.add(job)
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPool(minthreads=0, maxthreads=self.max_threads, name="tensorshare-send")
            pool.threadFactory = functools.partial(threading.Thread, daemon=True)
            pool.start()
            self.reactor.addSystemEventTrigger("before", "shutdown", self.stop)
        pool.callInThread(self._run, job, done)
        return job

    def _run(self, job: SpanSend, done: Callable[[SpanSend], None]) -> None:
        try:
            send_spans(job)
        except BaseException as exc:  # pragma: no cover - a bug: still report, so the writer ends the connection
            job.error = exc
            log.exception("sending stored spans failed")
        finally:
            self._active.discard(job)
        self.reactor.callFromThread(self._finished, job, done)

    def _finished(self, job: SpanSend, done: Callable[[SpanSend], None]) -> None:
        self.bytes_sent += job.sent
        if self.counters is not None:
            self.counters.sendfile_bytes += job.sent
        done(job)

    def stop(self) -> None:
        """Stop the threads: the sends under way are cancelled (their connections are
        closing with the server), so each thread ends within a poll."""
        pool, self._pool = self._pool, None
        for job in list(self._active):
            job.cancelled = True
        if pool is not None:
            pool.stop()
