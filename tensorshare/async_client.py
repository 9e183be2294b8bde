"""The asynchronous client for Twisted code: every method returns a Deferred.

It runs on the reactor the application already runs (nothing is started for you)
and shares the sans-IO core in :mod:`.connection` with the blocking client.
Requests are pipelined on one connection; listen callbacks run on the reactor
thread, as Twisted code expects.  When the connection drops, pending Deferreds
fail with :class:`ConnectionLostError` at once, and the client reconnects with
exponential backoff (authenticating again) and restores its listens.  TLS is
Twisted's (pyOpenSSL); a server silent for ``keepalive`` seconds is probed with
NOOP and the connection dropped if it stays silent as long again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from twisted.internet import defer, interfaces, protocol as twisted_protocol
from twisted.internet.endpoints import SSL4ClientEndpoint, TCP4ClientEndpoint, connectProtocol
from zope.interface import implementer

from .protocol import messages as protocol
from .protocol.auth import resolve_token
from ._client.connection import (
    DEAD, DEFAULT_REUSE, NO_VALUE, PROBE, ClientConnection, Keepalive, ListenSnapshot, Notification,
    next_request_id, notification_of, reply_buffers, reply_value, report_unsolicited, request_frame,
)
from .errors import (
    AuthenticationError, ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UntrustedServerError,
    UsageError,
)
from .protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")


@implementer(interfaces.IPushProducer)
class _Wire(twisted_protocol.Protocol):
    """One connection of an :class:`AsyncClient`: bytes to frames and back.

    It registers itself as the transport's producer only to learn when writes are
    backed up (a large value still going out): the keepalive waits meanwhile, since
    the server answers a probe only after reading everything sent before it.
    """

    def __init__(self, client: "AsyncClient"):
        self.client = client
        self.conn = ClientConnection(token=client._token, reuse=client._buffers)
        self.greeted: defer.Deferred = defer.Deferred()  # fires with self once requests may be sent
        self.last_heard = self.last_sent = client.reactor.seconds()  # for the keepalive
        self.keepalive = None if client.keepalive is None else Keepalive(client.keepalive)
        self._outgoing: list[bytes] = []
        self._flush_scheduled = False
        self._certificate_checked = client._tls is None
        self.write_blocked = False

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self.transport.registerProducer(self, True)

    # IPushProducer: writes are not held back, only watched for the keepalive
    def pauseProducing(self) -> None:
        self.write_blocked = True

    def resumeProducing(self) -> None:
        self.write_blocked = False
        self.last_sent = self.client.reactor.seconds()

    def stopProducing(self) -> None:
        pass

    def dataReceived(self, data: bytes) -> None:
        self.last_heard = self.client.reactor.seconds()
        if not self._certificate_checked:  # data arrives only after the TLS handshake
            self._certificate_checked = True
            if not self._opening_step(self._check_certificate):
                return
        try:
            frames = self.conn.feed(data)
        except ProtocolError as exc:
            log.warning("bad data from server: %s", exc)
            self.transport.abortConnection()
            return
        for frame in frames:
            if not self.conn.ready:
                if not self._opening_step(lambda: self._open_with(frame)):
                    return
                continue
            self.client._frame_received(frame)

    def _opening_step(self, step: Callable[[], None]) -> bool:
        """Run one step of the opening handshake; on failure fail ``greeted`` and abort."""
        try:
            step()
        except TensorShareError as exc:
            self.transport.abortConnection()
            if not self.greeted.called:
                self.greeted.errback(exc)
            return False
        return True

    def _check_certificate(self) -> None:
        from OpenSSL import crypto

        x509 = self.transport.getPeerCertificate()
        self.client._tls.check_certificate(None if x509 is None else crypto.dump_certificate(crypto.FILETYPE_ASN1, x509))

    def _open_with(self, frame) -> None:
        request = self.conn.opening(frame)
        if request is not None:
            self.transport.write(request)
        if self.conn.ready:
            self.greeted.callback(self)

    def abandon_opening(self) -> None:
        """Give up on a connection whose handshake did not finish in time."""
        if not self.greeted.called and self.transport is not None:
            hint = "" if self.client._tls else " (a TLS server? then pass tls=True)"
            self.greeted.errback(ConnectionLostError(
                f"no tensorshare greeting from {self.client.host}:{self.client.port} within "
                f"{self.client.connect_timeout:g}s{hint}"))
            self.transport.abortConnection()

    def connectionLost(self, reason) -> None:
        if not self.greeted.called:
            self.greeted.errback(self._opening_failure(reason))
        self.client._connection_lost(self, reason)

    def _opening_failure(self, reason) -> TensorShareError:
        """The error for a connection lost before the handshake was over."""
        text = reason.getErrorMessage()
        if self.client._tls is not None:
            if "certificate verify failed" in text or reason.type.__name__ == "VerificationError":
                return UntrustedServerError(f"the TLS certificate of {self.client.host}:{self.client.port} "
                                            f"is not trusted: {text}")
            if not self._certificate_checked:
                return ConnectionLostError(f"TLS handshake with {self.client.host}:{self.client.port} failed "
                                           f"(is it a TLS server?): {text}")
        return ConnectionLostError(f"closed before greeting: {text}")

    def send(self, parts: list) -> None:
        """Queue a frame; the frames of one reactor turn go out in one write.

        Twisted transports take bytes only; the copy also snapshots the value.
        (One write per turn instead of one per request: each write costs a
        buffer join and an epoll registration.)
        """
        self._outgoing.extend(p if type(p) is bytes else bytes(p) for p in parts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.client.reactor.callLater(0, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._outgoing and self.transport is not None and self.connected:
            data, self._outgoing = b"".join(self._outgoing), []
            self.transport.write(data)
            self.last_sent = self.client.reactor.seconds()


class AsyncClient:
    """A tensorshare client whose methods return Deferreds.

    Create it with :meth:`connect`::

        client = yield AsyncClient.connect("127.0.0.1", 8000)
        yield client.put("bin", torch.ones(3))
        items = yield client.peek("bin")
    """

    def __init__(self, reactor, host: str, port: int, timeout: float | None, device: Any, max_backoff: float, *,
                 connect_timeout: float = 10.0, token: str | bytes | None = None, tls: TLSSettings | None = None,
                 keepalive: float | None = 15.0, reuse: int = DEFAULT_REUSE):
        self.reactor, self.host, self.port = reactor, host, port
        self._buffers = reply_buffers(reuse)  # arrays large replies were received into (see Client)
        self.timeout, self.device, self.max_backoff = timeout, device, max_backoff
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive or None
        self._token = resolve_token(token)
        self._tls = tls
        self._tls_options = None if tls is None else tls.twisted_options(host)
        self._failure: AuthenticationError | None = None  # final: no more connections after it
        self._keepalive_timer = None
        self._wire: _Wire | None = None
        self._pending: dict[int, tuple[str, defer.Deferred, float | None]] = {}  # in send order
        self._sweeper = None  # the one timer that expires requests
        self._listens: dict[str, list[Callable[[Notification], Any]]] = {}
        self._closed = False
        self._backoff = 0.05
        self._retry = None

    @classmethod
    def connect(cls, host: str = "127.0.0.1", port: int = 8000, *, reactor=None, timeout: float | None = 60.0,
                device: Any = None, max_backoff: float = 2.0, connect_timeout: float = 10.0,
                token: str | bytes | None = None, tls: bool | None = None, tls_ca: str | None = None,
                tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                reuse: int = DEFAULT_REUSE) -> defer.Deferred:
        """Connect, authenticate if the server asks, and fire with the client.

        The options mean what they mean for :class:`tensorshare.Client`: opening a
        connection takes at most ``connect_timeout`` seconds; ``token`` defaults to
        the ``TENSORSHARE_TOKEN`` environment variable; ``tls``/``tls_ca``/
        ``tls_fingerprint`` choose TLS and whom to trust (needs the ``tls`` extra);
        ``reuse`` bounds the reply memory kept for reuse; an
        :class:`AuthenticationError` is final (no reconnection).
        """
        if reactor is None:
            from twisted.internet import reactor
        try:
            settings = TLSSettings.from_options(tls, tls_ca, tls_fingerprint)
            client = cls(reactor, host, port, timeout, device, max_backoff, connect_timeout=connect_timeout,
                         token=token, tls=settings, keepalive=keepalive, reuse=reuse)
        except TensorShareError:
            return defer.fail()
        return client._open().addCallback(lambda _: client)

    # -- API

    def put(self, bin: str, value: Any, *, tag: int | None = None) -> defer.Deferred:
        """Replace the items of ``bin`` with ``value``; fires with the item count."""
        return self._call(protocol.PUT, bin, value, tag)

    def append(self, bin: str, value: Any, *, tag: int | None = None) -> defer.Deferred:
        """Add one item to ``bin``; fires with the new item count."""
        return self._call(protocol.APPEND, bin, value, tag)

    def get(self, bin: str) -> defer.Deferred:
        """Take all items out of ``bin``; fires with the list of them."""
        return self._call(protocol.GET, bin)

    def peek(self, bin: str) -> defer.Deferred:
        """Fires with the list of items of ``bin``, which keeps them."""
        return self._call(protocol.PEEK, bin)

    def list(self) -> defer.Deferred:
        """Fires with ``{bin: n_items}``."""
        return self._call(protocol.LIST)

    def delete(self, bin: str) -> defer.Deferred:
        """Remove ``bin``."""
        return self._call(protocol.DELETE, bin)

    def ping(self) -> defer.Deferred:
        return self._call(protocol.NOOP)

    @defer.inlineCallbacks
    def listen(self, bin: str, callback: Callable[[Notification], Any]):
        """Call ``callback(notification)`` (on the reactor thread) on every change to
        ``bin``; fires with the :class:`ListenSnapshot` once listening has started.
        Far behind (PROTOCOL.md §8.7), only the latest change per bin is told."""
        snapshot = yield self._call(protocol.LISTEN, bin)
        self._listens.setdefault(bin, []).append(callback)
        return snapshot

    def unlisten(self, bin: str, callback: Callable | None = None) -> defer.Deferred:
        """Stop calling ``callback`` (or every callback) for ``bin``."""
        callbacks = self._listens.get(bin, [])
        if callback is None:
            callbacks.clear()
        elif callback in callbacks:
            callbacks.remove(callback)
        if callbacks:
            return defer.succeed(None)
        self._listens.pop(bin, None)
        return self._call(protocol.UNLISTEN, bin)

    def close(self) -> None:
        """Close the connection; pending Deferreds fail with ConnectionLostError."""
        self._closed = True
        self._listens.clear()
        for timer in (self._retry, self._sweeper, self._keepalive_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._retry = self._sweeper = self._keepalive_timer = None
        if self._buffers is not None:
            self._buffers.clear()
        if self._wire is not None:
            self._wire._flush()  # what was queued this turn still goes out
            self._wire.transport.unregisterProducer()  # TLS closes only without a producer
            self._wire.transport.loseConnection()

    @property
    def connected(self) -> bool:
        return self._wire is not None

    # -- internals

    def _open(self) -> defer.Deferred:
        if self._tls_options is None:
            endpoint = TCP4ClientEndpoint(self.reactor, self.host, self.port, timeout=self.connect_timeout)
        else:
            endpoint = SSL4ClientEndpoint(self.reactor, self.host, self.port, self._tls_options,
                                          timeout=self.connect_timeout)
        wire = _Wire(self)
        # The endpoint bounds the TCP connect; this bounds TLS, greeting and AUTH too.
        timer = self.reactor.callLater(self.connect_timeout, wire.abandon_opening)

        def stop_timer(result):
            if timer.active():
                timer.cancel()
            return result

        d = connectProtocol(endpoint, wire)
        d.addCallback(lambda _: wire.greeted)
        d.addBoth(stop_timer)
        d.addCallback(self._opened)
        d.addErrback(self._open_failed)
        return d

    def _opened(self, wire: _Wire) -> None:
        self._wire = wire
        self._backoff = 0.05
        if self.keepalive is not None and self._keepalive_timer is None:
            self._keepalive_timer = self.reactor.callLater(self.keepalive, self._check_alive)
        for name in list(self._listens):
            self._call(protocol.LISTEN, name).addCallbacks(self._relistened(name), self._relisten_failed(name))

    def _open_failed(self, failure):
        if failure.check(AuthenticationError):
            self._failure = failure.value  # a wrong token or an untrusted server stays so: do not hammer it
        if failure.check(TensorShareError):
            return failure
        raise ConnectionLostError(f"cannot connect to {self.host}:{self.port}: {failure.getErrorMessage()}")

    def _check_alive(self) -> None:
        """Probe a server silent for ``keepalive`` seconds with a NOOP; abort the
        connection (and so reconnect) if nothing comes for as long after it."""
        self._keepalive_timer = None
        wire = self._wire
        if self._closed or wire is None:
            return  # the next connection starts the timer again
        now = self.reactor.seconds()
        if wire.write_blocked:  # our own bytes are still going out: nothing to judge yet
            self._keepalive_timer = self.reactor.callLater(self.keepalive, self._check_alive)
            return
        action, wake = wire.keepalive.due(now, wire.last_heard, wire.last_sent)
        if action == DEAD:
            log.warning("%s:%s sent nothing for %gs after a keepalive probe: dropping the connection",
                        self.host, self.port, self.keepalive)
            wire.transport.abortConnection()
            return
        if action == PROBE:
            wire.send(request_frame(next_request_id(), protocol.NOOP))  # its reply is dropped on arrival
            wire.keepalive.probed(now)
        self._keepalive_timer = self.reactor.callLater(max(wake - now, 0.01), self._check_alive)

    def _relistened(self, name: str) -> Callable:
        def deliver(snapshot: ListenSnapshot) -> None:
            note = Notification(name, snapshot.n_items, snapshot.seq, protocol.LISTEN, snapshot.tag)
            self._notify(note)
        return deliver

    def _relisten_failed(self, name: str) -> Callable:
        def report(failure) -> None:
            log.warning("could not listen to %r again after reconnecting: %s", name, failure.getErrorMessage())
        return report

    def _call(self, op: str, name: str | None = None, value: Any = NO_VALUE, tag: int | None = None) -> defer.Deferred:
        if self._closed:
            return defer.fail(UsageError("the client is closed"))
        if self._failure is not None:
            return defer.fail(self._failure.with_traceback(None))
        if self._wire is None:
            return defer.fail(ConnectionLostError(f"not connected to {self.host}:{self.port} (reconnecting)"))
        if self._buffers is not None:
            self._buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        rid = next_request_id()
        try:
            parts = request_frame(rid, op, name, value, tag)
        except TensorShareError:
            return defer.fail()
        d = defer.Deferred()
        deadline = None if self.timeout is None else self.reactor.seconds() + self.timeout
        self._pending[rid] = (op, d, deadline)
        self._wire.send(parts)
        if deadline is not None and self._sweeper is None:
            self._sweeper = self.reactor.callLater(self.timeout, self._sweep)
        return d

    def _sweep(self) -> None:
        """Fail the requests whose deadline has passed (one timer for all: a
        DelayedCall per request cost more than the rest of a small request)."""
        self._sweeper = None
        now = self.reactor.seconds()
        expired = []
        for rid, (_op, _d, deadline) in self._pending.items():  # oldest first
            if deadline is None or deadline > now:
                break
            expired.append(rid)
        for rid in expired:
            _op, d, _deadline = self._pending.pop(rid)
            d.errback(TimeoutError(f"no reply from {self.host}:{self.port} within {self.timeout}s"))
        nxt = next((deadline for _op, _d, deadline in self._pending.values() if deadline is not None), None)
        if nxt is not None:
            self._sweeper = self.reactor.callLater(max(nxt - now, 0.01), self._sweep)

    def _frame_received(self, frame) -> None:
        rid = frame.header.get("id")
        if type(rid) is not int:
            log.warning("reply with a bad id %r from %s:%s: closing", rid, self.host, self.port)
            self._wire.transport.abortConnection()
            return
        if rid:
            entry = self._pending.pop(rid, None)
            if entry is None:
                return  # the caller gave up (timeout)
            op, d, _deadline = entry
            try:
                result = reply_value(op, frame, self.device)
            except TensorShareError:
                d.errback()
            else:
                d.callback(result)
            return
        note = notification_of(frame)
        if note is not None:
            self._notify(note)
            return
        report_unsolicited(frame, f"{self.host}:{self.port}")

    def _notify(self, note: Notification) -> None:
        for callback in list(self._listens.get(note.bin, ())):
            try:
                callback(note)
            except Exception:
                log.exception("tensorshare listen callback %r failed", callback)

    def _connection_lost(self, wire: _Wire, reason) -> None:
        if wire is not self._wire:
            return
        self._wire = None
        pending, self._pending = self._pending, {}
        for _op, d, _deadline in pending.values():
            d.errback(ConnectionLostError(f"connection to {self.host}:{self.port} lost: {reason.getErrorMessage()}"))
        if not self._closed:
            self._schedule_reconnect()

    def _schedule_reconnect(self) -> None:
        delay, self._backoff = self._backoff, min(self._backoff * 2, self.max_backoff)

        def attempt() -> None:
            self._retry = None
            if not self._closed:
                self._open().addErrback(retry_unless_final)

        def retry_unless_final(failure) -> None:
            if self._failure is not None:
                log.error("cannot reconnect to %s:%s: %s; giving up", self.host, self.port, failure.getErrorMessage())
            else:
                self._schedule_reconnect()

        self._retry = self.reactor.callLater(delay, attempt)
