"""The AsyncClient's transport: one Twisted connection, bytes to frames and back."""

from __future__ import annotations

import logging
from typing import Callable

from twisted.internet import defer, protocol as twisted_protocol, threads

from ..errors import ConnectionLostError, ProtocolError, TensorShareError, UntrustedServerError, WrongServerError
from ..protocol import peers
from ..protocol.keepalive import Traffic

log = logging.getLogger("tensorshare.client")


class Wire(twisted_protocol.Protocol):
    """One connection of an :class:`~tensorshare.AsyncClient`.

    It runs the opening handshake (``greeted`` fires with the wire once requests
    may be sent), hands later frames to the client, and sends queued frames once
    per reactor turn.  Its :class:`~..protocol.keepalive.Traffic` is what the
    keepalive judges (and the transport's producer, to learn when writes are backed
    up: the server answers a probe only after reading everything sent before it).
    """

    def __init__(self, client):
        self.client = client
        self.conn = client._new_connection()
        self.greeted: defer.Deferred = defer.Deferred()
        self.traffic = Traffic(client.reactor.seconds, client.keepalive)  # for the keepalive
        self._outgoing: list[bytes] = []
        self._flush_scheduled = False
        self._certificate_checked = client._tls is None
        self._speaks = None  # what a probe found the peer to be (peers.probe), if one ran

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self.transport.registerProducer(self.traffic, True)

    def dataReceived(self, data: bytes) -> None:
        self.traffic.heard()
        if not self._certificate_checked:  # data arrives only after the TLS handshake
            self._certificate_checked = True
            if not self._opening_step(self._check_certificate):
                return
        try:
            frames = self.conn.feed(data)
        except WrongServerError as exc:
            self._fail_opening(exc)
            return
        except ProtocolError as exc:
            log.warning("bad data from server: %s", exc)
            self.transport.abortConnection()
            return
        for frame in frames:
            if not self.conn.ready:
                if not self._opening_step(lambda: self._open_with(frame)):
                    return
                continue
            self.client._frame_received(self, frame)

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
        self.client._tls.check_transport(self.transport)

    def _open_with(self, frame) -> None:
        request = self.conn.opening(frame)
        if request is not None:
            self.transport.write(request)
        if self.conn.ready:
            self.greeted.callback(self)

    def abandon_opening(self) -> None:
        """Give up on a connection whose handshake did not finish in time."""
        if not self.greeted.called and self.transport is not None:
            hint = "" if self.client._tls else peers.silence_hint(self._speaks)
            self._fail_opening(ConnectionLostError(
                f"no tensorshare greeting from {self.client._where} within "
                f"{self.client.connect_timeout:g}s{hint}"))

    def probe_peer(self) -> None:
        """The peer has said nothing yet: find out what it is on a second connection
        (:func:`.peers.probe`, on a thread), and fail the opening if that tells."""
        if self.greeted.called or self.conn.first or self.transport is None:
            return
        reactor = self.client.reactor
        d = threads.deferToThreadPool(reactor, reactor.getThreadPool(), peers.probe, self.client.host,
                                      self.client.port, 1.0)
        d.addCallback(self._probed)

    def _probed(self, found: tuple) -> None:
        self._speaks, first = found
        if self._speaks in (peers.TLS, peers.HTTP) and not self.greeted.called and self.transport is not None:
            self._fail_opening(peers.wrong_server(self.client._where, first, self._speaks))

    def _fail_opening(self, error: TensorShareError) -> None:
        if not self.greeted.called:
            self.greeted.errback(error)
        if self.transport is not None:
            self.transport.abortConnection()

    def connectionLost(self, reason) -> None:
        if not self.greeted.called:
            self.greeted.errback(self._opening_failure(reason))
        self.client._connection_lost(self, reason)

    def _opening_failure(self, reason) -> TensorShareError:
        """The error for a connection lost before the handshake was over."""
        text = reason.getErrorMessage()
        where = self.client._where
        if self.client._tls is not None:
            if "certificate verify failed" in text or reason.type.__name__ == "VerificationError":
                return UntrustedServerError(f"the TLS certificate of {where} is not trusted: {text}")
            if not self._certificate_checked:
                return ConnectionLostError(f"TLS handshake with {where} failed (is it a TLS server?): {text}")
        return ConnectionLostError(f"closed before greeting: {text}")

    def send(self, parts: list) -> None:
        """Queue a frame; the frames of one reactor turn go out in one write.

        Twisted transports take bytes only; the copy also snapshots the value
        (device arrays too: they are copied down through the engine's pinned
        buckets now).  (One write per turn instead of one per request: each write
        costs a buffer join and an epoll registration.)
        """
        if type(parts) is not list:  # StagedParts: device arrays
            parts = [bytes(view) for view, _staged in parts.engine.pieces(parts)]
        self._outgoing.extend(p if type(p) is bytes else bytes(p) for p in parts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.client.reactor.callLater(0, self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._outgoing and self.transport is not None and self.connected:
            data, self._outgoing = b"".join(self._outgoing), []
            self.transport.write(data)
            self.traffic.sent()
