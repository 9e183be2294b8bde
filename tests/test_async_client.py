"""The Deferred client, in this process: connected through Twisted's in-memory
transports (``iosim``) to the real server protocol, time driven by a Clock
(tests/pairing.py).  TLS and real endpoints: tests/async_procs.py."""

from __future__ import annotations

import os

import pytest
import torch
from twisted.internet import defer

from pairing import async_pair, result_of
from tensorshare.errors import BusyError, ConnectionLostError, NoSuchBinError, TimeoutError


@pytest.fixture
def paired():
    client, pump, clock, state = async_pair()
    yield client, pump, clock, state
    client.close()
    pump.flush()
    state.storage.close()


def test_every_verb_pipelined_and_listened_to(paired):
    client, pump, clock, state = paired
    seen = []
    handle = result_of(client.listen("a-bin", seen.append), pump)
    assert handle.snapshot.n_items == 0 and not handle.snapshot.exists
    counts = result_of(defer.gatherResults([client.append("a-bin", torch.full((3,), float(i)))
                                            for i in range(200)]), pump)
    assert sorted(counts) == list(range(1, 201))
    items = result_of(client.peek("a-bin"), pump)
    assert [int(t[0]) for t in items] == list(range(200))
    result_of(client.put("a-bin", {"x": torch.arange(4)}, tag=9), pump)
    [item], seq = result_of(client.get("a-bin", with_seq=True), pump)
    assert torch.equal(item["x"], torch.arange(4)) and seq > 0
    assert result_of(client.list(), pump) == {"a-bin": 0}
    with pytest.raises(NoSuchBinError):
        result_of(client.peek("a-missing"), pump)
    result_of(handle.stop(), pump)
    result_of(client.delete("a-bin"), pump)
    assert [n.op for n in seen] == ["APPEND"] * 200 + ["PUT", "GET"]
    assert seen[-2].tag == 9 and seen[-1].seq == seq
    assert result_of(client.ping(), pump) >= 0


def test_calls_to_a_server_that_never_answers_time_out(paired):
    client, pump, clock, state = paired
    outcomes = []
    for _ in range(3):
        client.ping(timeout=0.3).addBoth(outcomes.append)  # not pumped: the server never sees them
    clock.advance(0.2)
    assert outcomes == []
    clock.advance(0.2)
    assert len(outcomes) == 3 and all(o.check(TimeoutError) for o in outcomes)


def test_keepalive_drops_a_silent_server_and_the_client_reconnects():
    client, pump, clock, state = async_pair(client_options={"keepalive": 0.3, "timeout": None})
    try:
        silent = pump.pumps[0].server
        silent.dataReceived = lambda data: None  # the server reads nothing and answers nothing
        pending = []
        client.ping().addBoth(pending.append)
        first = client.router.home.wire
        for _ in range(10):
            clock.advance(0.2)
            pump.flush()
        assert len(pending) == 1 and pending[0].check(ConnectionLostError)
        clock.advance(2.0)  # the backoff's first delay is at most 0.05 s
        pump.flush()
        assert client.router.home.wire is not None and client.router.home.wire is not first
        assert result_of(client.put("after", 1), pump) == 1
    finally:
        client.close()
        state.storage.close()


def test_a_request_held_by_the_server_outlasts_the_keepalive():
    """The keepalive probe queues behind an APPEND the server holds: the silence
    meanwhile is no sign of a dead server."""
    client, pump, clock, state = async_pair(client_options={"keepalive": 0.3, "timeout": 10.0})
    try:
        result_of(client.append("held", 1), pump)
        first = client.router.home.wire
        outcome = []
        client.append("held", 2, below=1, timeout=2.0).addBoth(outcome.append)
        for _ in range(15):  # 3 s: five keepalive periods, and past the wait
            clock.advance(0.2)
            pump.flush()
        assert len(outcome) == 1 and outcome[0].check(BusyError)  # the server's answer, not a dropped connection
        assert client.router.home.wire is first
        assert result_of(client.peek("held"), pump) == [1]
    finally:
        client.close()
        state.storage.close()


def test_a_lost_connection_fails_calls_at_once_then_listens_again(paired):
    client, pump, clock, state = paired
    seen = []
    result_of(client.listen("r", seen.append), pump)
    result_of(client.put("r", 1), pump)
    pending = []
    client.ping().addBoth(pending.append)
    client.router.home.wire.transport.loseConnection()
    pump.flush()
    assert len(pending) == 1 and pending[0].check(ConnectionLostError)
    clock.advance(1.0)
    pump.flush()
    assert client.connected
    assert [n.op for n in seen] == ["PUT", "LISTEN"] and seen[-1].n_items == 1  # the state found on reconnecting
    result_of(client.append("r", 2), pump)
    assert [n.op for n in seen][-1] == "APPEND"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_large_values_go_through_shared_memory_on_the_servers_host(paired):
    client, pump, clock, state = paired
    assert client.same_host
    value = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: over TCP while nobody maps the bin
    assert result_of(client.put("zc", value), pump) == 1
    [back] = result_of(client.peek("zc"), pump)  # a same-host reader: copied to shared memory, mapped
    assert torch.equal(back, value)
    assert result_of(client.put("zc", value), pump) == 1  # the reply says readers map the bin...
    assert result_of(client.put("zc", value), pump) == 1  # ...so this one is written into shared memory
    [item] = state.store.peek("zc")
    assert item.files is not None and item.files.in_memory  # adopted: no bytes crossed the transport
    [back] = result_of(client.peek("zc"), pump)
    assert torch.equal(back, value)
    assert result_of(client.peek("zc"), pump)[0].data_ptr() != back.data_ptr()


def test_large_inserts_into_a_table_in_files_go_through_shared_memory_once_the_server_says_so(tmp_path):
    client, pump, _clock, state = async_pair(memory_limit=1 << 20, spill_dir=str(tmp_path))
    try:
        n = 1 << 12  # 1 MiB of rows of 256 B: above the bar
        columns = {"x": ((), torch.int64), "y": ((62,), torch.float32)}
        result_of(client.create_table("t", 2 * n, columns, remover="fifo"), pump)  # 2 MiB: in files

        def rows(first):
            x = torch.arange(first, first + n)
            return {"x": x, "y": x.view(n, 1).expand(n, 62).float().contiguous()}

        areas = client.router.home.areas
        result_of(client.insert("t", rows(0)), pump)  # over the socket; the reply says mapped
        assert "t" in areas.mapped and not os.listdir(areas.incoming)
        for first in (n, 2 * n, 3 * n):
            result_of(client.insert("t", rows(first)), pump)  # through the same kept directory
            assert len(os.listdir(areas.incoming)) == 1
        slots = torch.arange(0, 2 * n, 97)  # (a read within the 1 MiB budget)
        got = result_of(client.read("t", slots), pump)
        assert torch.equal(got["x"], slots + 2 * n)
        assert torch.equal(got["y"], (slots + 2 * n).view(-1, 1).expand(-1, 62).float())
    finally:
        client.close()
        pump.flush()
        state.storage.close()


def test_a_table_checkpoint_loads_through_the_async_client(paired, tmp_path):
    """``AsyncClient.load_table`` (it had none): a checkpoint written from one server by
    the blocking client is made again on another, each row at its slot, with its
    priority; ``list`` takes a glob."""
    from serverproc import ServerProcess

    import tensorshare

    rows = {"obs": torch.arange(12, dtype=torch.float32).reshape(6, 2)}
    server = ServerProcess()
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=30) as blocking:
            blocking.create_table("replay", 8, {"obs": ((2,), torch.float32)}, sampler="prioritized")
            blocking.insert("replay", rows, priorities=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            assert blocking.save("replay", tmp_path / "ckpt") == 6
            slots = blocking.table_info("replay", slots=0)["slots"]
    finally:
        server.stop()
    client, pump, clock, state = paired
    assert result_of(client.load_table(tmp_path / "ckpt", "replay-copy"), pump) == 6
    info = result_of(client.table_info("replay-copy", slots=0), pump)
    assert info["size"] == 6 and info["sampler"] == "prioritized"
    assert torch.equal(info["slots"]["indices"], slots["indices"])
    assert torch.equal(info["slots"]["priorities"], slots["priorities"])
    read = result_of(client.read("replay-copy", slots["indices"]), pump)
    assert torch.equal(read["obs"], rows["obs"])
    result_of(client.put("other", 1), pump)
    assert result_of(client.list("replay*"), pump) == {"replay-copy": 6}


def test_a_large_frame_is_copied_once_and_written_by_itself():
    """A real transport takes bytes only: a large value is copied once (its snapshot), at
    the call, and written alone, so Twisted's buffer never joins it with other frames."""
    import tracemalloc

    import numpy as np
    from twisted.internet.task import Clock

    from tensorshare.drivers.twisted import LARGE_FRAME, Options, Wire
    from tensorshare.protocol.engine import Engine
    from wiretools import StrictTransport

    clock = Clock()
    wire = Wire(Options(clock, "127.0.0.1"), 1, Engine())
    transport = StrictTransport(buffer_size=64 << 10)
    wire.makeConnection(transport)
    payload = np.arange(4 * LARGE_FRAME, dtype=np.uint8)
    small = [b"small-before"], [b"small-after"]
    tracemalloc.start()
    try:
        wire.send(small[0])
        wire.send([b"large-head", memoryview(payload)])
        payload[:] = 7  # changed after the call: the snapshot went
        wire.send(small[1])
        clock.advance(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < payload.nbytes * 1.25  # one copy (two before: bytes() of the part, then a join)
    assert [len(b) for b in transport.buffered] == [len(b"small-before") + len(b"large-head") + payload.nbytes]
    transport.drain()  # the transport took it: what queued behind it goes now
    assert transport.buffered == [b"small-after"]
    transport.drain()
    expected = b"small-before" + b"large-head" + np.arange(4 * LARGE_FRAME, dtype=np.uint8).tobytes() + b"small-after"
    assert bytes(transport.delivered) == expected


def test_repeated_requests_go_out_from_prepared_heads_the_server_knows(paired, monkeypatch):
    """A loop's puts and peeks of a bin are the same bytes but for the id
    (tensorshare/wire/heads.py): the server serves all but the first of each from
    the head it learned; a bad name is still refused before anything is sent."""
    from tensorshare.errors import UsageError
    from tensorshare.wire.heads import KnownHeads
    from tensorshare_server.protocol.known import KnownRequests

    client, pump, clock, state = paired
    read, served = KnownRequests.read, []

    def counting(self, data, pos=0):
        found = read(self, data, pos)
        if found is not None:
            served.append(found[1].command.verb)
        return found

    look, hits = KnownHeads.read, []

    def looking(self, data, pos=0):  # the lookup alone: a hit is a request not decoded again
        found = look(self, data, pos)
        if found is not None:
            hits.append(found[0][0][0].verb)
        return found

    monkeypatch.setattr(KnownRequests, "read", counting)
    monkeypatch.setattr(KnownHeads, "read", looking)
    for i in range(5):
        assert result_of(client.put("a-loop", torch.full((4,), float(i))), pump) == 1
        assert torch.equal(result_of(client.peek("a-loop"), pump)[-1], torch.full((4,), float(i)))
    assert result_of(client.append("a-loop", torch.ones(4)), pump) == 2
    assert sorted(served) == ["APPEND"] + ["PEEK"] * 5 + ["PUT"] * 5
    assert sorted(hits) == ["PEEK"] * 4 + ["PUT"] * 4  # (each learned the first time, then known)
    result_of(client.put("a-loop", torch.ones(2), tag=3), pump)  # (a request with a tag: the general layout)
    assert len(served) == 11
    for name in ("a-bad\x01", "n" * 257):
        with pytest.raises(UsageError):
            result_of(client.put(name, torch.ones(2)), pump)
        with pytest.raises(UsageError):
            result_of(client.peek(name), pump)
    assert len(served) == 11
