"""Issue #31, the third hardening round, where the protocol decides: the real client
protocol and real server sessions paired in memory (tests/pairing.py), no socket.

Each test failed on the code the issue was filed against; the findings and their
figures are in docs/reliability.md, "Third round".  The cases a process, a disk or
a signal decides are in tests/test_hardening_three.py.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from pairing import HeldJobs, Pair
from tensorshare._client.connection import request_frame
from tensorshare.protocol.engine import next_request_id
from tensorshare.errors import StorageFullError, TooLargeError
from tensorshare.protocol.messages import (
    AUTH, DELETE, MAX_RELEASE_IDS, NOOP, PUT, TCREATE, TINSERT, TREAD, TSAMPLE, Key, TableKey,
)
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import frame_head

K = TableKey
KiB, MiB = 1 << 10, 1 << 20


def _create(pair: Pair, name: str, capacity: int, columns: dict | None = None) -> None:
    spec = {"capacity": capacity, "sampler": "uniform", "remover": "fifo"}
    if columns:
        spec["columns"] = columns
    pair.call(TCREATE, {Key.BIN: name, K.SPEC: spec})


# -- 6: TCREATE's per-slot state is bounded and counted


def test_6_a_table_whose_slot_state_does_not_fit_the_memory_budget_gets_452(tmp_path):
    """Two ~100-byte TCREATEs of 2**26 rows each took +1.9 GiB beside a memory limit."""
    # (rows bounded only by the state's memory: by default the rows would be, at 24 bytes each)
    pair = Pair(memory_limit=4 * MiB, spill_dir=str(tmp_path), zero_copy=False, max_table_rows=1 << 30)
    with pytest.raises(StorageFullError, match="state"):
        _create(pair, "huge", 1 << 20)  # 21 bytes a row and the trees: about 22 MiB
    _create(pair, "fits", 1 << 12)
    store = pair.state.store
    assert 21 << 12 < store.table_bytes < 1 * MiB
    pair.call(DELETE, {Key.BIN: "fits"})
    assert store.table_bytes == 0


def test_6_the_rows_of_all_tables_together_are_bounded():
    pair = Pair(max_table_rows=1000)
    _create(pair, "a", 600)
    with pytest.raises(TooLargeError, match="1000 rows"):
        _create(pair, "b", 600)
    pair.call(DELETE, {Key.BIN: "a"})
    _create(pair, "b", 600)


def test_6_a_large_table_in_memory_is_made_off_the_reactor_and_counted_once_made():
    """A TCREATE of 4M rows filled its per-slot state on the reactor thread (0.24 s)."""
    from tensorshare_server.bins.store import BinStore, Item
    from tensorshare_server.bins.tablestore import MADE_INLINE, TableStore

    jobs, store = HeldJobs(), BinStore()
    tables = TableStore(store, jobs)
    made = []
    spec = {"capacity": MADE_INLINE, "columns": {"x": {"shape": [2], "dtype": "float32"}}}
    tables.create("small", spec, lambda result, error: made.append(("small", error)))
    assert made == [("small", None)] and not jobs.queued  # at once
    tables.create("large", {**spec, "capacity": MADE_INLINE + 1}, lambda result, error: made.append(("large", error)))
    tables.create("large", {**spec, "capacity": MADE_INLINE + 1}, lambda result, error: made.append(("again", error)))
    assert len(jobs.queued) == 1 and "large" not in tables and tables.total_rows == 2 * MADE_INLINE + 1
    counted = store.table_bytes
    jobs.release()
    assert made[1:] == [("large", None), ("again", None)] and "large" in tables
    assert store.table_bytes - counted >= 8 * (MADE_INLINE + 1)  # its columns and state count once made
    tables.create("items", {"capacity": MADE_INLINE + 1}, lambda result, error: made.append(("items", error)))
    store.put("items", Item(encode(0).description, (), 0))  # a bin takes the name meanwhile
    jobs.release()
    assert made[-1][0] == "items" and "is a bin" in str(made[-1][1]) and tables.total_rows == 2 * MADE_INLINE + 1


# -- 7: tables count in the memory budget


def test_7_columns_in_memory_count_and_the_bins_spill_to_make_room(tmp_path):
    """Columns held in memory were not counted with the bins: bins and tables could
    each fill the limit (about twice the limit in all)."""
    pair = Pair(memory_limit=1 * MiB, spill_dir=str(tmp_path), zero_copy=False)
    _create(pair, "t", 1024, {"x": {"shape": [512], "dtype": "uint8"}})  # 512 KiB of columns, in memory
    store = pair.state.store
    assert store.table_bytes > 512 * KiB
    for i in range(4):
        pair.call(PUT, {Key.BIN: f"b{i}"}, torch.zeros(256 * KiB, dtype=torch.uint8))
    assert store.resident_bytes + store.unspillable_bytes <= 1 * MiB
    assert store.resident_bytes <= 1 * MiB - 512 * KiB


def test_7_items_of_a_table_of_items_count_and_are_refused_past_the_budget(tmp_path):
    """A table of items was never counted: inserts went on past the memory limit."""
    pair = Pair(memory_limit=1 * MiB, spill_dir=str(tmp_path), zero_copy=False)
    _create(pair, "items", 64)
    store = pair.state.store
    held = []
    with pytest.raises(StorageFullError, match="memory budget"):
        for i in range(8):
            pair.call(TINSERT, {Key.BIN: "items"}, torch.zeros(256 * KiB, dtype=torch.uint8))
            held.append(store.table_bytes)
    assert len(held) == 3 and held[-1] > 3 * 256 * KiB
    pair.call(DELETE, {Key.BIN: "items"})
    assert store.table_bytes == 0


# -- 11: a listener hears every change made while it listened


@pytest.mark.parametrize("others", [False, True])
def test_11_stopping_a_listen_keeps_delivering_until_the_server_has_stopped(others):
    """The original's callback flow (listen, append, delete, ignore, back to back):
    the handle was forgotten when stop() was called, so the notifications of the
    append and the delete, already on their way, were dropped.  ``others``: another
    handle of the bin listens on (the server is not told to stop: a NOOP is the fence)."""
    from twisted.internet import defer

    from pairing import async_pair

    client, pump, clock, state = async_pair()
    try:
        heard, kept = [], []
        handle = _settled(client.listen("flow", heard.append), pump)
        if others:
            _settled(client.listen("flow", kept.append), pump)
        calls = [client.append("flow", torch.arange(3)), client.delete("flow"), handle.stop()]
        _settled(defer.gatherResults(calls), pump)
        assert [n.op for n in heard] == ["APPEND", "DELETE"]
        _settled(client.append("flow", torch.arange(3)), pump)
        assert [n.op for n in heard] == ["APPEND", "DELETE"]  # nothing after the stop was answered
        assert [n.op for n in kept] == (["APPEND", "DELETE", "APPEND"] if others else [])
    finally:
        client.close()
        pump.flush()
        state.storage.close()


def _settled(deferred, pump):
    out = []
    deferred.addBoth(out.append)
    pump.flush()
    assert out, "not settled"
    if hasattr(out[0], "raiseException"):
        out[0].raiseException()
    return out[0]


# -- 14: smaller ones


def test_14_auth_on_a_server_without_a_token_gets_503_whatever_it_holds():
    """§4.3: AUTH when none is due is 503 and the connection goes on; one without its
    fields was answered 501 (its fields were checked first)."""
    pair = Pair()
    rid = pair.send_request(AUTH)
    assert [(f.header["id"], f.header["code"]) for f in pair.receive()] == [(rid, 503)]
    assert pair.call(NOOP) is not None and not pair.outbox.closed


def test_14_a_release_of_100k_ids_is_refused_as_a_request_and_the_connection_goes_on():
    """It was answered 500 and the connection closed: a framing error for a request
    whose header decodes to more than the server lets a header hold."""
    pair = Pair()
    rid = next_request_id()
    pair.send(frame_head({"op": "PUT", "id": rid, "bin": "b", "value": encode(torch.arange(4)).description,
                          "release": list(range(1, 100_001))}, 32) + bytes(32))
    [reply] = pair.receive()
    assert (reply.header["id"], reply.header["code"]) == (rid, 501) and "decodes to" in reply.header["msg"]
    assert not pair.outbox.closed and pair.state.storage.listing() == {}  # nothing stored
    pair.call(PUT, {Key.BIN: "b"}, torch.arange(4))
    assert pair.state.storage.listing() == {"b": 1}


def test_14_the_clients_send_release_ids_a_few_at_a_time():
    """What the clients send stays far from that limit: at most MAX_RELEASE_IDS a request."""
    from tensorshare._client.values import Values

    values = Values(None, False, 0)
    for rid in range(1, 150):
        values.release(rid)
    sent = [values._with_releases({Key.BIN: "b"})[Key.RELEASE] for _ in range(3)]
    assert [len(ids) for ids in sent] == [MAX_RELEASE_IDS, MAX_RELEASE_IDS, 149 - 2 * MAX_RELEASE_IDS]
    assert sum(sent, []) == list(range(1, 150)) and values._with_releases(None) is None


def test_14_a_value_over_max_frame_is_too_large_on_both_routes(tmp_path):
    """README promises TooLargeError (552): a TCP client got a broken pipe (the server
    closed on the frame's prefix), a same-host one 501."""
    pair = Pair(max_frame=1024, same_host=True)
    assert pair.client.greeting[Key.MAX_FRAME] == 1024
    rid = pair.send_request(PUT, {Key.BIN: "b", Key.VALUE: encode(torch.zeros(512)).description,
                                  Key.SHM: "x", Key.SIZE: 2048})  # named in shared memory
    [reply] = pair.receive()
    assert (reply.header["id"], reply.header["code"]) == (rid, 552)
    with pytest.raises(TooLargeError, match="max-frame"):
        request_frame(next_request_id(), PUT, {Key.BIN: "b"}, torch.zeros(512), max_payload=1024)
    with pytest.raises(TooLargeError, match="max-frame"):  # named in shared memory: checked alike
        request_frame(next_request_id(), PUT, {Key.BIN: "b", Key.SIZE: 2048}, max_payload=1024)


# -- 5: TSAMPLE's n and TREAD's indices are bounded and counted


def _i64(values) -> bytes:
    return np.asarray(values, "<i8").tobytes()


def test_5_a_sample_or_read_larger_than_one_reply_may_carry_gets_552():
    """The reply was built before any check: two unread requests held +1 GiB
    beside a 4 MiB table."""
    pair = Pair(max_outbound=64 * KiB)
    _create(pair, "t", 256, {"x": {"shape": [1024], "dtype": "uint8"}})  # 1 KiB rows
    pair.call(TINSERT, {Key.BIN: "t"}, {"x": torch.zeros(256, 1024, dtype=torch.uint8)})
    with pytest.raises(TooLargeError, match="max_outbound"):
        pair.call(TSAMPLE, {Key.BIN: "t", Key.N: 1 << 16})  # 64 MiB of rows
    with pytest.raises(TooLargeError, match="max_outbound"):
        pair.call(TREAD, {Key.BIN: "t", K.INDICES: _i64(np.zeros(1000))})
    assert pair.state.storage.tables.get("t").table.samples == 0  # nothing drawn
    assert pair.call(TSAMPLE, {Key.BIN: "t", Key.N: 32}).values[0]["x"].shape == (32, 1024)


def test_5_the_header_of_a_reply_is_bounded_too():
    pair = Pair(max_reply_header=4096)
    _create(pair, "t", 8, {"x": {"shape": [], "dtype": "uint8"}})
    pair.call(TINSERT, {Key.BIN: "t"}, {"x": torch.zeros(8, dtype=torch.uint8)})
    with pytest.raises(TooLargeError, match="max_reply_header"):
        pair.call(TSAMPLE, {Key.BIN: "t", Key.N: 1000})  # 24 bytes a row of keys, indices, probabilities
    _create(pair, "items", 8)
    pair.call(TINSERT, {Key.BIN: "items"}, {"k" * 1000: 1})  # a description of about 1 KiB
    with pytest.raises(TooLargeError, match="max_reply_header"):
        pair.call(TSAMPLE, {Key.BIN: "items", Key.N: 8})
    assert len(pair.call(TSAMPLE, {Key.BIN: "items", Key.N: 2}).values) == 2


def test_5_gathered_rows_count_in_the_memory_budget_until_written(tmp_path):
    pair = Pair(memory_limit=1 * MiB, spill_dir=str(tmp_path), zero_copy=False)
    _create(pair, "t", 1024, {"x": {"shape": [1024], "dtype": "uint8"}})  # 1 MiB of columns: in files
    pair.call(TINSERT, {Key.BIN: "t"}, {"x": torch.zeros(1024, 1024, dtype=torch.uint8)})
    with pytest.raises(StorageFullError, match="memory budget"):
        pair.call(TREAD, {Key.BIN: "t", K.INDICES: _i64(np.arange(1024))})  # 1 MiB gathered: no room
    held = []
    pair.outbox.send = _holding(pair.outbox.send, held)  # a reply not yet written
    rid = pair.send_request(TREAD, {Key.BIN: "t", K.INDICES: _i64(np.arange(256))})
    assert pair.state.store.in_flight_bytes >= 256 * KiB
    held.pop()()  # written
    assert pair.state.store.in_flight_bytes == 0 and rid


def _holding(send, held: list):
    def hold(parts, on_abandon=None, on_written=None):
        if on_written is not None:
            held.append(on_written)
        return send(parts, on_abandon, None)
    return hold


# -- 9: a DELETE for one client of a connection spares a bin another has put since


def test_9_a_delete_with_an_owner_ends_only_that_owners_ephemeral_bin():
    pair = Pair()
    bins = {Key.BIN: "members/w"}
    pair.call(PUT, {**bins, Key.EPHEMERAL: True, Key.OWNER: b"client-a"}, 1)
    pair.call(PUT, {**bins, Key.EPHEMERAL: True, Key.OWNER: b"client-b"}, 2)  # the latest put owns it
    assert pair.call(DELETE, {**bins, Key.OWNER: b"client-a"}).header[Key.N] == 1  # not a's any more
    assert pair.state.storage.listing() == {"members/w": 1}
    pair.call(DELETE, {**bins, Key.OWNER: b"client-b"})
    assert pair.state.storage.listing() == {}
