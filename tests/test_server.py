"""End-to-end: the blocking client against a real server process on loopback.

(Protocol edge cases are tested in memory, both ends paired: tests/test_protocol.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare.wire.codec import encode
from wiretools import request_parts
from tensorshare.errors import (
    BadRequestError, ConnectionLostError, NoSuchBinError, UnknownVerbError, UsageError,
)
from tensorshare.wire.frames import frame_head
from wiretools import RawConnection, raw_frame, wait_for


# ----------------------------------------------------------------------- verbs


def test_put_replaces_and_peek_keeps(client):
    assert client.put("v-put", torch.arange(3)) == 1
    assert client.put("v-put", {"a": 1}) == 1
    assert client.peek("v-put") == [{"a": 1}]
    assert client.peek("v-put") == [{"a": 1}]


def test_append_keeps_order_and_items_stay_items(client):
    client.append("v-app", [1, 2])  # a list value is one item, never merged
    client.append("v-app", [3])
    assert client.append("v-app", (4,)) == 3
    assert client.peek("v-app") == [[1, 2], [3], (4,)]


def test_get_empties_but_keeps_bin(client):
    client.append("v-get", "a")
    client.append("v-get", "b")
    assert client.get("v-get") == ["a", "b"]
    assert client.get("v-get") == []
    assert client.list()["v-get"] == 0


def test_list_and_delete(client):
    client.put("v-del", 1)
    client.append("v-del", 2)
    assert client.list()["v-del"] == 2
    client.delete("v-del")
    assert "v-del" not in client.list()
    with pytest.raises(NoSuchBinError) as info:
        client.peek("v-del")
    assert info.value.code == 550 and "v-del" in str(info.value)
    with pytest.raises(NoSuchBinError):
        client.get("v-del")
    with pytest.raises(NoSuchBinError):
        client.delete("v-del")


def test_values_round_trip_through_server(client):
    value = {
        "w": torch.randn(5, 7),
        "strided": torch.arange(40).reshape(5, 8)[:, ::3],
        "half": torch.randn(3).to(torch.bfloat16),
        "np": np.arange(6, dtype=np.float64).reshape(2, 3),
        "meta": ("x", 2**70, None, True, 1.5, b"\x00\x01"),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(7),
    }
    client.put("v-values", value)
    [back] = client.peek("v-values")
    assert list(back) == list(value)
    for key in ("w", "strided", "half", "empty", "scalar"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key])
    assert isinstance(back["np"], np.ndarray) and np.array_equal(back["np"], value["np"])
    assert back["meta"] == value["meta"]


def test_large_tensor_is_identical(client):
    big = torch.randint(0, 255, (48 << 20,), dtype=torch.uint8)
    client.put("v-big", big)
    [back] = client.get("v-big")
    assert torch.equal(back, big)


def test_ping(client):
    assert client.ping() < 5


# ----------------------------------------------------------------------- errors


def test_bad_bin_name_is_refused_locally(client):
    with pytest.raises(UsageError):
        client.put("", 1)
    with pytest.raises(UsageError):
        client.put("bad\nname", 1)
    with pytest.raises(UsageError):
        client.put("x" * 1000, 1)


def test_unsupported_value_is_refused_before_sending(client):
    with pytest.raises(tensorshare.errors.EncodeError):
        client.put("v-bad", object())
    assert "v-bad" not in client.list()



def test_malformed_frame_gets_500_then_close_and_others_unaffected(server, client):
    client.put("v-survivor", 42)
    raw = RawConnection(server.port)
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20))
    reply = raw.read_frame()
    assert reply.header["code"] == 500 and "magic" in reply.header["msg"]
    assert raw.closed_by_peer()
    assert client.peek("v-survivor") == [42]



def test_error_classes_match_codes(client):
    with pytest.raises(NoSuchBinError):
        client.peek("v-never")
    assert issubclass(UnknownVerbError, tensorshare.errors.PermanentError)
    assert tensorshare.errors.error_for_code(501, "x").__class__ is BadRequestError


# ----------------------------------------------------------------------- listen


def test_listen_reports_every_change_in_order(server):
    with tensorshare.Client("127.0.0.1", server.port) as listener, \
            tensorshare.Client("127.0.0.1", server.port) as writer:
        seen = []
        handle = listener.listen("l-order", seen.append)
        assert handle.snapshot.exists is False and handle.snapshot.n_items == 0
        writer.append("l-order", 1)
        writer.append("l-order", 2)
        writer.put("l-order", 3)
        writer.get("l-order")
        writer.delete("l-order")
        assert wait_for(lambda: len(seen) == 5)
        assert [(n.op, n.n_items) for n in seen] == [
            ("APPEND", 1), ("APPEND", 2), ("PUT", 1), ("GET", 0), ("DELETE", 0)]
        seqs = [n.seq for n in seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
        handle.stop()
        writer.append("l-order", 4)
        time.sleep(0.2)
        assert len(seen) == 5


def test_listen_snapshot_is_atomic_with_stream(server):
    """Appends racing with the start of listening are either in the snapshot or notified."""
    stop = threading.Event()

    def hammer():
        with tensorshare.Client("127.0.0.1", server.port) as writer:
            while not stop.is_set():
                writer.append("l-race", 0)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        with tensorshare.Client("127.0.0.1", server.port) as listener:
            time.sleep(0.05)
            seen = []
            handle = listener.listen("l-race", seen.append)
            time.sleep(0.2)
            stop.set()
            thread.join()
            final = listener.list()["l-race"]
            assert wait_for(lambda: seen and seen[-1].n_items == final)
            appended = sum(1 for n in seen if n.op == "APPEND")
            assert handle.snapshot.n_items + appended == final
            assert all(a.seq < b.seq for a, b in zip(seen, seen[1:]))
            assert all(n.seq > handle.snapshot.seq for n in seen)
    finally:
        stop.set()
        thread.join()


def test_listen_callback_error_is_not_retried(server, caplog):
    with tensorshare.Client("127.0.0.1", server.port) as c:
        calls = []

        def bad(note):
            calls.append(note)
            raise RuntimeError("user bug")

        c.listen("l-bad", bad)
        c.append("l-bad", 1)
        c.append("l-bad", 2)
        assert wait_for(lambda: len(calls) == 2)
        time.sleep(0.1)
        assert len(calls) == 2


# ----------------------------------------------------------------------- concurrency


def test_pipelining_from_many_threads(server):
    n_threads, per_thread = 8, 150
    errors = []
    with tensorshare.Client("127.0.0.1", server.port) as c:
        def work(t):
            try:
                for i in range(per_thread):
                    c.append("p-many", (t, i))
                    if i % 10 == 0:
                        c.put(f"p-own-{t}", torch.full((4,), float(i)))
                        assert torch.equal(c.peek(f"p-own-{t}")[0], torch.full((4,), float(i)))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        items = c.get("p-many")
    assert sorted(items) == sorted((t, i) for t in range(n_threads) for i in range(per_thread))
    for t in range(n_threads):  # each thread's appends in its own order
        mine = [i for (tt, i) in items if tt == t]
        assert mine == list(range(per_thread))


def test_runs_of_non_blocking_calls_share_one_reader_thread_that_close_ends(server):
    """The background reader outlives a moment with no call in flight (starting a
    thread per burst cost more than the calls), and close() ends it at once."""
    c = tensorshare.Client("127.0.0.1", server.port, timeout=30)
    readers = []
    for burst in range(20):
        done = threading.Event()
        c.submit("APPEND", "linger", burst, lambda result, error: done.set())
        assert done.wait(10)
        readers.extend(t for t in threading.enumerate() if t.name == "tensorshare-reader" and t not in readers)
    assert len(readers) == 1 and readers[0].is_alive()
    assert len(c.get("linger")) == 20
    start = time.monotonic()
    c.close()
    readers[0].join(5)
    assert not readers[0].is_alive() and time.monotonic() - start < 1.0


def test_timeout_raises(server):
    # Over TCP, where 64 MiB takes longer than the timeout (by reference it may not).
    with tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        c.put("t-big", torch.zeros(16 << 20))
        with pytest.raises(tensorshare.TimeoutError):
            c.peek("t-big", timeout=0.0001)
        assert c.ping() < 5  # the connection is still usable afterwards


# ----------------------------------------------------------------------- faults


def test_reconnect_after_server_restart(fresh_server):
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=10)
    seen = []
    c.listen("r-bin", seen.append)
    c.put("r-bin", 1)
    assert wait_for(lambda: len(seen) == 1)
    fresh_server.restart()
    # The server's state is gone; the client notices, reconnects and listens again.
    assert wait_for(lambda: any(n.op == "LISTEN" for n in seen), timeout=15)
    assert not any(n.op == "LISTEN" and n.n_items for n in seen)
    c.append("r-bin", 2)
    assert wait_for(lambda: seen[-1].op == "APPEND" and seen[-1].n_items == 1)
    assert c.peek("r-bin") == [2]
    c.close()


def test_close_ends_a_listening_clients_wait_to_reconnect_at_once(fresh_server):
    """A listening client whose server is gone waits between attempts to connect;
    close() ends that wait instead of sitting it out (it blocked for up to max_backoff)."""
    import logging

    waits: list[float] = []

    class Waits(logging.Handler):
        def emit(self, record):
            if "retrying in" in record.msg:
                waits.append(record.args[-1])

    log = logging.getLogger("tensorshare.client")
    handler, level = Waits(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=10, max_backoff=30)
        c.listen("w-bin", lambda note: None)
        fresh_server.kill()
        assert wait_for(lambda: waits and waits[-1] >= 1.0, timeout=20)  # the reader waits a second or more
        [reader] = [t for t in threading.enumerate() if t.name == "tensorshare-reader"]
        start = time.monotonic()
        c.close()
        assert time.monotonic() - start < 0.5 and not reader.is_alive()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_a_call_whose_send_fails_leaves_the_client_usable_after_a_restart(fresh_server):
    """A put that finds the connection gone while it sends (a broken pipe) fails with
    ConnectionLostError; the next call reconnects and gets its reply (the failed call
    left the client believing a reader ran, and every later call waited out its timeout)."""
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=5, zero_copy=False, max_backoff=0.2)
    c.put("s-bin", 1)
    fresh_server.kill()
    with pytest.raises(ConnectionLostError):
        c.put("s-bin", torch.zeros(4 << 20))  # 16 MiB: more than the socket takes before the reset
    fresh_server.start()  # on the same port
    c.put("s-bin", 2)
    assert c.peek("s-bin") == [2]
    c.close()


def test_pending_call_fails_promptly_when_server_dies(fresh_server):
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30)
    c.put("d-bin", torch.zeros(1))
    fresh_server.kill()
    start = time.monotonic()
    with pytest.raises(ConnectionLostError):
        c.peek("d-bin")
    assert time.monotonic() - start < 5
    with pytest.raises(ConnectionLostError):  # nothing to reconnect to: clear error, no hang
        c.peek("d-bin")
    c.close()


def test_client_killed_mid_put_leaves_no_item(server, client):
    description = encode(torch.zeros(16 << 20)).description.hex()
    script = os.path.join(os.path.dirname(__file__), "fault_procs.py")
    proc = subprocess.Popen([sys.executable, script, "put", str(server.port), "k-half", description,
                             str(64 << 20), "0", "0.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid"  # half of the payload sent
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
        proc.stdout.close()
    time.sleep(0.2)
    assert "k-half" not in client.list()
    client.put("k-after", 1)
    assert client.peek("k-after") == [1]


def test_get_whose_reply_is_not_delivered_keeps_items(server, client):
    big = torch.arange(8 << 20, dtype=torch.float64)
    client.put("k-undelivered", big)
    seen = []
    client.listen("k-undelivered", seen.append)
    raw = RawConnection(server.port)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.send(raw_frame(1, "GET", "k-undelivered"))
    time.sleep(0.3)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()  # reset: the 64 MiB reply cannot have been delivered
    assert wait_for(lambda: [n.op for n in seen] == ["GET", "RESTORE"])
    assert client.list()["k-undelivered"] == 1
    assert torch.equal(client.peek("k-undelivered")[0], big)


# ----------------------------------------------------------------------- review findings




def test_tags_reach_listeners_and_snapshots(client, server):
    with tensorshare.Client("127.0.0.1", server.port) as other:
        seen = []
        client.put("g-tag", 1, tag=41)
        handle = client.listen("g-tag", seen.append)
        assert handle.snapshot.tag == 41
        other.append("g-tag", 2, tag=-(2**63))
        other.append("g-tag", 3)
        other.get("g-tag")
        assert wait_for(lambda: len(seen) == 3)
        assert [n.tag for n in seen] == [-(2**63), None, None]
    with pytest.raises(UsageError):
        client.put("g-tag", 1, tag=2**63)
    raw = RawConnection(server.port)
    raw.send(frame_head({"op": "PUT", "id": 1, "bin": "g-tag", "tag": "v1",
                         "value": request_parts(1, "PUT", "g", 0)[0][-20:]}, 0))
    assert raw.read_frame().header["code"] == 501
    raw.close()


@pytest.mark.process
def test_reply_too_large_for_one_header_is_refused_and_keeps_items():
    from serverproc import ServerProcess

    proc = ServerProcess("--max-reply-header", "4KiB")
    try:
        with tensorshare.Client("127.0.0.1", proc.port) as c:
            for i in range(200):  # about 45 bytes of description each: 9 KB in all
                c.append("big-header", {"step": i, "x": torch.zeros(1)})
            with pytest.raises(tensorshare.errors.TooLargeError) as info:
                c.get("big-header")
            assert info.value.code == 552 and "descriptions" in str(info.value)
            assert c.list()["big-header"] == 200
            c.put("small", 1)
            assert c.get("small") == [1]
    finally:
        proc.stop()


@pytest.mark.parametrize("reply", [
    {"code": 200, "id": [1]},  # unhashable id
    {"code": 151, "id": 0, "bin": "x", "n": "many", "seq": 1, "op": "PUT"},  # bad notification
    {"code": 250, "id": None},
])
def test_client_survives_a_lying_server(reply):
    """Nonsense from a server ends the connection with ConnectionLostError, nothing else."""
    from serverproc import FakeServer

    with FakeServer(reply) as fake:
        c = tensorshare.Client("127.0.0.1", fake.port, timeout=5, reconnect=False)
        with pytest.raises(ConnectionLostError):
            c.ping()
        c.close()
