"""The callback client (``TensorShare``) against a real server: each call's reply dict
as the original shaped it, errors in its terms, and a long pipeline of appends whose
callbacks all come, in order."""

from __future__ import annotations

import queue

import pytest
import torch

from serverproc import ServerProcess
from tensorshare import TensorShare

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def ts():
    srv = ServerProcess()
    client = TensorShare("127.0.0.1", srv.port, timeout=10)
    try:
        yield client
    finally:
        client.stop()
        srv.stop()


def _reply(call, *args) -> dict:
    heard: queue.Queue = queue.Queue()
    call(*args, heard.put)
    return heard.get(timeout=15)


def test_replies_are_the_originals_dicts(ts):
    assert _reply(ts.put, "compat-a", torch.ones(2)) == {"status": "OK"}
    assert _reply(ts.append, "compat-a", torch.zeros(3)) == {"status": "OK"}
    peeked = _reply(ts.peek, "compat-a")
    assert peeked["status"] == "OK" and [t.tolist() for t in peeked["data"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert _reply(ts.list)["data"]["compat-a"] == 2
    got = _reply(ts.get, "compat-a")
    assert got["status"] == "OK" and len(got["data"]) == 2
    ts.put("compat-b", torch.arange(4))  # no callback: nothing to call, nothing raised
    assert _reply(ts.get, "compat-b")["data"].tolist() == [0, 1, 2, 3]  # one item: itself, not a list


def test_errors_come_as_err_with_a_message(ts):
    missing = _reply(ts.get, "compat-never-put")
    assert missing["status"] == "ERR" and missing["msg"]
    ts.put("compat-c", torch.ones(1))
    assert _reply(ts.get, "compat-c")["status"] == "OK"
    emptied = _reply(ts.peek, "compat-c")  # taken: the bin is empty now
    assert emptied == {"status": "ERR", "msg": emptied["msg"]} and emptied["msg"]
    assert _reply(ts.delete, "compat-never-put") == {"status": "OK"}  # a missing bin too, as the original
    assert "compat-never-put" not in _reply(ts.list)["data"]


def test_a_pipeline_of_appends_calls_back_each_once_in_order(ts):
    count, heard = 3000, queue.Queue()
    for i in range(count):
        ts.append("compat-pipe", torch.full((4,), float(i)), lambda reply, i=i: heard.put((i, reply)))
    got = [heard.get(timeout=30) for _ in range(count)]
    assert [i for i, _ in got] == list(range(count)) and all(r == {"status": "OK"} for _, r in got)
    assert heard.empty()
    items = ts.client.peek("compat-pipe")
    assert [int(t[0]) for t in items] == list(range(count))
