"""The Twisted adapter: moves bytes between TCP connections and :class:`ServerSession`.

Inbound, ``dataReceived`` feeds the session.  Outbound, one :class:`FrameWriter` per
connection is the transport's only push producer: it writes whole frames in order,
part by part, stopping whenever the transport asks it to pause, so a large reply
never sits in memory twice and replies and notifications never interleave.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections import deque
from typing import Callable

from twisted.internet import interfaces, main, protocol, reactor, task, tcp
from zope.interface import implementer

from .busypoll import BusyPoll
from .flow import OutboundBudget
from ..protocol.session import ServerSession, ServerState

log = logging.getLogger("tensorshare.server")

try:  # SIOCOUTQ: unsent bytes of a TCP socket (Linux); elsewhere only Twisted's buffer is watched
    import fcntl
    import termios

    _OUTQ = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except ImportError:
    _OUTQ = None

_LARGE_READ = 1 << 20  # recv size while a large payload streams in
_SMALL_READ = 1 << 16  # recv size otherwise (Twisted's default)
_DIRECT_MAX = 64 << 10  # most bytes of small parts sent in one direct send()
_HOLD_MAX = 32  # most frames held back while a read is handled (see FrameWriter)
_LARGE_SEND = 4 << 20  # most bytes Twisted passes to one send() (its default: 128 KiB)
_TURN_SEND = 16 << 20  # most bytes of view parts one connection sends per pump (one per writable event)
_STALL_POLLS = 4  # looks per stall timeout at a congested connection's progress


@implementer(interfaces.IPushProducer)
class FrameWriter:
    """Writes queued frames to a transport as fast as it accepts them.

    Small replies skip Twisted's write buffer: ``transport.write`` only queues the
    bytes and asks the reactor for a writable event, so the reply would leave one
    reactor turn later (an epoll wait, two epoll_ctl calls and a dispatch: about a
    fifth of a small round trip here).  When the transport has nothing buffered,
    the leading small parts are sent at once with one ``send()`` on its socket;
    whatever the kernel does not take, and every large ``bytes`` part, goes through
    ``transport.write``, so order, backpressure and error handling stay Twisted's.
    Parts that are memoryviews (the pooled chunks of a stored item) are sent from
    their own memory (:meth:`_send_view`), since ``transport.write`` would need them
    copied into new ``bytes``.  While the protocol is inside ``dataReceived`` the writer holds its
    frames (:meth:`hold`/:meth:`release`), so the replies to a pipelined batch of
    requests leave together, in one system call per ``_HOLD_MAX`` frames: a client
    starts on the first replies while the rest are handled (holding a whole 64 KiB
    read's worth made client and server take turns; 32 at a time raised pipelined
    AsyncClient appends from about 17,000/s to 24,000-35,000/s here).

    What waits in the queue is accounted in an :class:`~.flow.OutboundBudget`
    (see :mod:`.flow`).  While it is congested, a notification replaces the one
    still waiting for the same bin, which leaves the queue; the newer one goes to
    the back, so it still follows every frame queued before it.
    ``on_congested``/``on_drained`` are told when the congestion starts and ends;
    they run inside the writer and must not send anything synchronously.
    """

    def __init__(self, transport, budget: OutboundBudget | None = None,
                 on_congested: Callable[[], None] | None = None, on_drained: Callable[[], None] | None = None):
        self.transport = transport
        self.budget = budget if budget is not None else OutboundBudget(1 << 62, float("inf"))
        self._on_congested = on_congested or _nothing
        self._on_drained = on_drained or _nothing
        self._queue: deque = deque()  # [parts (None once coalesced away), next index, on_abandon, bin or None]
        self._waiting_notes: dict[str, list] = {}  # bin -> its queued notification, not yet written
        self._dropped = 0  # coalesced-away entries still in the queue
        self.coalesced = 0  # notifications replaced by a newer one, over the connection's life
        self._paused = False
        self._closing = False
        self._lost = False
        self._holding = False
        self._view_sent = 0  # bytes of the view part at the head of the queue already sent
        self._turn_sent = 0
        # The direct path reads the buffer state of Twisted's TCP transport (its
        # FileDescriptor write buffers); any other transport (TLS, test fakes), or a
        # Twisted whose buffers look different, only ever sees transport.write.  A TLS
        # connection's transport is a TLSMemoryBIOProtocol, which is no tcp.Connection
        # (hasattr alone would not do: it forwards unknown attributes to the TCP
        # transport beneath, and a direct send() there would bypass the encryption).
        direct = isinstance(transport, tcp.Connection) and all(
            hasattr(transport, name) for name in ("_tempDataBuffer", "dataBuffer", "offset", "producerPaused"))
        self._socket = transport.getHandle() if direct else None

    @property
    def congested(self) -> bool:
        """True while the unsent frames are over the budget (see :mod:`.flow`)."""
        return self.budget.congested

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None) -> None:
        """Queue one frame (a reply: never dropped while the connection lives)."""
        if self._lost or self._closing:
            if on_abandon is not None:
                on_abandon()
            return
        self._enqueue([parts, 0, on_abandon, None])

    def notify(self, name: str, frame: bytes) -> None:
        """Queue a notification about bin ``name``; while congested it replaces the
        one for the same bin still waiting to be written."""
        if self._lost or self._closing:
            return
        if self.budget.congested:
            waiting = self._waiting_notes.get(name)
            if waiting is not None:
                self._drop(waiting)
        entry = [[frame], 0, None, name]
        self._waiting_notes[name] = entry
        self._enqueue(entry)

    @property
    def pending(self) -> bool:
        """Whether frames wait that the transport has not taken whole yet (a reply in progress)."""
        return bool(self._queue)

    def hold(self) -> None:
        """Queue frames without writing them until :meth:`release`."""
        self._holding = True

    def release(self) -> None:
        """Write what was queued since :meth:`hold`."""
        self._holding = False
        if self._queue and not self._paused:
            self._pump()

    def close(self) -> None:
        """Close the connection after the queued frames have been written."""
        self._closing = True
        if not self._queue:
            self._finish_close()

    def _enqueue(self, entry: list) -> None:
        queue = self._queue
        queue.append(entry)
        if self.budget.charge(entry[0]):
            self._on_congested()
        if (not self._holding or len(queue) >= _HOLD_MAX) and not self._paused:
            self._pump()

    def _drop(self, entry: list) -> None:
        """Take a waiting notification out of the queue (a newer one replaces it)."""
        if self.budget.discharge(entry[0], written=False):
            self._on_drained()
        entry[0] = None
        self.coalesced += 1
        self._dropped += 1
        queue = self._queue
        if self._dropped > 32 and 2 * self._dropped > len(queue):
            # Compact, so a reader that never reads cannot grow the queue with
            # dropped entries.  The head is never a dropped one mid-write.
            self._queue = deque(e for e in queue if e[0] is not None)
            self._dropped = 0

    def _written(self, entry: list) -> None:
        """An entry was handed to the transport whole: forget it."""
        name = entry[3]
        if name is not None and self._waiting_notes.get(name) is entry:
            del self._waiting_notes[name]

    def _pump(self) -> None:
        queue, write, budget = self._queue, self.transport.write, self.budget
        drained = False
        self._turn_sent = 0  # bytes of view parts sent in this call (_TURN_SEND)
        while queue and not self._paused:
            if self._socket is not None and not self._view_sent and self._transport_idle():
                sent = self._send_direct()
                if sent is not None:
                    drained |= sent
                    continue
            entry = queue[0]
            parts, index = entry[0], entry[1]
            if parts is None:  # coalesced away
                queue.popleft()
                self._dropped -= 1
                continue
            while index < len(parts) and not self._paused:
                part = parts[index]
                # Parts are bytes; memoryviews of pooled chunks (server/net/recvpool.py),
                # sent from their own memory where we own the socket; or spans of a
                # spilled item's mapping, copied out only now.
                if type(part) is bytes:
                    write(part)  # may call pauseProducing()
                elif type(part) is not memoryview or self._socket is None:
                    write(part.tobytes())
                elif not self._send_view(part):
                    break  # resumeProducing() goes on with it
                index += 1
                drained |= budget.discharge((part,))
            entry[1] = index
            if index == len(parts):
                queue.popleft()
                self._written(entry)
        if drained and not budget.congested:
            self._on_drained()
        if not queue and self._closing:
            self._finish_close()

    def _transport_idle(self) -> bool:
        """True when the transport holds no unsent bytes (so a direct send keeps order)."""
        t = self.transport
        return (t.connected and not t.disconnecting and not getattr(t, "_aborting", False)
                and not t._tempDataBuffer and t.offset == len(t.dataBuffer))

    def _send_view(self, part: memoryview) -> bool:
        """Send a memoryview part from its own memory (``transport.write`` takes only bytes:
        a copy, into fresh memory); True once all of it has gone.

        Otherwise, when the socket is full, Twisted still holds earlier bytes, or this
        call's share (``_TURN_SEND``, so that one fast reader does not hold the
        reactor for a whole large reply) is spent, the writer pauses and asks the
        transport to watch for writability: Twisted's ``doWrite`` writes what it holds
        and then, its buffer empty and its producer marked paused, calls
        :meth:`resumeProducing`, which goes on from ``_view_sent``.
        """
        t = self.transport
        if not t.connected or t.disconnecting:  # closing: Twisted's own path decides what still goes
            t.write(part[self._view_sent :].tobytes())
            self._view_sent = 0
            return True
        if self._transport_idle():
            view = part[self._view_sent :]
            try:
                while view and self._turn_sent < _TURN_SEND:
                    sent = self._socket.send(view[:_LARGE_SEND])
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
        t.producerPaused = True
        t.startWriting()
        return False

    def _send_direct(self) -> bool | None:
        """Send the leading small parts of the queue with one send(); None if none is
        small, else whether that ended the congestion."""
        queue = self._queue
        chunks, total = [], 0
        done = 0  # whole frames taken
        cut = None  # (entry, index) where a partly taken frame stops
        for entry in queue:
            parts, index = entry[0], entry[1]
            if parts is None:  # coalesced away
                done += 1
                continue
            while index < len(parts) and total + len(parts[index]) <= _DIRECT_MAX:
                part = parts[index]
                chunks.append(part if type(part) is bytes else part.tobytes())
                total += len(part)
                index += 1
            if index < len(parts):
                cut = (entry, index)
                break
            done += 1
        if not chunks:
            return None
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            sent = self._socket.send(data)
        except OSError:  # EAGAIN, or a dead socket: Twisted's own write path deals with it
            sent = 0
        for _ in range(done):
            entry = queue.popleft()
            if entry[0] is None:
                self._dropped -= 1
            else:
                self._written(entry)
        if cut is not None:
            cut[0][1] = cut[1]
        if sent < len(data):
            self.transport.write(data[sent:])  # may call pauseProducing() synchronously
        return self.budget.discharge(chunks)

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
        self._on_congested = self._on_drained = _nothing  # they refer back to the protocol
        queue, self._queue = self._queue, deque()
        self._waiting_notes.clear()
        for _parts, _index, on_abandon, _name in queue:
            if on_abandon is not None:
                on_abandon()


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

    def resume(self, reason: str) -> None:
        if reason in self._reasons:
            self._reasons.discard(reason)
            if not self._reasons and self.transport.connected:
                self.transport.resumeProducing()


def _nothing() -> None:
    pass


def _unsent(transport) -> tuple | None:
    """What the Twisted socket transport under ``transport`` (a TLS transport wraps
    one) still holds: bytes in its buffer and, where the OS tells (Linux), in the
    kernel's send queue, which shrinks with every byte the peer acknowledges.  None
    if there is nothing to look at.  Only compared with an earlier value."""
    for _ in range(4):
        if all(hasattr(transport, name) for name in ("dataBuffer", "offset", "_tempDataLen")):
            buffered = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
            return buffered, _kernel_unsent(transport)
        transport = getattr(transport, "transport", None)
        if transport is None:
            break
    return None


def _kernel_unsent(transport) -> int | None:
    if _OUTQ is None:
        return None
    try:
        raw = fcntl.ioctl(transport.getHandle().fileno(), _OUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return None
    return int.from_bytes(raw, sys.byteorder, signed=True)


class TensorShareProtocol(protocol.Protocol):
    """One server-side connection."""

    def __init__(self, state: ServerState):
        self.state = state
        self.writer: FrameWriter | None = None
        self.session: ServerSession | None = None
        self._read_size = 0
        self._stall_check = None  # DelayedCall while the outbound queue is congested
        self._last_unsent = None  # what the transport held at the last stall check (_unsent)
        self._resume_call = None  # DelayedCall that resumes the session after a drain

    def connectionMade(self) -> None:
        self.factory.live.add(self)
        self.transport.setTcpNoDelay(True)
        # Twisted hands the kernel at most SEND_LIMIT (128 KiB) per reactor turn; a
        # 64 MiB reply then costs 512 turns.  4 MiB per send() cut the server's CPU
        # per large reply by ~40% and a 64 MiB fan-out to 8 readers from ~810 to
        # ~470 ms here.
        self.transport.SEND_LIMIT = _LARGE_SEND
        config = self.state.config
        budget = OutboundBudget(config.max_outbound, config.outbound_stall_timeout, self.factory.clock.seconds)
        self.writer = FrameWriter(self.transport, budget, self._outbound_congested, self._outbound_drained)
        self.transport.registerProducer(self.writer, True)
        peer = self.transport.getPeer()
        self.session = ServerSession(self.state, self.writer, f"{peer.host}:{peer.port}", ReadGate(self.transport),
                                     same_host=_same_host(peer, self.transport.getHost()))
        self.session.connection_made()

    def dataReceived(self, data: bytes) -> None:
        self._received(self.session.data_received, data)

    def receive_buffer(self) -> memoryview | None:
        """Memory the session lends for the next read (see :class:`ReceivingServer`)."""
        return self.session.receive_buffer() if self.session is not None else None

    def received_into(self, n: int) -> None:
        """``n`` bytes were read into :meth:`receive_buffer`'s memory."""
        self._received(self.session.received_into, n)

    def _received(self, deliver: Callable, what) -> None:
        busy = self.factory.busy_poll
        if busy is not None:
            busy.note_request()
        writer = self.writer
        writer.hold()
        try:
            deliver(what)
        finally:
            writer.release()
        # Read large payloads in big gulps: fewer reactor turns per byte.
        size = _LARGE_READ if self.session.receiving_payload > _LARGE_READ else _SMALL_READ
        if size != self._read_size:
            self._read_size = self.transport.bufferSize = size

    def connectionLost(self, reason) -> None:
        self.factory.live.discard(self)
        for call in (self._stall_check, self._resume_call):
            if call is not None and call.active():
                call.cancel()
        self._stall_check = self._resume_call = None
        if self.session is not None:
            self.writer.connection_lost()  # first: what the session still sends is abandoned
            self.session.connection_lost()

    # -- flow control (the policy is in server/net/flow.py)

    def _outbound_congested(self) -> None:
        if self._stall_check is None:
            self._stall_check = self.factory.clock.callLater(self._stall_poll(), self._check_stall)

    def _stall_poll(self) -> float:
        return self.writer.budget.stall_timeout / _STALL_POLLS

    def _check_stall(self) -> None:
        self._stall_check = None
        budget = self.writer.budget
        if not budget.congested or self.session.closed:
            return
        unsent = _unsent(self.transport)
        if unsent != self._last_unsent:  # the socket took bytes since the last look
            self._last_unsent = unsent
            budget.note_progress()
        idle = budget.stalled_for()
        if idle < budget.stall_timeout:
            self._stall_check = self.factory.clock.callLater(self._stall_poll(), self._check_stall)
            return
        log.warning("disconnecting %s: it took no byte for %.1f s while %d bytes waited for it "
                    "(congested since they passed max_outbound, %d; %d notifications coalesced)",
                    self.session.peer, idle, budget.queued, budget.limit, self.writer.coalesced)
        self.transport.abortConnection()

    def _outbound_drained(self) -> None:
        # Called inside the writer: resume the waiting requests on a later turn.
        if self._resume_call is None:
            self._resume_call = self.factory.clock.callLater(0, self._resume)

    def _resume(self) -> None:
        self._resume_call = None
        if self.session.closed or self.writer.congested:
            return
        writer = self.writer
        writer.hold()
        try:
            self.session.resume()  # it stops and starts reading (through its ReadGate) as it goes
        finally:
            writer.release()

    def tick(self, now: float) -> None:
        if self.session is not None:
            self.session.tick(now, self.writer.pending)


class ReceivingServer(tcp.Server):
    """Twisted's TCP server transport, reading straight into lent memory when the
    protocol lends some.

    Twisted's ``doRead`` reads into a new ``bytes`` per ``recv()``.  While a large
    payload arrives into the receive pool (:mod:`.recvpool`), the session lends the
    pool chunk it fills instead, and this reads into it with ``recv_into``: no
    fresh memory and no copy.  Everything else (headers, small payloads, TLS, which
    a TLS protocol wraps and this does not see) takes Twisted's own path.
    """

    def doRead(self):
        lend = getattr(self.protocol, "receive_buffer", None)
        buf = lend() if lend is not None else None
        if buf is None:
            return super().doRead()
        try:
            n = self.socket.recv_into(buf)
        except BlockingIOError:
            return None
        except OSError:
            return main.CONNECTION_LOST
        if not n:
            return main.CONNECTION_DONE
        self.protocol.received_into(n)
        return None


class ReceivingPort(tcp.Port):
    """A TCP port whose connections are :class:`ReceivingServer` transports."""

    transport = ReceivingServer


def listen_tcp(port: int, factory: protocol.Factory, interface: str) -> ReceivingPort:
    """``reactor.listenTCP``, with :class:`ReceivingServer` transports."""
    listening = ReceivingPort(port, factory, interface=interface, reactor=reactor)
    listening.startListening()
    return listening


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

    def __init__(self, state: ServerState, clock=None):
        self.state = state
        self.clock = clock if clock is not None else reactor  # callLater/seconds, for flow control
        self.live: set[TensorShareProtocol] = set()
        self._ticker: task.LoopingCall | None = None  # applies the sessions' time limits
        self._trimmer: task.LoopingCall | None = None  # releases long-free receive pool memory
        self.busy_poll: BusyPoll | None = None  # told of each read of requests (server/net/busypoll.py)

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
