"""Tables at scale, checked at small sizes: the compact per-row state, the fifo ring,
sequences of rows (episode ends, padding, their priorities), and the compact state
through a reopened table.  Pure engine code, tested directly (the sizes that make
these matter are the benchmark's ``scale`` section)."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from test_tables_engine import Table, chi2, chi2_critical, compiled, scalars, tables, x_table, xs


def test_the_per_row_state_is_at_most_24_bytes_with_the_trees():
    per_row = {(s, r): tables.state_bytes(1 << 24, s, r) / (1 << 24)
               for s in ("uniform", "prioritized") for r in ("fifo", "lowest_priority")}
    assert max(per_row.values()) <= 24, per_row
    assert per_row[("prioritized", "fifo")] < 23


# -- a fifo table is a ring buffer


def test_a_batch_larger_than_a_fifo_table_keeps_its_newest_rows():
    t = x_table(5)
    first = t.insert(scalars(2, start=100)).keys.tolist()
    w = t.insert(scalars(12))
    assert sorted(xs(t.read(t.occupied()))) == [7, 8, 9, 10, 11]
    assert w.keys.size == 12 and w.indices.size == 12
    # each row's key names its slot; those overwritten at once match no row any more
    assert (w.keys % 5 == w.indices).all()
    assert (t._slots.find(w.keys[:7]) == -1).all() and (t._slots.find(w.keys[7:]) >= 0).all()
    assert sorted(w.removed.keys.tolist()) == sorted(w.keys[:7].tolist() + first)
    info = t.info()
    assert (info["inserts"], info["removals"], info["size"]) == (14, 9, 5)
    # and it goes on as a ring: the next row takes the oldest's slot
    oldest = int(t.read(t.occupied()).indices[np.argmin(xs(t.read(t.occupied())))])
    assert t.insert(scalars(1, start=50)).indices.tolist() == [oldest]


def test_only_the_fifo_remover_makes_a_ring_of_a_large_batch():
    for remover in ("lowest_priority", None):
        with pytest.raises(tables.BatchTooLargeError):
            x_table(3, remover=remover).insert(scalars(4))


def test_a_ring_of_items_gives_back_the_items_left_out():
    t = Table(2, None)
    w = t.insert(["a", "b", "c"])
    assert w.removed.items == ["a"] and sorted(t.read(t.occupied()).items) == ["b", "c"]


# -- sequences


def episodes(t: Table, lengths: list[int], start: int = 0) -> None:
    """Insert episodes of these lengths, one insert each: x counts up, the last row ends it."""
    for n in lengths:
        ends = np.zeros(n, bool)
        ends[-1] = True
        t.insert(scalars(n, start), ends=ends)
        start += n


def episode_of(x: int, lengths: list[int]) -> int:
    return int(np.searchsorted(np.cumsum(lengths), x, side="right"))


def test_sequences_are_consecutive_rows_of_one_episode():
    lengths = [2, 7, 3, 5, 1, 9]
    t = x_table(64, rng=3)
    episodes(t, lengths)
    s = t.sample_sequences(200, 3)
    x = np.array(xs(s)).reshape(200, 3)
    assert (np.diff(x, axis=1) == 1).all()
    assert all(len({episode_of(v, lengths) for v in row}) == 1 for row in x.tolist())
    assert (s.lengths == 3).all() and s.keys.size == 600
    # every whole start comes up: 5 + 1 + 3 + 7 of them
    starts = {row[0] for row in x.tolist()}
    valid = {x0 for x0 in range(sum(lengths)) if episode_of(x0, lengths) == episode_of(x0 + 2, lengths)
             and x0 + 2 < sum(lengths)}
    assert starts == valid


def test_uniform_sequences_are_uniform_over_the_whole_ones():
    lengths = [10, 4, 10]
    t = x_table(64, rng=7)
    episodes(t, lengths)
    s = t.sample_sequences(6000, 4)
    starts = np.array(xs(s)).reshape(-1, 4)[:, 0]
    valid = [0, 1, 2, 3, 4, 5, 6, 10, 14, 15, 16, 17, 18, 19, 20]
    counts = np.array([(starts == v).sum() for v in valid])
    assert counts.sum() == 6000
    assert chi2(counts, np.ones(len(valid))) < chi2_critical(len(valid) - 1)


def test_prioritized_sequences_follow_their_start_rows_priority():
    t = x_table(64, sampler="prioritized", priority_exponent=1.0, rng=11)
    episodes(t, [12, 12])
    keys = t.read(t.occupied()).keys
    p = np.zeros(24)
    p[[0, 3, 9, 12, 21]] = [1.0, 3.0, 5.0, 2.0, 4.0]  # start 9 and 21 have no whole sequence of 4
    t.update_priorities(keys, p)
    s = t.sample_sequences(5000, 4)
    starts = np.array(xs(s)).reshape(-1, 4)[:, 0]
    assert set(starts.tolist()) <= {0, 3, 12}
    counts = np.array([(starts == v).sum() for v in (0, 3, 12)])
    assert chi2(counts, np.array([1.0, 3.0, 2.0])) < chi2_critical(2)
    # each sequence's probability is its start's share of the table's weight
    assert np.allclose(s.probabilities, p[starts] / p.sum())
    # a sequence's priority is its start row's, set by its key
    assert t.update_priorities(s.keys.reshape(-1, 4)[:, 0][:1], [7.0]) == 1


def test_padded_sequences_repeat_their_last_row_and_say_their_length():
    t = x_table(64, rng=5)
    episodes(t, [2, 6])
    s = t.sample_sequences(400, 4, pad=True)
    x = np.array(xs(s)).reshape(400, 4)
    for row, length in zip(x.tolist(), s.lengths.tolist()):
        real = row[:length]
        assert real == list(range(real[0], real[0] + length))
        assert row[length:] == [real[-1]] * (4 - length)
        assert length == min(4, (2 if real[0] < 2 else 8) - real[0])
    assert set(x[:, 0].tolist()) == set(range(8))  # every row starts one
    # the padding is not counted: each real row once
    assert t.info()["samples"] == int(s.lengths.sum())


def test_sequences_run_on_across_the_ring_and_stop_at_a_break():
    t = x_table(10, rng=2)
    t.insert(scalars(7))
    t.insert(scalars(8, start=7))  # slots 7, 8, 9, 0, 1 ... : one stream across the wrap
    x = np.array(xs(t.sample_sequences(300, 5))).reshape(-1, 5)
    assert (np.diff(x, axis=1) == 1).all() and x.min() >= 5
    assert any(row[0] <= 9 <= row[-1] for row in x.tolist())  # some cross the wrap (slot 9 -> 0)
    # a row written in place breaks the stream there: no sequence runs through it
    t.write([2], scalars(1, start=1000))
    x = np.array(xs(t.sample_sequences(300, 3))).reshape(-1, 3)
    assert 1000 not in x and (np.diff(x, axis=1) == 1).all()


def test_sequences_need_rows_that_form_them():
    t = x_table(16, rng=1)
    episodes(t, [2, 2, 2])
    with pytest.raises(tables.EmptyTableError, match="no sequence of 3 rows"):
        t.sample_sequences(4, 3)
    assert t.info()["samples"] == 0
    with pytest.raises(tables.BadArgumentError, match="length"):
        t.sample_sequences(1, 17)
    with pytest.raises(tables.BadArgumentError, match="fifo"):
        x_table(4, sampler="fifo").sample_sequences(1, 1)
    with pytest.raises(tables.BadArgumentError, match="max_times_sampled"):
        x_table(4, max_times_sampled=2).sample_sequences(1, 1)
    with pytest.raises(tables.BadArgumentError, match="ends"):
        t.insert(scalars(2), ends=[True])


def test_the_rate_limiter_counts_a_sequence_sample_as_its_rows():
    t = x_table(64, samples_per_insert=1.0, error_buffer=(0, 40), rng=2)
    episodes(t, [20])
    assert t.samples_allowed() == 20
    assert not t.can_sample(21) and t.can_sample(20)
    t.sample_sequences(5, 4)
    assert t.samples_allowed() == 0 and not t.can_sample(1)
    with pytest.raises(tables.WouldBlockError):
        t.sample_sequences(1, 1)


def test_the_oldest_rows_of_a_ring_are_those_the_tree_orders_first_across_its_wrap():
    t = x_table(10)
    order = t._remover.index
    for n in (7, 6, 5, 9, 3):  # the ring's oldest row moves round, wrapping past slot 9
        t.insert(scalars(n))
        for k in (k for k in (1, 2, 5, 9, 10) if k <= t.size):
            ring = order._ring(k)
            assert ring is not None and ring.tolist() == order.tree.smallest(k).tolist(), (n, k)
    t.remove(t.read(t.occupied()).keys[:1])  # a hole: no ring from the oldest on
    assert order.first(10).tolist() == order.tree.smallest(10).tolist()


# -- rows into files


def _file_rows(directory: str, column: str, dtype) -> np.ndarray:
    """A column's rows as its file holds them, read with ``pread`` (not the table's mapping)."""
    path = os.path.join(directory, f"{column}.memmap")
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(os.pread(fd, os.path.getsize(path), 0), dtype)
    finally:
        os.close(fd)


@pytest.mark.parametrize("keep", [False, True])
def test_rows_reach_a_file_backed_columns_files_in_runs_across_the_ring_and_scattered(tmp_path, keep):
    directory = str(tmp_path / "t")
    t = Table(20, {"x": ((), "int64"), "y": ((3,), "float32")}, remover="fifo", rng=0,
              backing=tables.MemmapBacking(directory, keep=keep))
    for start, n in ((0, 7), (7, 9), (16, 11), (27, 20)):  # the ring wraps past slot 19 twice
        t.insert({"x": np.arange(start, start + n, dtype=np.int64),
                  "y": np.arange(start, start + n, dtype=np.float32).repeat(3).reshape(n, 3)})
    ring = np.arange(27, 47)
    held = np.sort(t.read(np.arange(20)).values["x"].to_numpy())
    assert held.tolist() == ring.tolist()
    x = _file_rows(directory, "x", np.int64)
    assert sorted(x.tolist()) == ring.tolist()
    assert np.array_equal(_file_rows(directory, "y", np.float32).reshape(20, 3), x.astype(np.float32).repeat(3).reshape(20, 3))
    # slots in more runs than are worth a write each go through the mapping, to the same file
    every_other = np.arange(0, 20, 2)
    t.write(every_other, {"x": -every_other - 1, "y": np.zeros((10, 3), np.float32)})
    x = _file_rows(directory, "x", np.int64)
    assert x[every_other].tolist() == (-every_other - 1).tolist()
    assert t.read(every_other).values["x"].to_numpy().tolist() == (-every_other - 1).tolist()


def test_rows_the_files_cannot_take_are_refused_451_and_the_rows_they_replace_leave(tmp_path):
    directory = str(tmp_path / "t")

    def table(reopen=False):
        backing = tables.MemmapBacking(directory, keep=True, reopen=reopen)
        return Table(10, {"x": ((), "int64")}, sampler="prioritized", remover="fifo", rng=0, backing=backing), backing

    t, backing = table()
    t.insert(scalars(10))
    (column,) = t._data
    readonly = os.open(os.path.join(directory, "x.memmap"), os.O_RDONLY)
    os.dup2(readonly, backing._files[id(column)])  # the file refuses writes (EBADF), as a failing disk would (EIO)
    os.close(readonly)
    with pytest.raises(tables.RowsNotWrittenError, match="4 rows they were to replace") as raised:
        t.insert(scalars(4, start=100))
    assert raised.value.code == 451
    # the 4 oldest rows (perhaps partly overwritten) are gone; the batch never came in
    assert t.size == 6 and sorted(xs(t.read(t.occupied()))) == list(range(4, 10))
    assert set(xs(t.sample(200))) <= set(range(4, 10))
    # nor does it after a kill: its record in the journal is gone
    again, _ = table(reopen=True)
    assert again.size == 6 and sorted(xs(again.read(again.occupied()))) == list(range(4, 10))
    again.insert(scalars(6, start=200))  # into the 4 free slots, then over the 2 oldest rows
    assert sorted(xs(again.read(again.occupied()))) == [*range(6, 10), *range(200, 206)]


# -- the compact state through a reopened table


def test_the_compact_state_comes_back_when_a_table_is_reopened(tmp_path):
    directory = str(tmp_path / "t")

    def table(reopen=False):
        return Table(40, {"x": ((), "int64")}, sampler="prioritized", remover="fifo", rng=1,
                     backing=tables.MemmapBacking(directory, keep=True, reopen=reopen))

    t = table()
    episodes(t, [5, 30, 12])  # 47 rows into 40: the ring has wrapped
    s = t.sample(50)
    t.update_priorities(s.keys[:5], [0.5, 2.0, 3.0, 4.0, 5.0])
    before = t.slots()
    sequences = t.sample_sequences(1, 4)
    del t
    again = table(reopen=True)
    after = again.slots()
    for what in ("indices", "keys", "priorities", "ends"):
        assert np.array_equal(before[what], after[what]), what
    # (the sequence sample counted its rows; the reopened table has every count)
    assert (after["times_sampled"] >= before["times_sampled"]).all()
    assert after["times_sampled"].sum() == before["times_sampled"].sum() + 4
    assert again.size == 40 and again.info()["inserts"] == 40
    # new rows get keys after every key there, and go where the ring goes on
    oldest = int(before["indices"][np.argmin(before["keys"])])
    w = again.insert(scalars(1, start=99))
    assert w.keys[0] > before["keys"].max() and w.indices.tolist() == [oldest]
    # the episode marks hold: no sequence runs across an end
    x = np.array(xs(again.sample_sequences(200, 6))).reshape(-1, 6)
    assert (np.diff(x, axis=1) == 1).all()
    assert sequences.lengths.tolist() == [4]


def test_rows_written_with_their_sample_counts_give_only_what_is_left_of_max_times_sampled():
    """A write may give rows the times they were sampled already (a table made again
    from a checkpoint): a row leaves when its count reaches ``max_times_sampled``, and
    the table's allowance (samples its rows may still give) counts them; a count at the
    limit or below 0, or one count too many, is refused before anything changes; a
    count past the slots' limit is kept at it."""
    t = Table(4, {"x": ((), "int64")}, sampler="fifo", remover=None, max_times_sampled=3)
    t.write([0, 1, 2], scalars(3), times_sampled=[2, 1, 0])
    assert t.slots()["times_sampled"].tolist() == [2, 1, 0]
    assert t.samples_allowed() == 1 + 2 + 3
    assert xs(t.sample(1)) == [0]  # the oldest, sampled a third time: it leaves
    assert t.slots()["indices"].tolist() == [1, 2]
    assert t.samples_allowed() == 2 + 3
    for bad, match in (([3], "max_times_sampled"), ([-1], ">= 0"), ([0, 0], "sample counts")):
        with pytest.raises(tables.TableError, match=match):
            t.write([3], scalars(1, start=7), times_sampled=bad)
    assert t.slots()["indices"].tolist() == [1, 2] and t.samples_allowed() == 5
    free = Table(2, {"x": ((), "int64")})  # (no max_times_sampled: any count, saturating)
    free.write([0], scalars(1), times_sampled=[1 << 40])
    assert free.slots()["times_sampled"].tolist() == [np.iinfo(np.uint32).max]


def test_sample_counts_written_as_int64_by_an_older_server_are_narrowed(tmp_path):
    directory = str(tmp_path / "t")
    t = Table(8, {"x": ((), "int64")}, backing=tables.MemmapBacking(directory, keep=True))
    t.insert(scalars(3))
    del t
    path = os.path.join(directory, "_slots", "times_sampled.bin")
    np.array([5, 0, 7] + [0] * 5, np.int64).tofile(path)
    os.unlink(os.path.join(directory, "_slots", "flags.bin"))
    again = Table(8, {"x": ((), "int64")}, backing=tables.MemmapBacking(directory, keep=True, reopen=True))
    assert os.path.getsize(path) == 8 * 4
    assert again.slots()["times_sampled"].tolist() == [5, 0, 7] and again.size == 3


# -- the rows all tables may have follow the memory budget


def test_the_rows_of_all_tables_follow_the_memory_budget_by_default():
    from pairing import Pair
    from tensorshare.errors import TooLargeError
    from tensorshare.protocol.messages import DELETE, TCREATE, Key, TableKey

    pair = Pair(memory_limit=24 * 1000)  # room for the state of 1,000 rows at 24 bytes
    assert pair.state.storage.tables.max_rows == 1000

    def create(name: str, capacity: int):
        spec = {"capacity": capacity, "columns": {"x": {"shape": [], "dtype": "uint8"}}}
        return pair.call(TCREATE, {Key.BIN: name, TableKey.SPEC: spec})

    create("a", 600)
    with pytest.raises(TooLargeError, match="1000 rows"):
        create("b", 600)
    pair.call(DELETE, {Key.BIN: "a"})
    create("b", 1000)
    # an explicit --max-table-rows wins; without a limit, the machine's memory counts
    assert Pair(memory_limit=24 * 1000, max_table_rows=5).state.storage.tables.max_rows == 5
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Pair().state.storage.tables.max_rows == physical // 24 > 1 << 26


# -- gathers from mapped files hint the kernel while they fault pages in


class _Mapping:
    """Records the madvise calls a gather makes (the array's real mapping stays unhinted)."""

    def __init__(self):
        self.calls = []

    def madvise(self, option, start=0, length=0):
        self.calls.append((start, length))


class _Column(np.ndarray):
    _mmap = None


def test_rows_are_hinted_while_gathers_are_slow_and_no_longer_once_they_are_fast():
    readahead = sys.modules["_tables_engine_under_test.readahead"]
    column = np.arange(40 * 4096, dtype=np.uint8).reshape(40, 4096).view(_Column)
    column._mmap = mapping = _Mapping()
    state = np.zeros(40, np.int64).view(_Column)
    state._mmap = state_mapping = _Mapping()
    now = [0.0]
    slow = [True]

    def clock():  # each gather "takes" 0.5 s (slow) or nothing (fast)
        now[0] += 0.5 if slow[0] else 0.0
        return now[0]

    reads = readahead.ReadAhead(clock)
    out = np.empty((4, 4096), np.uint8)
    slots = np.array([7, 3, 4, 30])

    def operation():
        reads.begin(slots, [column, state])
        reads.gather(column, slots, out)
        assert (out == column[slots]).all()

    operation()
    assert mapping.calls == [] and reads.hinting
    operation()  # every file's rows, one call per run of consecutive rows: 3-4, 7, 30
    assert mapping.calls == [(3 * 4096, 2 * 4096), (7 * 4096, 4096), (30 * 4096, 4096)]
    assert state_mapping.calls == [(0, 5 * 8), (0, 8 * 8), (0, 31 * 8)]  # (from the page each starts in)
    for _ in range(14):
        operation()
    mapping.calls.clear()
    operation()  # the 16th: a probe without hints, still slow
    assert mapping.calls == [] and reads.hinting and reads.probe == 32
    slow[0] = False
    for _ in range(31):
        operation()
    operation()  # a fast probe: hints off
    assert not reads.hinting
    mapping.calls.clear()
    operation()
    assert mapping.calls == []


@pytest.mark.parametrize("remover", ["fifo", "lowest_priority"])
def test_trees_rebuilt_after_a_kill_in_many_pieces_are_the_trees_kept_as_rows_changed(tmp_path, monkeypatch, remover):
    """A restart after a kill rebuilds every tree from the rows, a piece at a time on
    threads: what it builds is what the incremental updates kept."""
    monkeypatch.setattr(sys.modules[f"{tables.__name__}.blocks"], "CHUNK", 64)  # many pieces: several threads
    directory = str(tmp_path / "t")

    def table(reopen=False):
        return Table(1000, {"x": ((), "int64")}, sampler="prioritized", priority_exponent=0.6, remover=remover,
                     rng=3, backing=tables.MemmapBacking(directory, keep=True, reopen=reopen))

    t = table()
    rng = np.random.default_rng(0)
    for n in (800, 500):  # (the second evicts)
        t.insert(scalars(n), priorities=rng.random(n) + 0.01)
    t.update_priorities(t.sample(400).keys, rng.random(400) + 0.01)
    t.remove(t.sample(50).keys)
    kept = [index.tree.tree.copy() for index in t._indexes] + [t._slots.count.tree.copy()]
    before = t.slots()
    del t  # killed: no note
    again = table(reopen=True)
    rebuilt = [index.tree.tree for index in again._indexes] + [again._slots.count.tree]
    assert len(rebuilt) == 3
    for old, new in zip(kept, rebuilt):
        if old.dtype == np.float64:  # (sums of the same weights, added in another order)
            assert np.allclose(old, new, rtol=1e-12, atol=0)
        else:
            assert np.array_equal(old, new)
    after = again.slots()
    for what in ("indices", "keys", "priorities", "ends"):
        assert np.array_equal(before[what], after[what]), what
    assert again.size == before["indices"].size


def test_a_table_shut_cleanly_reopens_with_its_trees_and_one_killed_rebuilds_them(tmp_path, monkeypatch):
    directory = str(tmp_path / "t")

    def table(reopen=False):
        return Table(40, {"x": ((), "int64")}, sampler="prioritized", priority_exponent=0.5,
                     remover="lowest_priority", max_times_sampled=3, rng=1,
                     backing=tables.MemmapBacking(directory, keep=True, reopen=reopen))

    rebuilt = []
    restore = Table._restore
    monkeypatch.setattr(Table, "_restore", lambda self: rebuilt.append(1) or restore(self))
    t = table()
    episodes(t, [7, 30, 12])
    t.update_priorities(t.sample(9).keys, np.linspace(0.5, 4, 9))
    before = (t.size, t._slots.next_seq, t.samples_allowed(), t.slots()["keys"].tolist())
    moves = t._sampler.tree.bounds.copy()  # (the bounds of the sum tree's leaves the update moved)
    assert moves.any() or compiled.loops is None
    t.shut()
    del t
    again = table(reopen=True)
    assert rebuilt == [] and not os.path.exists(os.path.join(directory, "_slots", "shut.json"))
    assert (again.size, again._slots.next_seq, again.samples_allowed(), again.slots()["keys"].tolist()) == before
    assert np.array_equal(again._sampler.tree.bounds, moves)  # (so a leaf's bound holds across restarts)
    for index in again._indexes:  # the trees as they were are the trees the rows make
        kept = index.tree.tree.copy()
        index.tree.rebuild()
        if kept.dtype == np.float64:  # (the sum tree's moved leaves: within their bound of the sums)
            assert np.allclose(kept, index.tree.tree, rtol=1e-13, atol=0)
        else:
            assert np.array_equal(kept, index.tree.tree)
    kept = again._slots.count.tree.copy()
    again._slots.count.rebuild()
    assert np.array_equal(kept, again._slots.count.tree)
    again.insert(scalars(3, start=500))
    del again  # killed: no note, so the next start rebuilds
    third = table(reopen=True)
    assert rebuilt == [1] and third.size == 40 and 502 in xs(third.read(third.occupied()))


def test_a_table_from_before_the_leaves_bounds_rebuilds_its_trees_once(tmp_path, monkeypatch):
    """A durable table written before the sum tree kept its leaves' bounds (no
    ``tree_sum_bounds.bin``) reopens by rebuilding its trees, even after a clean stop,
    with every bound zero; the next clean stop reopens as usual."""
    directory = str(tmp_path / "t")

    def table(reopen=False):
        return Table(64, {"x": ((), "int64")}, sampler="prioritized", priority_exponent=0.6, rng=1,
                     backing=tables.MemmapBacking(directory, keep=True, reopen=reopen))

    rebuilt = []
    restore = Table._restore
    monkeypatch.setattr(Table, "_restore", lambda self: rebuilt.append(1) or restore(self))
    t = table()
    keys = t.insert(scalars(64), priorities=np.linspace(1, 2, 64)).keys
    t.update_priorities(keys[::3], np.linspace(3, 4, keys[::3].size))
    before = t.slots()
    t.shut()
    del t
    os.remove(os.path.join(directory, "_slots", "tree_sum_bounds.bin"))
    again = table(reopen=True)
    assert rebuilt == [1] and not again._sampler.tree.bounds.any()
    assert again.slots()["priorities"].tolist() == before["priorities"].tolist()
    kept = again._sampler.tree.tree.copy()
    again._sampler.tree.rebuild()
    assert np.array_equal(kept, again._sampler.tree.tree)
    again.shut()
    del again
    table(reopen=True)
    assert rebuilt == [1]


# -- a batch's temporaries


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_batchs_numpy_temporaries_reuse_heap_memory_instead_of_new_pages():
    script = """
import resource, numpy as np
from tensorshare_server import malloc
malloc.tune()
values = np.arange(1 << 17, dtype=np.int64)  # (1 MiB temporaries below)

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a = values * 3
        b = a + values
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()
outside = faults()
with malloc.heap_temporaries():
    faults()
    print(outside, faults())
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    outside, inside = map(int, out.stdout.split())
    assert outside >= 20 * 2 * 256 and inside < 64, (outside, inside)  # each MiB's pages faulted in again, or none


def _trees_as_rebuilt(t: Table) -> None:
    """Every tree of ``t`` is the tree its rows make (rebuilt from scratch on a copy)."""
    for tree in [index.tree for index in t._indexes] + [t._slots.count]:
        kept = tree.tree.copy()
        tree.rebuild()
        if kept.dtype == np.float64:  # (sums of the same weights, added in another order)
            assert np.allclose(kept, tree.tree, rtol=1e-12, atol=0)
        else:
            assert np.array_equal(kept, tree.tree), type(tree).__name__


@pytest.mark.parametrize("capacity", [77, 1000, 2048])
@pytest.mark.parametrize("sampler", ["fifo", "lifo", "prioritized"])
def test_trees_kept_by_ring_inserts_are_the_trees_the_rows_make(capacity, sampler):
    """Inserts into a ring buffer update the age orders run by run and leave the row
    counts of refilled slots alone: across wraps, partial blocks, batches larger than
    the table, and rows removed, sampled out or written between them, the trees stay
    those a rebuild makes."""
    t = x_table(capacity, sampler=sampler, remover="fifo", max_times_sampled=3 if sampler == "prioritized" else 0)
    rng = np.random.default_rng(capacity)
    for step in range(60):
        n = int(rng.choice([1, 31, 33, 200, capacity - 1, capacity + 5]))
        t.insert(scalars(n), priorities=rng.random(n) + 0.01)
        _trees_as_rebuilt(t)
        if step % 3 == 1 and t.size > 10:
            t.remove(t.sample(5).keys)
        elif step % 3 == 2:
            free = np.flatnonzero(t._slots.key < 0)
            t.write(np.concatenate((free[:3], t.occupied()[:2])), scalars(len(free[:3]) + 2))
        _trees_as_rebuilt(t)
    oldest = t._remover.index
    assert t._remover.victims(7).tolist() == oldest.tree.smallest(7).tolist()


def test_one_priority_for_all_weighs_as_each_row_would():
    """Rows given one priority for all get one power for all: the same weights, sums
    and probabilities as a power a row (and rows of other priorities beside them)."""
    t = x_table(1000, sampler="prioritized", priority_exponent=0.6)
    t.insert(scalars(500), priorities=0.7)
    t.insert(scalars(300), priorities=np.linspace(0.1, 3.0, 300))
    sampler = t._sampler
    for p in (np.full(700, 0.7), np.full((40, 16), 2.5), np.linspace(0.1, 3.0, 300)):
        np.testing.assert_allclose(sampler.weights(p), np.power(p, 0.6), rtol=1e-15, atol=0)
    expected = np.concatenate((np.full(500, 0.7 ** 0.6), np.linspace(0.1, 3.0, 300) ** 0.6))
    assert t._sampler.tree.total == pytest.approx(expected.sum(), rel=1e-12)
    drawn = t.sample(64)
    np.testing.assert_allclose(drawn.probabilities, expected[drawn.indices] / expected.sum(), rtol=1e-12)


def test_a_durable_table_hints_each_row_state_file_and_nothing_else(tmp_path):
    """While gathers are slow, each per-row state file is hinted at the rows read; the
    one-number file of the next key's seq is not (hinted at slot 2,399 it made every
    read of a durable table 451: ``madvise start out of bounds``)."""
    t = Table(2400, {"x": ((), "int64")}, backing=tables.MemmapBacking(str(tmp_path / "t"), keep=True))
    t.insert(scalars(2400))
    t._backing._hints.hinting = True  # (as after slow gathers: rows faulted in from the disk)
    assert xs(t.read([17, 2350, 3, 2399, 0])) == [17, 2350, 3, 2399, 0]
    assert sorted(os.path.basename(a.filename) for a in t._backing._rows) == [  # (a narrow column's too)
        "flags.bin", "key.bin", "priority.bin", "times_sampled.bin", "x.memmap"]


def _mapped_kib(path: str) -> int:
    """KiB of ``path``'s mapping in this process's page tables (smaps' Rss)."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for at, line in enumerate(lines):
        if line.endswith(" " + path):
            rss = next(entry for entry in lines[at + 1:] if entry.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError(f"{path} is not mapped")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps (Linux)")
def test_a_narrow_columns_pages_are_mapped_once_rows_are_written_and_a_wide_ones_are_not(tmp_path):
    """Rows written with pwritev are in the page cache, not in the column's mapping: the
    pages they were written to are mapped in at once (a gather right after would fault
    on each), for narrow columns (gathered through the mapping), not wide ones (read
    with preadv); a page is asked for once, not again when written again."""
    readahead = sys.modules[f"{tables.__name__}.readahead"]
    if readahead.POPULATE_READ is None:
        pytest.skip("no MADV_POPULATE_READ here")
    page, per_page = readahead.PAGE, readahead.PAGE // 8
    directory = str(tmp_path / "t")
    t = Table(64 * per_page, {"x": ((), "int64")}, remover="fifo", backing=tables.MemmapBacking(directory))
    path = os.path.realpath(os.path.join(directory, "x.memmap"))
    assert _mapped_kib(path) == 0
    t.insert(scalars(per_page + 1))  # the first page and a row of the second
    x = t._data[0]
    if not t._backing._written[id(x)].on:
        pytest.skip("the kernel refuses MADV_POPULATE_READ (before Linux 5.14)")
    assert _mapped_kib(path) == 2 * page // 1024
    t.insert(scalars(per_page - 1))  # the rest of the second page
    assert _mapped_kib(path) == 2 * page // 1024
    x._mmap.madvise(mmap.MADV_DONTNEED)  # the pages out of the mapping (still in the page cache)
    assert _mapped_kib(path) == 0
    t.write(np.arange(per_page), {"x": -np.arange(per_page)})  # the first page again: not asked for again
    assert _mapped_kib(path) == 0
    # (far from the first: a fault maps the cached pages of its 64 KiB around it too)
    far = np.arange(32 * per_page, 33 * per_page + 1)
    t.write(far, {"x": far})
    assert _mapped_kib(path) == 2 * page // 1024
    assert xs(t.read(np.arange(per_page))) == (-np.arange(per_page)).tolist()
    assert xs(t.read(far)) == far.tolist()

    wide = Table(8, {"w": ((page // 4,), "float32")}, backing=tables.MemmapBacking(str(tmp_path / "w")))
    wide.insert({"w": np.ones((8, page // 4), np.float32)})
    assert _mapped_kib(os.path.realpath(str(tmp_path / "w" / "w.memmap"))) == 0  # (read with preadv)
