"""The table verbs (PROTOCOL.md §12) between the real client protocol and real server
sessions paired in memory: every verb, every refusal, and requests that wait for the
rate limiter (parked with Waits, timed by a Clock), with no socket.  The engine's own
rules are tested in test_tables_engine.py; here, what the wire and the server add."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pairing import Pair
from tensorshare.errors import BadNameError, BadRequestError, BusyError, NoSuchBinError, RemoteError, TimeoutError
from tensorshare.protocol.messages import (
    GET, LIST, LISTEN, NOOP, PUT, TCREATE, TINFO, TINSERT, TLIMITS, TPRIORITY, TREAD, TSAMPLE, TWRITE, Key,
    TableKey,
)

K = TableKey
COLUMNS = {"obs": {"shape": [2, 3], "dtype": "uint8"}, "reward": {"shape": [], "dtype": "float32"}}


def i64(values) -> bytes:
    return np.asarray(values, "<i8").tobytes()


def f64(values) -> bytes:
    return np.asarray(values, "<f8").tobytes()


def keys_of(header: dict, key: str = K.KEYS) -> list[int]:
    return np.frombuffer(header[key], "<i8").tolist()


def batch(first: int, n: int) -> dict:
    rows = torch.arange(first, first + n)
    return {"obs": (rows.view(n, 1, 1) % 256).to(torch.uint8).expand(n, 2, 3).contiguous(),
            "reward": rows.to(torch.float32)}


def make(pair: Pair, name: str = "t", seed: int = 0, **spec) -> None:
    spec.setdefault("capacity", 100)
    spec.setdefault("columns", COLUMNS)
    pair.call(TCREATE, {Key.BIN: name, K.SPEC: spec})
    pair.state.storage.table(name).table.rng = np.random.default_rng(seed)  # statistics on a fixed seed


def insert(pair: Pair, first: int, n: int, name: str = "t", **fields):
    return pair.call(TINSERT, {Key.BIN: name, **fields}, batch(first, n))


def sample(pair: Pair, n: int, name: str = "t", **fields):
    return pair.call(TSAMPLE, {Key.BIN: name, Key.N: n, **fields})


def rewards(reply) -> list[int]:
    return reply.values[0]["reward"].to(torch.int64).tolist()


def _replies(pair: Pair, rid: int) -> list[dict]:
    return [f.header for f in pair.receive() if f.header.get("id") == rid]


# ---------------------------------------------------------------- every verb


@pytest.mark.parametrize("split", [None, 1, 7])
def test_every_table_verb_round_trips(split):
    pair = Pair()
    assert pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 8, "columns": COLUMNS}}, split=split).result == 0
    reply = pair.call(TINSERT, {Key.BIN: "t", K.PRIORITIES: f64([1, 2, 3])}, batch(0, 3), split=split)
    assert keys_of(reply.header) == [0, 9, 18] and reply.header["n"] == 3  # seq * capacity + index
    got = pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([2, 0, 2])}, split=split)
    assert got.header[K.COLUMNS] is True
    value = got.values[0]
    assert value["reward"].tolist() == [2.0, 0.0, 2.0] and value["obs"].shape == (3, 2, 3)
    assert value["obs"].dtype == torch.uint8 and value["obs"][0].eq(2).all()
    drawn = pair.call(TSAMPLE, {Key.BIN: "t", Key.N: 4}, split=split)
    probs = np.frombuffer(drawn.header[K.PROBABILITIES], "<f8")
    assert drawn.values[0]["reward"].shape == (4,) and np.allclose(probs, 1 / 3)
    assert [k % 8 for k in keys_of(drawn.header)] == keys_of(drawn.header, K.INDICES)
    assert pair.call(TPRIORITY, {Key.BIN: "t", K.KEYS: i64([0, 9, 99]), K.PRIORITIES: f64([5, 6, 7])},
                     split=split).result == 2
    written = pair.call(TWRITE, {Key.BIN: "t", K.INDICES: i64([1, 5])}, batch(50, 2), split=split)
    assert keys_of(written.header) == [25, 37]  # new rows, new keys
    info = pair.call(TINFO, {Key.BIN: "t"}, split=split).result
    assert (info["size"], info["inserts"], info["samples"], info["removals"]) == (4, 5, 4, 1)
    info = pair.call(TLIMITS, {Key.BIN: "t", K.LIMITS: {"min_size_to_sample": 2}}, split=split).result
    assert info["rate_limiter"]["min_size_to_sample"] == 2
    assert pair.call(LIST).result == {"t": 4}


def test_keys_come_back_as_runs_where_the_request_accepts_them_and_name_the_same_rows():
    """TINSERT and TWRITE with ``key_runs`` get their keys as runs where few runs hold
    them (a ring's wrap makes two; a batch past the capacity, more), else as bytes;
    decoded by the client, they are the keys a request without it gets (two tables
    given the same changes)."""
    from tensorshare._client.tables import _changed_keys

    pair = Pair()
    for name in ("runs", "bytes"):
        make(pair, name, capacity=10)
    changes = [(TINSERT, {}, 7), (TINSERT, {}, 7), (TINSERT, {}, 25), (TINSERT, {}, 1),
               (TWRITE, {K.INDICES: i64([2, 3, 4, 0])}, 4), (TWRITE, {K.INDICES: i64([9, 1, 7, 3, 5, 0, 8, 2, 6, 4])}, 10),
               (TWRITE, {K.INDICES: i64([])}, 0)]
    shapes = []
    for command, fields, n in changes:
        runs = pair.call(command, {Key.BIN: "runs", K.KEY_RUNS: True, **fields}, batch(0, n)).header
        plain = pair.call(command, {Key.BIN: "bytes", **fields}, batch(0, n)).header
        assert K.KEY_RUNS not in plain and len(plain[K.KEYS]) == 8 * n
        assert _changed_keys(runs, n).tolist() == keys_of(plain), (command.verb, fields, runs)
        assert runs["n"] == plain["n"]
        shapes.append(len(runs[K.KEY_RUNS]) // 3 if K.KEY_RUNS in runs else "bytes")
    assert shapes == [1, 2, 4, 1, 2, "bytes", 0]


@pytest.mark.parametrize("header, match", [
    ({K.KEY_RUNS: [0, 1, 5, 10, 1]}, "do not fit"),  # not triples
    ({K.KEY_RUNS: [0, 1, 3, 10, 1, 3]}, "do not fit"),  # more keys than rows
    ({K.KEY_RUNS: [0, 1, -1]}, "do not fit"),
    ({"n": 1}, "without its keys"),
])
def test_a_client_refuses_keys_that_do_not_fit_what_it_sent(header, match):
    from tensorshare._client.tables import _changed_keys
    from tensorshare.errors import ProtocolError

    with pytest.raises(ProtocolError, match=match):
        _changed_keys(header, 5)


def test_key_runs_cover_every_key_in_order():
    from server.protocol.tables import MAX_KEY_RUNS, key_runs

    def back(runs):
        return [first + step * i for first, step, count in zip(runs[::3], runs[1::3], runs[2::3]) for i in range(count)]

    rng = np.random.default_rng(3)
    cases = [[], [5], [5, 9], list(range(0, 100, 11)), [99, 0, 11, 22], [0, 11, 22, 5, 16, 27, 38]]
    cases += [rng.choice(1000, size, replace=False).tolist() for size in (2, 3, 12, 40)]
    for n in (63, 64, 65, 200):  # a ring's keys across its wrap, on either side of the Python path's limit
        cases.append([(seq * 50 + seq % 50) for seq in range(30, 30 + n)])
        cases.append(list(range(5, 5 + 51 * n, 51)))  # one run (a ring's insert that does not wrap)
        cases.append(list(range(9 + 7 * n, 9, -7)))  # a run going down
        cases.append(rng.choice(10_000, n, replace=False).tolist())
    for keys in cases:
        runs = key_runs(np.asarray(keys, np.int64))
        if runs is None:
            assert len(keys) > MAX_KEY_RUNS
        else:
            assert back(runs) == keys and len(runs) // 3 <= MAX_KEY_RUNS
    assert key_runs(rng.permutation(40).astype(np.int64)) is None  # scattered: bytes


def test_a_table_of_items_holds_any_value_and_samples_return_lists():
    pair = Pair()
    pair.call(TCREATE, {Key.BIN: "items", K.SPEC: {"capacity": 4, "sampler": "fifo"}})
    for value in ({"a": torch.arange(3)}, "text", [1, 2.5]):
        pair.call(TINSERT, {Key.BIN: "items"}, value)
    got = pair.call(TSAMPLE, {Key.BIN: "items", Key.N: 2})
    assert K.COLUMNS not in got.header
    assert [v["a"].tolist() for v in got.values] == [[0, 1, 2], [0, 1, 2]]  # fifo: the oldest, twice
    assert pair.call(TREAD, {Key.BIN: "items", K.INDICES: i64([1, 2])}).values == ["text", [1, 2.5]]


def test_creating_again_with_the_same_settings_keeps_the_table_and_other_settings_are_refused():
    pair = Pair()
    make(pair)
    insert(pair, 0, 3)
    pair.call(TLIMITS, {Key.BIN: "t", K.LIMITS: {"min_size_to_sample": 3}})  # limits do not count
    assert pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 100, "columns": COLUMNS}}).result == 3
    with pytest.raises(BadNameError, match="other settings"):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 101, "columns": COLUMNS}})


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("value, match", [
    ({"obs": torch.zeros(2, 2, 4, dtype=torch.uint8), "reward": torch.zeros(2)}, "rows of shape"),
    ({"obs": torch.zeros(2, 2, 3, dtype=torch.int32), "reward": torch.zeros(2)}, "holds uint8, not int32"),
    ({"obs": torch.zeros(2, 2, 3, dtype=torch.uint8)}, "missing"),
    ({"obs": torch.zeros(2, 2, 3, dtype=torch.uint8), "reward": torch.zeros(3)}, "rows"),
    ({"obs": torch.zeros(2, 2, 3, dtype=torch.uint8), "reward": torch.zeros(2), "x": torch.zeros(2)}, "no column"),
    (torch.zeros(3), "dict of column name"),
    ({"obs": {"nested": torch.zeros(1)}, "reward": torch.zeros(1)}, "dict of column name"),
])
def test_a_batch_that_does_not_match_the_columns_gets_501_and_changes_nothing(value, match):
    pair = Pair()
    make(pair)
    insert(pair, 0, 2)
    with pytest.raises(BadRequestError, match=match):
        pair.call(TINSERT, {Key.BIN: "t"}, value)
    assert pair.call(TINFO, {Key.BIN: "t"}).result["inserts"] == 2


@pytest.mark.parametrize("command, fields, error, match", [
    (TREAD, {K.INDICES: i64([100])}, BadRequestError, "out of range"),
    (TREAD, {K.INDICES: i64([-1])}, BadRequestError, "out of range"),
    (TREAD, {K.INDICES: i64([7])}, BadRequestError, "holds no row"),
    (TREAD, {K.INDICES: b"\x00" * 7}, BadRequestError, "int64"),
    (TPRIORITY, {K.KEYS: i64([0]), K.PRIORITIES: f64([-1])}, BadRequestError, "priority"),
    (TPRIORITY, {K.KEYS: i64([0, 1]), K.PRIORITIES: f64([1, 2, 3])}, BadRequestError, "3 priorities for 2"),
    (TLIMITS, {K.LIMITS: {"samples_per_insert": -1.0}}, BadRequestError, "samples_per_insert"),
    (TLIMITS, {K.LIMITS: {"capacity": 3}}, BadRequestError, "unknown limit"),
    (TSAMPLE, {Key.N: 0}, BadRequestError, "n must be"),
])
def test_bad_arguments_get_clear_codes(command, fields, error, match):
    pair = Pair()
    make(pair)
    insert(pair, 0, 2)
    with pytest.raises(error, match=match):
        pair.call(command, {Key.BIN: "t", **fields})


def test_an_index_out_of_range_in_a_write_changes_nothing():
    pair = Pair()
    make(pair, capacity=4)
    with pytest.raises(BadRequestError, match="out of range"):
        pair.call(TWRITE, {Key.BIN: "t", K.INDICES: i64([0, 4])}, batch(0, 2))
    with pytest.raises(BadRequestError, match="2 indices for a batch of 3"):
        pair.call(TWRITE, {Key.BIN: "t", K.INDICES: i64([0, 1])}, batch(0, 3))
    assert pair.call(LIST).result == {"t": 0}


@pytest.mark.parametrize("spec, match", [
    ({"columns": COLUMNS}, "needs a capacity"),
    ({"capacity": 0}, "capacity"),
    ({"capacity": 10, "sampler": "random"}, "unknown sampler"),
    ({"capacity": 10, "remover": "lifo"}, "unknown remover"),
    ({"capacity": 10, "colums": {}}, "unknown table setting"),
    ({"capacity": 10, "columns": {"a b": {"shape": [1], "dtype": "uint8"}}}, "identifier"),
    ({"capacity": 10, "columns": {"a": {"shape": [1], "dtype": "uint9"}}}, "unknown dtype"),
    ({"capacity": 10, "priority_exponent": "high"}, "priority_exponent"),
    ({"capacity": 10, "min_size_to_sample": 11}, "above the capacity"),
    ({"capacity": 10, "error_buffer": 1.0}, "needs samples_per_insert"),
    ({"capacity": "10"}, "capacity must be an int"),
    ({"capacity": -5000}, "capacity must be an int"),
    ({"capacity": 10.0}, "capacity must be an int"),
    ({"capacity": True}, "capacity must be an int"),
    ({"capacity": 10, "columns": {"a": {"shape": [1], "dtype": []}}}, "unknown dtype"),
    ({"capacity": 10, "columns": {"a": [[1], {"x": 1}]}}, "unknown dtype"),
    ({"capacity": 10, "samples_per_insert": 1e-300, "error_buffer": 1e10}, "too wide"),
    ({"capacity": 10, "samples_per_insert": 0.5, "error_buffer": [-1e308, 1e308]}, "too wide"),
])
def test_bad_table_settings_get_501(spec, match):
    pair = Pair()
    with pytest.raises(BadRequestError, match=match):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: spec})
    assert pair.call(LIST).result == {}


def test_refused_creates_leave_the_rows_all_tables_may_have_as_they_were():
    """A create refused for its settings (or a capacity below one) counts no rows
    against ``--max-table-rows``: the rows a later create may take stay the same."""
    from tensorshare.errors import TooLargeError

    pair = Pair(max_table_rows=1000)
    for spec in ({"capacity": 600, "sampler": "bogus"}, {"capacity": -5000}, {"capacity": 600, "columns": {"a": 1}}):
        with pytest.raises(BadRequestError):
            pair.call(TCREATE, {Key.BIN: "t", K.SPEC: spec})
    make(pair, "a", capacity=600)
    with pytest.raises(TooLargeError, match="600 of the 1000 rows"):
        make(pair, "b", capacity=401)
    make(pair, "b", capacity=400)


def test_limits_too_wide_to_count_are_refused_and_change_nothing():
    make(pair := Pair(), capacity=10, samples_per_insert=2.0, error_buffer=10.0)
    before = pair.call(TINFO, {Key.BIN: "t"}).header[K.INFO]["rate_limiter"]
    with pytest.raises(BadRequestError, match="too wide"):
        pair.call(TLIMITS, {Key.BIN: "t", K.LIMITS: {"samples_per_insert": 0.5, "error_buffer": [-1e308, 1e308]}})
    assert pair.call(TINFO, {Key.BIN: "t"}).header[K.INFO]["rate_limiter"] == before


def test_a_replacement_the_machine_cannot_hold_is_refused_452_and_the_old_table_stays():
    """Without --memory-limit, a table larger than the machine's memory is refused
    before the table it replaces is deleted (it was deleted, then the allocation
    failed); so are new columns of that size."""
    from tensorshare.errors import StorageFullError

    make(pair := Pair(), capacity=1024)
    insert(pair, 0, 3)
    huge = {"big": {"shape": [1 << 30], "dtype": "uint8"}}  # 1 TiB for 1,024 rows
    with pytest.raises(StorageFullError, match="more than the machine's"):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 1024, "columns": huge}, K.REPLACE: True})
    with pytest.raises(StorageFullError, match="more than the machine's"):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 1024, "columns": {**COLUMNS, **huge}},
                            K.ADD_COLUMNS: True})
    assert pair.call(LIST).result == {"t": 3}
    assert rewards(pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1, 2])})) == [0, 1, 2]


def test_a_table_too_large_for_its_slot_state_gets_552():
    from tensorshare.errors import TooLargeError

    pair = Pair()  # (the rows all tables may have follow the memory budget: 24 bytes of it a row)
    with pytest.raises(TooLargeError, match="rows they may have together"):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 1 << 40}})
    assert pair.call(LIST).result == {}


def test_a_name_is_a_bin_or_a_table_never_both():
    pair = Pair()
    pair.call(PUT, {Key.BIN: "b"}, torch.zeros(1))
    with pytest.raises(BadNameError, match="is a bin"):
        pair.call(TCREATE, {Key.BIN: "b", K.SPEC: {"capacity": 4}})
    with pytest.raises(BadNameError, match="is a bin, not a table"):
        pair.call(TSAMPLE, {Key.BIN: "b", Key.N: 1})
    make(pair)
    for command in (PUT, GET):
        with pytest.raises(BadNameError, match="is a table"):
            pair.call(command, {Key.BIN: "t"}, torch.zeros(1)) if command is PUT else pair.call(command,
                                                                                               {Key.BIN: "t"})
    with pytest.raises(NoSuchBinError, match="no table named"):
        pair.call(TINFO, {Key.BIN: "nothing"})


def test_sampling_an_empty_table_without_waiting_gets_450():
    pair = Pair()
    make(pair)
    with pytest.raises(BusyError) as info:
        sample(pair, 1)
    assert isinstance(info.value, TimeoutError) and "holds no rows" in str(info.value)


def test_a_table_is_listed_listened_to_and_deleted_like_a_bin():
    from tensorshare.protocol.messages import DELETE

    pair = Pair()
    other = Pair(state=pair.state)
    other.call(LISTEN, {Key.BIN: "t"})
    make(pair)
    insert(pair, 0, 3)
    notes = [f.header for f in other.receive()]
    assert [(h["op"], h["n"]) for h in notes] == [("CREATE", 0), ("INSERT", 3)]
    assert notes[1]["seq"] > notes[0]["seq"]
    pair.call(DELETE, {Key.BIN: "t"})
    assert [h["op"] for h in (f.header for f in other.receive())] == ["DELETE"]
    assert pair.call(LIST).result == {}
    make(pair)  # the name is free again
    assert pair.call(LIST).result == {"t": 0}


# ---------------------------------------------------------------- through the server: the engine's rules


def test_prioritized_sampling_through_the_server_follows_updated_priorities():
    pair = Pair()
    make(pair, sampler="prioritized", priority_exponent=1.0, capacity=4)
    keys = keys_of(insert(pair, 0, 4, **{K.PRIORITIES: f64([1, 1, 1, 1])}).header)
    pair.call(TPRIORITY, {Key.BIN: "t", K.KEYS: i64(keys), K.PRIORITIES: f64([1, 2, 3, 4])})
    counts = np.zeros(4)
    for _ in range(40):
        counts += np.bincount(rewards(sample(pair, 250)), minlength=4)
    expected = 10_000 * np.array([1, 2, 3, 4]) / 10
    assert ((counts - expected) ** 2 / expected).sum() < 16.3  # chi-square, 3 dof, p = 0.001
    drawn = sample(pair, 8)
    assert np.allclose(np.frombuffer(drawn.header[K.PROBABILITIES], "<f8"), (np.array(rewards(drawn)) + 1) / 10)


def test_a_sample_that_carries_a_priority_update_sets_it_before_it_draws():
    """A learner's update riding on its next TSAMPLE: set first (the sample draws by
    it), refused whole when the keys or priorities are, and kept when the sample
    then cannot go on."""
    pair = Pair()
    make(pair, sampler="prioritized", priority_exponent=1.0, capacity=8, min_size_to_sample=1)
    keys = keys_of(insert(pair, 0, 4, **{K.PRIORITIES: f64([1, 1, 1, 1])}).header)
    info = lambda: pair.call(TINFO, {Key.BIN: "t", K.SLOTS: 0}).header[K.INFO]  # noqa: E731
    for chosen in (3, 0, 2):
        only = np.zeros(4)
        only[chosen] = 1.0
        drawn = sample(pair, 32, **{K.KEYS: i64(keys), K.PRIORITIES: f64(only)})
        assert rewards(drawn) == [chosen] * 32
        assert np.allclose(np.frombuffer(drawn.header[K.PROBABILITIES], "<f8"), 1.0)
    before = info()
    for fields, match in (({K.KEYS: i64(keys)}, "both keys and priorities"),
                          ({K.PRIORITIES: f64([1, 1, 1, 1])}, "both keys and priorities"),
                          ({K.KEYS: i64(keys), K.PRIORITIES: f64([1, -1, 1, 1])}, "priority"),
                          ({K.KEYS: i64(keys), K.PRIORITIES: f64([1, 1])}, "2 priorities for 4")):
        with pytest.raises(BadRequestError, match=match):
            sample(pair, 4, **fields)
    after = info()
    assert after["samples"] == before["samples"]
    assert np.frombuffer(after["slots"]["priorities"], "<f8").tolist() == [0.0, 0.0, 1.0, 0.0]
    pair.call(TLIMITS, {Key.BIN: "t", K.LIMITS: {"min_size_to_sample": 8}})  # the sample cannot go on now
    with pytest.raises(BusyError):
        sample(pair, 4, **{K.KEYS: i64(keys), K.PRIORITIES: f64([4, 3, 2, 1])})
    assert np.frombuffer(info()["slots"]["priorities"], "<f8").tolist() == [4.0, 3.0, 2.0, 1.0]
    assert info()["samples"] == before["samples"]


def test_uniform_sampling_through_the_server_is_uniform():
    pair = Pair()
    make(pair, capacity=10)
    insert(pair, 0, 10)
    counts = np.bincount(rewards(sample(pair, 20_000)), minlength=10)
    assert ((counts - 2000) ** 2 / 2000).sum() < 27.9  # chi-square, 9 dof, p = 0.001


def test_fifo_remover_evicts_the_oldest_and_max_times_sampled_removes_rows():
    pair = Pair()
    make(pair, capacity=3, sampler="fifo", max_times_sampled=2)
    insert(pair, 0, 3)
    insert(pair, 3, 2)  # rows 0 and 1 go
    assert rewards(pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1, 2])})) == [3, 4, 2]
    assert rewards(sample(pair, 3)) == [2, 2, 3]  # the oldest twice, then the next
    assert pair.call(LIST).result == {"t": 2}
    with pytest.raises(BadRequestError, match="holds no row"):
        pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([2])})


# ---------------------------------------------------------------- waiting for the rate limiter


def _pairs(n: int = 2):
    first = Pair()
    return [first] + [Pair(state=first.state) for _ in range(n - 1)]


def test_a_sample_waits_for_min_size_while_other_connections_are_served():
    learner, actor = _pairs()
    make(learner, min_size_to_sample=4)
    rid = learner.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 2, Key.WAIT: 5.0})
    noop = learner.send_request(NOOP)
    insert(actor, 0, 3)  # served while the learner waits
    learner.clock.advance(0)
    assert learner.receive() == []
    info = actor.call(TINFO, {Key.BIN: "t"}).result
    assert info["waiting_samples"] == 1 and info["size"] == 3
    insert(actor, 3, 1)
    learner.clock.advance(0)
    replies = [f for f in learner.receive()]
    assert [(f.header["id"], f.header["code"]) for f in replies] == [(rid, 226), (noop, 200)]


def test_samples_per_insert_blocks_and_releases_both_ways():
    learner, actor = _pairs()
    make(learner, min_size_to_sample=2, samples_per_insert=2.0, error_buffer=4.0)
    insert(actor, 0, 2)  # filling up to min_size is never limited
    # diff = inserts * 2 - samples stays in [c - 4, c + 4] = [0, 8] around c = 2 * min_size
    assert len(rewards(sample(learner, 4))) == 4  # diff 4 -> 0
    rid = learner.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 2, Key.WAIT: 5.0})
    learner.clock.advance(0)
    assert learner.receive() == []  # blocked until an insert
    insert(actor, 2, 1)  # diff 2: the sample goes, diff 0
    learner.clock.advance(0)
    assert [h["code"] for h in _replies(learner, rid)] == [226]
    insert(actor, 3, 4)  # diff 8: the top of the window
    rid = actor.send_request(TINSERT, {Key.BIN: "t", Key.WAIT: 5.0}, batch(7, 1))
    actor.clock.advance(0)
    assert actor.receive() == []  # blocked until samples
    sample(learner, 2)
    actor.clock.advance(0)
    [reply] = _replies(actor, rid)
    assert reply["code"] == 250 and reply["n"] == 8


def test_a_waiting_insert_expires_with_450_and_inserts_nothing():
    actor, learner = _pairs()
    make(actor, min_size_to_sample=1, samples_per_insert=1.0, error_buffer=2.0)
    insert(actor, 0, 3)
    rid = actor.send_request(TINSERT, {Key.BIN: "t", Key.WAIT: 2.0}, batch(3, 1))
    actor.clock.advance(1.9)
    assert actor.receive() == []
    actor.clock.advance(0.2)
    [reply] = _replies(actor, rid)
    assert reply["code"] == 450 and "within 2s" in reply["msg"]
    assert learner.call(TINFO, {Key.BIN: "t"}).result["inserts"] == 3


def test_a_waiting_sample_does_not_hold_back_the_insert_it_waits_for():
    learner, actor = _pairs()
    make(learner, min_size_to_sample=5)
    rid = learner.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 1, Key.WAIT: 5.0})
    for i in range(5):  # each insert is served at once
        assert insert(actor, i, 1).header["n"] == i + 1
    learner.clock.advance(0)
    assert [h["code"] for h in _replies(learner, rid)] == [226]


def test_changing_limits_releases_waiting_requests():
    learner, admin = _pairs()
    make(learner, min_size_to_sample=10)
    insert(admin, 0, 3)
    rid = learner.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 1, Key.WAIT: 5.0})
    admin.call(TLIMITS, {Key.BIN: "t", K.LIMITS: {"min_size_to_sample": 3}})
    learner.clock.advance(0)
    assert [h["code"] for h in _replies(learner, rid)] == [226]


def test_deleting_a_table_refuses_its_waiting_requests_with_550():
    from tensorshare.protocol.messages import DELETE

    learner, admin = _pairs()
    make(learner, min_size_to_sample=10)
    rid = learner.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 1, Key.WAIT: 5.0})
    admin.call(DELETE, {Key.BIN: "t"})
    learner.clock.advance(0)
    [reply] = _replies(learner, rid)
    assert reply["code"] == 550 and "deleted" in reply["msg"]


def test_a_connection_that_closes_while_waiting_changes_nothing():
    actor, learner = _pairs()
    make(actor, samples_per_insert=1.0, error_buffer=2.0)
    insert(actor, 0, 3)
    actor.send_request(TINSERT, {Key.BIN: "t", Key.WAIT: 10.0}, batch(3, 1))
    actor.session.connection_lost()
    sample(learner, 3)
    learner.clock.advance(0)
    assert learner.call(TINFO, {Key.BIN: "t"}).result["inserts"] == 3


def test_the_async_client_has_the_table_methods():
    from pairing import async_pair

    client, pump, clock, state = async_pair()
    results = []
    client.create_table("t", 10, {"x": ((2,), torch.float32)}).addBoth(results.append)
    client.insert("t", {"x": torch.ones(3, 2)}).addBoth(results.append)
    client.sample("t", 4).addBoth(results.append)
    pump.flush()
    assert results[0] == 0 and results[1].tolist() == [0, 11, 22]
    assert results[2].value["x"].shape == (4, 2) and len(results[2]) == 4
    client.close()
    pump.flush()


def test_a_read_with_empty_gives_an_emptied_slot_as_key_minus_one_and_zeros():
    """A copy of a table whose rows leave meanwhile reads what is there: with
    ``empty``, a slot that holds no row is key -1 and zeros (its bytes are a row that
    left), not a 501 for the whole read; never with ``sample``."""
    make(pair := Pair(), capacity=8, max_times_sampled=1)
    insert(pair, 0, 3)
    pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([1]), K.SAMPLE: True})  # sampled out: slot 1 is empty
    with pytest.raises(BadRequestError, match="slot 1 holds no row"):
        pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1, 2])})
    reply = pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1, 2]), K.EMPTY: True})
    assert keys_of(reply.header)[1] == -1 and min(keys_of(reply.header)[::2]) >= 0
    assert rewards(reply) == [0, 0, 2] and reply.values[0]["obs"][1].sum() == 0
    with pytest.raises(BadRequestError, match="sample or empty"):
        pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0]), K.EMPTY: True, K.SAMPLE: True})


def test_a_durable_table_the_disk_cannot_hold_is_refused_452_and_a_replaced_one_stays(tmp_path):
    """A table's files are allocated whole: one larger than the disk's free space is
    refused before anything is made, and before the table it would replace is deleted."""
    import shutil

    from tensorshare.errors import StorageFullError

    pair = Pair(data_dir=str(tmp_path / "data"))
    make(pair, capacity=8)
    insert(pair, 0, 2)
    row = 1 << 20  # bytes a row: more rows than the disk has MiB free
    rows = shutil.disk_usage(tmp_path).free // row + 1024
    huge = {"capacity": rows, "columns": {"big": {"shape": [row], "dtype": "uint8"}}}
    for fields in ({Key.BIN: "u", K.SPEC: huge}, {Key.BIN: "t", K.SPEC: huge, K.REPLACE: True}):
        with pytest.raises(StorageFullError, match="no room on the disk"):
            pair.call(TCREATE, fields)
    assert pair.call(LIST).result == {"t": 2}
    assert rewards(pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1])})) == [0, 1]


def test_a_durable_tables_files_are_made_and_removed_by_disk_jobs(tmp_path):
    """Making and removing a table's files (sparse columns, JSON, a tree that may
    hold gigabytes) runs as disk jobs, never in the handler: TCREATE is answered
    once the files are made, DELETE once they are gone, and the session serves
    what follows in order meanwhile."""
    from pairing import HeldJobs
    from tensorshare.protocol.messages import DELETE
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state
    from twisted.internet.task import Clock

    jobs = HeldJobs()
    state = build_state(ServerConfig(data_dir=str(tmp_path / "data")), jobs, clock=Clock())
    jobs.release()
    pair = Pair(state=state)
    tables = tmp_path / "data" / "tables"
    made = pair.send_request(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 8, "columns": COLUMNS}})
    noop = pair.send_request(NOOP)
    assert _replies(pair, made) == [] and not tables.exists()  # nothing on disk yet, nothing answered
    jobs.release()
    frames = pair.receive()
    assert [(f.header["id"], f.header["code"]) for f in frames] == [(made, 250), (noop, 200)]
    assert sorted(os.listdir(next(tables.iterdir()))) == ["_slots", "meta.json", "obs.memmap", "reward.memmap",
                                                          "table.json"]
    gone = pair.send_request(DELETE, {Key.BIN: "t"})
    assert _replies(pair, gone) == [] and any(tables.iterdir())
    assert Pair(state=state).call(LIST).result == {}  # out of the namespace at once
    jobs.release()
    assert [h["code"] for h in _replies(pair, gone)] == [250] and not any(tables.iterdir())
    pair.close()


def test_the_new_columns_of_a_durable_table_are_made_by_disk_jobs(tmp_path):
    """TCREATE with ``add_columns`` on a table in files makes the new columns' files
    on a disk thread and notes them in its JSON there too: answered once both are
    done; the table serves meanwhile, with the columns it had."""
    import json

    from pairing import HeldJobs
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state
    from twisted.internet.task import Clock

    jobs = HeldJobs()
    state = build_state(ServerConfig(data_dir=str(tmp_path / "data")), jobs, clock=Clock())
    jobs.release()
    pair = Pair(state=state)
    made = pair.send_request(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 8, "columns": COLUMNS}})
    jobs.release()
    assert [h["code"] for h in _replies(pair, made)] == [250]
    directory = next((tmp_path / "data" / "tables").iterdir())
    wider = {**COLUMNS, "done": {"shape": [], "dtype": "bool"}}
    grown = pair.send_request(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 8, "columns": wider}, K.ADD_COLUMNS: True})
    other = Pair(state=state)
    assert "done" not in other.call(TINFO, {Key.BIN: "t"}).result["columns"]  # served meanwhile, as it was
    assert _replies(pair, grown) == [] and not (directory / "done.memmap").exists()
    jobs.release()  # the new column's file
    assert (directory / "done.memmap").exists() and _replies(pair, grown) == []
    jobs.release()  # the table's JSON
    assert [h["code"] for h in _replies(pair, grown)] == [250]
    assert json.loads((directory / "table.json").read_text())["spec"]["columns"]["done"] == {"shape": [],
                                                                                             "dtype": "bool"}
    assert other.call(TINFO, {Key.BIN: "t"}).result["columns"]["done"] == {"shape": [], "dtype": "bool"}
    other.close()
    pair.close()


# ---------------------------------------------------------------- TorchRL's needs: reads counted, columns, slots


def test_a_read_as_a_sample_waits_for_the_rate_limiter_and_the_wait_is_counted():
    learner, actor = _pairs()
    make(learner, min_size_to_sample=2, samples_per_insert=1.0, error_buffer=2.0)
    insert(actor, 0, 4)  # diff = 2 (min size's credit) + 2 (past it)
    got = learner.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1, 2]), K.SAMPLE: True, Key.WAIT: 0})
    assert rewards(got) == [0, 1, 2]
    assert learner.call(TINFO, {Key.BIN: "t"}).result["samples"] == 3
    with pytest.raises(BusyError, match="asked to wait 0s"):  # diff 1: a read of 2 may not go now
        learner.call(TREAD, {Key.BIN: "t", K.INDICES: i64([0, 1]), K.SAMPLE: True})
    rid = learner.send_request(TREAD, {Key.BIN: "t", K.INDICES: i64([3, 0]), K.SAMPLE: True, Key.WAIT: 5.0})
    learner.clock.advance(1.5)
    assert learner.receive() == []
    info = actor.call(TINFO, {Key.BIN: "t"}).result
    assert info["waiting_samples"] == 1 and info["blocked_seconds"] == {"insert": 0.0, "sample": 0.0}
    insert(actor, 4, 1)
    learner.clock.advance(0)
    assert [h["code"] for h in _replies(learner, rid)] == [226]
    info = actor.call(TINFO, {Key.BIN: "t"}).result
    assert info["samples"] == 5 and info["blocked_seconds"]["sample"] == pytest.approx(1.5)
    # a plain read is not paced (nor counted)
    assert rewards(learner.call(TREAD, {Key.BIN: "t", K.INDICES: i64([1] * 10)})) == [1] * 10


def test_a_table_gains_columns_with_add_columns_and_keeps_its_rows():
    pair = Pair()
    make(pair, capacity=10)
    insert(pair, 0, 3)
    wider = {**COLUMNS, "done": {"shape": [], "dtype": "bool"}}
    with pytest.raises(BadNameError, match="other settings"):  # without add_columns: refused as before
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 10, "columns": wider}})
    assert pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 10, "columns": wider}, K.ADD_COLUMNS: True}).result == 3
    got = pair.call(TREAD, {Key.BIN: "t", K.INDICES: i64([2])}).values[0]
    assert got["done"].tolist() == [False] and got["reward"].tolist() == [2.0]
    assert pair.call(TINFO, {Key.BIN: "t"}).result["columns"]["done"] == {"shape": [], "dtype": "bool"}
    changed = {**wider, "reward": {"shape": [2], "dtype": "float32"}}
    with pytest.raises(BadNameError, match="column 'reward'"):
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 10, "columns": changed}, K.ADD_COLUMNS: True})
    with pytest.raises(BadNameError, match="other settings"):  # other settings than columns: refused
        pair.call(TCREATE, {Key.BIN: "t", K.SPEC: {"capacity": 11, "columns": wider}, K.ADD_COLUMNS: True})


def test_a_tables_meta_is_kept_and_given_back_and_bad_meta_is_refused():
    pair = Pair()
    meta = {"torchrl": {"kind": "pytree", "leaves": ["a", "b"], "inner": []}}
    make(pair, meta=meta)
    assert pair.call(TINFO, {Key.BIN: "t"}).result["meta"] == meta
    with pytest.raises(BadNameError, match="other settings"):
        make(pair, meta={"torchrl": {"kind": "tensor"}})
    for bad in ([1, 2], {"blob": b"\x00" * 10}, {"big": "x" * (65 << 10)}):
        with pytest.raises(BadRequestError, match="meta"):
            make(pair, name="u", meta=bad)


def test_the_occupied_slots_come_in_pages():
    pair = Pair()
    n = (1 << 18) + 5  # more than a page
    make(pair, capacity=n + 3, columns={"x": {"shape": [], "dtype": "int8"}})
    pair.call(TWRITE, {Key.BIN: "t", K.INDICES: i64(np.arange(n) + 3)}, {"x": torch.zeros(n, dtype=torch.int8)})
    first = pair.call(TINFO, {Key.BIN: "t", K.SLOTS: 0}).result["slots"]
    got = np.frombuffer(first["indices"], "<i8")
    assert got.size == 1 << 18 and got[0] == 3 and first["next"] == got[-1] + 1 == (1 << 18) + 3
    rest = pair.call(TINFO, {Key.BIN: "t", K.SLOTS: first["next"]}).result["slots"]
    assert np.frombuffer(rest["indices"], "<i8").tolist() == list(range((1 << 18) + 3, n + 3))
    assert rest["next"] is None and np.frombuffer(rest["priorities"], "<f8").tolist() == [1.0] * 5
    with pytest.raises(BadRequestError):
        pair.call(TINFO, {Key.BIN: "t", K.SLOTS: -1})
