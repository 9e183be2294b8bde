"""The storage tells of every change it makes, through the sink it was built with.

Handlers used to publish the changes the storage returned (eight sites) and wake
waiting requests by hand (four): a new write path that forgot it left listeners and
waiting requests unaware, without a word.  Here each kind of change is made
through the storage alone, and the sink must have heard of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensorshare.wire.codec import encode
from tensorshare.wire.description import DEFAULT_LIMITS
from tensorshare_server.bins.durable import DataDir
from tensorshare_server.bins.jobs import InlineJobs
from tensorshare_server.bins.storage import Storage
from tensorshare_server.bins.store import BinStore
from tensorshare_server.config import ServerConfig
from tensorshare_server.protocol.notify import ListenerRegistry
from tensorshare_server.root import ServerState, build_state


class Heard:
    """A sink that writes down what it is told."""

    def __init__(self):
        self.told: list[tuple] = []

    def publish(self, change) -> None:
        self.told.append((change.op, change.bin, change.n_items))

    def touched(self, name: str) -> None:
        self.told.append(("touched", name))


def _value(x: float = 1.0) -> tuple:
    enc = encode([x] * 4)
    return enc.description, (enc.payload_bytes(),), enc.nbytes, None


def _done(out: list):
    return lambda change, error: out.append((change, error))


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "data-dir"])
def test_every_change_to_a_bin_is_told(tmp_path, durable):
    heard = Heard()
    data_dir = DataDir(str(tmp_path / "data")) if durable else None
    storage = Storage(BinStore(), InlineJobs(), data_dir=data_dir, sink=heard)
    out = []
    storage.add("b", *_value(), True, _done(out))
    storage.add("b", *_value(2.0), False, _done(out))
    assert [error for _, error in out] == [None, None]
    items, change = storage.take("b", 1)
    storage.restore("b", items)
    storage.delete("b", _done(out))
    assert out[-1][1] is None
    assert heard.told == [("PUT", "b", 1), ("APPEND", "b", 2), ("GET", "b", 1), ("RESTORE", "b", 2),
                          ("DELETE", "b", 0)]
    storage.close()


def test_memory_writes_mirrors_and_device_references_are_told():
    heard = Heard()
    storage = Storage(BinStore(), InlineJobs(), sink=heard)
    storage.add_now("e", *_value(), True)
    storage.mirror("m", [_value()], "PUT")
    assert storage.unmirror("m").op == "DELETE"
    assert storage.unmirror("m") is None  # nothing to drop: nothing told
    description, segments, nbytes, tag = _value()
    item, _ = storage.add_reference("d", description, nbytes, tag, {"dev": "GPU-0"}, 64)
    storage.fill("d", item, segments)  # its bytes came: reads waiting for them are tested
    other, _ = storage.add_reference("lost", description, nbytes, tag, {"dev": "GPU-0"}, 64)
    storage.lose_reference("lost", other)  # its publisher left: reads waiting for it are answered
    assert heard.told == [("PUT", "e", 1), ("PUT", "m", 1), ("DELETE", "m", 0), ("PUT", "d", 1), ("touched", "d"),
                          ("PUT", "lost", 1), ("touched", "lost")]


def test_every_change_to_a_table_is_told():
    heard = Heard()
    storage = Storage(BinStore(), InlineJobs(), sink=heard)
    out = []
    storage.create_table("t", {"capacity": 4, "max_times_sampled": 1}, _done(out))
    assert out[-1][1] is None
    table = storage.table("t")
    description, segments, nbytes, _ = _value()
    storage.insert_rows(table, storage.table_rows(table, description, segments, nbytes, DEFAULT_LIMITS), None)
    storage.insert_rows(table, storage.table_rows(table, description, segments, nbytes, DEFAULT_LIMITS), None)
    storage.set_table_limits(table, {})  # the rate limiter may let waiting requests through now
    storage.write_rows(table, np.array([0], dtype=np.int64),
                       storage.table_rows(table, description, segments, nbytes, DEFAULT_LIMITS), None)
    storage.sample_rows(table, 1)  # sampled once: max_times_sampled removes it
    storage.delete("t", _done(out))
    ops = [entry[0] for entry in heard.told]
    assert ops == ["CREATE", "INSERT", "INSERT", "touched", "WRITE", "SAMPLE", "DELETE"], heard.told


def test_a_server_state_and_its_storage_share_one_listener_registry():
    """The storage's sink is the registry the sessions listen through; a state built
    around a storage that tells another sink is refused, not left deaf."""
    state = build_state(ServerConfig(zero_copy=False))
    assert state.storage.sink is state.listeners
    listeners = ListenerRegistry()
    assert ServerState(ServerConfig(), Storage(BinStore(), InlineJobs(), sink=listeners)).listeners is listeners
    with pytest.raises(ValueError, match="sink"):
        ServerState(ServerConfig(), Storage(BinStore(), InlineJobs()), ListenerRegistry())
