"""The Twisted adapter: moves bytes between TCP connections and :class:`ServerSession`.

Inbound, ``dataReceived`` feeds the session.  Outbound, one :class:`FrameWriter` per
connection is the transport's only push producer: it writes whole frames in order,
part by part, stopping whenever the transport asks it to pause, so a large reply
never sits in memory twice and replies and notifications never interleave.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from twisted.internet import interfaces, protocol
from zope.interface import implementer

from .session import ServerSession, ServerState

log = logging.getLogger("tensorshare.server")

_LARGE_READ = 1 << 20  # recv size while a large payload streams in


@implementer(interfaces.IPushProducer)
class FrameWriter:
    """Writes queued frames to a transport as fast as it accepts them."""

    def __init__(self, transport):
        self.transport = transport
        self._queue: deque = deque()  # [parts, next index, on_abandon]
        self._paused = False
        self._closing = False
        self._lost = False

    def send(self, parts: list, on_abandon: Callable[[], None] | None = None) -> None:
        if self._lost or self._closing:
            if on_abandon is not None:
                on_abandon()
            return
        self._queue.append([parts, 0, on_abandon])
        if len(self._queue) == 1:
            self._pump()

    def close(self) -> None:
        """Close the connection after the queued frames have been written."""
        self._closing = True
        if not self._queue:
            self._finish_close()

    def _pump(self) -> None:
        queue, write = self._queue, self.transport.write
        while queue and not self._paused:
            entry = queue[0]
            parts, index = entry[0], entry[1]
            while index < len(parts) and not self._paused:
                write(parts[index])  # may call pauseProducing() synchronously
                index += 1
            entry[1] = index
            if index == len(parts):
                queue.popleft()
        if not queue and self._closing:
            self._finish_close()

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
        queue, self._queue = self._queue, deque()
        for _parts, _index, on_abandon in queue:
            if on_abandon is not None:
                on_abandon()


class TensorShareProtocol(protocol.Protocol):
    """One server-side connection."""

    def __init__(self, state: ServerState):
        self.state = state
        self.writer: FrameWriter | None = None
        self.session: ServerSession | None = None

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self.writer = FrameWriter(self.transport)
        self.transport.registerProducer(self.writer, True)
        peer = self.transport.getPeer()
        self.session = ServerSession(self.state, self.writer, f"{peer.host}:{peer.port}")
        self.session.connection_made()

    def dataReceived(self, data: bytes) -> None:
        self.session.data_received(data)
        # Read large payloads in big gulps: fewer reactor turns per byte.
        big = self.session.receiving_payload > _LARGE_READ
        self.transport.bufferSize = _LARGE_READ if big else 1 << 16

    def connectionLost(self, reason) -> None:
        if self.session is not None:
            self.session.connection_lost()
            self.writer.connection_lost()


class TensorShareFactory(protocol.Factory):
    """Builds a :class:`TensorShareProtocol` per connection, all sharing one state."""

    def __init__(self, state: ServerState):
        self.state = state

    def buildProtocol(self, addr) -> TensorShareProtocol:
        return TensorShareProtocol(self.state)
