"""The server's per-request shortcuts past Twisted (server/net/twisted_internals.py,
server/net/writer.py), on real sockets: gathered sends, extra reads while a frame is
incomplete, and event dispatch without Twisted's logging context."""

from __future__ import annotations

import socket

import pytest
from twisted.internet import main, protocol
from twisted.internet.testing import MemoryReactor

from tensorshare_server.net import twisted_internals, writer as writer_module
from tensorshare_server.net.flow import OutboundBudget
from tensorshare_server.net.writer import FrameWriter


def _recv_exactly(sock: socket.socket, n: int, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _recv_available(sock: socket.socket, quiet: float = 0.3) -> bytes:
    """Everything that arrives until nothing has for ``quiet`` seconds."""
    sock.settimeout(quiet)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except TimeoutError:
        pass
    return bytes(data)


@pytest.fixture
def wired():
    """A writer on a real TCP-like transport whose reactor never runs: bytes that
    reach the peer went by the writer's direct sends, not Twisted's buffer."""
    a, b = socket.socketpair()
    transport = twisted_internals.ReceivingServer(a, protocol.Protocol(), ("127.0.0.1", 1), None, 0, MemoryReactor())
    budget = OutboundBudget(1 << 30)
    out = FrameWriter(transport, budget)
    try:
        yield transport, out, budget, b
    finally:
        transport.stopReading()
        transport.stopWriting()
        a.close()
        b.close()


def test_a_reply_of_several_large_parts_leaves_in_one_direct_send(wired):
    transport, out, budget, peer = wired
    head, big, view = b"h" * 40, bytes(range(256)) * 400, memoryview(bytearray(b"v" * 70_000))
    frames = [[head, big, view], [b"n" * 30]]  # 102 KB + 70 KB + a notification: over the old 64 KiB
    for parts in frames:
        out.send(parts)
    expected = b"".join(bytes(p) for parts in frames for p in parts)
    assert _recv_exactly(peer, len(expected)) == expected
    assert twisted_internals.transport_idle(transport)  # nothing waited in Twisted's buffer
    assert not out.pending and out.written == len(expected)
    assert budget.queued == 0


def test_what_the_kernel_does_not_take_goes_to_twisted_in_order(wired):
    transport, out, budget, peer = wired
    transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    parts = [b"a" * 50_000, memoryview(b"b" * 60_000), b"c" * 70_000]
    out.send(parts)
    expected = b"".join(bytes(p) for p in parts)
    taken = _recv_available(peer)  # what the kernel took at once
    assert 0 < len(taken) < len(expected)
    held = bytes(transport.dataBuffer)[transport.offset :] + b"".join(transport._tempDataBuffer)
    assert taken + held == expected
    assert not out.pending and budget.queued == 0


def test_parts_over_the_direct_limit_still_go_through_twisted(wired):
    transport, out, budget, peer = wired
    parts = [b"x" * 16, b"y" * (writer_module._DIRECT_MAX + 1)]
    out.send(parts)
    assert _recv_exactly(peer, 16) == b"x" * 16
    held = bytes(transport.dataBuffer)[transport.offset :] + b"".join(transport._tempDataBuffer)
    assert held == parts[1]


def test_a_larger_reply_to_an_idle_writer_leaves_at_once_in_one_sendmsg_without_accounting(wired):
    transport, out, budget, peer = wired
    chunk = memoryview(bytearray(b"v" * 70_000)).toreadonly()  # (a pooled chunk of a stored item)
    written, abandoned = [], []
    out.hold()  # (the read that asked for it is being handled)
    out.send_reply([b"head", chunk, chunk], lambda: abandoned.append(1), lambda: written.append(1))
    assert written == [1] and budget.queued == 0 and not out.pending
    assert _recv_exactly(peer, 140_004) == b"head" + bytes(chunk) * 2
    out.send_reply([b"small"])  # held until the read's end: the next larger reply keeps its place
    out.send_reply([b"head", chunk])
    assert out.pending and budget.queued >= 70_000
    out.release()
    assert _recv_exactly(peer, 70_009) == b"small" + b"head" + bytes(chunk) and budget.queued == 0
    out.connection_lost()
    assert abandoned == []


def test_a_larger_reply_the_kernel_does_not_take_whole_leaves_the_rest_to_twisted_in_order(wired):
    transport, out, budget, peer = wired
    transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    chunk = memoryview(b"w" * 60_000)
    out.send_reply([b"head", chunk])
    out.send_reply([b"next", chunk])  # Twisted holds bytes now: this one takes the queue
    assert out.pending and budget.queued >= 60_000
    taken = _recv_available(peer)
    held = bytes(transport.dataBuffer)[transport.offset :] + b"".join(transport._tempDataBuffer)
    # (the queued reply's bytes part went to Twisted's buffer behind it; its chunk waits for a writable socket)
    assert 0 < len(taken) and taken + held == b"head" + bytes(chunk) + b"next" and out.pending


class _Reader(protocol.Protocol):
    """Wants ``expect`` bytes; counts the reads it was given."""

    def __init__(self, expect: int):
        self.expect, self.data, self.reads = expect, bytearray(), 0

    def dataReceived(self, data: bytes) -> None:
        self.reads += 1
        self.data += data

    @property
    def receiving(self) -> int:
        return self.expect - len(self.data)

    def receive_buffer(self):
        return None

    def read_more(self) -> bool:
        return True


def _reading(expect: int, read_size: int):
    a, b = socket.socketpair()
    proto = _Reader(expect)
    transport = twisted_internals.ReceivingServer(a, proto, ("127.0.0.1", 1), None, 0, MemoryReactor())
    proto.makeConnection(transport)
    transport.bufferSize = read_size
    return transport, proto, a, b


def test_an_incomplete_frame_is_read_on_in_the_same_event():
    transport, proto, a, b = _reading(expect=30, read_size=10)
    try:
        b.sendall(b"z" * 30)
        assert transport.doRead() is None
        assert proto.data == b"z" * 30 and proto.reads == 3  # one readable event, not three
        b.sendall(b"w" * 5)
        transport.doRead()
        assert proto.reads == 4  # a whole frame: one read per event, as Twisted does
    finally:
        transport.stopReading()
        a.close()
        b.close()


def test_extra_reads_are_bounded_and_stop_when_nothing_is_left():
    transport, proto, a, b = _reading(expect=10_000, read_size=10)
    try:
        b.sendall(b"q" * 1000)
        transport.doRead()
        assert proto.reads == twisted_internals.READS_PER_EVENT  # others' turn: the rest waits
        transport.doRead()
        assert proto.reads == 2 * twisted_internals.READS_PER_EVENT
        proto.data.clear()
        proto.reads = 0
        _recv_rest = a.recv(1 << 16)  # empty the socket
        b.sendall(b"r" * 5)
        assert transport.doRead() is None and proto.reads == 1  # the next recv found nothing
        b.close()
        assert transport.doRead() is main.CONNECTION_DONE
        del _recv_rest
    finally:
        transport.stopReading()
        a.close()


def test_direct_dispatch_delivers_events_and_survives_a_failing_handler():
    from twisted.internet import epollreactor

    target = epollreactor.EPollReactor()
    try:
        assert twisted_internals.dispatch_directly(target)
        pairs = [socket.socketpair() for _ in range(2)]
        seen = []

        class Broken(protocol.Protocol):
            def dataReceived(self, data):
                raise RuntimeError("a handler bug")

        class Good(protocol.Protocol):
            def dataReceived(self, data):
                seen.append(data)

        transports = []
        for (a, _), proto in zip(pairs, (Broken(), Good())):
            t = twisted_internals.ReceivingServer(a, proto, ("127.0.0.1", 1), None, 0, target)
            proto.makeConnection(t)
            t.startReading()
            transports.append(t)
        for _, b in pairs:
            b.sendall(b"ping")
        target.doIteration(0.5)
        assert seen == [b"ping"]
        assert transports[0].disconnected or transports[0].disconnecting  # Twisted's own handling of the bug
    finally:
        for _, b in pairs:
            b.close()
        target._poller.close()
    assert not twisted_internals.dispatch_directly(MemoryReactor())
