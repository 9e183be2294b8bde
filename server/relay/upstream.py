"""A relay's connection to its upstream: a small Twisted client of its own, torch-free.

A server process loads neither torch nor the client library, relays included, and a
relay needs little of a client: requests whose replies it passes on or installs
raw (never decoded), listens, and a copy's payload received where it says.  So
this is a client of its own on the protocol both ends share: the opening handshake
is :mod:`tensorshare.protocol.handshake`'s, frames are :mod:`tensorshare.wire.frames`',
replies are checked against their :class:`~tensorshare.protocol.messages.Command`,
reconnections wait :mod:`tensorshare.protocol.retry`'s jittered backoff (the
clients' policy) and a silent upstream is probed as
:mod:`tensorshare.protocol.keepalive` says.

:class:`Upstream` connects (retrying until the upstream answers), and connects
again whenever the connection drops, listening again to every bin it listened to
(each listen's callback then hears of the bin's state, ``op`` ``LISTEN``).  Calls
in flight when it drops fail with :class:`ConnectionLostError`; nothing is sent
twice.  A refused authentication is final (:attr:`Upstream.on_refused`): a relay
does not hammer an upstream that will not have it.  A payload is received into one
``bytearray`` (:class:`ArraySink`), unless :attr:`Upstream.arriving` gives a sink
for a copy of a bin (cut-through, :mod:`.stream`).  A multi-worker upstream gets
one :class:`Upstream` per worker (:mod:`.upstreams`), each checking that its
greeting comes from the worker it was opened for (:attr:`Upstream.fits`).
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable

from twisted.internet import defer, protocol
from twisted.internet.endpoints import SSL4ClientEndpoint, TCP4ClientEndpoint, connectProtocol

from tensorshare.errors import (
    AuthenticationError, ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UntrustedServerError,
)
from tensorshare.protocol.handshake import CLIENT_FRAME_LIMITS, Handshake
from tensorshare.protocol.keepalive import Traffic
from tensorshare.protocol.messages import (
    ITEMS, KEEPALIVE, LISTEN, NOOP, NOTIFICATION, NOTIFY, PEEK, UNLISTEN, Command, Key, reply_error,
)
from tensorshare.protocol.retry import Backoff
from tensorshare.protocol.tls import TLSSettings
from tensorshare.wire.frames import Frame, FrameDecoder, frame_head

log = logging.getLogger("tensorshare.server.relay")

INCOMING = "INCOMING"  # the op of the notification that announces (or carries) a copy arriving (§11)
_ids = itertools.count(1)


class ArraySink:
    """A payload received into one ``bytearray``; the frame's payload is a read-only view of it."""

    def __init__(self, nbytes: int):
        self.array = bytearray(nbytes)
        self._view = memoryview(self.array)
        self._filled = 0

    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def filled(self) -> int:
        """Bytes received so far."""
        return self._filled

    def write(self, data) -> None:
        n = len(data)
        self._view[self._filled:self._filled + n] = data
        self._filled += n

    def finish(self):
        return self._view.toreadonly()


class Reply:
    """An upstream's success reply: its header and its frame (payload undecoded)."""

    __slots__ = ("header", "frame")

    def __init__(self, header: dict, frame: Frame):
        self.header, self.frame = header, frame


class _Call:
    __slots__ = ("command", "fields", "deferred", "timer")

    def __init__(self, command: Command, fields: dict, deferred: defer.Deferred):
        self.command, self.fields, self.deferred, self.timer = command, fields, deferred, None


class Upstream:
    """One connection of the relay to its upstream (see the module docstring).

    Hooks the relay sets: ``on_ready()`` once a connection is up (the first and each
    next), ``on_lost(reason)`` when one drops, ``on_refused(error)`` when the
    upstream refuses the relay (then it stops trying), ``arriving(bin, header,
    nbytes)`` for the sink of a copy of a bin (None: an :class:`ArraySink`);
    ``fits(greeting)``, whether a connection greeted so serves what this one is for
    (if not, it is dropped and tried again later), and ``on_unreached()`` when an
    attempt to connect fails (:mod:`.upstreams` uses both to follow workers)."""

    def __init__(self, reactor, host: str, port: int, *, token: bytes | None = None, tls: TLSSettings | None = None,
                 connect_timeout: float = 10.0, keepalive: float | None = 15.0, max_backoff: float = 2.0):
        self.reactor, self.host, self.port = reactor, host, port
        self.token, self.tls = token, tls
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.on_ready: Callable[[], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.on_refused: Callable[[BaseException], None] | None = None
        self.arriving: Callable | None = None
        self.fits: Callable[[dict], bool] | None = None
        self.on_unreached: Callable[[], None] | None = None
        self._wire: _Wire | None = None
        self._calls: dict[int, _Call] = {}
        self._listens: dict[str, Callable] = {}  # bin -> callback(header, payload) of its notifications
        self._backoff = Backoff(0.05, max_backoff)
        self._timer = None  # the next attempt to connect, or the next keepalive check
        self._closed = False

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self._wire is not None

    # -- connecting

    def start(self) -> None:
        """Connect (and keep connecting whenever the connection drops)."""
        self._timer = None
        if self._closed:
            return
        self._open().addCallbacks(self._opened, self._not_opened)

    def greeting_once(self) -> defer.Deferred:
        """Connect once, to serve nothing: a Deferred of the upstream's greeting (the
        connection then closes), or of why it could not be had."""
        self._closed = True  # (no retrying, and the connection's loss is nobody's concern)

        def greeted(wire: _Wire) -> dict:
            wire.transport.loseConnection()
            return wire.handshake.greeting

        return self._open().addCallback(greeted)

    def _open(self) -> defer.Deferred:
        """Open a connection: a Deferred of its wire once greeted (and authenticated)."""
        wire = _Wire(self)
        if self.tls is None:
            endpoint = TCP4ClientEndpoint(self.reactor, self.host, self.port, timeout=self.connect_timeout)
        else:
            endpoint = SSL4ClientEndpoint(self.reactor, self.host, self.port, self.tls.twisted_options(self.host),
                                          timeout=self.connect_timeout)
        give_up = self.reactor.callLater(self.connect_timeout, wire.abandon)  # TLS, greeting and AUTH too

        def stop_timer(result):
            if give_up.active():
                give_up.cancel()
            return result

        d = connectProtocol(endpoint, wire)
        d.addCallback(lambda _: wire.greeted)
        return d.addBoth(stop_timer)

    def _opened(self, wire: "_Wire") -> None:
        if self._closed:
            wire.transport.loseConnection()
            return
        if self.fits is not None and not self.fits(wire.handshake.greeting):  # not what this connection is for
            wire.transport.loseConnection()
            self._retry()
            return
        self._wire = wire
        self._backoff.reset()
        for name in list(self._listens):  # listening again after a reconnection
            self._listen_again(name)
        if self.keepalive is not None:
            self._timer = self.reactor.callLater(self.keepalive, self._check_alive, wire)
        if self.on_ready is not None:
            self.on_ready()

    def _not_opened(self, failure) -> None:
        if self._closed:
            return
        if failure.check(AuthenticationError):
            if self.on_refused is not None:
                self.on_refused(failure.value)
            return
        log.info("relay: upstream %s unreachable (%s); trying again", self.where, failure.getErrorMessage())
        self._retry()
        if self.on_unreached is not None:
            self.on_unreached()

    def _retry(self) -> None:
        if not self._closed:
            self._timer = self.reactor.callLater(self._backoff.next(), self.start)

    def _lost(self, wire: "_Wire", reason: str) -> None:
        if wire is not self._wire:
            return
        self._wire = None
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        calls, self._calls = self._calls, {}
        error = ConnectionLostError(f"connection to upstream {self.where} lost: {reason}")
        for call in calls.values():
            self._settle(call, error)
        if self.on_lost is not None:
            self.on_lost(reason)
        self._retry()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._wire is not None:
            self._wire.transport.unregisterProducer()  # TLS closes only without a producer
            self._wire.transport.loseConnection()

    def _check_alive(self, wire: "_Wire") -> None:
        """Probe an upstream silent for ``keepalive`` seconds with a NOOP; drop the
        connection (and so connect again) if nothing comes for as long after it."""
        self._timer = None
        if wire is not self._wire:
            return
        def drop() -> None:
            log.warning("relay: upstream %s silent for %gs after a keepalive probe: dropping the connection",
                        self.where, self.keepalive)
            wire.transport.abortConnection()

        delay = wire.traffic.check(lambda: wire.send([frame_head(NOOP.request(next(_ids)), 0)]), drop)
        if delay is not None:
            self._timer = self.reactor.callLater(delay, self._check_alive, wire)

    # -- calls

    def call(self, command: Command, fields: dict, value: tuple | None = None,
             timeout: float | None = None) -> defer.Deferred:
        """Send a request; a Deferred of its :class:`Reply`, or of the error (the
        upstream's refusal as a :class:`RemoteError`, :class:`ConnectionLostError`,
        :class:`TimeoutError` after ``timeout`` seconds).  ``value``: ``(description,
        payload parts, payload bytes)`` of a verb that carries one, sent as it came."""
        wire = self._wire
        if wire is None:
            raise ConnectionLostError(f"not connected to upstream {self.where}")
        rid = next(_ids)
        header = command.request(rid, fields)
        if value is None:
            parts = [frame_head(header, 0)]
        else:
            description, payload, nbytes = value
            header[Key.VALUE] = description
            parts = [frame_head(header, nbytes), *payload]
        call = self._calls[rid] = _Call(command, fields, defer.Deferred())
        if timeout is not None:
            call.timer = self.reactor.callLater(timeout, self._expire, rid)
        wait = fields.get(Key.WAIT)
        if wait and wire.traffic.keepalive is not None:  # the upstream may hold it: silence until then is expected
            wire.traffic.keepalive.hold(self.reactor.seconds() + wait + 1.0)
        wire.send(parts)
        return call.deferred

    def _expire(self, rid: int) -> None:
        call = self._calls.pop(rid, None)
        if call is not None:
            call.timer = None
            self._settle(call, TimeoutError(f"no reply from upstream {self.where} in time"))

    @staticmethod
    def _settle(call: _Call, outcome) -> None:
        if call.timer is not None and call.timer.active():
            call.timer.cancel()
        if isinstance(outcome, BaseException):
            call.deferred.errback(outcome)
        else:
            call.deferred.callback(outcome)

    def listen(self, name: str, callback: Callable[[dict, object], None]) -> defer.Deferred:
        """Listen to bin ``name``: ``callback(header, payload)`` for each notification
        (a copy's bytes as the payload of an ``INCOMING``), and, after each
        reconnection, with the bin's state then (``op`` ``LISTEN``).  A Deferred of
        the LISTEN reply's header (the snapshot)."""
        self._listens[name] = callback
        d = self.call(LISTEN, {Key.BIN: name})
        d.addErrback(self._unlisten_on_error, name)
        return d.addCallback(lambda reply: reply.header)

    def unlisten(self, name: str) -> None:
        """Listen to bin ``name`` no more (here at once; upstream once its UNLISTEN is in)."""
        self._listens.pop(name, None)
        if self._wire is not None:
            self.call(UNLISTEN, {Key.BIN: name}).addErrback(
                lambda failure: log.info("relay: could not stop listening to %r upstream: %s", name,
                                         failure.getErrorMessage()))

    def listening(self, name: str) -> bool:
        """Whether bin ``name`` is listened to (or being: each new connection listens again)."""
        return name in self._listens

    def taken_listens(self) -> dict[str, Callable]:
        """The listens of this connection (bin -> callback), forgotten here: they move to another."""
        listens, self._listens = self._listens, {}
        return listens

    def adopt_listen(self, name: str, callback: Callable[[dict, object], None]) -> None:
        """Listen to bin ``name`` from the next connection on (as after a reconnection:
        ``callback`` first hears of the bin's state then, ``op`` ``LISTEN``)."""
        self._listens[name] = callback

    def _unlisten_on_error(self, failure, name: str):
        if not failure.check(ConnectionLostError):  # (after a reconnection it is listened to again)
            self._listens.pop(name, None)
        return failure

    def _listen_again(self, name: str) -> None:
        def again(reply: Reply) -> None:
            callback = self._listens.get(name)
            if callback is not None:
                callback({**reply.header, Key.BIN: name, Key.OP: "LISTEN"}, None)

        self.call(LISTEN, {Key.BIN: name}).addCallbacks(
            again, lambda failure: log.warning("relay: could not listen to %r upstream again: %s", name,
                                               failure.getErrorMessage()))

    # -- incoming frames

    def _sink(self, header: dict, nbytes: int):
        """The sink of a frame's payload: the relay's for a copy of a bin it wants to
        pass on as it arrives, else an :class:`ArraySink`."""
        if nbytes and self.arriving is not None:
            name = self._copy_of(header)
            if name is not None:
                sink = self.arriving(name, header, nbytes)
                if sink is not None:
                    return sink
        return ArraySink(nbytes)

    def _copy_of(self, header: dict) -> str | None:
        """The bin whose copy a frame carries: a 226 answering a PEEK ``incoming``, or
        an ``INCOMING`` notification; None for any other frame."""
        code, rid = header.get(Key.CODE), header.get(Key.ID)
        if code == NOTIFY and rid == 0 and header.get(Key.OP) == INCOMING and type(header.get(Key.BIN)) is str:
            return header[Key.BIN]
        if code == ITEMS and type(rid) is int:
            call = self._calls.get(rid)
            if call is not None and call.command is PEEK and call.fields.get(Key.INCOMING):
                return call.fields[Key.BIN]
        return None

    def _frame(self, frame: Frame) -> None:
        """A frame after the handshake: a reply, a notification, or a frame nobody asked for."""
        header = frame.header
        rid = header.get(Key.ID)
        if type(rid) is not int:
            raise ProtocolError(f"reply id must be an integer, got {rid!r:.40}")
        if rid:
            call = self._calls.pop(rid, None)
            if call is None:  # a keepalive probe's, or a call that timed out
                return
            try:
                outcome = Reply(call.command.check_reply(header), frame)
            except TensorShareError as exc:
                outcome = exc
            self._settle(call, outcome)
            return
        code = header.get(Key.CODE)
        if code == NOTIFY:
            NOTIFICATION.check(header)
            callback = self._listens.get(header[Key.BIN])
            if callback is not None:
                try:
                    callback(header, frame.payload)
                except Exception:  # a bug of the relay's: the connection goes on
                    log.exception("relay: handling a notification of %r failed", header[Key.BIN])
        elif code != KEEPALIVE:
            log.info("relay: upstream %s sent an error for no request: %s", self.where,
                     reply_error(header, "unsolicited frame"))


class _Wire(protocol.Protocol):
    """One connection to the upstream: the handshake, then frames to :class:`Upstream`;
    its :class:`~tensorshare.protocol.keepalive.Traffic` is what the keepalive judges."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.handshake = Handshake(upstream.token, lambda: next(_ids))
        self.decoder = FrameDecoder(upstream._sink, CLIENT_FRAME_LIMITS)
        self.greeted: defer.Deferred = defer.Deferred()
        self.traffic = Traffic(upstream.reactor.seconds, upstream.keepalive)
        self._certificate_checked = upstream.tls is None

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self.transport.registerProducer(self.traffic, True)

    def dataReceived(self, data: bytes) -> None:
        self.traffic.heard()
        try:
            if not self._certificate_checked:  # data arrives only after the TLS handshake
                self._certificate_checked = True
                self.upstream.tls.check_transport(self.transport)
            for frame in self.decoder.feed(data):
                if self.handshake.ready:
                    self.upstream._frame(frame)
                    continue
                request = self.handshake.opening(frame)
                if request is not None:
                    self.transport.write(request)
                if self.handshake.ready:
                    self.greeted.callback(self)
        except TensorShareError as exc:
            log.warning("relay: upstream %s: %s; dropping the connection", self.upstream.where, exc)
            if not self.greeted.called:
                self.greeted.errback(exc)
            self.transport.abortConnection()

    def abandon(self) -> None:
        """Give up on a connection whose handshake did not finish in time."""
        if not self.greeted.called:
            self.greeted.errback(ConnectionLostError(f"no tensorshare greeting from {self.upstream.where} within "
                                                     f"{self.upstream.connect_timeout:g}s"))
            if self.transport is not None:
                self.transport.abortConnection()

    def connectionLost(self, reason) -> None:
        text = reason.getErrorMessage()
        if not self.greeted.called:
            if self.upstream.tls is not None and "certificate verify failed" in text:
                self.greeted.errback(UntrustedServerError(f"the TLS certificate of {self.upstream.where} is not "
                                                          f"trusted: {text}"))
            else:
                self.greeted.errback(ConnectionLostError(f"closed before greeting: {text}"))
        self.upstream._lost(self, text)

    def send(self, parts: list) -> None:
        """Write one frame (a real transport takes bytes only: parts are joined, one copy)."""
        self.transport.write(b"".join(part if type(part) is bytes else bytes(part) for part in parts))
        self.traffic.sent()
