"""The engine over Twisted: one member's connection, opened, fed, kept alive and opened again.

Two client ends run on a reactor: the :class:`~tensorshare.AsyncClient` and a relay's
connections to its upstream (``server/relay/upstream.py``, which loads neither
torch nor the client library).  Both are :class:`TwistedMember` s under a
:class:`~tensorshare.protocol.router.Router`: this module moves bytes between a
Twisted transport and the member's :class:`~tensorshare.protocol.engine.Engine`
and carries out what the engine decides (the AUTH and probes in its outbox, a
dead connection dropped, the next attempt after its backoff).  What a reply, a
notification or a listen restored means is the owner's, told through
:attr:`TwistedMember.answered`, :attr:`~TwistedMember.notified` and
:attr:`~TwistedMember.restored`.

A connection is a :class:`Wire` (a Twisted protocol); :func:`open_wire` opens one
and fires with it once the opening is over (TLS checked, greeted, authenticated),
so the first connection of a client, or one that looks at the server's public
address for a new map, can be handed to the member it turns out to serve
(``TwistedMember(..., opened=wire)``).  Frames are queued and written once per
reactor turn (each write costs a join and an epoll registration).  Calls in flight
expire on one timer per member (a timer per request cost more than the rest of a
small request).  :func:`start_members` starts a router's members once it routes
by a greeting; :class:`Remapper` looks at the server's public address again when
a member finds its worker gone or another one in its place, or a request is
refused with 427, for both owners alike.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable

from twisted.internet import defer, protocol, threads
from twisted.internet.endpoints import SSL4ClientEndpoint, TCP4ClientEndpoint, UNIXClientEndpoint, connectProtocol

from ..errors import (
    AuthenticationError, ConnectionLostError, TensorShareError, TimeoutError, UntrustedServerError, WrongServerError,
)
from ..disk.areas import LOCAL_BUFFER, local_socket
from ..protocol import peers
from ..protocol.engine import DEAD, READY, Call, Engine, Notice, Restored
from ..protocol.messages import Key
from ..protocol.router import Router
from ..protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")

_CURRENT = object()  # "the map the router routes by now"
LARGE_FRAME = 1 << 20  # a frame of this many bytes or more is written by itself (see Wire.send)


class Options:
    """How a Twisted member connects: ``token`` (the HMAC key), ``tls``
    (:class:`TLSSettings` or None), the seconds an opening may take, the keepalive
    interval (None: off), the longest backoff, whether a silent plaintext peer is
    probed for what it is, a ``connector`` (tests pair the ends in memory) and the
    payload sinks of a connection no member serves yet (the decoder's default, which
    loads the value codec, for None).  ``local``: a plaintext connection moves to the
    server's Unix socket when its greeting names one this process trusts
    (:func:`open_nearest`, PROTOCOL.md §10.1)."""

    def __init__(self, reactor, host: str, *, token: bytes | None = None, tls: TLSSettings | None = None,
                 connect_timeout: float = 10.0, keepalive: float | None = 15.0, max_backoff: float = 2.0,
                 probe_peer: bool = True, connector: Callable | None = None, log_prefix: str = "",
                 sinks: Callable | None = None, local: bool = False):
        self.reactor, self.host = reactor, host
        self.token, self.tls = token, tls
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive or None
        self.max_backoff = max_backoff
        self.probe_peer = probe_peer
        self.connector = connector
        self.log_prefix = log_prefix
        self.sinks = sinks  # the payload sinks of a connection no member serves yet (None: the decoder's default)
        self.local = local and tls is None and connector is None
        self.tls_options = None if tls is None else tls.twisted_options(host)

    def engine(self, port: int) -> Engine:
        kw = {} if self.sinks is None else {"sinks": self.sinks}
        return Engine(self.token, f"{self.host}:{port}", keepalive=self.keepalive, max_backoff=self.max_backoff,
                      **kw)


class Wire(protocol.Protocol):
    """One connection: bytes in to the engine, its events to the owner (see the module
    docstring).  ``greeted`` fires with the wire once requests may be sent.  It is
    the transport's (streaming) producer only to learn when our writes are backed
    up: the server answers a keepalive probe only after reading everything sent
    before it.  ``path``: the server's Unix socket it is connected through (None: TCP)."""

    def __init__(self, options: Options, port: int, engine: Engine, path: str | None = None):
        self.options, self.port, self.engine, self.path = options, port, engine, path
        self.owner: Any = None  # the member it serves (None while opening)
        self.greeted: defer.Deferred = defer.Deferred()
        self.write_blocked = False
        self._outgoing: list[bytes] = []  # small frames' parts, joined in one write per turn
        self._large: list[bytes] = []  # large frames (with the small ones before each), written one at a time
        self._flush_scheduled = False
        self._certificate_checked = options.tls is None
        self._speaks = None  # what a probe found the peer to be, if one ran
        self._early: list = []  # events that came with the end of the opening, for the owner

    @property
    def client(self):  # (the in-memory connectors of the tests read the port through it)
        return self

    @property
    def where(self) -> str:
        return f"{self.options.host}:{self.port}"

    def connectionMade(self) -> None:
        if self.path is None:
            self.transport.setTcpNoDelay(True)
        else:  # (as large as loopback TCP's: a Unix socket's default holds back larger replies)
            self.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER)
        self.transport.registerProducer(self, True)
        self.engine.connected(self.options.reactor.seconds())

    def dataReceived(self, data: bytes) -> None:
        engine = self.engine
        try:
            if not self._certificate_checked:  # data arrives only after the TLS handshake
                self._certificate_checked = True
                self.options.tls.check_transport(self.transport)
            events = engine.receive(data, self.options.reactor.seconds())
        except (WrongServerError, AuthenticationError) as exc:
            self._fail(exc)
            return
        except TensorShareError as exc:  # the peer broke the protocol, or refused us (421...)
            if self.greeted.called:
                log.warning("%sbad data from %s: %s; dropping the connection", self.options.log_prefix, self.where,
                            exc)
            self._fail(exc)
            return
        if engine.outbox:
            self.send(engine.take_outbox())
        if not events:
            return
        if not self.greeted.called:
            if events[0] is READY:
                self._early = events[1:]
                self.greeted.callback(self)
            return
        if self.owner is not None:
            self.owner.events(self, events)

    def handed(self, owner) -> None:
        """``owner`` serves this connection from now on (events the opening brought go to it)."""
        self.owner = owner
        early, self._early = self._early, []
        if early:
            owner.events(self, early)

    def _fail(self, error: BaseException) -> None:
        if not self.greeted.called:
            self.greeted.errback(error)
        if self.transport is not None:
            self.transport.abortConnection()

    def abandon_opening(self) -> None:
        """Give up on a connection whose opening did not finish in time."""
        if not self.greeted.called and self.transport is not None:
            hint = "" if self.options.tls else peers.silence_hint(self._speaks)
            self._fail(ConnectionLostError(f"no tensorshare greeting from {self.where} within "
                                           f"{self.options.connect_timeout:g}s{hint}"))

    def probe_peer(self) -> None:
        """The peer said nothing yet: find out what it is on a second connection (on a
        thread), and fail the opening if that tells."""
        if self.greeted.called or self.engine._first or self.transport is None:
            return
        reactor = self.options.reactor
        d = threads.deferToThreadPool(reactor, reactor.getThreadPool(), peers.probe, self.options.host, self.port,
                                      1.0)
        d.addCallback(self._probed)

    def _probed(self, found: tuple) -> None:
        self._speaks, first = found
        if self._speaks in (peers.TLS, peers.HTTP) and not self.greeted.called and self.transport is not None:
            self._fail(peers.wrong_server(self.where, first, self._speaks))

    def connectionLost(self, reason) -> None:
        self._outgoing, self._large = [], []
        if not self.greeted.called:
            self.greeted.errback(self._opening_failure(reason))
        if self.owner is not None:
            self.owner.lost(self, reason.getErrorMessage())

    def _opening_failure(self, reason) -> TensorShareError:
        text = reason.getErrorMessage()
        if self.options.tls is not None:
            if "certificate verify failed" in text or reason.type.__name__ == "VerificationError":
                return UntrustedServerError(f"the TLS certificate of {self.where} is not trusted: {text}")
            if not self._certificate_checked:
                return ConnectionLostError(f"TLS handshake with {self.where} failed (is it a TLS server?): {text}")
        return ConnectionLostError(f"closed before greeting: {text}")

    # -- writing

    def send(self, parts: list) -> None:
        """Queue a frame.  Small frames queued in one reactor turn go out in one write.  A
        large one is copied once, now, straight from the value's memory into the bytes
        a real transport insists on (the copy is also the value's snapshot: changing it
        after the call is safe); it goes to the transport alone, so that Twisted's
        buffer never joins it with other frames (a copy more)."""
        if all(type(p) is bytes for p in parts):
            self._outgoing.extend(parts)
        elif sum(memoryview(p).nbytes for p in parts) < LARGE_FRAME:
            self._outgoing.extend(p if type(p) is bytes else bytes(p) for p in parts)
        else:  # the small frames queued before it lead it in the same bytes (they are tiny)
            self._large.append(b"".join([*self._outgoing, *parts]))
            self._outgoing = []
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.options.reactor.callLater(0, self.flush)

    def flush(self, everything: bool = False) -> None:
        """Write what is queued: the large frames one at a time, each once the transport
        has taken the one before (``everything``: all now, as a closing connection must)."""
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or not self.connected:
            return
        large = self._large
        wrote = False
        while large:
            if self.write_blocked and not everything:
                break  # (resumeProducing flushes again, once the transport has taken what it holds)
            transport.write(large.pop(0))
            wrote = True
        if self._outgoing and not large and (everything or not (wrote and self.write_blocked)):
            data, self._outgoing = b"".join(self._outgoing), []
            transport.write(data)
            wrote = True
        if wrote:
            self.engine.sent(self.options.reactor.seconds())

    def close(self) -> None:
        if self.transport is not None:
            self.flush(everything=True)  # what was queued still goes out
            self.transport.unregisterProducer()  # TLS closes only without a producer
            self.transport.loseConnection()

    # IPushProducer: writes are not held back, only watched
    def pauseProducing(self) -> None:
        self.write_blocked = True

    def resumeProducing(self) -> None:
        self.write_blocked = False
        self.engine.sent(self.options.reactor.seconds())
        if self._large or self._outgoing:  # (what queued behind a large frame the transport has taken now)
            self.flush()

    def stopProducing(self) -> None:
        pass


def open_wire(options: Options, port: int, engine: Engine, path: str | None = None) -> defer.Deferred:
    """Open a connection to ``port`` (through the server's Unix socket ``path`` if given)
    for ``engine``: a Deferred of its :class:`Wire` once the opening is over (within
    ``connect_timeout``: TCP, TLS, greeting and AUTH)."""
    wire = Wire(options, port, engine, path)
    reactor = options.reactor
    timers = [reactor.callLater(options.connect_timeout, wire.abandon_opening)]
    if options.probe_peer and options.tls is None and options.connector is None and path is None:
        timers.append(reactor.callLater(min(peers.PROBE_AFTER, options.connect_timeout / 2), wire.probe_peer))

    def stop_timers(result):
        for timer in timers:
            if timer.active():
                timer.cancel()
        return result

    if options.connector is not None:
        d = options.connector(wire)
    elif path is not None:
        d = connectProtocol(UNIXClientEndpoint(reactor, path, timeout=options.connect_timeout), wire)
    elif options.tls_options is None:
        d = connectProtocol(TCP4ClientEndpoint(reactor, options.host, port, timeout=options.connect_timeout), wire)
    else:
        d = connectProtocol(SSL4ClientEndpoint(reactor, options.host, port, options.tls_options,
                                               timeout=options.connect_timeout), wire)
    d.addCallback(lambda _: wire.greeted)
    d.addBoth(stop_timers)

    def failed(failure):
        engine.refused(failure.value)
        if failure.check(TensorShareError):
            return failure
        through = "" if path is None else f" through {path}"
        raise ConnectionLostError(f"cannot connect to {wire.where}{through}: {failure.getErrorMessage()}")

    return d.addErrback(failed)


def open_nearest(options: Options, port: int, engine: Engine, path: str | None = None) -> defer.Deferred:
    """:func:`open_wire` the nearest way: through the server's Unix socket ``path``
    (named by an earlier greeting) while it is there, else over TCP, moving the new
    connection to the Unix socket its greeting names if ``options.local`` and this
    process trusts it (:func:`~tensorshare.disk.areas.local_socket`, PROTOCOL.md §10.1).
    The wire's ``path`` says which it is."""
    if path is not None:
        def gone(failure):  # (a restarted server has a new socket: TCP tells where)
            if engine.closed or engine.failure is not None:
                return failure
            log.info("%s%s: its Unix socket is gone (%s); connecting over TCP", options.log_prefix,
                     f"{options.host}:{port}", failure.getErrorMessage())
            return open_nearest(options, port, engine)

        return open_wire(options, port, engine, path).addErrback(gone)
    d = open_wire(options, port, engine)
    return d.addCallback(_nearer, options, port, engine) if options.local else d


def _nearer(wire: Wire, options: Options, port: int, engine: Engine):
    """``wire``, just opened over TCP, or in its place a connection through the Unix
    socket its greeting names (see :func:`open_nearest`)."""
    path = local_socket(engine.greeting.get(Key.SHM))
    if path is None:
        return wire
    wire.transport.abortConnection()  # (it reads nothing more: the engine is the new connection's)
    engine.lost(ConnectionLostError("moved to the same-host socket"))  # (listens it restored: never answered)

    def tcp_again(failure):
        if engine.failure is not None:
            return failure
        log.info("%s%s: not using its Unix socket %s (%s); connecting over TCP", options.log_prefix, wire.where,
                 path, failure.getErrorMessage())
        return open_wire(options, port, engine)

    return open_wire(options, port, engine, path).addErrback(tcp_again)


class TwistedMember:
    """One connection's driver under a router (see the module docstring).

    It keeps its worker's connection open: connecting when started (or taking
    ``opened``, already greeted), connecting again after a loss with the engine's
    backoff, unless the failure is final.  The owner's hooks: ``answered(call)``
    for a call settled (reply, error, expiry or loss); ``notified(notice)`` and
    ``restored(event)``; ``on_ready(member)`` once a connection is up (each time);
    ``on_lost(member, reason)``; ``on_refused(member, error)`` when the server will
    not have us (final); ``fits(member, greeting)``, whether a connection greeted so
    serves what this member is for (if not it is dropped, and tried again later);
    ``on_unreached(member)`` when an attempt to connect fails."""

    def __init__(self, options: Options, index: int | None, port: int, opened: Wire | None = None):
        self.options, self.index, self.port = options, index, port
        self.reactor = options.reactor
        self.engine = opened.engine if opened is not None else options.engine(port)
        self.wire: Wire | None = None
        self.answered: Callable[[Call], None] = _nobody
        self.notified: Callable[[Notice], None] = _nobody
        self.restored: Callable[[Restored], None] = _nobody
        self.on_ready: Callable | None = None
        self.on_lost: Callable | None = None
        self.on_refused: Callable | None = None
        self.fits: Callable | None = None
        self.on_unreached: Callable | None = None
        self.opening: defer.Deferred | None = None  # the first connection, while it opens
        self._timer = None  # the next attempt to connect
        self._keepalive_timer = None
        self._sweeper = None  # the one timer that expires calls
        self._sweep_at = 0.0
        self._opened = opened
        self.local = None if opened is None else opened.path  # the worker's Unix socket, once one was used
        self.areas: Any = None  # the owner's verified same-host areas of this connection (the user clients')

    @property
    def where(self) -> str:
        return f"{self.options.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self.wire is not None

    def start(self) -> defer.Deferred:
        """Connect (or take the connection given), and keep connecting whenever it drops;
        a Deferred of the first connection's outcome."""
        if self._opened is not None:
            wire, self._opened = self._opened, None
            self._take(wire)
            return defer.succeed(None)
        self.opening = d = self._attempt()
        d.addBoth(self._first_done)
        return d

    def _first_done(self, result):
        self.opening = None
        return result

    def _attempt(self) -> defer.Deferred:
        self._timer = None
        if self.engine.closed:
            return defer.fail(ConnectionLostError("client closed"))
        d = open_nearest(self.options, self.port, self.engine, self.local)
        return d.addCallbacks(self._take, self._not_opened)

    def _take(self, wire: Wire) -> None:
        if self.engine.closed:
            wire.close()
            return None
        if self.fits is not None and not self.fits(self, self.engine.greeting):
            wire.transport.abortConnection()
            self._retry()
            raise ConnectionLostError(f"{self.where} greeted as another worker than this connection is for")
        self.wire = wire
        self.local = wire.path
        if self.engine.outbox:  # (listens moved here before the connection was taken)
            wire.send(self.engine.take_outbox())
        wire.handed(self)
        if self.engine.keepalive is not None and self._keepalive_timer is None:
            self._keepalive_timer = self.reactor.callLater(self.engine.keepalive_interval, self._check_alive)
        if self.on_ready is not None:
            self.on_ready(self)
        return None

    def _not_opened(self, failure):
        if self.engine.closed:
            return failure
        if self.engine.failure is not None:
            log.error("%scannot connect to %s: %s; giving up", self.options.log_prefix, self.where,
                      failure.getErrorMessage())
            if self.on_refused is not None:
                self.on_refused(self, failure.value)
            return failure
        log.info("%s%s unreachable (%s); trying again", self.options.log_prefix, self.where, failure.getErrorMessage())
        self._retry()
        if self.on_unreached is not None:
            self.on_unreached(self)
        return failure

    def _retry(self) -> None:
        delay = self.engine.retry_delay()
        if delay is not None and self._timer is None:
            self._timer = self.reactor.callLater(delay, self._retry_now)

    def _retry_now(self) -> None:
        self._attempt().addErrback(lambda failure: None)

    # -- calls

    def send(self, call: Call, parts: list, deadline: float | None = None) -> None:
        """Send ``call`` (its frame's ``parts``, built by the owner); ``answered(call)``
        hears of it.  ``deadline`` (``reactor.seconds()``): it expires then."""
        wire = self.wire
        if wire is None:
            raise ConnectionLostError(f"not connected to {self.where} (reconnecting)")
        self.engine.track(call, self.reactor.seconds())
        wire.send(parts)
        if deadline is not None:
            call.deadline = deadline
            if self._sweeper is None or self._sweep_at > deadline:
                self._sweep_by(deadline)

    def events(self, wire: Wire, events: list) -> None:
        if wire is not self.wire:
            return
        for event in events:
            kind = type(event)
            try:
                if kind is Notice:
                    self.notified(event)
                elif kind is Restored:
                    self.restored(event)
                elif event is not READY:
                    self.answered(event)
            except Exception:
                log.exception("%shandling %r from %s failed", self.options.log_prefix, event, self.where)

    def abandon(self, call: Call) -> None:
        """The caller of ``call`` left: forget it, resetting the connection if the server
        could still deliver to nobody (:meth:`Engine.abandon`)."""
        if self.engine.abandon(call) and self.wire is not None:
            self.wire.transport.abortConnection()

    # -- timeouts

    def _sweep_by(self, deadline: float) -> None:
        sweeper = self._sweeper
        if sweeper is not None and sweeper.active():
            sweeper.cancel()
        self._sweep_at = deadline
        self._sweeper = self.reactor.callLater(max(deadline - self.reactor.seconds(), 0.0), self._sweep)

    def _sweep(self) -> None:
        """Fail the calls whose deadline has passed."""
        self._sweeper = None
        now = self.reactor.seconds()
        calls = self.engine.calls
        late = [call for call in calls.values() if call.deadline is not None and call.deadline <= now]
        for call in late:
            self.abandon(call)
            call.error = TimeoutError(f"no reply from {self.where} in time")
            self.answered(call)
        deadlines = [call.deadline for call in calls.values() if call.deadline is not None]
        if deadlines:
            self._sweep_by(max(min(deadlines), now + 0.01))

    # -- the connection's end

    def lost(self, wire: Wire, reason: str) -> None:
        if wire is not self.wire:
            return
        self.wire = None
        error = ConnectionLostError(f"connection to {self.where} lost: {reason}")
        for call in self.engine.lost(error):
            self.answered(call)
        if self.on_lost is not None:
            self.on_lost(self, reason)
        self._retry()

    def _check_alive(self) -> None:
        """Do what the engine's keepalive asks: a probe, or dropping a silent connection."""
        self._keepalive_timer = None
        wire = self.wire
        if self.engine.closed or wire is None:
            return  # the next connection starts the timer again
        now = self.reactor.seconds()
        action, wake = self.engine.tick(now, wire.write_blocked)
        if action == DEAD:
            log.warning("%s%s", self.options.log_prefix, self.engine.dead_error())
            wire.transport.abortConnection()
            return
        if self.engine.outbox:
            wire.send(self.engine.take_outbox())
        if wake is not None:
            self._keepalive_timer = self.reactor.callLater(max(wake - now, 0.01), self._check_alive)

    def close(self) -> None:
        """No more connections; calls in flight fail."""
        for timer in (self._timer, self._sweeper, self._keepalive_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._timer = self._sweeper = self._keepalive_timer = None
        wire, self.wire = self.wire, None
        for call in self.engine.close():
            self.answered(call)
        if wire is not None:
            wire.close()
        elif self._opened is not None:
            self._opened.close()

    def adopt(self, handle) -> None:
        """Listen with ``handle`` (moved here from another member) from now on."""
        self.engine.adopt(handle)
        # What the engine asks to send goes out now, or when an opened connection is taken.
        if self.wire is not None and self.engine.outbox:
            self.wire.send(self.engine.take_outbox())

    def stop_listening(self, handle):
        """``(command, fields)`` of the call that ends ``handle`` (:meth:`Engine.stop_listening`)."""
        return self.engine.stop_listening(handle)

    def forget_listen(self, handle) -> None:
        """``handle`` hears nothing more here (its stopping call failed)."""
        self.engine.listens.remove(handle)


def start_members(router: Router) -> defer.Deferred:
    """Start every member of ``router`` (making those not made yet: after
    :meth:`Router.start` or :meth:`Router.learn`, none is started); a Deferred of
    their first connections, failing with the first that failed."""
    openings = [member.start() for member in router.all()]
    return defer.gatherResults(openings, consumeErrors=True).addCallbacks(lambda _: None, first_error)


def first_error(failure):
    """The failure of the first of several Deferreds that failed (gatherResults wraps it)."""
    return failure.value.subFailure if isinstance(failure.value, defer.FirstError) else failure


class Remapper:
    """A multi-worker server's workers mapped again, over Twisted (the decisions are the
    :class:`~tensorshare.protocol.router.Router`'s; the looking is this).

    A member greeted by another worker than it was made for (:meth:`fits`, its
    ``fits`` hook), a worker that cannot be reached (:meth:`unreached`) and a 427
    make the owner look at the server's public address again (:meth:`again`, one
    look at a time); if the server runs other workers now, the router routes by them,
    the old members are closed and the new ones started."""

    def __init__(self, options: Options, router: Router):
        self.options, self.router = options, router
        self.closed = False
        self._waiting: list | None = None  # while a look is under way: (Deferred, the map it was asked by)

    def fits(self, member: TwistedMember, greeting: dict) -> bool:
        """Whether ``member``'s greeting comes from the worker it was made for; if not,
        look again."""
        if member not in self.router.members:
            return False  # (replaced meanwhile)
        if self.router.fits(member.index, greeting):
            return True
        self.again(f"{member.where} greeted as another worker than {member.index}")
        return False

    def unreached(self, member: TwistedMember) -> None:
        """``member`` could not connect: its worker may have moved."""
        if member.index is not None:
            self.again(f"worker {member.index} at {member.where} unreachable")

    def again(self, why: str, seen: Any = _CURRENT) -> defer.Deferred:
        """Look at the public address again; a Deferred of whether the router routes
        differently now than by the map ``seen`` (default: the map now)."""
        d = defer.Deferred()
        first = self._waiting is None
        if first:
            self._waiting = []
        self._waiting.append((d, self.router.map if seen is _CURRENT else seen))
        if first:
            options, port = self.options, self.router.port
            open_wire(options, port, options.engine(port)).addCallbacks(self._mapped, self._unmapped, (why,), None,
                                                                        (why,))
        return d

    def _mapped(self, wire: Wire, why: str) -> None:
        old = None if self.closed else self.router.learn(wire.engine.greeting, wire)
        if old is None:
            wire.close()  # the same workers: the members reconnect by themselves
        else:
            log.warning("%s%s:%d runs other workers now (%s): mapping them again", self.options.log_prefix,
                        self.options.host, self.router.port, why)
            for member in old:
                member.close()  # (its calls in flight fail with ConnectionLostError)
            start_members(self.router).addErrback(lambda failure: None)  # (each keeps trying by itself)
        self._answer()

    def _unmapped(self, failure, why: str) -> None:
        log.info("%scannot map the workers of %s:%d again (%s): %s", self.options.log_prefix, self.options.host,
                 self.router.port, why, failure.getErrorMessage())
        self._answer()

    def _answer(self) -> None:
        waiting, self._waiting = self._waiting, None
        for d, seen in waiting:
            d.callback(self.router.stale(seen))


def _nobody(event) -> None:
    pass


__all__ = ["Options", "Remapper", "TwistedMember", "Wire", "first_error", "open_wire", "start_members"]
