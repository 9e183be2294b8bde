"""Helpers for tests that speak frames over plain sockets, sending what no client would."""

from __future__ import annotations

import socket
import time

from twisted.internet.address import IPv4Address

from tensorshare._client.connection import NO_VALUE, request_frame
from tensorshare.protocol import messages as protocol
from tensorshare.protocol.messages import COMMANDS, Key
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import FrameDecoder, frame_head


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class RawConnection:
    """A plain socket speaking frames.  ``rcvbuf`` (bytes) shrinks its receive buffer
    before connecting, to play a client that reads slowly or not at all."""

    def __init__(self, port: int, rcvbuf: int | None = None, timeout: float = 10):
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        self.decoder = FrameDecoder()
        self.frames = []
        self.greeting = self.read_frame()
        assert self.greeting.header["code"] == protocol.GREETING

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self):
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("closed")
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def closed_by_peer(self, timeout: float = 10.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(1 << 16):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()


def request_parts(rid, op, name=None, value=NO_VALUE, tag=None, extra=None) -> list:
    """The parts of a request frame for verb ``op`` (any string: unknown verbs too),
    built as the clients build them where the verb is known."""
    fields = {} if name is None else {Key.BIN: name}
    if tag is not None:
        fields[Key.TAG] = tag
    if extra:
        fields.update(extra)
    command = COMMANDS.get(op)
    if command is not None:
        return request_frame(rid, command, fields, value)
    header = {Key.OP: op, Key.ID: rid, **fields}
    if value is NO_VALUE:
        return [frame_head(header, 0)]
    enc = encode(value)
    header[Key.VALUE] = enc.description
    return [frame_head(header, enc.nbytes), *enc.buffers]


def raw_frame(rid, op, name=None, value=None, tag=None, extra=None) -> bytes:
    """One request frame as bytes (``value=None``: no value)."""
    parts = request_parts(rid, op, name, NO_VALUE if value is None else value, tag, extra)
    return b"".join(bytes(p) for p in parts)


class OutboxBase:
    """What a session's outbox does besides keeping what it is sent (:meth:`send`):
    replies go the same way, nothing is ever withdrawn, closing is noted.
    ``congested`` is what the flow-control tests set by hand; the others leave it off."""

    def __init__(self):
        self.congested = False
        self.closed = False
        self.peer_closed = False  # what peer_gone() says: a test sets it to play a peer that went

    def peer_gone(self) -> bool:
        return self.peer_closed

    def send(self, parts, on_abandon=None, on_written=None):
        raise NotImplementedError

    def send_reply(self, parts, on_abandon=None, on_written=None) -> None:
        self.send(parts, on_abandon, on_written)

    def reply(self, data) -> None:
        self.send([data])

    def withdraw(self, ticket) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class CollectingOutbox(OutboxBase):
    """A session's outbox for sans-IO tests: keeps every frame it is given, decoded."""

    def __init__(self):
        super().__init__()
        self.frames: list = []
        self._decoder = FrameDecoder()

    @property
    def headers(self) -> list[dict]:
        return [frame.header for frame in self.frames]

    def send(self, parts, on_abandon=None, on_written=None):
        self.frames.extend(self._decoder.feed(b"".join(bytes(p) for p in parts)))
        if on_written is not None:
            on_written()
        return None


class StrictTransport:
    """A transport that, like Twisted's TCP one, takes only bytes, buffers what the
    'socket' has not taken and pauses its producer past ``buffer_size`` bytes."""

    def __init__(self, buffer_size: int = 1024):
        self.buffer_size = buffer_size
        self.buffered: list[bytes] = []
        self.delivered = bytearray()
        self.producer = None
        self.paused = False
        self.closed = False

    def setTcpNoDelay(self, enabled):
        pass

    def getPeer(self):
        return IPv4Address("TCP", "127.0.0.1", 40000)

    def getHost(self):
        return IPv4Address("TCP", "127.0.0.1", 8000)

    def pauseProducing(self):  # of reading: nothing to read here
        pass

    def resumeProducing(self):
        pass

    def registerProducer(self, producer, streaming):
        assert streaming
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None

    def loseConnection(self):
        self.closed = True

    def write(self, data):
        if type(data) is not bytes:
            raise TypeError(f"Data must be bytes, not {type(data).__name__}")
        self.buffered.append(data)
        if sum(map(len, self.buffered)) > self.buffer_size and not self.paused:
            self.paused = True
            self.producer.pauseProducing()

    def drain(self) -> None:
        """The peer read everything buffered; resume the producer as Twisted does."""
        for data in self.buffered:
            self.delivered += data
        self.buffered.clear()
        if self.paused:
            self.paused = False
            self.producer.resumeProducing()

    def frames(self) -> list[dict]:
        return [f.header for f in FrameDecoder().feed(bytes(self.delivered))]
