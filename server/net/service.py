"""The Twisted adapter: moves bytes between TCP connections and :class:`ServerSession`.

Inbound, ``dataReceived`` (or, for a large payload, a read into lent memory) feeds
the session.  Outbound, the connection's :class:`~.writer.FrameWriter` writes the
session's frames.  Flow control (``server/net/flow.py``) and the time limits are
applied from here with the reactor's clock.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from functools import partial
from typing import Callable

from twisted.internet import protocol, reactor, task

from tensorshare.disk.areas import LOCAL_BUFFER

from ..protocol.session import ServerSession
from . import twisted_internals
from .busypoll import BusyPoll
from .flow import OutboundBudget, StallWatch
from .sendfile import SpanSender
from .batch import WriteBatch
from .writer import LARGE_SEND, FrameWriter

log = logging.getLogger("tensorshare.server")

_LARGE_READ = 1 << 20  # recv size while a large payload streams in
_SMALL_READ = 1 << 16  # recv size otherwise (Twisted's default)
# A connection closing (a refusal, a time limit, a framing error) gets this long to
# make progress writing its last frames before it is aborted: TLS's loseConnection
# waits for a handshake that a silent peer never does.
CLOSE_GRACE = 1.0


class ReadGate:
    """Pauses reading a transport while any reason to holds: requests waiting (for the
    outbox to drain, or for the disk), memory over budget while spilling."""

    def __init__(self, transport):
        self.transport = transport
        self._reasons: set[str] = set()

    def pause(self, reason: str) -> None:
        if not self._reasons:
            self.transport.pauseProducing()
        self._reasons.add(reason)

    @property
    def paused(self) -> bool:
        return bool(self._reasons)

    def resume(self, reason: str) -> None:
        if reason in self._reasons:
            self._reasons.discard(reason)
            if not self._reasons and self.transport.connected:
                self.transport.resumeProducing()


class TensorShareProtocol(protocol.Protocol):
    """One server-side connection."""

    def __init__(self, state):
        self.state = state
        self.writer: FrameWriter | None = None
        self.session: ServerSession | None = None
        self.gate: ReadGate | None = None
        self._read_size = 0
        # Payload bytes still to come after the last read (0 between frames): while any,
        # :class:`ReceivingServer` asks for lent memory and reads again at once.
        self.receiving = 0
        self._stall = StallWatch()  # how long pending output has gone without progress
        self._resume_call = None  # DelayedCall that resumes the session after a drain

    def connectionMade(self) -> None:
        self.factory.live.add(self)
        peer = self.transport.getPeer()
        local = not hasattr(peer, "host")  # a same-host client on the Unix socket (server/app.py)
        if not local:
            self.transport.setTcpNoDelay(True)
        else:  # (as much on its way as loopback TCP: tensorshare.disk.areas)
            self.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER)
        # Fewer reactor turns per large reply (see docs/design.md).
        twisted_internals.set_send_limit(self.transport, LARGE_SEND)
        config = self.state.config
        budget = OutboundBudget(config.max_outbound)
        self.writer = FrameWriter(self.transport, budget, None, self._outbound_drained, self.factory.write_batch,
                                  self.factory.span_sender)
        self.transport.registerProducer(self.writer, True)
        self.gate = ReadGate(self.transport)
        self.session = ServerSession(self.state, self.writer,
                                     _local_peer(self.transport) if local else f"{peer.host}:{peer.port}",
                                     self.gate, same_host=local or _same_host(peer, self.transport.getHost()))
        self.session.connection_made()
        # (dataReceived below, without its Python frame: it runs for every read)
        self.dataReceived = partial(self._received, self.session.data_received)

    def dataReceived(self, data: bytes) -> None:
        self._received(self.session.data_received, data)

    def receive_buffer(self) -> memoryview | None:
        """Memory the session lends for the next read, while :attr:`receiving` (see
        :class:`ReceivingServer`)."""
        return self.session.receive_buffer()

    def received_into(self, n: int) -> None:
        """``n`` bytes were read into :meth:`receive_buffer`'s memory."""
        self._received(self.session.received_into, n)

    def read_more(self) -> bool:
        """Whether to read again at once while :attr:`receiving` (:class:`ReceivingServer`):
        nothing holds reading back."""
        return not self.gate.paused

    def _received(self, deliver: Callable, what) -> None:
        busy = self.factory.busy_poll
        if busy is not None:
            busy.note_request(self)
        writer = self.writer
        writer.begin_read()
        try:
            receiving = deliver(what)
        finally:
            writer.end_read()
        # Read large payloads in big gulps: fewer reactor turns per byte.
        self.receiving = receiving
        if receiving > _LARGE_READ:
            if self._read_size != _LARGE_READ:
                self._read_size = _LARGE_READ
                twisted_internals.set_read_size(self.transport, _LARGE_READ)
        elif self._read_size != _SMALL_READ:  # (the usual read: nothing to change)
            self._read_size = _SMALL_READ
            twisted_internals.set_read_size(self.transport, _SMALL_READ)

    def connectionLost(self, reason) -> None:
        self.factory.live.discard(self)
        self.__dict__.pop("dataReceived", None)  # (its partial refers back to this protocol: no cycle left)
        call = self._resume_call
        if call is not None and call.active():
            call.cancel()
        self._resume_call = None
        if self.session is not None:
            self.writer.connection_lost()  # first: what the session still sends is abandoned
            self.session.connection_lost()

    # -- flow control (the policy is in server/net/flow.py)

    def _check_stall(self, now: float) -> bool:
        """Drop the connection if its pending output has made no progress for the
        stall timeout (the grace, while closing); True if it was dropped."""
        writer = self.writer
        pending = writer.pending or writer.closing
        marker = (writer.written, twisted_internals.unsent(self.transport)) if pending else None
        stalled = self._stall.observe(now, pending, marker)
        limit = CLOSE_GRACE if writer.closing else self.state.config.outbound_stall_timeout
        if stalled < limit:
            return False
        budget, session = writer.budget, self.session
        log.warning("conn %d dropped (%s): it took no byte for %.1f s while %d bytes waited for it%s "
                    "(%d notifications coalesced)", session.stats.id, session.peer, stalled, budget.queued,
                    " after it was closed" if writer.closing else "", session.notifier.coalesced,
                    extra={"conn": session.stats.id, "event": "drop"})
        if session.counters is not None and not writer.closing:
            session.counters.slow_readers_dropped += 1
        self.transport.abortConnection()
        return True

    def _outbound_drained(self) -> None:
        # Called inside the writer: resume the waiting requests on a later turn.
        if self._resume_call is None:
            self._resume_call = self.factory.clock.callLater(0, self._resume)

    def _resume(self) -> None:
        self._resume_call = None
        if self.session.closed or self.writer.congested:
            return
        writer = self.writer
        writer.begin_read()
        try:
            self.session.resume()  # it stops and starts reading (through its ReadGate) as it goes
        finally:
            writer.end_read()

    def tick(self, now: float) -> None:
        if self.session is not None and not self._check_stall(now):
            self.session.tick(now, self.writer.pending)


def _local_peer(transport) -> str:
    """How a client on the Unix socket is named in logs and on the status page:
    ``local:pid<PID>`` (its process, from ``SO_PEERCRED`` where there is one)."""
    try:
        pid, _uid, _gid = _PEERCRED.unpack(transport.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                       _PEERCRED.size))
    except (AttributeError, OSError):  # (no SO_PEERCRED on this system)
        return f"local:{transport.sessionno}"
    return f"local:pid{pid}"


_PEERCRED = struct.Struct("3i")


def _same_host(peer, local) -> bool:
    """Whether a TCP peer is on this host: a loopback address, or our own address.

    Only a hint (the greeting's token check decides): it keeps the shared
    directories' paths and token away from peers that cannot use them."""
    host = getattr(peer, "host", None)
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback or host == getattr(local, "host", None)
    except ValueError:
        return False


class TensorShareFactory(protocol.Factory):
    """Builds a :class:`TensorShareProtocol` per connection, all sharing one state."""

    def __init__(self, state, clock=None):
        self.state = state
        self.clock = clock if clock is not None else reactor  # callLater/seconds, for flow control
        state.waits.clock = self.clock  # and for the requests that wait in the server
        self.live: set[TensorShareProtocol] = set()
        self.write_batch = WriteBatch()  # frames for other connections wait for the end of a read
        self._ticker: task.LoopingCall | None = None  # applies the sessions' time limits
        self._trimmer: task.LoopingCall | None = None  # releases long-free receive pool memory
        self.busy_poll: BusyPoll | None = None  # told of each read of requests (server/net/busypoll.py)
        # Stored files' spans go to the kernel on these threads (server/net/sendfile.py).
        self.span_sender = SpanSender(reactor, counters=state.counters) if state.config.sendfile else None

    def startFactory(self) -> None:
        interval = self.state.config.tick_interval
        if interval is not None:
            self._ticker = task.LoopingCall(self._tick)
            self._ticker.start(interval, now=False)
        pool = self.state.recv_pool
        if pool is not None:  # free chunks go back to the system after pool.idle seconds
            self._trimmer = task.LoopingCall(pool.trim)
            self._trimmer.clock = self.clock
            self._trimmer.start(pool.idle / 4, now=False)

    def stopFactory(self) -> None:
        for call in (self._ticker, self._trimmer):
            if call is not None and call.running:
                call.stop()
        self._ticker = self._trimmer = None
        if self.state.recv_pool is not None:
            self.state.recv_pool.clear()

    def _tick(self) -> None:
        now = self._ticker.clock.seconds()
        for proto in list(self.live):
            try:
                proto.tick(now)
            except Exception:  # a bug must not end the time limits of every connection
                log.exception("time limits of a connection failed")

    def buildProtocol(self, addr) -> TensorShareProtocol:
        proto = TensorShareProtocol(self.state)
        proto.factory = self
        return proto

    def disconnect_all(self) -> None:
        """Abort every open connection (when an embedded server stops)."""
        for proto in list(self.live):
            proto.transport.abortConnection()
