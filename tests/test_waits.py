"""Requests that wait in the server (server/protocol/waits.py): the registry alone,
then APPEND ``below`` and GET ``max`` through real sessions paired in memory, then
against a server process."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from twisted.internet.task import Clock

import tensorshare
from pairing import Pair
from serverproc import ServerProcess
from tensorshare.errors import BusyError, TimeoutError, UsageError
from tensorshare.protocol.messages import APPEND, GET, LIST, NOOP, PUT, Key
from tensorshare_server.protocol.waits import Waits

# ---------------------------------------------------------------- the registry


class Gate:
    """A readiness test a test opens by hand; records what ran."""

    def __init__(self, log: list, name: str, is_open: bool = False):
        self.log, self.name, self.open = log, name, is_open
        self.broken = False

    def ready(self) -> bool:
        if self.broken:
            raise ZeroDivisionError("a bug in the test")
        return self.open

    def go(self) -> None:
        self.log.append(("go", self.name))

    def expire(self) -> None:
        self.log.append(("expired", self.name))


KEY = ("b", "room")  # (bin, lane)


def _park(waits: Waits, gate: Gate, timeout: float = 10.0, key: tuple = KEY):
    return waits.park(key, gate.ready, gate.go, timeout, gate.expire)


def test_a_ready_request_goes_at_once_and_counts_as_going_until_settled():
    waits, log = Waits(Clock()), []
    assert _park(waits, Gate(log, "a", True)) is None
    assert log == [("go", "a")] and waits.going(KEY) == 1
    waits.settled(KEY)
    assert waits.going(KEY) == 0


def test_parked_requests_go_in_order_on_the_turn_after_a_change():
    clock, log = Clock(), []
    waits = Waits(clock)
    first, second = Gate(log, "first"), Gate(log, "second")
    _park(waits, first)
    _park(waits, second)
    second.open = True
    waits.changed("b")
    clock.advance(0)
    assert log == []  # the second waits behind the first, which is not ready
    first.open = True
    waits.changed("b")
    assert log == []  # not inside the handler of whatever changed the bin
    clock.advance(0)
    assert log == [("go", "first"), ("go", "second")]
    assert waits.waiting(KEY) == 0


def test_a_ready_request_does_not_overtake_parked_ones():
    clock, log = Clock(), []
    waits = Waits(clock)
    _park(waits, Gate(log, "parked"))
    assert _park(waits, Gate(log, "late", True)) is not None  # parked behind, though ready
    assert log == []


def test_expiry_and_cancel_let_the_next_one_go():
    clock, log = Clock(), []
    waits = Waits(clock)
    slow, cancelled, ready = Gate(log, "slow"), Gate(log, "cancelled"), Gate(log, "ready", True)
    _park(waits, slow, timeout=1.0)
    handle = _park(waits, cancelled, timeout=5.0)
    _park(waits, ready, timeout=5.0)
    clock.advance(1.0)
    assert log == [("expired", "slow")]
    waits.cancel(handle)
    clock.advance(0)
    assert log == [("expired", "slow"), ("go", "ready")]
    clock.advance(10)
    assert ("expired", "cancelled") not in log and clock.getDelayedCalls() == []


def test_a_zero_timeout_refuses_at_once():
    waits, log = Waits(Clock()), []
    assert _park(waits, Gate(log, "now"), timeout=0) is None
    assert log == [("expired", "now")]


def test_a_failing_test_refuses_that_request_only():
    clock, log = Clock(), []
    waits = Waits(clock)
    broken = Gate(log, "broken")
    _park(waits, broken)
    after = Gate(log, "after")
    _park(waits, after)
    broken.broken = True
    after.open = True
    waits.changed("b")
    clock.advance(0)
    assert log == [("expired", "broken"), ("go", "after")]


# ---------------------------------------------------------------- sessions in memory


def _two_sessions():
    a = Pair()
    b = Pair(state=a.state)
    return a, b


def _replies(pair: Pair, rid: int) -> list[dict]:
    return [f.header for f in pair.receive() if f.header.get("id") == rid]


def test_an_append_below_waits_for_a_take_on_another_connection():
    worker, trainer = _two_sessions()
    for i in range(2):
        worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([i]))
    rid = worker.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 2, Key.WAIT: 5.0}, torch.tensor([2]))
    noop = worker.send_request(NOOP)
    assert worker.receive() == []  # parked, and the NOOP behind it waits
    assert [t.item() for t in trainer.call(GET, {Key.BIN: "r", Key.MAX: 1}).result] == [0]
    worker.clock.advance(0)
    replies = [f.header for f in worker.receive()]
    assert [(h["id"], h["code"]) for h in replies] == [(rid, 250), (noop, 200)]  # in request order
    assert replies[0]["n"] == 2
    assert [t.item() for t in trainer.call(GET, {Key.BIN: "r"}).result] == [1, 2]


def test_notifications_reach_a_connection_while_its_append_waits():
    from tensorshare.protocol.messages import LISTEN

    worker, trainer = _two_sessions()
    worker.call(LISTEN, {Key.BIN: "params"})
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    rid = worker.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 5.0}, torch.tensor([1]))
    trainer.call(PUT, {Key.BIN: "params", Key.TAG: 7}, torch.zeros(2))
    [note] = [f.header for f in worker.receive()]
    assert note["code"] == 151 and note["bin"] == "params" and note["tag"] == 7
    trainer.call(GET, {Key.BIN: "r"})
    worker.clock.advance(0)
    assert [h["code"] for h in _replies(worker, rid)] == [250]


def test_an_append_below_expires_with_450_and_stores_nothing():
    worker, trainer = _two_sessions()
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    rid = worker.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 2.0}, torch.tensor([1]))
    worker.clock.advance(1.9)
    assert worker.receive() == []
    worker.clock.advance(0.2)
    [reply] = _replies(worker, rid)
    assert reply["code"] == 450 and "after waiting 2s" in reply["msg"]
    assert trainer.call(LIST).result == {"r": 1}


def test_an_append_below_with_room_is_stored_at_once_and_without_wait_is_refused_at_once():
    worker, _ = _two_sessions()
    assert worker.call(APPEND, {Key.BIN: "r", Key.BELOW: 1}, torch.tensor([0])).result == 1
    with pytest.raises(BusyError):  # no wait asked: full is a refusal
        worker.call(APPEND, {Key.BIN: "r", Key.BELOW: 1}, torch.tensor([1]))


def test_parked_appends_of_several_connections_fill_the_room_in_arrival_order():
    trainer = Pair()
    workers = [Pair(state=trainer.state) for _ in range(3)]
    trainer.call(PUT, {Key.BIN: "r"}, torch.tensor([-1]))
    rids = [w.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 10.0}, torch.tensor([i]))
            for i, w in enumerate(workers)]
    seen = []
    for _ in range(4):
        seen += [t.item() for t in trainer.call(GET, {Key.BIN: "r"}).result]
        trainer.clock.advance(0)
        for w, rid in zip(workers, rids):
            for h in _replies(w, rid):
                assert h["code"] == 250 and h["n"] == 1  # never more than below - 1 before it
    assert seen == [-1, 0, 1, 2]


def test_a_connection_that_closes_while_parked_stores_nothing():
    worker, trainer = _two_sessions()
    worker.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    worker.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 10.0}, torch.tensor([1]))
    worker.session.connection_lost()
    assert [t.item() for t in trainer.call(GET, {Key.BIN: "r"}).result] == [0]
    trainer.clock.advance(20)
    assert trainer.call(LIST).result == {"r": 0}
    assert trainer.state.waits.waiting(("r", "room")) == 0


def test_a_durable_append_being_written_counts_against_below(tmp_path):
    from pairing import HeldJobs
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state

    jobs = HeldJobs()
    state = build_state(ServerConfig(data_dir=str(tmp_path / "data")), jobs, clock=Clock())
    jobs.release()
    one, two = Pair(state=state), Pair(state=state)
    first = one.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 5.0}, torch.tensor([1]))
    second = two.send_request(APPEND, {Key.BIN: "r", Key.BELOW: 1, Key.WAIT: 5.0}, torch.tensor([2]))
    state.waits.clock.advance(0)
    assert state.waits.going(("r", "room")) == 1 and state.waits.waiting(("r", "room")) == 1  # one is being written
    jobs.release()
    state.waits.clock.advance(0)
    assert [h["code"] for h in _replies(one, first)] == [250]
    assert _replies(two, second) == []  # the bin holds one now
    state.waits.clock.advance(5)
    assert [h["code"] for h in _replies(two, second)] == [450]


def test_get_max_takes_the_first_items_and_leaves_the_rest(tmp_path):
    pair = Pair(data_dir=str(tmp_path / "data"))
    for i in range(5):
        pair.call(APPEND, {Key.BIN: "r"}, torch.tensor([i]))
    assert [t.item() for t in pair.call(GET, {Key.BIN: "r", Key.MAX: 2}).result] == [0, 1]
    assert [t.item() for t in pair.call(GET, {Key.BIN: "r", Key.MAX: 10}).result] == [2, 3, 4]
    for i in range(5, 8):
        pair.call(APPEND, {Key.BIN: "r"}, torch.tensor([i]))
    assert [t.item() for t in pair.call(GET, {Key.BIN: "r", Key.MAX: 1}).result] == [5]
    pair.close()
    again = Pair(data_dir=str(tmp_path / "data"))  # the floor on disk moved past the taken ones only
    assert [t.item() for t in again.call(GET, {Key.BIN: "r"}).result] == [6, 7]
    again.close()


@pytest.mark.parametrize("fields", [{Key.MAX: 0}, {Key.MAX: -1}, {Key.MAX: 1.5}])
def test_get_max_must_be_a_positive_integer(fields):
    from tensorshare.errors import BadRequestError

    pair = Pair()
    pair.call(APPEND, {Key.BIN: "r"}, torch.tensor([0]))
    with pytest.raises((BadRequestError, UsageError)):
        pair.call(GET, {Key.BIN: "r", **fields})


# ---------------------------------------------------------------- against a server process


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    yield proc
    proc.stop()


def test_backpressure_end_to_end(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=10) as producer, \
            tensorshare.Client("127.0.0.1", server.port, timeout=10) as consumer:
        producer.delete("bp") if "bp" in producer.list() else None
        for i in range(3):
            producer.append("bp", torch.tensor([i]), below=3)
        with pytest.raises(TimeoutError):  # BusyError is one
            producer.append("bp", torch.tensor([99]), below=3, timeout=0.3)
        stored = []

        def produce():
            for i in range(3, 10):
                stored.append(producer.append("bp", torch.tensor([i]), below=3))

        thread = threading.Thread(target=produce)
        thread.start()
        taken = []
        deadline = time.monotonic() + 20
        while len(taken) < 10 and time.monotonic() < deadline:
            taken += [t.item() for t in consumer.get("bp", max_items=2)]
            time.sleep(0.01)
        thread.join(10)
        assert taken == list(range(10))
        assert max(stored) <= 3
