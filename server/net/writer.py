"""The outbound side of one connection: whole frames written in order, paced by the socket.

One :class:`FrameWriter` per connection is the transport's only push producer: it
writes queued frames part by part, stopping whenever the transport asks it to
pause, so a large reply never sits in memory twice and replies and notifications
never interleave.  What it queues is accounted in an :class:`~.flow.OutboundBudget`.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from typing import Callable

from twisted.internet import interfaces
from zope.interface import implementer

from . import twisted_internals
from .batch import WriteBatch
from .twisted_internals import send_now
from .flow import SHARED_PART, OutboundBudget
from .sendfile import AVAILABLE as SENDFILE_AVAILABLE

log = logging.getLogger("tensorshare.server")

_DIRECT_MAX = 256 << 10  # most bytes of leading parts sent in one direct send()/sendmsg()
_JOIN_MAX = 4 << 10  # leading parts up to this many bytes in all are joined into one send()
_GATHER_PARTS = 64  # most parts in one sendmsg() (the system allows 1024)
_HOLD_MAX = 32  # most frames held back while a read is handled (see FrameWriter)
LARGE_SEND = 4 << 20  # most bytes passed to one send()
_TURN_SEND = 16 << 20  # most bytes of view parts one connection sends per pump (one per writable event)


class Queued:
    """A frame in the queue: its parts, how many were written, and what to do if the
    connection dies first.  :meth:`FrameWriter.send` returns it as a ticket."""

    __slots__ = ("parts", "index", "on_abandon", "on_written", "written")

    def __init__(self, parts: list, on_abandon: Callable[[], None] | None,
                 on_written: Callable[[], None] | None = None):
        self.parts = parts  # None once withdrawn
        self.index = 0
        self.on_abandon = on_abandon
        self.on_written = on_written
        self.written = False

    def done(self) -> None:
        """The frame was handed to the transport whole."""
        self.written = True
        if self.on_written is not None:
            self.on_written()


@implementer(interfaces.IPushProducer)
class FrameWriter:
    """Writes queued frames to a transport as fast as it accepts them.

    Small replies skip Twisted's write buffer: ``transport.write`` only queues the
    bytes and asks the reactor for a writable event, so the reply would leave one
    reactor turn later.  When the transport has nothing buffered, the leading
    parts (up to ``_DIRECT_MAX`` bytes) are sent at once with one ``send()`` or
    ``sendmsg()`` on its socket; whatever the kernel does not take, and every
    larger ``bytes`` part, goes through ``transport.write``, so order, backpressure and error handling stay Twisted's.  Parts that are
    memoryviews (the pooled chunks of a stored item) are sent from their own memory
    (:meth:`_send_view`), since ``transport.write`` would need them copied into new
    ``bytes``.  While the protocol is inside ``dataReceived`` the writer holds its
    frames (:meth:`hold`/:meth:`release`), so the replies to a pipelined batch of
    requests leave together, ``_HOLD_MAX`` frames per system call at most: a client
    starts on the first replies while the rest are handled (see docs/design.md).
    Frames for other connections made meanwhile (notifications) wait for the end of
    that read too (:class:`WriteBatch`), as do small replies; a larger one that finds nothing
    queued, held or buffered leaves at once (:meth:`_send_gathered`).

    Parts that are spans of stored files (a spilled or durable item) go to
    ``sender`` (:mod:`.sendfile`: the kernel sends them from the page cache, on a
    thread) when the connection is plain TCP; the writer sends nothing else until
    that hand-off is back (:meth:`_spans_sent`).  Without a sender, or on TLS,
    they are copied out (``tobytes``).

    ``on_congested``/``on_drained`` are told when the budget's congestion starts
    and ends; they run inside the writer and must not send anything synchronously.
    """

    def __init__(self, transport, budget: OutboundBudget | None = None,
                 on_congested: Callable[[], None] | None = None, on_drained: Callable[[], None] | None = None,
                 batch: WriteBatch | None = None, sender=None):
        self.transport = transport
        self.batch = batch  # the server's write batch, if frames may wait for the end of a read
        self.budget = budget if budget is not None else OutboundBudget(1 << 62)
        self._written = 0  # bytes handed to the transport (or the kernel) so far
        self._on_congested = on_congested or _nothing
        self._on_drained = on_drained or _nothing
        self._queue: deque[Queued] = deque()
        self._withdrawn = 0  # withdrawn entries still in the queue
        self._paused = False
        self._closing = False
        self._lost = False
        self._holding = False
        # Small replies sent past the queue (send_reply): held until the end of a read, only
        # while the queue is empty; the hooks of those that have any, by index: (on_abandon, on_written).
        self._held: list[bytes] = []
        self._held_hooks: dict[int, tuple] = {}
        self._view_sent = 0  # bytes of the view part at the head of the queue already sent
        self._turn_sent = 0
        self._socket = twisted_internals.direct_socket(transport)
        # Spans of stored files go to the kernel through this (server/net/sendfile.py).
        self._sender = sender if self._socket is not None and SENDFILE_AVAILABLE else None
        self._offload = None  # the SpanSend under way, if any: nothing else is written meanwhile

    @property
    def written(self) -> int:
        """Bytes handed to the transport so far, counting a hand-off's progress: the
        stall watch's mark of progress."""
        offload = self._offload
        return self._written + (offload.sent if offload is not None else 0)

    @property
    def congested(self) -> bool:
        """True while the unsent frames are over the budget (see :mod:`.flow`)."""
        return self.budget.congested

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None,
             on_written: Callable[[], None] | None = None) -> Queued | None:
        """Queue one frame; returns its ticket (None if the connection is gone).
        ``on_written`` runs once it is handed to the transport whole, ``on_abandon`` if
        the connection dies first."""
        if self._lost or self._closing:
            if on_abandon is not None:
                on_abandon()
            return None
        if self._held:  # small replies came first: they keep their place
            self._queue_held()
        entry = Queued(parts, on_abandon, on_written)
        queue = self._queue
        queue.append(entry)
        if self.budget.charge(parts):
            self._on_congested()
        if not self._holding and self.batch is not None and self.batch.open:
            self.batch.join(self)  # another connection's read is being handled: write at its end
        elif (not self._holding or len(queue) >= _HOLD_MAX) and not self._paused:
            self._pump()
        return entry

    def peer_gone(self) -> bool:
        """Whether the peer has closed its end already (its FIN or its reset waits to
        be read): a reply now would reach nobody.  False where it cannot tell (TLS),
        or while requests it sent before closing wait to be read."""
        if self._lost:
            return True
        sock = self._socket
        if sock is None:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # reset by the peer
            return True

    def send_reply(self, parts: list, on_abandon: Callable[[], None] | None = None,
                   on_written: Callable[[], None] | None = None) -> None:
        """Send one frame that nobody will withdraw (a reply), as :meth:`send` would.

        The usual reply, under ``SHARED_PART`` bytes of ``bytes`` parts while nothing
        is queued and the writer is not paused, skips the queue and the outbound
        budget: it goes out with one ``send()`` at once, or with the other replies
        of the read being handled (:meth:`hold`) when that ends.  Everything else
        (a large reply, a slow reader's, one behind queued frames) takes the queue."""
        data = parts[0] if len(parts) == 1 else _joined(parts)
        if type(data) is bytes:
            self.reply(data, on_abandon, on_written)
        elif not self._send_gathered(parts, on_written):
            self.send(parts, on_abandon, on_written)

    def _send_gathered(self, parts: list, on_written: Callable[[], None] | None) -> bool:
        """A larger reply (``bytes`` and pooled chunks, up to ``_DIRECT_MAX``) while nothing is queued,
        held or buffered: one ``sendmsg()`` at once, past the queue and its accounting (the rest
        to Twisted's buffer, as :meth:`_send_direct`); False (nothing done) otherwise."""
        if (self._queue or self._held or self._paused or self._socket is None or self._lost or self._closing
                or self._offload is not None or len(parts) > _GATHER_PARTS
                or (not self._holding and self.batch is not None and self.batch.open)):
            return False
        total = 0
        for part in parts:
            kind = type(part)
            if kind is not bytes and kind is not memoryview:  # (spans of files: the sender's)
                return False
            total += len(part)
        t = self.transport
        if total > _DIRECT_MAX or not twisted_internals.transport_idle(t):
            return False
        try:
            sent = self._socket.sendmsg(parts)
        except OSError:  # EAGAIN, or a dead socket: Twisted's own write path deals with it
            sent = 0
        if sent < total:
            t.write(_unsent(parts, sent))  # may call pauseProducing()
        self._written += total
        if on_written is not None:
            on_written()
        return True

    def reply(self, data: bytes, on_abandon: Callable[[], None] | None = None,
              on_written: Callable[[], None] | None = None) -> None:
        """:meth:`send_reply` of one ``bytes`` frame (a handler's usual outcome)."""
        if self._queue or self._paused or self._socket is None or self._lost or self._closing \
                or self._offload is not None or len(data) >= SHARED_PART:
            self.send([data], on_abandon, on_written)
            return
        held = self._held
        held.append(data)
        if on_abandon is not None or on_written is not None:
            self._held_hooks[len(held) - 1] = (on_abandon, on_written)
        if not self._holding:
            batch = self.batch
            if batch is not None and batch.open:  # another connection's read is being handled
                batch.join(self)
                return
        elif len(held) < _HOLD_MAX:
            return
        self._send_held()

    def _send_held(self) -> None:
        """Send the held replies with one ``send()`` (Twisted's buffer takes what the
        kernel does not, or all of it after bytes it still holds: order is kept)."""
        held, self._held = self._held, []
        data = held[0] if len(held) == 1 else b"".join(held)
        send_now(self.transport, self._socket, data)  # (transport.write may call pauseProducing())
        self._written += len(data)
        if self._held_hooks:
            hooks, self._held_hooks = self._held_hooks, {}
            for _, on_written in hooks.values():
                if on_written is not None:
                    on_written()

    def _queue_held(self) -> None:
        """Put the held replies in the queue (accounted), ahead of what comes next."""
        held, self._held = self._held, []
        hooks, self._held_hooks = self._held_hooks, {}
        queue, budget = self._queue, self.budget
        for i, data in enumerate(held):
            queue.append(Queued([data], *hooks.get(i, (None, None))))
            if budget.charge((data,)):
                self._on_congested()

    def withdraw(self, entry: Queued | None) -> bool:
        """Take a queued frame back if none of it has been written (True if so)."""
        if (entry is None or entry.written or entry.parts is None or entry.index
                or ((self._view_sent or self._offload is not None) and self._queue and self._queue[0] is entry)):
            return False
        if self.budget.discharge(entry.parts) | self.budget.frame_done():
            self._on_drained()
        entry.parts = None
        self._withdrawn += 1
        queue = self._queue
        if self._withdrawn > 32 and 2 * self._withdrawn > len(queue):
            # Compact, so a peer that never reads cannot grow the queue with
            # withdrawn entries.  The head is never a withdrawn one mid-write.
            self._queue = deque(e for e in queue if e.parts is not None)
            self._withdrawn = 0
        return True

    @property
    def closing(self) -> bool:
        """Whether the connection is to close once its frames are written."""
        return self._closing

    @property
    def pending(self) -> bool:
        """Whether frames wait that the transport has not taken whole yet (a reply in progress)."""
        return bool(self._queue or self._held)

    def hold(self) -> None:
        """Queue frames without writing them until :meth:`release`."""
        self._holding = True

    def begin_read(self) -> None:
        """A read of this writer's connection is being handled: :meth:`hold` its
        frames, and open the server's batch (frames for other connections wait for
        the end of the read too).  One call per read: this is the request path."""
        self._holding = True
        if self.batch is not None:
            self.batch.open = True

    def end_read(self) -> None:
        """The read is handled: the batch's other writers write, then this one
        (:meth:`WriteBatch.end`, then :meth:`release`)."""
        batch = self.batch
        if batch is not None:
            if batch.joined:
                batch.end()
            else:
                batch.open = False
        self._holding = False  # (release(), inline: this is the request path)
        if self._held:
            self._send_held()
        if self._queue and not self._paused:
            self._pump()

    def release(self) -> None:
        """Write what was queued since :meth:`hold`."""
        self._holding = False
        if self._held:
            self._send_held()
        if self._queue and not self._paused:
            self._pump()

    def close(self) -> None:
        """Close the connection after the queued frames have been written."""
        if self._held:
            self._queue_held()
        self._closing = True
        if not self._queue:
            self._finish_close()

    def _pump(self) -> None:
        if self._offload is not None:  # the kernel is sending spans: _spans_sent() goes on
            return
        queue, write, budget = self._queue, self.transport.write, self.budget
        drained = handed = False
        self._turn_sent = 0  # bytes of view parts sent in this call (_TURN_SEND)
        while queue and not self._paused:
            if (self._socket is not None and not self._view_sent
                    and twisted_internals.transport_idle(self.transport)):
                sent = self._send_direct()
                if sent is not None:
                    drained |= sent
                    continue
            entry = queue[0]
            parts, index = entry.parts, entry.index
            if parts is None:  # withdrawn
                queue.popleft()
                self._withdrawn -= 1
                continue
            while index < len(parts) and not self._paused:
                part = parts[index]
                # Parts are bytes; memoryviews of pooled chunks (server/protocol/recvpool.py),
                # sent from their own memory where we own the socket; or spans of a
                # stored item's files, sent by the kernel or else copied out only now.
                if type(part) is bytes:
                    write(part)  # may call pauseProducing()
                elif type(part) is memoryview:
                    if self._socket is None:
                        write(part.tobytes())
                    elif not self._send_view(part):
                        break  # resumeProducing() goes on with it
                elif self._sender is not None and hasattr(part, "fileno") and self._hand_over(entry, index):
                    handed = True
                    break  # _spans_sent() or resumeProducing() goes on with it
                else:
                    write(part.tobytes()[self._view_sent :])
                    self._view_sent = 0
                index += 1
                self._written += len(part)
                drained |= budget.discharge((part,))
            entry.index = index
            if handed:
                break
            if index == len(parts):
                queue.popleft()
                entry.done()
                drained |= budget.frame_done()
        if drained and not budget.congested:
            self._on_drained()
        if not queue and self._closing:
            self._finish_close()

    def _send_view(self, part: memoryview) -> bool:
        """Send a memoryview part from its own memory (``transport.write`` takes only bytes:
        a copy, into fresh memory); True once all of it has gone.

        Otherwise, when the socket is full, Twisted still holds earlier bytes, or this
        call's share (``_TURN_SEND``, so that one fast reader does not hold the
        reactor for a whole large reply) is spent, the writer pauses and asks the
        transport to wake it when writable; :meth:`resumeProducing` goes on from
        ``_view_sent``.
        """
        t = self.transport
        if not t.connected or t.disconnecting:  # closing: Twisted's own path decides what still goes
            t.write(part[self._view_sent :].tobytes())
            self._view_sent = 0
            return True
        if twisted_internals.transport_idle(t):
            view = part[self._view_sent :]
            try:
                while view and self._turn_sent < _TURN_SEND:
                    sent = self._socket.send(view[:LARGE_SEND])
                    self._written += sent
                    self._view_sent += sent
                    self._turn_sent += sent
                    view = view[sent:]
            except BlockingIOError:
                pass
            except OSError as exc:  # the connection is gone: end it (Twisted reports the loss)
                log.info("closing %s: sending failed: %s", t.getPeer(), exc)
                self._paused = True
                t.abortConnection()
                return False
            if not view:
                self._view_sent = 0
                return True
        self._paused = True
        twisted_internals.wake_when_writable(t)
        return False

    def _hand_over(self, entry: Queued, index: int) -> bool:
        """Hand the run of file spans from ``entry.parts[index]`` (``_view_sent`` bytes
        into it) to the sender (see :mod:`.sendfile`), or wait for Twisted to send
        what it holds first; False if the transport is closing (copy it out instead)."""
        t = self.transport
        if not t.connected or t.disconnecting:
            return False
        entry.index = index
        if not twisted_internals.transport_idle(t):  # earlier bytes go first; doWrite resumes us
            self._paused = True
            twisted_internals.wake_when_writable(t)
            return True
        spans = []
        for part in entry.parts[index:]:
            if type(part) is bytes or type(part) is memoryview or not hasattr(part, "fileno"):
                break
            spans.append(part)
        try:
            self._offload = self._sender.start(self._socket, spans, self._view_sent, self._spans_sent)
        except OSError as exc:  # no descriptor left for the thread: copy this part out instead
            log.warning("sending a stored item without sendfile: %s", exc)
            return False
        return True

    def _spans_sent(self, job) -> None:
        """A hand-off is back (on the reactor thread): account for what went, then go on."""
        if self._offload is not job:  # the connection was lost meanwhile
            return
        self._offload = None
        self._written += job.sent
        if self._lost:
            return
        entry = self._queue[0]
        for _ in range(job.parts_done):
            self._finish_part(entry)
        self._view_sent = job.offset
        t = self.transport
        if job.error is not None:
            log.info("closing %s: sending a stored item failed: %s", t.getPeer(), job.error)
            self._paused = True
            t.abortConnection()
            return
        if not job.finished and not job.cancelled:  # the socket stayed full: wait for it on the reactor
            self._paused = True
            twisted_internals.wake_when_writable(t)
            return
        if not self._paused:
            self._pump()

    def _finish_part(self, entry: Queued) -> None:
        """The part at ``entry.index`` is sent whole (and the frame, if it was its last)."""
        part = entry.parts[entry.index]
        entry.index += 1
        self._view_sent = 0
        budget = self.budget
        drained = budget.discharge((part,))
        if entry.index == len(entry.parts):
            self._queue.popleft()
            entry.done()
            drained |= budget.frame_done()
        if drained and not budget.congested:
            self._on_drained()

    def _send_direct(self) -> bool | None:
        """Send the leading parts of the queue that fit in ``_DIRECT_MAX`` with one
        system call; None if the first does not fit, else whether that ended the
        congestion.

        A few small parts are joined into one ``send()``; more bytes than that go
        out with one ``sendmsg()`` straight from the parts (a GET of a few 64 KiB
        items is one system call and no copy, not a ``send()`` per item)."""
        queue = self._queue
        if len(queue) == 1:  # the usual case, one reply of one small part: no gathering
            entry = queue[0]
            parts = entry.parts
            if parts is not None and len(parts) == 1 and not entry.index:
                data = parts[0]
                if type(data) is bytes and len(data) < SHARED_PART:
                    return self._send_one(entry, data)
        chunks, originals, total = [], [], 0
        shared = False
        done = 0  # whole frames taken
        cut = None  # (entry, index) where a partly taken frame stops
        for entry in queue:
            parts, index = entry.parts, entry.index
            if parts is None:  # withdrawn
                done += 1
                continue
            while (index < len(parts) and total + len(parts[index]) <= _DIRECT_MAX
                   and len(chunks) < _GATHER_PARTS):
                part = parts[index]
                kind = type(part)
                # bytes and memoryviews (pooled chunks) go from their own memory; spans of
                # a spilled item's mapping are copied out only now.
                chunks.append(part if kind is bytes or kind is memoryview else part.tobytes())
                if len(part) >= SHARED_PART:
                    shared = True  # counted by identity (flow.py): discharged part by part
                originals.append(part)
                total += len(part)
                index += 1
            if index < len(parts):
                cut = (entry, index)
                break
            done += 1
        if not chunks:
            return None
        sock = self._socket
        if len(chunks) == 1:
            data = chunks[0]
        elif total <= _JOIN_MAX:
            data = b"".join(chunks)
        else:
            data = None
        try:
            sent = sock.send(data) if data is not None else sock.sendmsg(chunks)
        except OSError:  # EAGAIN, or a dead socket: Twisted's own write path deals with it
            sent = 0
        frames = 0
        for _ in range(done):
            entry = queue.popleft()
            if entry.parts is None:
                self._withdrawn -= 1
            else:
                frames += 1
                entry.written = True
                if entry.on_written is not None:
                    entry.on_written()
        if cut is not None:
            cut[0].index = cut[1]
        if sent < total:  # the kernel took part of it: Twisted writes the rest (bytes only)
            self.transport.write(_unsent(chunks if data is None else (data,), sent))  # may pause us
        self._written += total
        if shared:
            return self.budget.discharge(originals) | self.budget.frame_done_many(frames)
        return self.budget.sent_small(total, frames)

    def _send_one(self, entry: Queued, data: bytes) -> bool:
        """:meth:`_send_direct` of a queue that is one frame of one small part."""
        try:
            sent = self._socket.send(data)
        except OSError:  # EAGAIN, or a dead socket: Twisted's own write path deals with it
            sent = 0
        self._queue.popleft()
        entry.written = True
        if entry.on_written is not None:
            entry.on_written()
        if sent < len(data):
            self.transport.write(data[sent:])  # may call pauseProducing() synchronously
        self._written += len(data)
        return self.budget.sent_small(len(data), 1)

    def _finish_close(self) -> None:
        if not self._lost:
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    # IPushProducer
    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()

    def stopProducing(self) -> None:
        self.connection_lost()

    def connection_lost(self) -> None:
        """Run the abandon hooks of every frame not yet handed to the transport whole."""
        self._lost = True
        self._view_sent = 0
        if self._offload is not None:
            self._offload.cancelled = True  # its thread stops within a poll; _spans_sent() then ignores it
        self._on_congested = self._on_drained = _nothing  # they refer back to the protocol
        queue, self._queue = self._queue, deque()
        for entry in queue:
            if entry.on_abandon is not None and entry.parts is not None:
                entry.on_abandon()
        self._held, hooks, self._held_hooks = [], self._held_hooks, {}
        for on_abandon, _ in hooks.values():
            if on_abandon is not None:
                on_abandon()


def _nothing() -> None:
    pass


_ONLY_BYTES = frozenset((bytes,))


def _joined(parts: list) -> bytes | None:
    """``parts`` as one ``bytes`` if they are all ``bytes`` and fewer than
    ``SHARED_PART`` in all (a small reply), else None."""
    if not _ONLY_BYTES.issuperset(map(type, parts)) or sum(map(len, parts)) >= SHARED_PART:
        return None
    return b"".join(parts)


def _unsent(chunks, sent: int) -> bytes:
    """The bytes of ``chunks`` after the first ``sent``, as one ``bytes``."""
    for i, chunk in enumerate(chunks):
        if sent < len(chunk):
            rest = [memoryview(chunk)[sent:], *chunks[i + 1 :]]
            return b"".join(rest)
        sent -= len(chunk)
    return b""
