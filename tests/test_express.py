"""The blocking client's express lane (tensorshare/_client/express.py), against real server processes.

A lone small call on an idle connection goes out in one send and its reply is
read in one read, without the engine tracking it; anything else (an error reply,
a reply that does not come whole, one referring to the server's files, a wait
the keepalive cuts short, a call given up) is handed to the general path where
it stands.  These tests check both halves: which calls the lane takes (the
engine's ``track`` counts the calls it did not), and that every case handed
over ends as the general path ends it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import tensorshare
from tensorshare.errors import ConnectionLostError, NoSuchBinError, TimeoutError, UsageError
from serverproc import ServerProcess


def _counting_tracks(client) -> list:
    """The calls the home connection's engine tracks from now on (the general path's)."""
    engine = client.router.home.engine
    tracked: list = []
    track = engine.track

    def counting(call, now=None):
        tracked.append(call.command.verb)
        return track(call, now)

    engine.track = counting
    return tracked


def test_lone_small_calls_take_the_express_lane(server):
    with tensorshare.Client("127.0.0.1", server.port) as c:
        c.ping()  # (the keepalive's first look goes the general way)
        tracked = _counting_tracks(c)
        value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert c.put("x-lone", value) == 1
        assert c.append("x-lone", torch.ones(2, dtype=torch.int64)) == 2
        items = c.peek("x-lone")
        assert torch.equal(items[0], value) and torch.equal(items[1], torch.ones(2, dtype=torch.int64))
        assert c.list()["x-lone"] == 2
        taken = c.get("x-lone")
        assert len(taken) == 2 and torch.equal(taken[0], value)
        assert c.peek("x-lone") == []
        c.delete("x-lone")
        assert tracked == []  # none of them was tracked: all went the express way
        assert items[0].data_ptr() != taken[0].data_ptr()  # each reply in memory of its own
        # Not lone: a dict value, a listen on the connection: the general way, as before.
        c.put("x-lone", {"a": torch.zeros(2)})
        assert tracked == ["PUT"]
        heard = []
        c.listen("x-lone", heard.append)
        del tracked[:]
        c.put("x-lone", value)
        assert tracked == ["PUT"]
        deadline = time.monotonic() + 5
        while not any(n.op == "PUT" for n in heard) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(n.op == "PUT" for n in heard)


def test_replies_the_lane_does_not_settle_are_settled_the_general_way(server):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a reply that does not come in one read
    with tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c, \
            tensorshare.Client("127.0.0.1", server.port) as local:
        c.ping()
        local.ping()
        c.put("x-big", big)
        tracked = _counting_tracks(c)
        assert torch.equal(c.peek("x-big")[0], big)
        assert tracked == ["PEEK"]  # handed over after the first read
        assert local.same_host
        local_tracked = _counting_tracks(local)
        assert torch.equal(local.peek("x-big")[0], big)  # referred to in the server's files: mapped
        assert local_tracked == ["PEEK"]
        with pytest.raises(NoSuchBinError):
            c.peek("x-none")  # an error reply: raised as the general path raises it
        assert tracked == ["PEEK", "PEEK"]
        with pytest.raises(UsageError):
            c.put("", torch.ones(1))  # refused before anything is sent
        assert tracked == ["PEEK", "PEEK"]
        assert c.put("x-after", torch.ones(3)) == 1 and torch.equal(c.peek("x-after")[0], torch.ones(3))
        assert tracked == ["PEEK", "PEEK"]


def test_a_late_reply_is_not_taken_for_the_next_calls(fresh_server):
    with tensorshare.Client("127.0.0.1", fresh_server.port, keepalive=None) as c, \
            tensorshare.Client("127.0.0.1", fresh_server.port) as other:
        c.put("x-late", torch.zeros(4))
        fresh_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                c.peek("x-late", timeout=0.3)  # its reply comes after the caller left
        finally:
            fresh_server.proc.send_signal(signal.SIGCONT)
        assert c.connected  # a read given up: nothing lost, the connection kept
        other.put("x-late", torch.ones(4))
        time.sleep(0.2)  # the late reply (zeros) waits in the socket, alone
        assert torch.equal(c.peek("x-late")[0], torch.ones(4))
        for i in range(5):
            assert c.put("x-late", torch.full((4,), float(i))) == 1
            assert torch.equal(c.peek("x-late")[0], torch.full((4,), float(i)))
        fresh_server.proc.send_signal(signal.SIGSTOP)  # the same for a reply the server makes from a template
        try:
            with pytest.raises(TimeoutError):
                c.append("x-late-count", torch.ones(1), timeout=0.3)
        finally:
            fresh_server.proc.send_signal(signal.SIGCONT)
        time.sleep(0.2)  # its late reply (1 item) waits in the socket
        assert c.append("x-late-count", torch.ones(1)) == 2


def test_a_take_given_up_resets_the_connection(fresh_server):
    with tensorshare.Client("127.0.0.1", fresh_server.port, keepalive=None) as c:
        c.append("x-take", torch.ones(2))
        fresh_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                c.get("x-take", timeout=0.3)
            assert not c.connected  # its items could be taken for nobody: reset, as the general path does
        finally:
            fresh_server.proc.send_signal(signal.SIGCONT)
        assert c.append("x-take2", torch.ones(1)) == 1  # connected again


def test_the_keepalive_ends_a_wait_on_a_silent_server(fresh_server):
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=20, keepalive=0.3, reconnect=False)
    try:
        c.put("x-silent", torch.ones(2))
        c.put("x-silent", torch.ones(2))
        os.kill(fresh_server.pid, signal.SIGSTOP)  # the kernel still takes the bytes; nothing answers
        try:
            start = time.monotonic()
            with pytest.raises(ConnectionLostError, match="keepalive"):
                c.peek("x-silent")  # the keepalive ends it long before the timeout
            assert time.monotonic() - start < 5
        finally:
            os.kill(fresh_server.pid, signal.SIGCONT)
    finally:
        c.close()


def test_threads_sharing_a_client_meet_the_lane_and_the_general_path(server):
    errors: list = []
    with tensorshare.Client("127.0.0.1", server.port) as c:
        def work(k: int) -> None:
            try:
                for i in range(150):
                    value = torch.full((k + 1,), float(i))
                    assert c.put(f"x-thread-{k}", value) == 1
                    assert torch.equal(c.peek(f"x-thread-{k}")[0], value)
                    assert c.append(f"x-thread-{k}", value) == 2
                    assert len(c.get(f"x-thread-{k}")) == 2
            except BaseException as exc:  # (reported by the main thread)
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert errors == []


@pytest.mark.process
def test_a_server_of_workers_is_served_through_the_lane():
    proc = ServerProcess("--workers", "2")
    try:
        with tensorshare.Client("127.0.0.1", proc.port) as c:
            assert c.workers == 2
            for i in range(20):
                name = f"x-w-{i}"
                assert c.put(name, torch.full((3,), float(i))) == 1
                assert torch.equal(c.peek(name)[0], torch.full((3,), float(i)))
            assert sum(1 for name in c.list() if name.startswith("x-w-")) == 20
    finally:
        proc.stop()


def test_tensors_of_every_kind_read_through_the_lane(server):
    values = [torch.tensor(3.5), torch.arange(5, dtype=torch.float64), torch.ones(3, 7, dtype=torch.int16),
              torch.tensor([True, False, True]), torch.randn(4, 3, dtype=torch.complex64), torch.randn(2, 3).t(),
              torch.ones(3, dtype=torch.bfloat16), torch.empty(0, 3), torch.arange(5, dtype=torch.uint8)]
    with tensorshare.Client("127.0.0.1", server.port) as c:
        c.ping()
        tracked = _counting_tracks(c)
        for value in values:
            c.put("x-kinds", value)
            for _ in range(3):  # the first read learns the description; the next ones copy at once
                got = c.peek("x-kinds")[0]
                assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
                got.zero_()  # each read's tensor is its own memory
        assert tracked == ["PUT", "PUT"]  # (bfloat16, with no numpy twin, and an empty tensor: the general encoder)


def test_a_read_of_one_item_is_read_with_its_template_and_others_decoded(server, monkeypatch):
    from tensorshare._client import express

    decoded: list = []
    whole = express.whole_frames
    monkeypatch.setattr(express, "whole_frames", lambda data, limits: decoded.append(1) or whole(data, limits))
    with tensorshare.Client("127.0.0.1", server.port) as c:
        c.ping()
        tracked = _counting_tracks(c)
        value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        c.put("x-one", value)
        for _ in range(2):  # the description decoded the first time, found decoded the next
            assert torch.equal(c.peek("x-one")[0], value)
        assert decoded == []  # a put's reply and a one-item read's: each read with its template
        c.append("x-one", torch.ones(2))
        assert [v.shape for v in c.peek("x-one")] == [(2, 3), (2,)]  # two items: decoded as a map
        assert decoded == [1]
        assert torch.equal(c.get("x-one", max_items=1)[0], value)  # a take of one item: the template's again
        assert decoded == [1] and tracked == []


def test_a_bins_usual_calls_go_out_from_prepared_heads(server, monkeypatch):
    from tensorshare._client import express

    made: list = []
    prepared = express.bin_request
    monkeypatch.setattr(express, "bin_request", lambda *args: made.append(args[1].verb) or prepared(*args))
    with tensorshare.Client("127.0.0.1", server.port) as c:
        c.ping()
        tracked = _counting_tracks(c)
        for turn in range(2):  # more bins than the server keeps known heads of: forgotten and learned again
            for i in range(270):
                name = f"x-head-{i}"
                assert c.put(name, torch.full((4,), float(i + turn))) == 1
                assert torch.equal(c.peek(name)[-1], torch.full((4,), float(i + turn)))
        assert c.append("x-head-0", torch.ones(2, dtype=torch.int64)) == 2
        assert [v.dtype for v in c.get("x-head-0")] == [torch.float32, torch.int64]
        assert tracked == [] and made == ["PUT", "PEEK"] * 540 + ["APPEND", "GET"]
        for name in ("x-bad\x01", "n" * 257):  # refused before anything is sent, as the general path refuses
            with pytest.raises(UsageError):
                c.put(name, torch.ones(2))
            with pytest.raises(UsageError):
                c.peek(name)
        assert c.peek("x-head-1")[-1][0] == 2.0 and tracked == []


def test_calls_the_lane_does_not_take_go_out_from_prepared_heads_too(server, monkeypatch):
    from tensorshare._client import connection
    from tensorshare.protocol.messages import PEEK, PUT, Key

    made: list = []
    prepared = connection.bin_request  # (request_frame's: the lane calls its own import)
    monkeypatch.setattr(connection, "bin_request", lambda *args: made.append(args[1].verb) or prepared(*args))
    with tensorshare.Client("127.0.0.1", server.port) as c:
        c.ping()
        tracked = _counting_tracks(c)
        for i in range(3):  # (then=: the general path)
            assert c._call(PUT, {Key.BIN: "x-general"}, torch.full((4,), float(i)),
                           then=lambda reply: reply.result) == 1
            assert c._call(PEEK, {Key.BIN: "x-general"}, then=lambda reply: reply.values[-1][0].item()) == i
        assert tracked == made == ["PUT", "PEEK"] * 3
        c._call(PUT, {Key.BIN: "x-general", Key.TAG: 4}, torch.ones(2), then=lambda reply: None)
        assert made == ["PUT", "PEEK"] * 3 + ["PUT"]  # (a tag too: its head once it comes again, test_request_heads)
        for name in ("x-bad\x01", "n" * 257):  # refused before anything is sent
            with pytest.raises(UsageError):
                c._call(PEEK, {Key.BIN: name}, then=lambda reply: None)
        assert len(tracked) == 7
