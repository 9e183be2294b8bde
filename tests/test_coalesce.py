"""Small pipelined requests are held back while earlier ones await their replies and
sent together (tensorshare/_client/coalesce.py): the bookkeeping alone, then real clients
against a real server (order kept, nothing stale after a reconnection) and against a
server that stops reading (a held batch the socket takes only part of)."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import torch

from serverproc import OneConnectionServer
from tensorshare import Client, ConnectionLostError
from tensorshare.protocol import messages as protocol
from tensorshare._client.coalesce import Coalescer
from tensorshare.wire.frames import FrameDecoder, frame_head

A, B = object(), object()  # two sockets, as far as the coalescer can tell


# ------------------------------------------------------------------ bookkeeping


def test_holds_only_while_a_sent_request_awaits_its_reply():
    box = Coalescer(100)
    assert not box.hold(A, 1, b"x" * 10)  # nothing in flight: send it now
    assert box.take(A, 1) == []  # request 1 goes out directly
    assert box.awaiting(A) and not box.awaiting(B)
    assert box.hold(A, 2, b"a" * 40) and box.hold(A, 3, b"b" * 60)
    assert not box.hold(A, 4, b"c")  # over the limit: the caller sends it, after these
    box.answered(1)
    assert not box.awaiting(A) and box  # the reply came: hold no more, but send what waits
    assert not box.hold(A, 4, b"c")
    assert box.take(A, 4) == [b"a" * 40, b"b" * 60]  # in order, ahead of request 4
    assert not box
    for rid in (2, 3):
        assert box.awaiting(A)
        box.answered(rid)
    assert box.awaiting(A)  # 4 is still out
    box.answered(4)
    assert not box.awaiting(A)


def test_a_new_socket_drops_what_was_held_for_the_last():
    box = Coalescer(100)
    box.take(A, 1)
    assert box.hold(A, 2, b"old")
    assert not box.hold(B, 3, b"new")  # nothing is in flight on B
    assert box.take(B, 3) == []  # frames meant for A never go out on B
    assert box.awaiting(B) and not box.awaiting(A)
    box.answered(1)  # a late reply from A's connection changes nothing on B
    assert box.awaiting(B)


def test_the_unsent_rest_goes_first():
    box = Coalescer(100)
    box.take(A, 1)
    box.hold(A, 2, b"0123456789")
    data = b"".join(box.take(A))
    box.keep_rest(memoryview(data)[4:])
    assert box.partial
    assert box.hold(A, 3, b"next")
    assert [bytes(f) for f in box.take(A)] == [b"456789", b"next"]
    assert not box.partial
    box.keep_rest(memoryview(b""))  # all of it went
    assert not box and not box.partial


# ------------------------------------------------------------------ real server


def _count(obj, method: str) -> list:
    """Record the results of ``obj.method`` (a Coalescer's, in a live client)."""
    seen, real = [], getattr(obj, method)

    def spy(*args):
        result = real(*args)
        seen.append((args, result))
        return result

    setattr(obj, method, spy)
    return seen


def test_pipelined_calls_from_many_threads_keep_their_order(server):
    threads_n, per_thread = 3, 300
    with Client("127.0.0.1", server.port, timeout=30) as client:
        holds = _count(client.router.home.coalescer, "hold")
        done = threading.Semaphore(0)
        errors = []

        def completed(result, error):
            if error is not None:
                errors.append(error)
            done.release()

        def work(t: int) -> None:
            name = f"coalesce-order-{t}"
            for i in range(per_thread):
                value = torch.tensor([t, i])
                if i % 50 == 49:  # a blocking call sends everything held first
                    client.append(name, value)
                    done.release()
                else:
                    client.submit(protocol.APPEND, name, value, completed)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        deadline = time.monotonic() + 30
        for _ in range(threads_n * per_thread):
            assert done.acquire(timeout=max(deadline - time.monotonic(), 0)), "a pipelined call never completed"
        assert not errors
        assert any(held for _, held in holds), "no request was ever held back"
        for t in range(threads_n):
            items = client.get(f"coalesce-order-{t}")
            assert [int(item[1]) for item in items] == list(range(per_thread))
            assert all(int(item[0]) == t for item in items)


def test_held_requests_fail_with_their_connection_and_are_never_sent_later(fresh_server):
    with Client("127.0.0.1", fresh_server.port, timeout=30, keepalive=None) as client:
        holds = _count(client.router.home.coalescer, "hold")
        outcomes = []
        finished = threading.Semaphore(0)

        def completed(result, error):
            outcomes.append(error)
            finished.release()

        client.put("coalesce-warm", torch.zeros(1))
        fresh_server.proc.send_signal(signal.SIGSTOP)  # it answers nothing from now on
        try:
            client.submit(protocol.APPEND, "coalesce-first", torch.ones(4), completed)
            time.sleep(0.2)  # the background reader waits for the reply (it sends what is held when it loops)
            for i in range(20):
                client.submit(protocol.APPEND, "coalesce-held", torch.full((4,), float(i)), completed)
            assert sum(1 for _, held in holds if held) == 20
            assert client.router.home.coalescer, "the held requests went out: the test would test nothing"
        finally:
            fresh_server.kill()  # SIGKILL also ends a stopped process
        for _ in range(21):
            assert finished.acquire(timeout=10), "a call in flight did not fail with its connection"
        assert all(isinstance(error, ConnectionLostError) for error in outcomes)
        fresh_server.start()  # same port, empty
        assert client.append("coalesce-after", torch.ones(2)) == 1  # reconnects
        assert client.list() == {"coalesce-after": 1}  # nothing held for the old connection went out


def test_a_thread_still_holding_the_old_socket_leaves_the_new_ones_requests_alone(fresh_server):
    """A sender that picked up the socket before it was replaced gets the send lock
    late: it must fail, not take (and lose) what is held for the new connection."""
    with Client("127.0.0.1", fresh_server.port, timeout=10, keepalive=None) as client:
        client.put("coalesce-stale", torch.zeros(1))
        old = client.router.home.link
        client.router.home.drop(old, ConnectionLostError("lost"))  # as the reader would
        client.put("coalesce-stale", torch.zeros(1))  # reconnects
        done = threading.Semaphore(0)
        results = []

        def completed(result, error):
            results.append(error or result)
            done.release()

        fresh_server.proc.send_signal(signal.SIGSTOP)  # the first request stays in flight
        try:
            client.submit(protocol.APPEND, "coalesce-stale-x", torch.ones(2), completed)
            client.submit(protocol.APPEND, "coalesce-stale-x", torch.ones(2), completed)
            assert client.router.home.coalescer, "the second request should be held"
            with pytest.raises(ConnectionLostError):  # a thread that got the socket before
                client.router.home._send(old, [b"never sent"], None, 0)
        finally:
            fresh_server.proc.send_signal(signal.SIGCONT)
        assert done.acquire(timeout=10) and done.acquire(timeout=10), "a held request was lost"
        assert results == [1, 2]
        assert client.list() == {"coalesce-stale": 1, "coalesce-stale-x": 2}


class _GatedServer(OneConnectionServer):
    """Greets, reads the first request whole and then nothing until ``go`` is set;
    answers it; waits ``pause`` seconds; then reads and answers everything (APPEND
    replies).  Its receive buffer is tiny, so a client's held requests cannot all go
    out at once while it does not read."""

    def __init__(self, pause: float):
        self.pause = pause
        self.go = threading.Event()
        self.answered = 0
        super().__init__(rcvbuf=4096)

    def serve(self, conn: socket.socket) -> None:
        conn.sendall(frame_head({"code": protocol.GREETING, "id": 0, "msg": "hi", "version": 1}, 0))
        decoder, frames = FrameDecoder(), []
        while not frames:
            frames.extend(decoder.feed(conn.recv(1 << 16)))
        self.go.wait(10)
        for frame in frames:
            self._answer(conn, frame)
        time.sleep(self.pause)
        try:
            while data := conn.recv(1 << 16):
                for frame in decoder.feed(data):
                    self._answer(conn, frame)
        except OSError:
            pass

    def _answer(self, conn: socket.socket, frame) -> None:
        self.answered += 1
        conn.sendall(frame_head({"code": protocol.DONE, "id": frame.header["id"], "n": self.answered,
                                 "seq": self.answered}, 0))


def test_a_held_batch_the_socket_takes_only_part_of_still_goes_out():
    """The reader sends held requests without waiting for the socket: what it cannot
    take now waits, and the reader then also wakes when the socket can take more
    (here nothing else is in flight, so no reply would wake it)."""
    gated = _GatedServer(pause=0.3)
    try:
        with Client("127.0.0.1", gated.port, timeout=30, zero_copy=False, keepalive=None) as client:
            client.router.home.link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            rests = _count(client.router.home.coalescer, "keep_rest")
            holds = _count(client.router.home.coalescer, "hold")
            replies = []
            done = threading.Semaphore(0)

            def completed(result, error):
                replies.append(error or result)
                done.release()

            value = torch.ones(7000)  # 28 KB: two fit in what may be held, 64 KiB
            for _ in range(3):
                client.submit(protocol.APPEND, "coalesce-gated", value, completed)
            assert [held for _, held in holds] == [True, True]  # the first went out at once (nothing in flight)
            gated.go.set()
            start = time.monotonic()
            for _ in range(3):
                assert done.acquire(timeout=10), "held requests never went out"
            assert time.monotonic() - start < 3.0, "the rest of a held batch waited for a timeout"
            assert replies == [1, 2, 3]
            assert rests and len(rests[0][0][0]) > 0, "the socket took the whole batch: nothing was tested"
    finally:
        gated.close()


def test_a_request_held_as_the_last_reply_came_is_sent_at_once(server):
    """The race: a request is held because one is in flight, and that one's reply is
    read while the holder still has the send lock, so the reader cannot send what is
    held.  The holder sees that nothing awaits a reply any more and sends it."""
    with Client("127.0.0.1", server.port, timeout=30) as client:
        box, real_hold = client.router.home.coalescer, client.router.home.coalescer.hold

        def hold_then_lose_the_race(sock, rid, data):
            held = real_hold(sock, rid, data)
            deadline = time.monotonic() + 10
            while box.awaiting(sock) and time.monotonic() < deadline:  # the reader reads the reply meanwhile
                time.sleep(0.001)
            time.sleep(0.05)  # ... and finds the send lock taken
            return held

        got = []
        done = threading.Semaphore(0)
        client.submit(protocol.APPEND, "coalesce-race", torch.ones(2), lambda r, e: done.release())
        box.hold = hold_then_lose_the_race
        start = time.monotonic()
        client.submit(protocol.APPEND, "coalesce-race", torch.ones(2), lambda r, e: (got.append(r), done.release()))
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
        assert got == [2]
        assert time.monotonic() - start < 0.7, "the held request waited for the reader's next turn (1 s)"


@pytest.mark.parametrize("n", [1, 2])
def test_a_lone_request_goes_out_at_once(server, n):
    """With nothing in flight nothing is held, so a single call is not delayed."""
    with Client("127.0.0.1", server.port, timeout=30) as client:
        holds = _count(client.router.home.coalescer, "hold")
        got = threading.Event()
        for _ in range(n):
            got.clear()
            client.submit(protocol.APPEND, f"coalesce-lone-{n}", torch.ones(2), lambda result, error: got.set())
            assert got.wait(10)
        assert not any(held for _, held in holds)
