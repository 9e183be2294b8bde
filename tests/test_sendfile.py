"""Spilled and durable items sent by the kernel from their files (server/net/sendfile.py).

The thread side (``send_spans``) is tested on real socket pairs and real files;
the server's path end to end, against real server processes: the bytes that
arrive, that the path is taken (the server's ``tensorshare_sendfile_bytes``
counter), that other clients are answered while a large reply is being sent,
that a reply cut short loses nothing, and that TLS connections keep the copying
path.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

import tensorshare
from opsproc import OpsServer, http_get
from wiretools import RawConnection, raw_frame, wait_for

from tensorshare_server.bins.spill import FileSpan
from tensorshare_server.net import sendfile
from tensorshare_server.net.sendfile import SpanSend, send_spans

pytestmark = pytest.mark.skipif(not sendfile.AVAILABLE, reason="this platform has no os.sendfile")

MiB = 1 << 20


def _file(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return open(path, "rb", buffering=0)


def _receive_all(sock: socket.socket, nbytes: int, out: bytearray) -> None:
    while len(out) < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        out += chunk


def _pair():
    a, b = socket.socketpair()
    a.setblocking(False)  # as the server's sockets are
    return a, b


def test_spans_arrive_whole_and_in_order(tmp_path):
    first, second = os.urandom(3 * MiB + 5), os.urandom(MiB + 3)
    f1, f2 = _file(tmp_path, "a", first), _file(tmp_path, "b", second)
    spans = [FileSpan(f1, 0, 2 * MiB), FileSpan(f1, 2 * MiB, len(first)), FileSpan(f2, 7, len(second))]
    expected = first + second[7:]
    a, b = _pair()
    got = bytearray()
    reader = threading.Thread(target=_receive_all, args=(b, len(expected), got))
    reader.start()
    job = send_spans(SpanSend(os.dup(a.fileno()), spans, 0))
    reader.join(10)
    assert job.error is None and job.finished and job.sent == len(expected)
    assert bytes(got) == expected
    with pytest.raises(OSError):  # the thread closed its duplicate descriptor
        os.fstat(job.fd)
    a.close(), b.close(), f1.close(), f2.close()


def test_a_full_socket_hands_the_rest_back_and_it_resumes_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(sendfile, "PATIENCE", 0.1)
    data = os.urandom(8 * MiB)
    f = _file(tmp_path, "a", data)
    spans = [FileSpan(f, i, min(i + 3 * MiB, len(data))) for i in range(0, len(data), 3 * MiB)]
    a, b = _pair()
    started = time.monotonic()
    job = send_spans(SpanSend(os.dup(a.fileno()), spans, 0))  # nobody reads: the socket fills up
    assert time.monotonic() - started < 5
    assert job.error is None and not job.finished and 0 < job.sent < len(data)
    got = bytearray()
    reader = threading.Thread(target=_receive_all, args=(b, len(data), got))
    reader.start()
    done = job.sent
    while True:  # as the writer does: hand over again from where the last one stopped
        rest = spans[job.parts_done:]
        job = send_spans(SpanSend(os.dup(a.fileno()), rest, job.offset))
        assert job.error is None
        done += job.sent
        if job.finished:
            break
    reader.join(10)
    assert done == len(data) and bytes(got) == data
    a.close(), b.close(), f.close()


def test_a_file_shorter_than_its_span_is_an_error_not_a_short_frame(tmp_path):
    f = _file(tmp_path, "a", b"x" * 1000)
    a, b = _pair()
    job = send_spans(SpanSend(os.dup(a.fileno()), [FileSpan(f, 0, 4000)], 0))
    assert isinstance(job.error, OSError) and not job.finished and job.sent == 1000
    a.close(), b.close(), f.close()


def test_a_cancelled_send_stops(tmp_path):
    f = _file(tmp_path, "a", os.urandom(8 * MiB))
    a, b = _pair()
    job = SpanSend(os.dup(a.fileno()), [FileSpan(f, 0, 8 * MiB)], 0)
    job.cancelled = True
    assert send_spans(job).sent == 0 and not job.finished
    a.close(), b.close(), f.close()


# -- end to end, real server processes


def _sendfile_bytes(server: OpsServer) -> int:
    status, _, body = http_get(server.url("/metrics"), getattr(server, "headers", None))
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("tensorshare_sendfile_bytes_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no tensorshare_sendfile_bytes_total in /metrics")


def _spilled(server: OpsServer) -> int:
    status, _, body = http_get(server.url("/status.json"), getattr(server, "headers", None))
    assert status == 200
    return json.loads(body)["tiers"]["spilled"]["bytes"]


def _spill(server: OpsServer, client, name: str, value: torch.Tensor) -> None:
    """Put ``value`` and push it out of memory (--memory-limit 1MiB) into a spill file."""
    before = _spilled(server)
    client.put(name, value)
    client.put(name + "-push", torch.ones(MiB // 4))
    assert wait_for(lambda: _spilled(server) >= before + value.numel() * value.element_size(), timeout=10)


@pytest.mark.process
def test_a_spilled_peek_is_sent_by_the_kernel_and_arrives_whole():
    server = OpsServer("--memory-limit", "1MiB")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            value = torch.randn(5 * MiB // 4 + 3)  # spans of 4 MiB and a ragged tail
            nested = {"w": torch.arange(3 * MiB // 8, dtype=torch.int64), "b": torch.ones(17)}
            _spill(server, client, "sf/one", value)
            client.put("sf/many", nested)
            _spill(server, client, "sf/other", torch.zeros(MiB))
            before = _sendfile_bytes(server)
            assert torch.equal(client.peek("sf/one")[0], value)
            back = client.peek("sf/many")[0]
            assert torch.equal(back["w"], nested["w"]) and torch.equal(back["b"], nested["b"])
            sent = _sendfile_bytes(server) - before
            assert sent >= value.numel() * 4 + nested["w"].numel() * 8
            got = client.get("sf/one")[0]  # a GET of it too, and it is gone afterwards
            assert torch.equal(got, value) and not client.peek("sf/one")
    finally:
        server.stop()


@pytest.mark.process
def test_without_sendfile_the_same_bytes_are_copied():
    server = OpsServer("--memory-limit", "1MiB", "--no-sendfile")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            value = torch.randn(5 * MiB // 4 + 3)
            _spill(server, client, "nosf/one", value)
            assert torch.equal(client.peek("nosf/one")[0], value)
            assert _sendfile_bytes(server) == 0
    finally:
        server.stop()


@pytest.mark.process
def test_others_are_answered_while_a_large_spilled_reply_is_sent_and_it_arrives_whole():
    server = OpsServer("--memory-limit", "1MiB")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            value = torch.randint(0, 1 << 30, (48 * MiB // 4,), dtype=torch.int32)
            _spill(server, client, "sf/big", value)
            slow = RawConnection(server.port, rcvbuf=64 << 10)
            slow.send(raw_frame(1, "PEEK", "sf/big"))
            first = slow.sock.recv(64 << 10)  # the reply has begun, and stops at the full socket
            assert first
            for _ in range(5):  # the reactor is not held by the reply in progress
                started = time.monotonic()
                client.ping()
                assert time.monotonic() - started < 5  # a held reactor: no answer at all
            time.sleep(sendfile.PATIENCE + 0.3)  # the thread gave the connection back: resume on writable
            slow.sock.settimeout(20)
            assert not slow.decoder.feed(first)
            frame = None
            while frame is None:
                data = slow.sock.recv(1 << 20)
                assert data, "the server closed the connection"
                frames = slow.decoder.feed(data)
                if frames:
                    frame = frames[0]
            assert frame.header["code"] == 226
            payload = memoryview(frame.payload).cast("B")
            assert bytes(payload[: value.numel() * 4]) == value.numpy().tobytes()
            assert _sendfile_bytes(server) >= value.numel() * 4
            slow.close()
    finally:
        server.stop()


@pytest.mark.process
def test_a_reply_cut_short_loses_nothing():
    server = OpsServer("--memory-limit", "1MiB")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            value = torch.randn(32 * MiB // 4)
            _spill(server, client, "sf/cut", value)
            for _ in range(3):
                gone = RawConnection(server.port, rcvbuf=64 << 10)
                gone.send(raw_frame(1, "PEEK", "sf/cut"))
                assert gone.sock.recv(64 << 10)
                gone.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                gone.close()  # a reset in the middle of the reply
            assert client.ping() < 5
            assert torch.equal(client.peek("sf/cut")[0], value)
            assert torch.equal(client.get("sf/cut")[0], value)
    finally:
        server.stop()


@pytest.mark.process
def test_durable_items_are_sent_from_the_data_directory(tmp_path):
    server = OpsServer("--data-dir", str(tmp_path / "data"))
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            value = torch.randn(6 * MiB // 4)
            client.put("sf/durable", value)
            client.put("sf/durable-push", torch.ones(4))
            # A durable item stays in memory until evicted; a restart serves it from its files.
        server.stop()
        server.start()
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            assert torch.equal(client.peek("sf/durable")[0], value)
            assert _sendfile_bytes(server) >= value.numel() * 4
    finally:
        server.stop()


@pytest.mark.process
def test_tls_connections_keep_the_copying_path(tmp_path):
    from certs import make_certificates

    certs = make_certificates(tmp_path)
    token = tmp_path / "token"
    token.write_text("sendfile-test-token")
    server = OpsServer("--memory-limit", "1MiB", "--tls-cert", certs.cert, "--tls-key", certs.key,
                       "--token-file", str(token))
    server.headers = {"Authorization": "Bearer sendfile-test-token"}
    try:
        with tensorshare.Client("127.0.0.1", server.port, token="sendfile-test-token",
                                tls_fingerprint=certs.fingerprint, zero_copy=False, timeout=30) as client:
            value = torch.randn(5 * MiB // 4 + 3)
            _spill(server, client, "sf/tls", value)
            assert torch.equal(client.peek("sf/tls")[0], value)
            assert _sendfile_bytes(server) == 0
    finally:
        server.stop()


@pytest.mark.process
def test_a_server_stops_promptly_while_it_sends_a_spilled_reply():
    server = OpsServer("--memory-limit", "1MiB")
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False, timeout=30) as client:
            _spill(server, client, "sf/stop", torch.randn(32 * MiB // 4))
        reader = RawConnection(server.port, rcvbuf=64 << 10)
        reader.send(raw_frame(1, "PEEK", "sf/stop"))
        assert reader.sock.recv(64 << 10)
        started = time.monotonic()
        assert server.stop(timeout=15) == 0
        assert time.monotonic() - started < 5
        reader.close()
    finally:
        server.stop()
