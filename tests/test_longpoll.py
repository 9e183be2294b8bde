"""Reads that wait in the server (server/protocol/longpoll.py): GET ``wait``/``least``
and PEEK ``since``/``wait``, through real sessions paired in memory, then the
client methods against a server process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorshare
from pairing import Pair
from tensorshare.errors import NoSuchBinError, UsageError
from tensorshare.protocol.messages import APPEND, DELETE, GET, LIST, NOOP, PEEK, PUT, Key
from tensorshare_server.protocol.waits import Waits
from twisted.internet.task import Clock


def _two_sessions():
    a = Pair()
    return a, Pair(state=a.state)


def _replies(pair: Pair, rid: int) -> list:
    return [f for f in pair.receive() if f.header.get("id") == rid]


def _values(frame) -> list:
    from tensorshare._client.connection import read_reply

    return [t.item() for t in read_reply(GET, frame).result]


# ---------------------------------------------------------------- GET wait / least


def test_a_get_that_waits_is_answered_by_the_append_that_fills_it():
    trainer, worker = _two_sessions()
    rid = trainer.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0, Key.LEAST: 2})
    noop = trainer.send_request(NOOP)
    assert trainer.receive() == []  # held (the bin does not even exist yet), the NOOP behind it
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    trainer.clock.advance(0)
    assert trainer.receive() == []  # one item: fewer than least
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([1]))
    trainer.clock.advance(0)
    frames = trainer.receive()
    assert [(f.header["id"], f.header["code"]) for f in frames] == [(rid, 226), (noop, 200)]
    assert _values(frames[0]) == [0, 1]
    assert worker.call(LIST).result == {"r": 0}  # taken


def test_a_get_with_enough_items_is_answered_at_once_and_takes_at_most_max():
    trainer, worker = _two_sessions()
    for i in range(3):
        worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([i]))
    assert [t.item() for t in trainer.call(GET, {Key.BIN: "r", Key.WAIT: 5.0, Key.LEAST: 2, Key.MAX: 2}).result] \
        == [0, 1]
    assert worker.call(LIST).result == {"r": 1}


def test_a_get_whose_wait_runs_out_takes_what_there_is():
    trainer, worker = _two_sessions()
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([7]))
    rid = trainer.send_request(GET, {Key.BIN: "r", Key.WAIT: 2.0, Key.LEAST: 3})
    trainer.clock.advance(1.9)
    assert trainer.receive() == []
    trainer.clock.advance(0.2)
    [frame] = _replies(trainer, rid)
    assert frame.header["code"] == 226 and _values(frame) == [7]
    assert trainer.state.waits.waiting(("r", "take")) == 0


def test_a_get_that_waits_on_a_bin_that_never_comes_gets_550():
    trainer, _ = _two_sessions()
    rid = trainer.send_request(GET, {Key.BIN: "nothing", Key.WAIT: 1.0})
    trainer.clock.advance(1.1)
    [frame] = _replies(trainer, rid)
    assert frame.header["code"] == 550


def test_waiting_gets_are_served_in_arrival_order_and_never_hold_back_appends_below():
    first = Pair()
    second, worker = Pair(state=first.state), Pair(state=first.state)
    a = first.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0})
    b = second.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0})
    # An APPEND with below is not parked behind the waiting takes: it has room.
    assert worker.call(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 5.0}, torch.tensor([0])).result == 1
    first.clock.advance(0)
    [got_a] = _replies(first, a)
    assert _values(got_a) == [0] and _replies(second, b) == []
    worker.call(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 5.0}, torch.tensor([1]))
    first.clock.advance(0)
    [got_b] = _replies(second, b)
    assert _values(got_b) == [1]


def test_a_waiting_get_and_a_waiting_append_below_meet():
    """A consumer that waits for 2 and a producer capped at 2 never deadlock."""
    trainer, worker = _two_sessions()
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([1]))
    parked = worker.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 2, Key.WAIT: 5.0}, torch.tensor([2]))
    got = trainer.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0, Key.LEAST: 2, Key.MAX: 2})
    assert _values(_replies(trainer, got)[0]) == [0, 1]
    trainer.clock.advance(0)
    assert [f.header["code"] for f in _replies(worker, parked)] == [250]
    got = trainer.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0, Key.LEAST: 2})
    worker.call(APPEND, {Key.BIN: "r", Key.BELOW: 2, Key.WAIT: 5.0}, torch.tensor([3]))
    trainer.clock.advance(0)
    assert _values(_replies(trainer, got)[0]) == [2, 3]


def test_a_connection_that_closes_while_its_get_waits_takes_nothing():
    trainer, worker = _two_sessions()
    trainer.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0})
    trainer.session.connection_lost()
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    worker.clock.advance(0)
    assert worker.call(LIST).result == {"r": 1}
    assert worker.state.waits.waiting(("r", "take")) == 0


@pytest.mark.parametrize("fields", [{Key.LEAST: 0}, {Key.LEAST: "2"}, {Key.WAIT: -1}, {Key.LEAST: 3, Key.MAX: 2}])
def test_bad_wait_fields_are_refused_with_501(fields):
    pair = Pair()
    rid = pair.send_request(GET, {Key.BIN: "r", Key.WAIT: 1.0, **fields})
    [frame] = _replies(pair, rid)
    assert frame.header["code"] == 501
    assert pair.call(NOOP).header["code"] == 200  # the connection goes on


# ---------------------------------------------------------------- PEEK since / wait


def test_a_peek_since_the_current_seq_waits_for_the_next_version():
    trainer, worker = _two_sessions()
    trainer.call(PUT, {Key.BIN: "params", Key.TAG: 1}, torch.tensor([1]))
    seq = worker.call(PEEK, {Key.BIN: "params"}).header[Key.SEQ]
    rid = worker.send_request(PEEK, {Key.BIN: "params", Key.SINCE: seq, Key.WAIT: 5.0})
    assert worker.receive() == []
    trainer.call(PUT, {Key.BIN: "params", Key.TAG: 2}, torch.tensor([2]))
    worker.clock.advance(0)
    [frame] = _replies(worker, rid)
    assert _values(frame) == [2] and frame.header[Key.SEQ] > seq


def test_a_peek_since_an_older_seq_is_answered_at_once():
    trainer, worker = _two_sessions()
    trainer.call(PUT, {Key.BIN: "params"}, torch.tensor([1]))
    trainer.call(PUT, {Key.BIN: "params"}, torch.tensor([2]))
    reply = worker.call(PEEK, {Key.BIN: "params", Key.SINCE: 1, Key.WAIT: 5.0})
    assert [t.item() for t in reply.result] == [2]


def test_a_peek_since_a_seq_the_bin_never_had_is_answered_at_once():
    """A reader whose seq came from before a restart is never held for a seq that
    may not come again: any seq but the bin's own means it moved on."""
    trainer, worker = _two_sessions()
    trainer.call(PUT, {Key.BIN: "p"}, torch.tensor([1]))
    seq = worker.call(PEEK, {Key.BIN: "p"}).header[Key.SEQ]
    reply = worker.call(PEEK, {Key.BIN: "p", Key.SINCE: seq + 1000, Key.WAIT: 5.0})
    assert [t.item() for t in reply.result] == [1]


def test_a_peek_whose_wait_runs_out_sends_nothing_new_and_a_delete_ends_the_wait():
    trainer, worker = _two_sessions()
    trainer.call(PUT, {Key.BIN: "p"}, torch.tensor([1]))
    seq = worker.call(PEEK, {Key.BIN: "p"}).header[Key.SEQ]
    rid = worker.send_request(PEEK, {Key.BIN: "p", Key.SINCE: seq, Key.WAIT: 1.0})
    worker.clock.advance(1.1)
    [frame] = _replies(worker, rid)  # still at seq: no items (an idle reader re-reads nothing)
    assert frame.header["code"] == 226 and frame.header[Key.ITEMS] == [] and frame.header[Key.SEQ] == seq
    assert frame.payload_len == 0
    reply = worker.call(PEEK, {Key.BIN: "p", Key.SINCE: seq})  # without wait: a conditional read
    assert reply.result == [] and reply.header[Key.SEQ] == seq
    rid = worker.send_request(PEEK, {Key.BIN: "p", Key.SINCE: seq, Key.WAIT: 5.0})
    trainer.call(DELETE, {Key.BIN: "p"})
    worker.clock.advance(0)
    assert [f.header["code"] for f in _replies(worker, rid)] == [550]


def test_notifications_reach_a_connection_while_its_peek_waits():
    from tensorshare.protocol.messages import LISTEN

    trainer, worker = _two_sessions()
    trainer.call(PUT, {Key.BIN: "params"}, torch.tensor([1]))
    worker.call(LISTEN, {Key.BIN: "control"})
    seq = worker.call(PEEK, {Key.BIN: "params"}).header[Key.SEQ]
    worker.send_request(PEEK, {Key.BIN: "params", Key.SINCE: seq, Key.WAIT: 5.0})
    trainer.call(PUT, {Key.BIN: "control"}, torch.tensor([0]))
    [note] = [f.header for f in worker.receive()]
    assert note["code"] == 151 and note["bin"] == "control"


# ---------------------------------------------------------------- the registry's lanes


def test_unordered_requests_hold_back_nobody_and_keep_their_place():
    clock, log = Clock(), []
    waits = Waits(clock)
    state = {"a": False, "b": False}
    for name in ("a", "b"):
        waits.park(("k", "peek"), lambda n=name: state[n], lambda n=name: log.append(n), 10.0, lambda: None, ordered=False)
    state["b"] = True
    waits.changed("k")
    clock.advance(0)
    assert log == ["b"] and waits.waiting(("k", "peek")) == 1
    state["a"] = True
    waits.changed("k")
    clock.advance(0)
    assert log == ["b", "a"] and waits.waiting(("k", "peek")) == 0


# ---------------------------------------------------------------- the clients, against a server process


def test_a_blocking_take_and_a_long_poll_end_to_end(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=10) as learner, \
            tensorshare.Client("127.0.0.1", server.port, timeout=10) as actor:
        start = time.monotonic()
        with pytest.raises(NoSuchBinError):  # waited, and it never came
            learner.get("lp-missing", wait=0.2)
        assert time.monotonic() - start >= 0.2

        def produce():
            time.sleep(0.1)
            for i in range(4):
                actor.append("lp-r", torch.tensor([i]))

        thread = threading.Thread(target=produce)
        thread.start()
        taken = [t.item() for t in learner.get("lp-r", wait=10, least=4)]
        thread.join(5)
        assert taken == [0, 1, 2, 3]

        actor.put("lp-p", torch.tensor([1]), tag=1)
        [value], seq = learner.peek("lp-p", with_seq=True)
        threading.Timer(0.1, lambda: actor.put("lp-p", torch.tensor([2]), tag=2)).start()
        start = time.monotonic()
        [value], later = learner.peek("lp-p", with_seq=True, since=seq, wait=10)
        assert value.item() == 2 and later > seq and time.monotonic() - start < 5
        # The wait may outlast the client's own timeout: the call waits for the server,
        # which sends nothing new when nothing changed.
        with tensorshare.Client("127.0.0.1", server.port, timeout=0.2) as short:
            assert short.peek("lp-p", since=later, wait=0.5, with_seq=True) == ([], later)


def test_wait_arguments_are_checked_before_sending(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=10) as client:
        with pytest.raises(UsageError):
            client.get("lp-x", wait=1.0, least=0)
        with pytest.raises(UsageError):
            client.peek("lp-x", since="3", wait=1.0)


def test_the_async_client_waits_in_the_server_too():
    from pairing import async_pair

    client, pump, clock, state = async_pair(client_options={"keepalive": 0.3})
    producer = Pair(state=state)
    results = []
    client.get("ar", wait=30, least=2).addBoth(results.append)
    for _ in range(5):  # longer than two keepalive periods: a held read is no dead server
        clock.advance(0.3)
        pump.flush()
    assert results == [] and client.connected
    producer.call(APPEND, {Key.BIN: "ar"}, torch.tensor([0]))
    producer.call(APPEND, {Key.BIN: "ar"}, torch.tensor([1]))
    clock.advance(0)
    pump.flush()
    assert [[t.item() for t in r] for r in results] == [[0, 1]]


def test_a_get_that_waited_then_reads_from_the_disk_answers_in_order(tmp_path):
    """One request answered later in two steps, as the session carries it out: it
    waits in its bin's take lane, goes when the item comes, then waits for the disk
    (the item only has its files: over a tiny memory budget); the connection's next
    request is answered after it, and its lane is told once it is answered."""
    from pairing import HeldJobs
    from tensorshare._client.connection import read_reply
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state

    jobs, clock = HeldJobs(), Clock()
    state = build_state(ServerConfig(data_dir=str(tmp_path / "data"), memory_limit=4096), jobs, clock=clock)
    jobs.release()
    reader, writer = Pair(state=state), Pair(state=state)
    taking = reader.send_request(GET, {Key.BIN: "r", Key.WAIT: 5.0})
    after = reader.send_request(NOOP)
    writer.send_request(APPEND, {Key.BIN: "r"}, torch.arange(16384))  # 128 KiB, over the budget
    jobs.release()  # written: stored, then only on disk
    assert [item.resident for item in state.store.items_of("r")] == [False]
    clock.advance(0)  # the GET goes on, and waits for the item's files to open
    assert reader.receive() == [] and state.waits.going(("r", "take")) == 1
    jobs.release()
    frames = reader.receive()
    assert [f.header["id"] for f in frames] == [taking, after]
    assert torch.equal(read_reply(GET, frames[0]).result[0], torch.arange(16384))
    assert state.waits.going(("r", "take")) == 0
    reader.close()
    writer.close()
