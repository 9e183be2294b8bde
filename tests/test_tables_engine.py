"""The table engine (server/bins/tables): columns, slots and keys, samplers, removers,
the rate limiter, the trees under them, memory-mapped columns.  Pure code, tested
directly: no server, no torch (but for the tensordict check)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tensorshare.errors import BadRequestError, RemoteError, TooLargeError, TransientError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "server" / "bins" / "tables"
_NAME = "_tables_engine_under_test"
# Loads the package from this checkout by its path: ``tensorshare_server`` may be
# installed from another one, and importing it would start the whole server package.
_LOADER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location({_NAME!r}, {str(PACKAGE / "__init__.py")!r},
                                              submodule_search_locations=[{str(PACKAGE)!r}])
module = importlib.util.module_from_spec(spec)
sys.modules[{_NAME!r}] = module
spec.loader.exec_module(module)
"""


def _load():
    if _NAME not in sys.modules:
        exec(_LOADER, {})
    return sys.modules[_NAME]


tables = _load()
Table, RawArray = tables.Table, tables.RawArray
SumTree = sys.modules[f"{_NAME}.sumtree"].SumTree
MinTree = sys.modules[f"{_NAME}.mintree"].MinTree
CountTree = sys.modules[f"{_NAME}.occupancy"].CountTree
Slots = sys.modules[f"{_NAME}.slots"].Slots
sumtree = sys.modules[f"{_NAME}.sumtree"]
mintree = sys.modules[f"{_NAME}.mintree"]
compiled = sys.modules[f"{_NAME}.compiled"]
take_rows = sys.modules[f"{_NAME}.rows"].take_rows
LOOPS = compiled.loops  # the compiled hot loops, None where they were not built
needs_loops = pytest.mark.skipif(LOOPS is None, reason="the compiled loops are not built here (no C compiler)")


@pytest.fixture(params=["compiled", "numpy"])
def tree_path(request, monkeypatch):
    """Run a test with the engine's compiled loops, then with numpy's alone."""
    if request.param == "numpy":
        monkeypatch.setattr(compiled, "loops", None)
    elif LOOPS is None:
        pytest.skip("the compiled loops are not built here (no C compiler at install)")
    return request.param


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square with ``df`` degrees of freedom at the normal
    quantile ``z`` (3.719: tail 1e-4), by the Wilson-Hilferty approximation."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(counts: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities / probabilities.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def scalars(n: int, start: int = 0) -> dict:
    return {"x": np.arange(start, start + n, dtype=np.int64)}


def x_table(capacity: int, **kw) -> Table:
    return Table(capacity, {"x": ((), "int64")}, rng=kw.pop("rng", 0), **kw)


def xs(rows) -> list[int]:
    return rows.values["x"].to_numpy().tolist()


# -- the boundary


def test_as_index_is_a_slice_exactly_for_consecutive_ascending_slots(tree_path):
    """A few slots are looked at as Python ints, more with the compiled loop or numpy:
    all say the same, on either side of the change."""
    as_index = sys.modules[f"{_NAME}.slots"].as_index
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, 31, 32, 33, 100, 200):
        run = np.arange(7, 7 + n, dtype=np.int64)
        cases = [(run, n > 0)]
        if n > 1:
            cases += [(run[::-1].copy(), False), (np.roll(run, 1), False),
                      (np.concatenate((run[:-1], [run[-1] + 1])), False),
                      (np.concatenate(([run[0]], run[:-1])), False)]  # (a repeat, span n - 2)
        if n > 3:
            inner = run.copy()
            inner[1], inner[2] = inner[2], inner[1]  # (the right span, out of order within)
            cases.append((inner, False))
            shuffled = rng.permutation(run)
            cases.append((shuffled, bool((shuffled == run).all())))
        for slots, consecutive in cases:
            got = as_index(slots)
            if consecutive:
                assert got == slice(7, 7 + n), slots
            else:
                assert got is slots, slots


def test_a_run_check_finds_a_step_off_anywhere(tree_path):
    """Every position of a break is found, in and past the compiled loop's chunks of 64
    differences, for steps of 1 and of a ring's keys, in a few values and in many; a
    non-contiguous or non-int64 array takes the Python or numpy path to the same answer."""
    is_run = sys.modules[f"{_NAME}.blocks"].is_run
    for step in (1, 1001):
        for n in (1, 2, 3, 32, 33, 64, 65, 66, 129, 300):  # (a few: the Python ints' path without the loop)
            run = np.arange(n, dtype=np.int64) * step + 5
            assert is_run(run, step) and (n == 1 or not is_run(run, step + 1))
            assert is_run(run[::2], 2 * step) and is_run(run.astype(np.int32), step)
            for at in sorted({1, 2, 63, 64, 65, 66, 127, 128, n - 1} & set(range(1, n))):
                off = run.copy()
                off[at] += 1
                assert not is_run(off, step), (step, n, at)
                off[at:] += 1  # (the rest on by one too: only the step at ``at`` is off)
                assert not is_run(off, step), (step, n, at)


def test_a_run_made_as_one_is_known_only_for_its_step_and_stays_one(tree_path):
    """An array ``run_of`` made is a run without a look (for its own step only), cannot
    be written, and one of its copies, written, is looked at again; a table's inserts
    into a ring and into a filling table hand such runs on, and keep their keys right."""
    blocks = sys.modules[f"{_NAME}.blocks"]
    for n in (5, 40, 100):
        run = blocks.run_of(10, n, 3)
        assert run.tolist() == list(range(10, 10 + 3 * n, 3))
        assert blocks.is_run(run, 3) and not blocks.is_run(run, 1)
        with pytest.raises(ValueError):
            run[1] = 0
        copy = run.copy()
        copy[n // 2] += 1
        assert not blocks.is_run(copy, 3)
    assert blocks.run_of(4, 0).size == 0
    # (remembered weakly: a run the table is done with is freed, and its id, reused, is
    # not taken for a run)
    import gc
    import weakref

    run = blocks.run_of(0, 1000)
    gone = weakref.ref(run)
    del run
    gc.collect()
    assert gone() is None
    for _ in range(20):
        other = np.arange(1000, dtype=np.int64)[::-1].copy()
        assert not blocks.is_run(other)
    t = Table(100, {"x": ((), "int64")}, remover="fifo")
    keys = [t.insert({"x": np.arange(40)}).keys for _ in range(5)]  # (filling, then a ring)
    assert t.size == 100
    assert np.concatenate(keys).tolist() == [seq * 100 + seq % 100 for seq in range(200)]
    assert sorted(t._slots.key.tolist()) == [seq * 100 + seq % 100 for seq in range(100, 200)]


def test_a_ring_of_oldest_rows_counts_only_live_rows_few_or_many():
    """The fifo remover's shortcut takes the k oldest slots when their keys follow one
    another; a slot whose row is not live (its key not yet cleared) breaks it, whether
    k is a few (compared as Python ints) or many (with numpy)."""
    LIVE = sys.modules[f"{_NAME}.slots"].LIVE
    for k in (5, 50):
        t = Table(100, {"x": ((), "int64")}, remover="fifo")
        t.insert({"x": np.arange(100)})
        ring = t._remover.index._ring
        assert ring(k).tolist() == list(range(k))
        t._slots.flags[1] &= ~LIVE
        assert ring(k) is None


def test_importing_the_engine_loads_neither_torch_nor_twisted():
    code = _LOADER + "print(sorted(m for m in ('torch', 'twisted', 'tensorshare_server') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_errors_carry_reply_codes():
    assert issubclass(tables.ColumnMismatchError, BadRequestError) and tables.ColumnMismatchError.code == 501
    assert issubclass(tables.TableFullError, TooLargeError) and tables.TableFullError.code == 552
    assert issubclass(tables.WouldBlockError, TransientError) and tables.WouldBlockError.code == 450
    assert issubclass(tables.SlotIndexError, IndexError)
    for name in ("TableSpecError", "BadArgumentError", "ColumnMismatchError", "SlotIndexError", "EmptySlotError",
                 "PriorityError", "TableFullError", "BatchTooLargeError", "EmptyTableError", "WouldBlockError"):
        cls = getattr(tables, name)
        assert issubclass(cls, tables.TableError) and issubclass(cls, RemoteError)
    assert str(tables.EmptyTableError("empty")) == "450 empty"


# -- specs and clear errors


@pytest.mark.parametrize("kwargs, match", [
    ({"capacity": 0}, "capacity"),
    ({"sampler": "random"}, "unknown sampler"),
    ({"remover": "lifo"}, "unknown remover"),
    ({"priority_exponent": -1}, "priority_exponent"),
    ({"max_times_sampled": -1}, "max_times_sampled"),
    ({"columns": {"x": ((), "float128")}}, "unknown dtype"),
    ({"columns": {"a b": ((), "int8")}}, "identifier"),
    ({"columns": {".hidden": ((), "int8")}}, "identifier"),
    ({"columns": {"x": ((-1,), "int8")}}, "shape"),
    ({"columns": {"x": "int8"}}, "expected"),
    ({"min_size_to_sample": 0}, "min_size_to_sample"),
    ({"min_size_to_sample": 11}, "above the capacity"),
    ({"samples_per_insert": 2.0}, "needs an error_buffer"),
    ({"error_buffer": 5}, "needs samples_per_insert"),
    ({"samples_per_insert": 4.0, "error_buffer": 3}, "at least"),
    ({"samples_per_insert": 1.0, "min_size_to_sample": 5, "error_buffer": (6, 20)}, "no sample could follow"),
])
def test_bad_specs_are_refused(kwargs, match):
    kwargs = {"capacity": 10, **kwargs}
    with pytest.raises(tables.TableSpecError, match=match):
        Table(**kwargs)


def test_columns_accept_torch_names_and_report_their_spec():
    t = Table(4, {"obs": ((4, 84, 84), "torch.uint8"), "r": ((), "float32")})
    assert t.info()["columns"] == {"obs": {"shape": [4, 84, 84], "dtype": "uint8"},
                                   "r": {"shape": [], "dtype": "float32"}}
    assert [c.row_bytes for c in t.columns] == [4 * 84 * 84, 4]


def test_batches_that_do_not_match_the_columns_are_refused_and_change_nothing():
    t = Table(8, {"a": ((2,), "float32"), "b": ((), "int64")})
    good = {"a": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.int64)}
    bad = [
        ({**good, "c": np.zeros(3, np.int64)}, "no column named 'c'"),
        ({"a": good["a"]}, "'b' is missing"),
        ({**good, "a": np.zeros((3, 2), np.float64)}, "holds float32, not float64"),
        ({**good, "a": np.zeros((3, 3), np.float32)}, "rows of shape"),
        ({**good, "b": np.zeros(2, np.int64)}, "has 2 rows"),
        ({**good, "b": np.array(1, np.int64)}, "leading dimension"),
        ({**good, "a": RawArray("float32", (3, 2), b"\0" * 23)}, "23 bytes"),
        ({**good, "a": np.zeros((3, 2), ">f4")}, "cannot be stored"),
        ({**good, "a": [[0.0, 0.0]] * 3}, "expected a RawArray"),
    ]
    for batch, match in bad:
        with pytest.raises(tables.ColumnMismatchError, match=match):
            t.insert(batch)
    with pytest.raises(tables.ColumnMismatchError, match="3 indices for a batch of 2"):
        t.write([0, 1, 2], {"a": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.int64)})
    assert t.size == 0 and t.inserts == 0 and t.version == 0
    t.insert(good)
    assert t.size == 3


def test_index_errors():
    t = x_table(5)
    t.insert(scalars(2))
    with pytest.raises(tables.SlotIndexError, match="index 5 out of range"):
        t.read([0, 5])
    with pytest.raises(tables.SlotIndexError, match="out of range"):
        t.read([-1])
    with pytest.raises(tables.BadArgumentError, match="must be integers"):
        t.read([0.5])
    with pytest.raises(tables.BadArgumentError, match="must be integers"):
        t.update_priorities(["a"], [1.0])
    with pytest.raises(tables.BadArgumentError, match="row count"):
        t.sample(-1)
    with pytest.raises(tables.BadArgumentError, match="row count"):
        t.can_insert(1.5)
    with pytest.raises(tables.SlotIndexError, match="more than once"):
        t.write([3, 3], scalars(2))
    with pytest.raises(tables.EmptySlotError, match="slot 3 holds no row"):
        t.read([1, 3])
    with pytest.raises(tables.PriorityError):
        t.update_priorities([0], [-1.0])
    with pytest.raises(tables.PriorityError):
        t.insert(scalars(2), priorities=[1.0, math.nan])
    with pytest.raises(tables.PriorityError, match="3 priorities for 2 rows"):
        t.insert(scalars(2), priorities=[1, 2, 3])
    assert t.size == 2


def test_sampling_an_empty_table_raises_and_can_sample_says_no():
    t = x_table(5)
    assert not t.can_sample(1)
    with pytest.raises(tables.EmptyTableError):
        t.sample(1)
    assert t.sample(0).keys.size == 0


# -- rows: keys, indices, bytes


TWO_BYTE_AND_OTHERS = [("bfloat16", 2), ("float16", 2), ("int16", 2), ("uint8", 1), ("bool", 1),
                       ("float32", 4), ("int64", 8), ("complex64", 8), ("float8_e4m3fn", 1), ("complex128", 16)]


def test_write_and_read_at_arbitrary_indices_round_trip_bytes_exactly():
    rng = np.random.default_rng(7)
    shape = (3, 5)
    columns = {f"c_{dtype}": (shape, dtype) for dtype, _ in TWO_BYTE_AND_OTHERS}
    t = Table(64, columns, rng=0)
    expected: dict[int, dict[str, bytes]] = {}
    for _ in range(6):
        idx = rng.choice(64, size=int(rng.integers(1, 20)), replace=False)
        batch, rows = {}, [{} for _ in idx]
        for dtype, width in TWO_BYTE_AND_OTHERS:
            raw = rng.integers(0, 256, size=(idx.size, *shape, width), dtype=np.uint8)
            batch[f"c_{dtype}"] = RawArray(dtype, (idx.size, *shape), raw.tobytes())
            for i in range(idx.size):
                rows[i][f"c_{dtype}"] = raw[i].tobytes()
        t.write(idx, batch)
        expected.update(zip(idx.tolist(), rows))
    assert t.size == len(expected)
    order = rng.permutation(sorted(expected))
    back = t.read(np.concatenate([order, order[:3]]))  # any order, repeats allowed
    for name, arr in back.values.items():
        assert arr.dtype == name[2:] and arr.shape == (order.size + 3, *shape)
        for i, slot in enumerate(np.concatenate([order, order[:3]]).tolist()):
            assert arr.data[i].tobytes() == expected[slot][name]
    assert back.values["c_float16"].to_numpy().dtype == np.float16
    with pytest.raises(TypeError):
        back.values["c_bfloat16"].to_numpy()


def test_keys_grow_name_one_row_for_good_and_give_its_index():
    t = x_table(4, remover="fifo")
    first = t.insert(scalars(3))
    assert first.indices.tolist() == [0, 1, 2]
    assert (first.keys % 4 == first.indices).all() and (np.diff(first.keys) > 0).all()
    again = t.write([1], scalars(1, 100))  # replaces the row at index 1: new key, old key dead
    assert again.removed.keys.tolist() == [first.keys[1]] and again.keys[0] > first.keys[-1]
    assert t.update_priorities([first.keys[1]], [5.0]) == 0  # stale key: ignored
    assert t.update_priorities(again.keys, [5.0]) == 1
    assert t.remove([first.keys[1], 10**15, -3]).keys.size == 0
    assert xs(t.read([0, 1, 2])) == [0, 100, 2]
    assert t.size == 3 and t.inserts == 4 and t.removals == 1


def test_a_dataset_fills_slots_by_index_and_size_counts_written_slots():
    t = x_table(1000, remover=None)
    t.write([999, 0, 500], scalars(3))
    assert t.size == 3
    t.write([0], scalars(1, 7))  # overwrite: still 3
    assert t.size == 3 and xs(t.read([0, 500, 999])) == [7, 2, 0]
    with pytest.raises(tables.EmptySlotError):
        t.read([1])


def test_insert_into_a_full_table_without_remover():
    t = x_table(3, remover=None)
    t.insert(scalars(3))
    with pytest.raises(tables.TableFullError):
        t.can_insert(1)
    with pytest.raises(tables.TableFullError):
        t.insert(scalars(1))
    with pytest.raises(tables.BatchTooLargeError):
        x_table(3, remover="lowest_priority").insert(scalars(4))
    # rows leave as they are sampled out: then a full table means wait
    q = x_table(3, remover=None, sampler="fifo", max_times_sampled=1)
    q.insert(scalars(3))
    assert not q.can_insert(1) and q.inserts_allowed() == 0
    with pytest.raises(tables.WouldBlockError):
        q.insert(scalars(1))
    version = q.version
    assert xs(q.sample(2)) == [0, 1]
    assert q.version > version and q.can_insert(2) and not q.can_insert(3)


def test_a_table_of_items():
    t = Table(3, sampler="fifo", remover="fifo", rng=0)
    items = [object() for _ in range(5)]
    first = t.insert(items[:3])
    assert first.removed.items == []
    second = t.insert(items[3:])
    assert second.removed.items == items[:2]  # the oldest made room, handed back for release
    assert t.sample(2).items == [items[2], items[2]]
    assert t.read([2, 0]).items == [items[2], items[3]]
    with pytest.raises(tables.ColumnMismatchError):
        t.insert({"x": 1})
    gone = t.remove(second.keys[:1])
    assert gone.items == [items[3]]
    assert t.info()["columns"] is None


def test_sample_and_read_gather_into_given_buffers():
    t = Table(16, {"obs": ((2, 3), "uint8"), "r": ((), "float32")}, rng=1)
    t.insert({"obs": np.arange(96, dtype=np.uint8).reshape(16, 2, 3), "r": np.arange(16, dtype=np.float32)})
    obs, r = bytearray(8 * 6), np.zeros(10, np.float32)  # r larger than needed: its start is used
    s = t.sample(8, out={"obs": obs, "r": r})
    assert np.shares_memory(s.values["r"].data, r)
    assert bytes(obs) == s.values["obs"].data.tobytes()
    assert (r[:8] == s.indices).all()
    assert (s.values["obs"].to_numpy()[:, 0, 0] == s.indices * 6).all()
    with pytest.raises(tables.ColumnMismatchError, match="at least 48 bytes"):
        t.read([0] * 8, out={"obs": bytearray(47)})
    with pytest.raises(tables.ColumnMismatchError, match="writable"):
        t.read([0] * 8, out={"obs": bytes(48)})
    with pytest.raises(tables.ColumnMismatchError, match="no column 'x'"):
        t.read([0], out={"x": bytearray(8)})
    # a bad buffer fails a sample before it counts or removes anything
    q = Table(4, {"r": ((), "float32")}, max_times_sampled=1, rng=0)
    q.insert({"r": np.ones(4, np.float32)})
    with pytest.raises(tables.ColumnMismatchError):
        q.sample(4, out={"r": bytearray(3)})
    assert q.size == 4 and q.samples == 0 and q.sample(4).removed.keys.size == 4


# -- samplers


def test_uniform_sampler_distribution():
    t = x_table(50, sampler="uniform", rng=12345)
    t.insert(scalars(10))
    s = t.sample(100_000)
    counts = np.bincount(s.indices, minlength=10)
    assert chi2(counts, np.ones(10)) < chi2_critical(9)
    assert np.allclose(s.probabilities, 0.1)


@pytest.mark.parametrize("stratified", [False, True])
def test_prioritized_sampler_distribution_follows_the_exponent(stratified, tree_path):
    t = x_table(64, sampler="prioritized", priority_exponent=0.6, stratified=stratified, rng=2024)
    priorities = np.arange(1.0, 11.0)
    t.insert(scalars(10), priorities=priorities)
    s = t.sample(200_000)
    counts = np.bincount(s.indices, minlength=10)
    expected = priorities ** 0.6
    assert chi2(counts, expected) < chi2_critical(9)
    assert np.allclose(s.probabilities, (expected / expected.sum())[s.indices])
    # narrow enough to catch a wrong exponent
    assert chi2(counts, priorities ** 0.5) > 10 * chi2_critical(9)
    assert chi2(counts, priorities ** 0.7) > 10 * chi2_critical(9)


def test_updated_priorities_are_reflected_in_sampling(tree_path):
    t = x_table(100, sampler="prioritized", priority_exponent=1.0, rng=99)
    keys = t.insert(scalars(4)).keys
    assert t.update_priorities(keys, [0.0, 1.0, 3.0, 0.0]) == 4
    counts = np.bincount(t.sample(40_000).indices, minlength=4)
    assert counts[0] == 0 and counts[3] == 0
    assert chi2(counts[1:3], np.array([1.0, 3.0])) < chi2_critical(1, z=4.0) + 1
    # a key given twice: the last priority wins; the sampler sees it
    t.update_priorities([keys[0], keys[0], keys[1]], [50.0, 2.0, 0.0])
    counts = np.bincount(t.sample(40_000).indices, minlength=4)
    assert counts[1] == 0 and counts[3] == 0
    assert chi2(counts[[0, 2]], np.array([2.0, 3.0])) < chi2_critical(1, z=4.0) + 1
    assert t.read([0, 1, 2]).priorities.tolist() == [2.0, 0.0, 3.0]
    # all weights zero: uniform over the rows
    t.update_priorities(keys, [0, 0, 0, 0])
    s = t.sample(1000)
    assert set(s.indices.tolist()) == {0, 1, 2, 3} and np.allclose(s.probabilities, 0.25)


def test_priority_updates_in_any_order_leave_the_trees_as_a_rebuild_does(tree_path):
    """Distinct keys in no order, a key given twice, and keys whose rows left: each
    update sets the right rows (the last of a key given twice) and the sampler's and
    the lowest-priority remover's trees agree with trees rebuilt from the rows."""
    t = x_table(200, sampler="prioritized", priority_exponent=0.6, remover="lowest_priority", rng=7)
    keys = t.insert(scalars(150), priorities=np.arange(1.0, 151.0)).keys
    rng = np.random.default_rng(3)
    expected = dict(zip(keys.tolist(), np.arange(1.0, 151.0).tolist()))
    for update in (rng.permutation(keys)[:60], np.concatenate([keys[5:9], keys[5:7], [10_000, -1]]),
                   keys[::-1][:40]):
        new = rng.random(update.size) * 10 + 0.1
        for key, p in zip(update.tolist(), new.tolist()):
            if key in expected:
                expected[key] = p
        assert t.update_priorities(update, new) == len(set(update.tolist()) & set(expected))
        got = t.read(range(150)).priorities
        assert got.tolist() == [expected[k] for k in keys.tolist()]
        sampler, order = t._sampler.tree, t._remover.index.tree  # (the sum tree; the lowest-priority order)
        before = (sampler.tree.copy(), order.tree.copy())
        sampler.rebuild()
        order.rebuild()
        assert np.allclose(before[0], sampler.tree, rtol=1e-12, atol=0) and np.array_equal(before[1], order.tree)


@needs_loops
@pytest.mark.parametrize("exponent", [0.6, 1.0, 0.5, 0.0])
def test_blocks_of_one_priority_sum_bit_for_bit_as_a_block_recomputed_alone_does(exponent):
    """An insert whose rows share one priority has its whole blocks summed once (the
    compiled refresh's shortcut); a block recomputed alone (one row's update) takes
    the general way: the tree must not change by a bit, nor differ from a rebuild."""
    t = x_table(160, sampler="prioritized", priority_exponent=exponent, remover="fifo", rng=0)
    sampler = t._sampler.tree
    for priorities, first in ((None, 0), (0.7, 0), (3.25, 37), (np.full(160, 1e-3), 0)):  # the last wraps the ring
        keys = t.insert(scalars(160, start=first), priorities=priorities).keys
        tree = sampler.tree.copy()
        leaves = tree[sampler.layout.leaves:sampler.layout.leaves + 10]
        assert len(set(leaves.tolist())) == 1 and leaves[0] > 0  # 10 whole blocks of 16, one sum
        one = t.read([5]).priorities[0]
        t.update_priorities(keys[5:6], [one])  # block 0 alone: the general way
        assert np.array_equal(sampler.tree, tree)
        sampler.rebuild()
        assert np.allclose(sampler.tree, tree, rtol=1e-12, atol=0)


def test_priority_overflowing_the_exponent_is_refused():
    t = x_table(4, sampler="prioritized", priority_exponent=4.0)
    with pytest.raises(tables.PriorityError, match="overflows"):
        t.insert(scalars(1), priorities=[1e100])


def test_priorities_whose_sum_would_overflow_are_refused_and_the_largest_allowed_sample_soundly(tree_path):
    """Issue #31, item 10: each of [1, 1, 1e308, 1e308] is finite, their sum is not;
    the tree's total became inf, every draw landed on one slot and the probabilities
    were 0 (infinite importance weights)."""
    t = x_table(4, sampler="prioritized", rng=5)
    with pytest.raises(tables.PriorityError, match="largest weight"):
        t.insert(scalars(4), priorities=[1.0, 1.0, 1e308, 1e308])
    assert t.size == 0
    top = SumTree(4, lambda pick: pick(np.zeros(4))).max_weight
    t.insert(scalars(4), priorities=[1.0, 1.0, top, top])
    s = t.sample(2000)
    assert np.isfinite(s.probabilities).all() and (s.probabilities > 0).all()
    drawn = np.bincount(s.indices, minlength=4)
    assert drawn[2] > 800 and drawn[3] > 800, drawn
    with pytest.raises(tables.PriorityError, match="largest weight"):
        t.update_priorities(s.keys[:1], [1e308])


def test_fifo_and_lifo_samplers():
    fifo = x_table(10, sampler="fifo")
    fifo.insert(scalars(5))
    assert xs(fifo.sample(3)) == [0, 0, 0]  # as Reverb: the oldest, as long as it stays
    assert np.allclose(fifo.sample(1).probabilities, 1.0)
    lifo = x_table(10, sampler="lifo")
    lifo.insert(scalars(5))
    lifo.insert(scalars(1, 9))
    assert xs(lifo.sample(2)) == [9, 9]


def test_a_sample_without_states_draws_and_counts_the_same_rows():
    """``states=False`` (a TSAMPLE or TREAD reply sends neither): no priorities or counts
    gathered, and the same draw, counts and removals as a sample with them; reads and
    sequences take it too."""
    made = []
    for states in (True, False):
        t = x_table(50, sampler="prioritized", max_times_sampled=2, rng=np.random.default_rng(4))
        t.insert(scalars(40), priorities=np.arange(1.0, 41.0))
        s = t.sample(16, states=states)
        made.append((s, t.slots(0)["times_sampled"].tolist()))
    (full, counts), (bare, bare_counts) = made
    assert bare.priorities is None and bare.times_sampled is None
    assert full.priorities is not None and full.times_sampled is not None
    assert xs(bare) == xs(full) and bare.keys.tolist() == full.keys.tolist() and counts == bare_counts
    assert bare.removed.keys.tolist() == full.removed.keys.tolist()
    t = x_table(50, sampler="uniform", rng=np.random.default_rng(5))
    t.insert(scalars(40), ends=np.arange(40) % 10 == 9)
    for rows in (t.read([3, 1, 3], states=False), t.read([2], sampled=True, states=False)):
        assert rows.priorities is None and rows.times_sampled is None
    assert xs(t.read([3, 1, 3], states=False)) == [3, 1, 3] and t.read([2]).times_sampled.tolist() == [1]
    sequences = t.sample_sequences(4, 3, states=False)
    assert sequences.priorities is None and sequences.times_sampled is None and sequences.keys.size == 12


def test_fifo_with_max_times_sampled_moves_on_as_rows_leave():
    q = x_table(10, sampler="fifo", max_times_sampled=1)
    q.insert(scalars(6))
    s = q.sample(4)
    assert xs(s) == [0, 1, 2, 3] and q.size == 2
    assert s.removed.keys.tolist() == s.keys.tolist() and (s.times_sampled == 1).all()
    assert not q.can_sample(3)  # only 2 rows left to give
    with pytest.raises(tables.WouldBlockError):
        q.sample(3)
    twice = x_table(10, sampler="fifo", max_times_sampled=2)
    twice.insert(scalars(4))
    assert xs(twice.sample(3)) == [0, 0, 1]
    assert xs(twice.sample(3)) == [1, 2, 2]
    assert twice.size == 1 and twice.samples_allowed() == 2
    stack = x_table(10, sampler="lifo", max_times_sampled=1)
    stack.insert(scalars(4))
    assert xs(stack.sample(3)) == [3, 2, 1]


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_times_sampled_with_random_samplers(sampler):
    t = x_table(50, sampler=sampler, max_times_sampled=2, rng=5)
    t.insert(scalars(20), priorities=np.linspace(0.1, 5, 20))
    s = t.sample(30)
    seen = np.bincount(s.indices, minlength=20)
    assert seen.max() <= 2
    assert t.size == 20 - int((seen == 2).sum())
    assert set(s.removed.keys.tolist()) == set(s.keys[seen[s.indices] == 2].tolist())
    assert t.samples_allowed() == 40 - 30
    rest = t.sample(10)  # exactly what is left
    assert t.size == 0 and np.bincount(np.concatenate([s.indices, rest.indices]), minlength=20).tolist() == [2] * 20
    assert t.removals == 20


def test_max_times_sampled_one_samples_without_replacement_in_proportion():
    # sampled one at a time, each row at most once: the first pick follows the priorities
    firsts = np.zeros(3, int)
    t = x_table(8, sampler="prioritized", max_times_sampled=1, rng=3)
    for _ in range(3000):
        t.insert(scalars(3), priorities=[1.0, 2.0, 7.0])
        s = t.sample(3)
        assert sorted(s.indices.tolist()) == sorted(set(s.indices.tolist()))
        firsts[s.values["x"].to_numpy()[0]] += 1
    assert chi2(firsts, np.array([1.0, 2.0, 7.0])) < chi2_critical(2)


# -- removers


def test_fifo_remover_evicts_the_oldest():
    t = x_table(4, remover="fifo", sampler="uniform")
    keys = t.insert(scalars(4)).keys
    newest = t.write([1], scalars(1, 50)).keys  # index 1 now holds the newest row
    w = t.insert(scalars(2, 10))
    assert w.removed.keys.tolist() == [keys[0], keys[2]] and sorted(w.indices.tolist()) == [0, 2]
    w = t.insert(scalars(2, 20))
    assert w.removed.keys.tolist() == [keys[3], newest[0]]
    assert sorted(xs(t.read(range(4)))) == [10, 11, 20, 21]
    assert t.removals == 5 and t.size == 4


def test_lowest_priority_remover_evicts_lowest_then_oldest(tree_path):
    t = x_table(5, remover="lowest_priority", sampler="uniform")
    keys = t.insert(scalars(5), priorities=[3.0, 1.0, 2.0, 1.0, 5.0]).keys
    low = t.insert(scalars(1, 10), priorities=[0.5])
    assert low.removed.keys.tolist() == [keys[1]]  # priority 1, older than row 3
    w = t.insert(scalars(2, 20), priorities=[9.0, 9.0])
    assert w.removed.keys.tolist() == [low.keys[0], keys[3]]  # chosen among the rows already there
    assert sorted(xs(t.read(range(5)))) == [0, 2, 4, 20, 21]
    t2 = x_table(4, remover="lowest_priority")
    keys = t2.insert(scalars(4), priorities=[1.0, 1.0, 1.0, 1.0]).keys
    t2.update_priorities(keys[:2], [4.0, 4.0])
    w = t2.insert(scalars(2, 10), priorities=[0.1, 0.1])
    assert w.removed.keys.tolist() == keys[2:].tolist()
    assert t2.insert(scalars(1, 20)).removed.keys.tolist() == [w.keys[0]]


def test_a_full_fifo_table_is_a_ring_buffer():
    t = x_table(5, remover="fifo")
    for start, n in [(0, 3), (3, 4), (7, 1), (8, 5)]:
        w = t.insert(scalars(n, start))
        assert w.indices.tolist() == [i % 5 for i in range(start, start + n)]
    assert xs(t.read(range(5))) == [10, 11, 12, 8, 9]


# -- the rate limiter


def test_rate_limiter_blocks_both_ways():
    t = x_table(100, samples_per_insert=2.0, min_size_to_sample=10, error_buffer=4)  # window [16, 24]
    assert not t.can_sample(1) and t.samples_allowed() == 0
    assert t.can_insert(12)  # as Reverb: the balance starts at 0, and 12 rows earn 24
    with pytest.raises(tables.BatchTooLargeError):
        t.can_insert(13)  # 26: more than the balance can ever be below the window's top
    t.insert(scalars(10))
    assert t.can_sample(4) and not t.can_sample(5) and t.samples_allowed() == 4
    assert t.can_insert(2) and not t.can_insert(3) and t.inserts_allowed() == 2
    t.insert(scalars(2))
    assert not t.can_insert(1)
    with pytest.raises(tables.WouldBlockError):
        t.insert(scalars(1))
    version = t.version
    t.sample(8)
    assert t.version > version
    assert t.can_insert(4) and not t.can_insert(5) and not t.can_sample(1)
    with pytest.raises(tables.WouldBlockError):
        t.sample(1)
    info = t.info()["rate_limiter"]
    assert (info["min_diff"], info["max_diff"], info["diff"]) == (16.0, 24.0, 16.0)
    assert info["inserts_allowed"] == 4 and info["samples_allowed"] == 0


def test_rate_limiter_refuses_at_once_what_it_could_never_allow():
    t = x_table(100, samples_per_insert=1.0, min_size_to_sample=1, error_buffer=3)  # window 6 wide
    t.insert(scalars(1))
    assert not t.can_sample(6)
    with pytest.raises(tables.BatchTooLargeError):
        t.can_sample(7)
    with pytest.raises(tables.BatchTooLargeError):
        t.sample(7)
    with pytest.raises(tables.BatchTooLargeError):
        t.can_insert(7)
    q = x_table(4, max_times_sampled=2)
    with pytest.raises(tables.BatchTooLargeError):
        q.can_sample(9)


def test_limits_change_at_run_time_and_apply_at_once():
    t = x_table(100, min_size_to_sample=5)
    t.insert(scalars(3))
    assert not t.can_sample(1)
    version = t.version
    t.set_limits(min_size_to_sample=2)
    assert t.version > version and t.can_sample(100)
    # a ratio starts balanced: at the centre of its window, min_size_to_sample * 1.0 = 2
    t.set_limits(samples_per_insert=1.0, error_buffer=2)  # window [0, 4]
    assert t.can_sample(2) and not t.can_sample(3)
    assert t.can_insert(2) and not t.can_insert(3)
    with pytest.raises(tables.TableSpecError):
        t.set_limits(error_buffer=0.5)  # too narrow: refused, limits unchanged
    assert t.can_insert(2) and not t.can_insert(3)
    t.set_limits(error_buffer=(0, 10))
    assert t.can_insert(8) and not t.can_insert(9)
    t.set_limits(samples_per_insert=None)
    assert t.can_insert(100) and t.can_sample(10_000)
    assert t.info()["rate_limiter"]["error_buffer"] is None
    with pytest.raises(tables.TableSpecError):
        t.set_limits(min_size_to_sample=101)


@settings(max_examples=60, deadline=None)
@given(spi=st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), min_size=st.integers(1, 8), buffer=st.integers(3, 12),
       ops=st.lists(st.tuples(st.sampled_from(["insert", "sample", "remove"]), st.integers(1, 5)), max_size=60))
def test_rate_limiter_decides_as_reverbs_rule(spi, min_size, buffer, ops):
    """Against a transcription of Reverb's RateLimiter::CanInsert / CanSample, with
    its counters: inserts, samples, deletes."""
    t = x_table(1000, samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=buffer)
    min_diff, max_diff = spi * min_size - buffer, spi * min_size + buffer
    inserts = samples = deletes = 0
    for op, n in ops:
        reverb_insert = inserts + n - deletes <= min_size or (inserts + n) * spi - samples <= max_diff
        reverb_sample = inserts - deletes >= min_size and inserts * spi - samples - n >= min_diff
        assert decision(t.can_insert, n) in ((True,) if reverb_insert else (False, "never"))
        assert decision(t.can_sample, n) in ((True,) if reverb_sample else (False, "never"))
        if op == "insert" and reverb_insert:
            t.insert(scalars(n))
            inserts += n
        elif op == "sample" and reverb_sample:
            t.sample(n)
            samples += n
        elif op == "remove" and t.size:
            deletes += t.remove(t.read(t.occupied()[:n]).keys).keys.size


def decision(can, n: int):
    try:
        return can(n)
    except tables.BatchTooLargeError:
        return "never"


# -- the trees under the selectors


@settings(max_examples=80, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 70), block=st.sampled_from([1, 2, 4, 16]))
def test_sum_tree_sums_and_searches_under_random_batched_updates(data, capacity, block):
    model = np.zeros(capacity)
    top = data.draw(st.sampled_from([0, 1, 2, 12]))  # the level searches start from: all the way down, or a mix
    tree = SumTree(capacity, lambda pick: pick(model), block=block, top=top)
    for _ in range(data.draw(st.integers(1, 8))):
        slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), unique=True, min_size=1)), np.int64)
        weights = np.array(data.draw(st.lists(st.integers(0, 100), min_size=slots.size, max_size=slots.size)),
                           np.float64)  # integers: every sum is exact, so is the search
        model[slots] = weights
        tree.changed(slots)
        inner = np.arange(1, tree.leaves)
        assert (tree.tree[inner] == tree.tree[2 * inner] + tree.tree[2 * inner + 1]).all()
        blocks = np.zeros(tree.leaves)
        np.add.at(blocks, np.arange(capacity) // block, model)
        assert (tree.tree[tree.leaves:] == blocks).all() and tree.total == model.sum()
    if model.sum() > 0:
        targets = np.concatenate([np.arange(0, model.sum(), 0.5), [model.sum() - 1e-9]])
        found = tree.find(targets)
        assert (found == np.searchsorted(np.cumsum(model), targets, side="right")).all()
        assert (model[found] > 0).all()
    rebuilt = SumTree(capacity, lambda pick: pick(model), block=block)
    rebuilt.rebuild()
    assert np.array_equal(rebuilt.tree, tree.tree)


@pytest.mark.parametrize("top", [0, 1, 12])
@pytest.mark.parametrize("block", [1, 4])
def test_sum_tree_never_lands_on_a_zero_weight_slot_past_the_total(block, top):
    model = np.array([0.1, 0.2, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    tree = SumTree(8, lambda pick: pick(model), block=block, top=top)
    tree.changed(np.arange(8))
    found = tree.find(np.array([tree.total, tree.total * (1 + 1e-12), 0.0]))
    assert found.tolist() == [3, 3, 0]


class _State:
    """What :class:`sumtree.Powers` reads: per-slot priorities and flags."""

    def __init__(self, capacity: int):
        self.priority = np.zeros(capacity)
        self.flags = np.zeros(capacity, np.uint8)

    def weights(self, exponent: float):
        """numpy's weights of these slots (what ``Powers`` describes), as a SumTree's ``weights``."""
        return lambda pick: np.where(pick(self.flags) & 1, pick(self.priority) ** exponent, 0.0)  # (1: LIVE)


def _assert_picks_as_numpy(fast, slow, expected: np.ndarray, targets: np.ndarray, exponent: float) -> None:
    """The compiled search finds slots that have weight, with their weights; at exponents that
    keep every sum exact, numpy's slots, else a slot whose interval holds the target (up to
    rounding at its ends: 1e-12 of the total)."""
    found, got = fast.pick(targets)
    assert (expected[found] > 0).all()
    assert np.allclose(got, expected[found], rtol=1e-14, atol=0)
    if exponent in (1.0, 0.0):
        assert found.tolist() == slow.find(targets).tolist()
    else:
        cumulative = np.cumsum(expected)
        slack = 1e-12 * cumulative[-1]  # (the check's own subtraction rounds too)
        assert ((cumulative[found] - expected[found] <= targets + slack) & (targets <= cumulative[found] + slack)).all()


@needs_loops
@settings(max_examples=120, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 90), block=st.sampled_from([1, 2, 4, 16]),
       exponent=st.sampled_from([1.0, 0.5, 0.6, 0.0, 2.0]))
def test_compiled_sum_tree_answers_as_numpy_does(data, capacity, block, exponent):
    """The compiled search and refresh against the numpy path, on the same weights:
    the same trees (integer priorities, exponent 1: every sum exact), the same slots
    for targets on and between the boundaries, weights equal to numpy's powers, and
    never a slot of weight zero."""
    state = _State(capacity)
    weights = state.weights(exponent)
    fast = sumtree.SumTree(capacity, weights, block=block, powers=sumtree.Powers(state, exponent))
    slow = sumtree.SumTree(capacity, weights, block=block)
    assert slow.powers is None
    for _ in range(data.draw(st.integers(1, 6))):
        slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), unique=True, min_size=1)), np.int64)
        state.priority[slots] = data.draw(st.lists(st.integers(0, 9), min_size=slots.size, max_size=slots.size))
        state.flags[slots] = data.draw(st.lists(st.sampled_from([0, 1, 3]), min_size=slots.size,
                                                max_size=slots.size))  # (3: LIVE and END)
        for tree in (fast, slow):
            tree.changed(slots)
        inner = np.arange(1, fast.leaves)
        assert (fast.tree[inner] == fast.tree[2 * inner] + fast.tree[2 * inner + 1]).all()
        assert np.allclose(fast.tree, slow.tree, rtol=1e-13, atol=0)
        if exponent == 1.0:
            assert np.array_equal(fast.tree, slow.tree)
    expected = weights(lambda array: array)
    if fast.total > 0:
        cumulative = np.cumsum(expected)
        targets = np.concatenate([cumulative[expected > 0][:-1], (cumulative[:-1] + cumulative[1:]) / 2,
                                  [0.0, fast.total * (1 - 1e-12)]])
        targets = targets[(targets >= 0) & (targets < fast.total)]
        _assert_picks_as_numpy(fast, slow, expected, targets, exponent)


@needs_loops
@pytest.mark.parametrize("block, exponent", [(16, 1.0), (16, 0.6), (4096, 1.0), (3, 0.5)])
def test_compiled_sum_tree_answers_as_numpy_does_over_many_chunks(block, exponent):
    """Batches whose blocks the compiled loops read in several chunks (2,048 slots a chunk,
    or one block where a block is larger), the last block cut short by the capacity: the
    same trees and slots as numpy's path (integer priorities: exact at exponent 1).  Every
    other block (scattered, as an update's), then runs of blocks (as a ring buffer's
    inserts), one of them all of one priority (one power for a chunk) but for dead rows."""
    capacity, rng = 20_011, np.random.default_rng(7)
    state = _State(capacity)
    weights = state.weights(exponent)
    fast = sumtree.SumTree(capacity, weights, block=block, powers=sumtree.Powers(state, exponent))
    slow = sumtree.SumTree(capacity, weights, block=block)
    for kind in (0, 1, 0, "run", "one priority"):  # (0, 1: every other block, from the first or the second)
        if kind in (0, 1):
            slots = rng.choice(capacity, 3_000, replace=False)
            slots = slots[slots // block % 2 == kind]
            state.priority[slots] = rng.integers(0, 9, slots.size)
        else:
            slots = np.arange(rng.integers(0, 3_000), capacity - rng.integers(0, 3_000))
            state.priority[slots] = rng.integers(0, 9, slots.size) if kind == "run" else 7
        state.flags[slots] = rng.choice([0, 1, 3], slots.size)
        for tree in (fast, slow):
            tree.changed(slots)
        if exponent == 1.0:
            assert np.array_equal(fast.tree, slow.tree)
        else:
            assert np.allclose(fast.tree, slow.tree, rtol=1e-13, atol=0)
    _assert_picks_as_numpy(fast, slow, weights(lambda array: array), rng.random(5_000) * fast.total, exponent)


@needs_loops
@pytest.mark.parametrize("capacity, block", [(20_011, 32), (1_000, 3), (64, 32), (7, 4)])
def test_compiled_age_trees_after_ring_inserts_match_numpy_and_a_rebuild(capacity, block):
    """A ring buffer's inserts (runs of slots given new keys rising with the slot: one
    slot, a few blocks, up to the capacity's end, the whole table) with rows dying
    around them: the oldest-first and newest-first trees the compiled loop leaves are
    numpy's, and a rebuild's from the rows."""
    selectors = sys.modules[f"{_NAME}.selectors"]
    rng, state = np.random.default_rng(11), Slots(capacity)
    trees = {}
    for by in ("oldest", "newest"):
        fast, slow = selectors.OrderIndex(state, by, block=block), selectors.OrderIndex(state, by, block=block)
        slow.tree.aged = None  # numpy's path
        trees[by] = fast, slow
    seq = 0
    for round_ in range(60):
        first = 0 if round_ % 10 == 0 else int(rng.integers(0, capacity))
        stop = capacity if round_ % 10 in (0, 1) else int(rng.integers(first + 1, min(capacity, first + 3_000) + 1))
        slots = np.arange(first, stop, dtype=np.int64)
        state.key[slots] = (seq + np.arange(slots.size)) * capacity + slots
        state.flags[slots] = 1
        seq += slots.size
        dying = rng.choice(capacity, min(capacity, 5), replace=False)
        dying = dying[(dying < first) | (dying >= stop)]
        state.flags[dying] = 0
        for by, (fast, slow) in trees.items():
            for index in (fast, slow):
                index.removed(dying)
                index.added(slots)
            assert np.array_equal(fast.tree.tree, slow.tree.tree), (by, round_, first, stop)
    for by, (fast, _) in trees.items():
        rebuilt = fast.tree.tree.copy()
        fast.tree.rebuild()
        assert np.array_equal(rebuilt, fast.tree.tree), by
        live = np.flatnonzero(state.flags & 1)
        assert fast.first(1)[0] == live[np.argmin(state.key[live] if by == "oldest" else -state.key[live])]


PRIORITIES = st.one_of(st.sampled_from([0.0, 1e-6, 0.5, 1.0, 3.0, 1e6]), st.floats(1e-3, 1e3))


def _reweigh(fast, slow, state, slots: np.ndarray, new) -> None:
    """Priorities ``new`` into ``slots`` (distinct): ``fast`` told as an update tells it
    (:meth:`SumTree.reweighed`), ``slow`` as numpy's path does (every block summed)."""
    before = state.priority[slots].copy()
    state.priority[slots] = new
    fast.reweighed(slots, before, np.sort(slots))
    slow.changed(np.sort(slots))


def _assert_leaves_near_their_sums(fast, state, exponent: float) -> None:
    """Every leaf within 64 ulp of its block's sum (numpy's powers differ from the compiled
    loop's by up to 1e-15 more), and exactly 0 where the block has no weight."""
    weights = state.weights(exponent)(lambda array: array)
    layout = fast.layout
    sums = np.zeros(layout.leaves)
    np.add.at(sums, np.arange(fast.capacity) // layout.block, weights)
    leaves = fast.tree[layout.leaves:]
    assert ((leaves == 0) == (sums == 0)).all()
    assert (np.abs(leaves - sums) <= 2e-14 * sums).all()
    inner = np.arange(1, fast.leaves)
    assert (fast.tree[inner] == fast.tree[2 * inner] + fast.tree[2 * inner + 1]).all()


@needs_loops
@settings(max_examples=60, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 70), block=st.sampled_from([1, 4, 16]),
       exponent=st.sampled_from([1.0, 0.5, 0.6, 0.0, 2.0]))
def test_a_priority_update_moves_leaves_and_stays_with_numpys_sums(data, capacity, block, exponent):
    """Updates that move leaves by their weights' changes (compiled) against numpy's path,
    which sums every block it changes, over more updates than a leaf is moved before it is
    summed again: integer priorities at exponent 1 give the same tree bit for bit, any
    priorities a tree within 1e-13, every leaf near its block's sum, a block with no weight
    a leaf of 0, and the same picks."""
    state = _State(capacity)
    state.flags[:] = data.draw(st.lists(st.sampled_from([0, 1, 3]), min_size=capacity, max_size=capacity))
    integers = data.draw(st.booleans())
    values = st.integers(0, 9).map(float) if integers else PRIORITIES
    state.priority[:] = data.draw(st.lists(values, min_size=capacity, max_size=capacity))
    weights = state.weights(exponent)
    fast = sumtree.SumTree(capacity, weights, block=block, powers=sumtree.Powers(state, exponent))
    slow = sumtree.SumTree(capacity, weights, block=block)
    for tree in (fast, slow):
        tree.changed(np.arange(capacity))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(data.draw(st.integers(1, 40))):
        slots = rng.choice(capacity, rng.integers(1, min(capacity, 8) + 1), replace=False)
        _reweigh(fast, slow, state, slots, data.draw(st.lists(values, min_size=slots.size, max_size=slots.size)))
        _assert_leaves_near_their_sums(fast, state, exponent)
        if integers and exponent == 1.0:
            assert np.array_equal(fast.tree, slow.tree)
        else:
            assert np.allclose(fast.tree, slow.tree, rtol=1e-13, atol=0)
    expected = weights(lambda array: array)
    if fast.total > 0:
        cumulative = np.cumsum(expected)
        targets = np.concatenate([(cumulative[:-1] + cumulative[1:]) / 2, [0.0, fast.total * (1 - 1e-12)]])
        exact = exponent if integers or exponent == 0.0 else None  # (sums exact: numpy's very slots)
        _assert_picks_as_numpy(fast, slow, expected, targets[(targets >= 0) & (targets < fast.total)], exact)


def _one_block(priorities, exponent: float):
    """A sum tree over one block of 16 slots, every slot live, summed."""
    state = _State(16)
    state.flags[:] = 1
    state.priority[:] = priorities
    tree = sumtree.SumTree(16, state.weights(exponent), block=16, powers=sumtree.Powers(state, exponent))
    tree.changed(np.arange(16))
    return state, tree


def _summed(state, exponent: float) -> float:
    """The block's leaf as a tree that sums it gives it."""
    again = sumtree.SumTree(16, state.weights(exponent), block=16, powers=sumtree.Powers(state, exponent))
    again.changed(np.arange(16))
    return float(again.tree[again.leaves])


def _move(tree, state, slot: int, value: float) -> None:
    slots = np.array([slot])
    before = state.priority[slots].copy()
    state.priority[slots] = value
    tree.reweighed(slots, before, slots)


@needs_loops
def test_a_moved_leaf_is_summed_again_after_31_moves():
    """The moves a leaf has made since its block was last summed are counted (the low 5
    bits of its bounds); the 32nd sums it again: the same leaf, bit for bit, as a tree
    that summed it."""
    exponent = 0.6
    state, tree = _one_block(np.linspace(0.1, 2.0, 16), exponent)
    rng = np.random.default_rng(3)
    for move in range(1, 40):
        slot = int(rng.integers(16))
        _move(tree, state, slot, state.priority[slot] * 1.01)  # (up: never below half of what it held)
        assert tree.bounds[0] & 31 == move % 32
        if move == 32:
            assert tree.tree[tree.leaves] == _summed(state, exponent)
    _assert_leaves_near_their_sums(tree, state, exponent)


@needs_loops
def test_a_block_of_one_priority_moves_as_its_rows_get_lower_ones():
    """Rows inserted with one priority (the default 1.0) sum to the bottom of a binade
    (16 rows: 16.0); lower priorities then move the leaf (counted in its bounds) rather
    than summing the block each time, down to half of it."""
    exponent = 0.6
    state, tree = _one_block(np.ones(16), exponent)
    for move, slot in enumerate(range(6), 1):
        _move(tree, state, slot, 0.3)
        assert tree.bounds[0] & 31 == move
    _assert_leaves_near_their_sums(tree, state, exponent)


@pytest.mark.parametrize("exponent, base, start, factor, steps", [
    (1.0, 1.0, 2.0 ** 60, 0.5, 30),  # a weight that rounded the 15 others away, then halved
    (2.0, 1e-3, 1e3, 0.75, 25),  # the same slowly, within the priorities the property test draws
    (0.6, 1.0, 50.0, 0.97, 31),
])
@needs_loops
def test_a_leaf_that_falls_below_half_the_largest_value_it_held_is_summed_again(exponent, base, start, factor, steps):
    """A leaf's error is bounded by the largest value it held since its block was last
    summed: a leaf falling step by step (each step less than half of it) must not keep
    that value's rounding. It moves only while it stays at half that value or more, so
    every leaf stays within 64 ulp of its block's sum, and a slot the large weight
    rounded away is drawn as often as its weight says."""
    state, tree = _one_block(np.full(16, base), exponent)
    _move(tree, state, 0, start)
    value = start
    for _ in range(steps):
        value *= factor
        _move(tree, state, 0, value)
        _assert_leaves_near_their_sums(tree, state, exponent)
    weights = state.weights(exponent)(lambda array: array)
    found, _ = tree.pick(np.linspace(0, tree.total, 4001)[:-1])
    share = np.bincount(found, minlength=16)[1:].sum() / found.size
    assert share == pytest.approx(weights[1:].sum() / weights.sum(), abs=2e-3)


@needs_loops
def test_a_move_that_would_leave_a_block_no_weight_or_cancel_sums_it():
    """A large weight made small (the small ones' sum would be lost in its rounding) and
    a weight of 0 sum the block again; a block with no weight reads exactly 0."""
    exponent = 1.0
    state, tree = _one_block(np.full(16, 1e-6), exponent)
    _move(tree, state, 5, 1e6)
    for slot, value in ((5, 1e-6), (2, 0.0)):
        _move(tree, state, slot, value)
        assert tree.tree[tree.leaves] == _summed(state, exponent)
    state.priority[:] = 0.0
    tree.reweighed(np.arange(16), np.full(16, 1e-6), np.arange(16))
    assert tree.total == 0.0


@needs_loops
def test_compiled_sum_tree_refuses_wrong_arrays():
    """Wrong dtypes, short arrays or a block past the tree raise, and write nothing."""
    loops, tree = LOOPS, np.zeros(8)
    priority, flags = np.ones(16), np.ones(16, np.uint8)
    with pytest.raises(TypeError, match="tree"):
        loops.refresh(np.zeros(8, np.float32), 2, priority, flags, 1.0, 4, 16, np.array([0]))
    with pytest.raises(ValueError, match="priority"):
        loops.refresh(tree, 2, priority[:8], flags, 1.0, 4, 16, np.array([0]))
    with pytest.raises(ValueError, match="out of range"):
        loops.refresh(tree, -1, priority, flags, 1.0, 4, 16, np.array([0]))
    with pytest.raises(IndexError, match="block 4"):
        loops.refresh(tree, 2, priority, flags, 1.0, 4, 16, np.array([0, 4]))
    slots, before, bounds = np.array([0, 5]), np.ones(2), np.zeros(4, np.uint16)
    with pytest.raises(IndexError, match="slot 16"):
        loops.adjust(tree, 2, priority, flags, 1.0, 4, 16, np.array([0, 16]), before, slots, bounds)
    with pytest.raises(IndexError, match="slot -1"):
        loops.adjust(tree, 2, priority, flags, 1.0, 4, 16, slots, before, np.array([-1, 0]), bounds)
    with pytest.raises(ValueError, match="before"):
        loops.adjust(tree, 2, priority, flags, 1.0, 4, 16, slots, before[:1], slots, bounds)
    with pytest.raises(ValueError, match="bounds"):
        loops.adjust(tree, 2, priority, flags, 1.0, 4, 16, slots, before, slots, bounds[:3])
    with pytest.raises(TypeError, match="bounds"):
        loops.adjust(tree, 2, priority, flags, 1.0, 4, 16, slots, before, slots, np.zeros(4, np.uint8))
    with pytest.raises(TypeError, match="slots"):
        loops.find(tree, 2, priority, flags, 1.0, 4, 16, np.zeros(2), np.zeros(2, np.int32), np.zeros(2))
    with pytest.raises(TypeError):  # read-only target array: it is written
        loops.find(tree, 2, priority, flags, 1.0, 4, 16, b"\0" * 16, np.zeros(2, np.int64), np.zeros(2))
    assert not tree.any()
    counts = np.zeros(4, np.uint32)
    with pytest.raises(IndexError, match="slot 4"):  # checked before the first count
        loops.count(counts, np.array([0, 1, 4]), 10)
    with pytest.raises(TypeError, match="times_sampled"):
        loops.count(np.zeros(4, np.int64), np.array([0]), 10)
    with pytest.raises(TypeError, match="priorities"):
        loops.first_bad(np.ones(2, np.float32), 1.0, 10.0)
    assert not counts.any()
    ages, key = np.full(8, -1, np.int64), np.arange(16, dtype=np.int64)
    with pytest.raises(IndexError, match="not a run"):
        loops.filled_run(ages, 2, key, flags, 4, 16, 3, 17, False)
    with pytest.raises(IndexError, match="not a run"):
        loops.filled_run(ages, 2, key, flags, 4, 16, 5, 5, False)
    with pytest.raises(ValueError, match="out of range"):  # 4 leaves of 4 slots hold 16, not 17
        loops.filled_run(ages, 2, np.arange(17), np.ones(17, np.uint8), 4, 17, 0, 1, False)
    with pytest.raises(ValueError, match="key"):
        loops.filled_run(ages, 2, key[:8], flags, 4, 16, 0, 1, False)
    with pytest.raises(TypeError, match="tree"):
        loops.filled_run(np.zeros(8, np.int32), 2, key, flags, 4, 16, 0, 1, False)
    assert (ages == -1).all()


@needs_loops
def test_compiled_stream_copy_copies_exactly_and_refuses_what_it_cannot_write():
    """The copy around the caches: every length (the 64-byte loop, an unaligned head, the
    tail) at every alignment of each side, nothing written outside ``dst``."""
    rng = np.random.default_rng(5)
    for n in (0, 1, 15, 16, 63, 64, 65, 127, 1000, 4103, 300_001):
        for at in (0, 1, 7, 16, 33):
            src = rng.integers(0, 256, n + 8, dtype=np.uint8)[at % 8:at % 8 + n]
            around = np.zeros(n + 64, np.uint8)
            LOOPS.stream_copy(around[at:at + n], src)
            assert np.array_equal(around[at:at + n], src) and not around[:at].any() and not around[at + n:].any()
    with pytest.raises(ValueError, match="4 bytes into 3"):
        LOOPS.stream_copy(np.zeros(3, np.uint8), np.ones(4, np.uint8))
    read_only = np.zeros(4, np.uint8)
    read_only.flags.writeable = False
    for dst in (read_only, np.zeros(8, np.uint8)[::2]):  # (nor into a strided view: it would write between)
        with pytest.raises(TypeError):
            LOOPS.stream_copy(dst, np.ones(4, np.uint8))
    assert not read_only.any()


@needs_loops
def test_compiled_gather_takes_rows_as_numpy_does_and_copies_nothing_for_a_bad_slot(tmp_path):
    """A sample's rows gathered with each row asked of memory ahead: the same bytes as
    numpy's take for rows of every width (an int64's, rows that straddle lines, rows
    wider than the lines asked ahead), repeats, an empty batch and a mapped column; a slot
    out of range or a buffer too small is refused before anything is written."""
    rng = np.random.default_rng(11)
    for row_bytes in (1, 3, 8, 56, 64, 300, 1024):
        column = rng.integers(0, 256, (1000, row_bytes), dtype=np.uint8)
        for n in (0, 1, 7, 256):
            slots = rng.integers(0, 1000, n)
            slots[:n // 2] = slots[n - n // 2:][:n // 2]  # (repeats)
            out = np.zeros((n, row_bytes), np.uint8)
            LOOPS.gather(column, row_bytes, slots, out)
            assert np.array_equal(out, column[slots])
    mapped = np.memmap(tmp_path / "c.memmap", np.uint8, "w+", shape=(500, 56))
    mapped[:] = rng.integers(0, 256, (500, 56), dtype=np.uint8)
    slots = np.array([499, 0, 250, 0])
    out = np.zeros((4, 56), np.uint8)
    LOOPS.gather(mapped, 56, slots, out)
    assert np.array_equal(out, mapped[slots])
    column, out = np.ones((10, 8), np.uint8), np.zeros((3, 8), np.uint8)
    for bad in ([0, 10, 1], [0, -1, 1]):
        with pytest.raises(IndexError, match="not in"):
            LOOPS.gather(column, 8, np.array(bad), out)
    with pytest.raises(ValueError, match="do not fit"):
        LOOPS.gather(column, 8, np.array([0, 1, 2, 3]), out)
    with pytest.raises(ValueError, match="not rows of"):
        LOOPS.gather(column, 7, np.array([0]), out)
    assert not out.any()


@needs_loops
def test_compiled_scatter_stores_as_numpy_does_and_nothing_for_a_bad_slot():
    """A priority update's stores, each line asked of memory ahead: numpy's assignment
    (of a slot given twice, the last value), float64 and int64 alike; a slot out of range
    or too few values are refused before anything is written."""
    rng = np.random.default_rng(13)
    for dtype in (np.float64, np.int64):
        for n in (0, 1, 5, 300):
            array, expected = np.zeros(1000, dtype), np.zeros(1000, dtype)
            slots = rng.integers(0, 1000, n)
            slots[:n // 3] = slots[n - n // 3:][:n // 3]  # (repeats: the last wins)
            values = rng.integers(1, 10**6, n).astype(dtype)
            array[:] = expected[:] = rng.integers(1, 10**6, 1000)
            replaced = np.zeros(n, dtype)
            LOOPS.scatter(array, slots, values, replaced)
            was = expected.copy()
            for i, slot in enumerate(slots.tolist()):  # (what each store replaced, in turn)
                assert replaced[i] == was[slot]
                was[slot] = values[i]
            expected[slots] = values
            assert np.array_equal(array, expected)
    array = np.zeros(10)
    for bad in ([0, 10], [-1, 0]):
        with pytest.raises(IndexError, match="not in"):
            LOOPS.scatter(array, np.array(bad), np.ones(2))
    with pytest.raises(ValueError, match="values"):
        LOOPS.scatter(array, np.array([0, 1, 2]), np.ones(2))
    with pytest.raises(ValueError, match="replaced"):
        LOOPS.scatter(array, np.array([0, 1]), np.ones(2), np.zeros(1))
    assert not array.any()


def test_keys_at_and_set_priorities_do_as_numpy_compiled_or_not(monkeypatch):
    """The state a sample and an update touch at scattered slots: the same keys read and
    priorities written with the compiled loops as with numpy (and slots not int64)."""
    for loops in (LOOPS, None):
        monkeypatch.setattr(compiled, "loops", loops)
        state = Slots(64)
        state.key[:] = np.arange(64) + 1000
        for slots in (np.array([5, 63, 0, 5]), np.array([1, 2], np.int32), np.arange(10)[::2]):
            assert state.keys_at(slots).tolist() == (np.asarray(slots) + 1000).tolist()
            state.set_priorities(slots, np.arange(slots.size) + 0.5)
            expected = np.zeros(64)
            expected[slots] = np.arange(slots.size) + 0.5
            assert state.priority[np.unique(slots)].tolist() == expected[np.unique(slots)].tolist()
            state.priority[:] = 0.0


@needs_loops
def test_compiled_distinct_rising_gives_numpy_distinct_blocks_or_says_they_do_not_rise():
    """An update's blocks from its sorted slots: numpy's distinct values of ``slots >> shift``
    for rising slots (repeats too, at every shift), -1 for slots that fall anywhere."""
    rng = np.random.default_rng(14)
    for n in (0, 1, 2, 17, 1024):
        values = np.sort(rng.integers(0, 1 << 40, n))
        values[n // 2:n // 2 + 3] = values[n // 2] if n > 4 else values[n // 2:n // 2 + 3]
        for shift in (0, 4, 20):
            out = np.zeros(max(n, 1), np.int64)
            k = LOOPS.distinct_rising(values, shift, out)
            assert out[:k].tolist() == np.unique(values >> shift).tolist()
    for falls in ([3, 2], [1, 2, 3, 0], [5, 5, 4]):
        assert LOOPS.distinct_rising(np.array(falls), 0, np.zeros(len(falls), np.int64)) == -1
    with pytest.raises(ValueError, match="out"):
        LOOPS.distinct_rising(np.arange(4), 0, np.zeros(3, np.int64))


def test_blocks_of_gives_sorted_distinct_blocks_compiled_or_not(monkeypatch):
    """Rising slots (an update's), falling ones, repeats and a run (an insert's) give
    the same blocks with the compiled pass as with numpy's."""
    rng = np.random.default_rng(15)
    layout = sys.modules[f"{_NAME}.blocks"].Blocks(10_000, 16)
    cases = [np.sort(rng.integers(0, 10_000, 300)), rng.integers(0, 10_000, 300), np.arange(40, 90),
             np.array([5, 5, 5]), np.array([9_999]), np.array([17, 3])]
    for slots in cases:
        got = []
        for loops in (LOOPS, None):
            monkeypatch.setattr(compiled, "loops", loops)
            got.append(layout.blocks_of(slots).tolist())
        assert got[0] == got[1] == np.unique(slots // 16).tolist()


def test_take_rows_gathers_the_same_rows_compiled_or_not(monkeypatch):
    """What the backings call: the compiled gather where it is built, numpy's take where
    not (or for a column of empty rows), the same rows either way."""
    rng = np.random.default_rng(12)
    for width in (0, 8, 56):
        column = rng.integers(0, 256, (300, width), dtype=np.uint8)
        slots = rng.integers(0, 300, 64)
        results = []
        for loops in (LOOPS, None):
            monkeypatch.setattr(compiled, "loops", loops)
            out = np.zeros((64, width), np.uint8)
            take_rows(column, slots, out)
            results.append(out)
        assert np.array_equal(results[0], column[slots]) and np.array_equal(results[1], column[slots])


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_large_batches_into_columns_in_memory_read_back_as_written(path, monkeypatch):
    """Batches of more than STREAM_MIN bytes go into a table's columns in memory with the
    compiled copy when their slots are a run, and the usual way across the ring's wrap."""
    if path == "numpy":
        monkeypatch.setattr(compiled, "loops", None)
    elif LOOPS is None:
        pytest.skip("the compiled loops are not built here")
    rng = np.random.default_rng(6)
    rows, capacity = 5_000, 12_000
    table = Table(capacity, {"obs": ((14,), "float32"), "action": ((), "int64")}, remover="fifo")
    assert rows * 56 >= sys.modules[f"{_NAME}.backing"].STREAM_MIN
    held = {}
    for _ in range(4):  # (the third batch wraps: two runs)
        obs, action = rng.random((rows, 14), np.float32), rng.integers(0, 1 << 40, rows)
        written = table.insert({"obs": obs, "action": action})
        held.update(zip(written.keys.tolist(), zip(obs, action.tolist())))
    keys = np.array(sorted(held)[-capacity:])
    drawn = table.read(keys % capacity)  # (key = seq * capacity + slot)
    assert drawn.keys.tolist() == keys.tolist()
    got_obs = np.frombuffer(bytes(drawn.values["obs"].data), np.float32).reshape(-1, 14)
    got_action = np.frombuffer(bytes(drawn.values["action"].data), np.int64)
    assert np.array_equal(got_obs, np.stack([held[k][0] for k in keys.tolist()]))
    assert got_action.tolist() == [held[k][1] for k in keys.tolist()]


def _both_paths(monkeypatch, run):
    """``run()`` with the compiled loops, then with numpy's paths: each outcome, as a
    value or as the type and message of what it raised."""
    outcomes = []
    for loops in (LOOPS, None):
        monkeypatch.setattr(compiled, "loops", loops)
        try:
            outcomes.append(("returned", run()))
        except Exception as exc:  # noqa: BLE001 (compared, not swallowed)
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


_ODD_PRIORITIES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, -0.0, 1.0, 1e-300, 5e-324, 1e154, 1e155, 1e200, 1e300, 1.7e308, -1e-300]))


@needs_loops
@settings(max_examples=150, deadline=None)
@given(priorities=st.lists(_ODD_PRIORITIES, min_size=1, max_size=80),
       spec=st.sampled_from([("uniform", 1.0), ("fifo", 1.0), ("prioritized", 1.0), ("prioritized", 0.6),
                             ("prioritized", 0.5), ("prioritized", 0.0), ("prioritized", 2.0)]))
def test_compiled_priority_check_takes_and_refuses_as_numpy_does(priorities, spec):
    """A batch of priorities (NaN, infinities, negatives, -0.0, subnormals, powers
    that overflow or pass the tree's largest weight) is taken or refused alike with
    the compiled check and with numpy's, with the same message; a refused batch
    leaves the table empty."""
    sampler, exponent = spec
    with pytest.MonkeyPatch.context() as monkeypatch:

        def run():
            t = x_table(len(priorities), sampler=sampler, priority_exponent=exponent)
            try:
                return t.insert(scalars(len(priorities)), priorities=priorities).keys.tolist()
            finally:
                assert t.size in (0, len(priorities))

        fast, slow = _both_paths(monkeypatch, run)
    assert fast == slow


@needs_loops
@settings(max_examples=100, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 40))
def test_compiled_key_lookup_matches_numpy(data, capacity):
    """The slots of keys (held, left, never given, negative, past int32) with the
    compiled loop and with numpy's."""
    state = Slots(capacity)
    held = data.draw(st.lists(st.integers(0, 2**62), max_size=capacity, unique_by=lambda k: k % capacity))
    for k in held:
        state.key[k % capacity] = k
    asked = np.array(held + data.draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=20))
                     + [k + capacity for k in held] + [-1, -capacity], np.int64)  # (-1: an empty slot's key)
    order = data.draw(st.permutations(range(asked.size)))
    asked = asked[list(order)] if asked.size else asked
    with pytest.MonkeyPatch.context() as monkeypatch:
        fast, slow = _both_paths(monkeypatch, lambda: state.find(asked).tolist())
    assert fast == slow
    if held:
        assert (state.find(np.array(held)) == np.array(held) % capacity).all()


@needs_loops
@settings(max_examples=100, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 30))
def test_compiled_sample_count_matches_numpy(data, capacity):
    """A sample's counts with the compiled loop and with numpy's: repeats counted
    each, saturating at the largest count."""
    top = int(np.iinfo(np.uint32).max)
    start = np.array(data.draw(st.lists(st.sampled_from([0, 1, 7, top - 2, top - 1, top]), min_size=capacity,
                                        max_size=capacity)), np.uint32)
    slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), max_size=60)), np.int64)
    with pytest.MonkeyPatch.context() as monkeypatch:

        def run():
            state = Slots(capacity)
            state.times_sampled[:] = start
            state.count_sampled(slots)
            return state.times_sampled.tolist()

        fast, slow = _both_paths(monkeypatch, run)
    assert fast == slow
    expected = np.minimum(start.astype(np.int64) + np.bincount(slots, minlength=capacity), top)
    assert fast == ("returned", expected.tolist())


def test_the_compiled_sum_tree_is_built_where_a_compiler_is():
    """setup.py builds ``_loops`` where a C compiler is at hand (it is optional: a
    machine without one gets numpy's loops, slower at 10^7 rows and up)."""
    import shutil
    import sysconfig

    if not (shutil.which(sysconfig.get_config_var("CC") or "cc") or shutil.which("cc")):
        pytest.skip("no C compiler here")
    assert LOOPS is not None, "the C extension _loops was not built (pip install -e . builds it)"


@needs_loops
def test_the_blocks_powers_are_vector_ones_where_the_cpu_and_the_c_library_have_them():
    """On x86-64 Linux with AVX2 and glibc's vector math library, the blocks' weights
    come four at a time from its pow (the property tests above hold them to numpy's)."""
    import ctypes.util
    import platform

    cpu = pathlib.Path("/proc/cpuinfo")
    if not (platform.machine() == "x86_64" and cpu.exists() and " avx2" in cpu.read_text()
            and ctypes.util.find_library("mvec")):
        pytest.skip("no AVX2 or no libmvec here: the scalar pow serves")
    assert LOOPS.vector_pow == 1


class _Rows(_State):
    """What the lowest-priority order reads: priorities, keys and flags."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.key = np.full(capacity, -1, np.int64)


@needs_loops
@settings(max_examples=100, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 90), block=st.sampled_from([1, 2, 8, 32]))
def test_compiled_lowest_priority_tree_answers_as_numpy_does(data, capacity, block):
    """The compiled refresh of the lowest-priority argmin tree against numpy's path:
    the same tree after scattered changes (few priorities: many ties, broken by key;
    rows dying and coming back), so the same smallest rows."""
    rows = _Rows(capacity)
    live = 1  # slots.LIVE

    def order(slots):
        return np.where(rows.flags[slots] & live, rows.priority[slots], np.inf), rows.key[slots]

    def held(slots):
        return rows.priority[slots], rows.key[slots]

    def one(slot):
        return float(rows.priority[slot]), int(rows.key[slot])

    fast = mintree.MinTree(capacity, order, np.inf, block=block, order_one=one, held_order=held, lowest=rows)
    slow = mintree.MinTree(capacity, order, np.inf, block=block, order_one=one, held_order=held)
    assert slow.lowest is None
    keys = iter(range(10_000))
    for _ in range(data.draw(st.integers(1, 8))):
        slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), unique=True, min_size=1)), np.int64)
        for slot in slots.tolist():
            if data.draw(st.booleans()):
                rows.priority[slot] = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
                if not rows.flags[slot] & live:
                    rows.key[slot], rows.flags[slot] = next(keys), data.draw(st.sampled_from([1, 3]))
            else:
                rows.priority[slot], rows.key[slot], rows.flags[slot] = 0.0, -1, 0
        for tree in (fast, slow):
            tree.changed(slots)
        assert np.array_equal(fast.tree, slow.tree)
        held_slots = np.flatnonzero(rows.flags & live)
        expected = held_slots[np.lexsort((rows.key[held_slots], rows.priority[held_slots]))]
        assert fast.smallest(capacity).tolist() == expected.tolist()


@settings(max_examples=80, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 40), block=st.sampled_from([1, 2, 8, 32]))
def test_min_tree_orders_by_value_then_tie(data, capacity, block):
    values = np.full(capacity, np.inf)
    ties = np.full(capacity, np.iinfo(np.int64).max)
    tree = MinTree(capacity, lambda slots: (values[slots], ties[slots]), np.inf, block=block)
    tie_source = iter(range(10_000))
    for _ in range(data.draw(st.integers(1, 8))):
        slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), unique=True, min_size=1)), np.int64)
        if data.draw(st.booleans()):
            new = np.array(data.draw(st.lists(st.integers(0, 3), min_size=slots.size, max_size=slots.size)),
                           np.float64)  # few values: many ties
            values[slots], ties[slots] = new, [next(tie_source) for _ in slots]
        else:
            values[slots], ties[slots] = np.inf, np.iinfo(np.int64).max
        tree.changed(slots)
        live = np.flatnonzero(values < np.inf)
        expected = live[np.lexsort((ties[live], values[live]))]
        for k in {1, 2, 3, capacity, capacity + 5}:
            assert tree.smallest(k).tolist() == expected[:k].tolist()
        assert tree.first == (expected[0] if expected.size else -1)
    rebuilt = MinTree(capacity, lambda slots: (values[slots], ties[slots]), np.inf, block=block)
    rebuilt.rebuild()
    assert np.array_equal(rebuilt.tree, tree.tree)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 300), block=st.sampled_from([1, 4, 64]))
def test_count_tree_finds_rows_and_free_slots_by_rank(data, capacity, block):
    live = np.zeros(capacity, bool)
    tree = CountTree(capacity, lambda slots: live[slots], block=block)
    for _ in range(data.draw(st.integers(1, 6))):
        slots = np.array(data.draw(st.lists(st.integers(0, capacity - 1), unique=True, min_size=1)), np.int64)
        live[slots] = data.draw(st.booleans())
        tree.changed(slots)
        held, free = np.flatnonzero(live), np.flatnonzero(~live)
        assert tree.total == held.size
        # each rank alone (the scalar walk) and many at once, repeated (the vectorised one)
        for ranked, wanted in ((False, held), (True, free)):
            if wanted.size:
                assert [int(tree.find(np.array([k]), free=ranked)[0]) for k in range(wanted.size)] == wanted.tolist()
                ranks = np.repeat(np.arange(wanted.size), 5)
                assert tree.find(ranks, free=ranked).tolist() == np.repeat(wanted, 5).tolist()
        for position in {0, 1, capacity // 2, capacity - 1, capacity}:
            assert tree.before(position) == int(live[:position].sum())


class TableAgainstAModel(RuleBasedStateMachine):
    """Random inserts, writes, removals, priority updates and samples; after each, the
    table's rows, keys and indexes agree with a plain dictionary of rows."""

    @initialize(sampler=st.sampled_from(tables.SAMPLERS), remover=st.sampled_from(tables.REMOVERS),
                m=st.sampled_from([0, 1, 3]))
    def make(self, sampler, remover, m):
        self.capacity = 9
        self.t = Table(self.capacity, {"x": ((), "int64"), "h": ((2,), "bfloat16")}, sampler=sampler,
                       remover=remover, max_times_sampled=m, priority_exponent=0.5, rng=4)
        self.m = m
        self.rows: dict[int, tuple[int, int, float]] = {}  # key -> (slot, x, priority)
        self.counter = 0

    def batch(self, n: int) -> dict:
        x = np.arange(self.counter, self.counter + n, dtype=np.int64)
        self.counter += n
        h = (np.repeat(x, 2) % 65536).astype(np.uint16)
        return {"x": x, "h": RawArray("bfloat16", (n, 2), h.tobytes())}

    def oldest_first(self) -> list[int]:
        return sorted(self.rows)

    @rule(n=st.integers(1, 5), p=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=5, max_size=5))
    def insert(self, n, p):
        short = n - (self.capacity - len(self.rows))
        if short > 0:
            if self.remover_name == "fifo":
                expected = self.oldest_first()[:short]
            else:
                expected = sorted(self.rows, key=lambda k: (self.rows[k][2], k))[:short]
        else:
            expected = []
        batch = self.batch(n)
        w = self.t.insert(batch, priorities=p[:n])
        assert w.removed.keys.tolist() == expected
        for key in expected:
            del self.rows[key]
        for key, slot, x, prio in zip(w.keys.tolist(), w.indices.tolist(), batch["x"].tolist(), p[:n]):
            assert key % self.capacity == slot and all(key > k for k in self.rows)
            self.rows[key] = (slot, x, prio)

    @property
    def remover_name(self):
        return self.t.remover

    @rule(data=st.data())
    def write(self, data):
        idx = data.draw(st.lists(st.integers(0, self.capacity - 1), unique=True, min_size=1, max_size=4))
        batch = self.batch(len(idx))
        replaced = sorted(k for k, row in self.rows.items() if row[0] in idx)
        w = self.t.write(idx, batch, priorities=1.0)
        assert sorted(w.removed.keys.tolist()) == replaced
        for key in replaced:
            del self.rows[key]
        for key, slot, x in zip(w.keys.tolist(), idx, batch["x"].tolist()):
            self.rows[key] = (slot, x, 1.0)

    @rule(data=st.data())
    def remove(self, data):
        if not self.rows:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.rows)), max_size=3))
        gone = self.t.remove(keys + [10**12])
        assert sorted(gone.keys.tolist()) == sorted(set(keys))
        for key in set(keys):
            del self.rows[key]

    @rule(data=st.data())
    def update(self, data):
        if not self.rows:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=4, unique=True))
        p = data.draw(st.lists(st.sampled_from([0.0, 0.25, 3.0]), min_size=len(keys), max_size=len(keys)))
        assert self.t.update_priorities(keys, p) == len(keys)
        for key, prio in zip(keys, p):
            slot, x, _ = self.rows[key]
            self.rows[key] = (slot, x, prio)

    @rule(n=st.integers(1, 6))
    def sample(self, n):
        if not self.t.can_sample(n):
            return
        before = dict(self.rows)
        s = self.t.sample(n)
        for key, slot, x in zip(s.keys.tolist(), s.indices.tolist(), s.values["x"].to_numpy().tolist()):
            assert before[key][:2] == (slot, x)
        if self.t.sampler == "prioritized" and any(p > 0 for _, _, p in before.values()):
            assert all(before[k][2] > 0 for k in s.keys.tolist()) or self.m
        if self.m:
            counts = {}
            for key in s.keys.tolist():
                counts[key] = counts.get(key, 0) + 1
            assert max(counts.values()) <= self.m
            for key in s.removed.keys.tolist():
                del self.rows[key]
        else:
            assert s.removed.keys.size == 0

    @invariant()
    def agrees(self):
        if not hasattr(self, "t"):
            return
        t, state = self.t, self.t._slots
        assert t.size == len(self.rows)
        live = np.flatnonzero(state.flags & 1).tolist()
        assert live == sorted(row[0] for row in self.rows.values())
        assert state.count.total == len(live)
        assert np.flatnonzero(state.key >= 0).tolist() == live
        if self.rows:
            keys = sorted(self.rows)
            back = t.read([self.rows[k][0] for k in keys])
            assert back.keys.tolist() == keys
            assert back.values["x"].to_numpy().tolist() == [self.rows[k][1] for k in keys]
            assert back.priorities.tolist() == [self.rows[k][2] for k in keys]
            h = back.values["h"].data.view(np.uint16).reshape(-1, 2)
            assert (h[:, 0] == h[:, 1]).all() and (h[:, 0] == np.array([self.rows[k][1] for k in keys])).all()
        if t.sampler == "prioritized":
            weights = np.zeros(self.capacity)
            for slot, _, prio in self.rows.values():
                weights[slot] = prio ** 0.5
            assert np.allclose(t._sampler.tree.get(np.arange(self.capacity)), weights)


TableAgainstAModel.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_table_against_a_model = TableAgainstAModel.TestCase


# -- memory-mapped columns


def _workload(backing) -> list:
    """A fixed sequence of inserts, writes, samples and priority updates; what they
    returned, as comparable values."""
    t = Table(64, {"obs": ((4, 6), "uint8"), "a": ((), "int64"), "v": ((3,), "bfloat16")}, sampler="prioritized",
              priority_exponent=0.6, remover="lowest_priority", max_times_sampled=3, backing=backing, rng=11)
    rng = np.random.default_rng(5)

    def batch(n: int) -> dict:
        return {"obs": rng.integers(0, 256, (n, 4, 6), dtype=np.uint8), "a": rng.integers(0, 1 << 40, n),
                "v": RawArray("bfloat16", (n, 3), rng.integers(0, 256, n * 6, dtype=np.uint8).tobytes())}

    seen = []
    for step in range(12):
        n = int(rng.integers(1, 16))
        w = t.insert(batch(n), priorities=rng.random(n) * 3)
        seen.append(("insert", w.keys.tolist(), w.removed.keys.tolist()))
        if step % 3 == 2:
            w = t.write(rng.choice(64, size=5, replace=False), batch(5))
            seen.append(("write", w.keys.tolist(), w.removed.keys.tolist()))
        if t.can_sample(8):
            s = t.sample(8)
            t.update_priorities(s.keys, rng.random(8))
            seen.append(("sample", s.keys.tolist(), s.probabilities.tolist(),
                         {k: v.data.tobytes() for k, v in s.values.items()}, s.removed.keys.tolist()))
    back = t.read(t.occupied())
    seen.append(("read", back.keys.tolist(), {k: v.data.tobytes() for k, v in back.values.items()}))
    t.close()
    return seen


def test_memmap_backed_table_gives_the_same_results_as_in_memory(tmp_path):
    assert _workload(tables.MemoryBacking()) == _workload(tables.MemmapBacking(str(tmp_path / "t")))
    assert os.listdir(tmp_path / "t") == []  # not kept: closing deleted the files


def test_memmap_files_are_tensordicts_layout(tmp_path):
    directory = str(tmp_path / "replay")
    backing = tables.MemmapBacking(directory, keep=True)
    t = Table(10, {"obs": ((2, 3), "uint8"), "w": ((2,), "bfloat16"), "r": ((), "float32")}, backing=backing)
    obs = np.arange(24, dtype=np.uint8).reshape(4, 2, 3)
    w_bits = np.array([[0x3F80, 0x4000], [0x4040, 0x4080], [0xBF80, 0x0000], [0x7F80, 0x3F00]], np.uint16)
    r = np.array([0.5, 1.5, 2.5, 3.5], np.float32)
    t_keys = t.write([0, 3, 6, 9], {"obs": obs, "w": RawArray("bfloat16", (4, 2), w_bits.tobytes()),
                                    "r": r}).keys.tolist()
    assert sorted(os.listdir(directory)) == ["_slots", "obs.memmap", "r.memmap", "w.memmap"]
    assert sorted(os.listdir(os.path.join(directory, "_slots"))) == ["flags.bin", "key.bin", "next_seq.bin",
                                                                     "priority.bin", "times_sampled.bin",
                                                                     "tree_count.bin",
                                                                     "tree_oldest.bin"]
    assert os.path.getsize(os.path.join(directory, "obs.memmap")) == 10 * 6
    raw = np.fromfile(os.path.join(directory, "r.memmap"), np.float32)
    assert raw[[0, 3, 6, 9]].tolist() == r.tolist() and raw[[1, 2]].tolist() == [0.0, 0.0]
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(tables.tensordict_metadata(t.columns, t.capacity), f)
    t.close()
    assert sorted(os.listdir(directory)) == ["_slots", "meta.json", "obs.memmap", "r.memmap", "w.memmap"]  # kept

    again = Table(10, {"obs": ((2, 3), "uint8"), "w": ((2,), "bfloat16"), "r": ((), "float32")},
                  backing=tables.MemmapBacking(directory, keep=True, reopen=True))
    assert again._data[0][[0, 3, 6, 9]].tobytes() == obs.tobytes()
    assert again.size == 4 and again.read([0, 3, 6, 9]).keys.tolist() == t_keys  # the rows, with their keys

    tensordict = pytest.importorskip("tensordict")
    import torch

    td = tensordict.TensorDict.load_memmap(directory)
    assert td.batch_size == torch.Size([10])
    assert td["obs"].dtype == torch.uint8 and td["obs"].shape == (10, 2, 3)
    assert td["obs"][[0, 3, 6, 9]].numpy().tobytes() == obs.tobytes()
    assert td["w"].dtype == torch.bfloat16
    assert td["w"][[0, 3, 6, 9]].view(torch.int16).numpy().view(np.uint16).tolist() == w_bits.tolist()
    assert td["w"][0].tolist() == [1.0, 2.0]
    assert td["r"][[0, 3, 6, 9]].tolist() == r.tolist()


class _Killed(BaseException):
    """The server dies here (the mapped files keep what was written before)."""


def _reopened(directory: str, **spec) -> Table:
    return Table(backing=tables.MemmapBacking(directory, keep=True, reopen=True), **spec)


def test_keys_never_come_back_after_a_restart_that_was_not_clean(tmp_path):
    """The newest rows left (removed, sampled out) before a kill: their keys are not
    given again, so a learner's update for one cannot reach a new row."""
    for spec, leave in (({"sampler": "uniform"}, "remove"),
                        ({"sampler": "fifo", "remover": None, "max_times_sampled": 1}, "sample")):
        spec = {"capacity": 8, "columns": {"x": ((), "int64")}, **spec}
        directory = str(tmp_path / leave)
        t = Table(backing=tables.MemmapBacking(directory, keep=True), **spec)
        given = t.insert(scalars(5)).keys.tolist()
        t.remove(given[-2:]) if leave == "remove" else t.sample(5)
        again = _reopened(directory, **spec)  # (no shut: as after kill -9)
        new = again.insert(scalars(3)).keys.tolist()
        assert min(new) > max(given), (leave, given, new)
        assert again.update_priorities(given[-2:], [5.0, 5.0]) == 0
        again.close()
        t.close()


@pytest.mark.parametrize("sampler", ["fifo", "prioritized"])
def test_a_row_sampled_out_when_the_server_died_leaves_at_the_restart(tmp_path, monkeypatch, sampler):
    """Killed after a sample counted a row to ``max_times_sampled`` but before the row
    was cleared: the restart takes it out (a fifo sample failed on it for good; a
    prioritized one redrew it round after round)."""
    directory = str(tmp_path / "t")
    spec = {"capacity": 4, "columns": {"x": ((), "int64")}, "sampler": sampler, "max_times_sampled": 1,
            "remover": None}
    t = Table(backing=tables.MemmapBacking(directory, keep=True), **spec)
    keys = t.insert(scalars(3), priorities=[1e6, 1.0, 1.0]).keys.tolist()

    def forget(self, slots):
        raise _Killed

    with monkeypatch.context() as m:
        m.setattr(sys.modules[f"{_NAME}.slots"].Slots, "forget", forget)
        with pytest.raises(_Killed):
            t.sample(1)  # (the oldest row for fifo; the row of priority 1e6, nearly always)
    again = _reopened(directory, **spec)
    spent = [k for k in keys if k not in again.slots()["keys"].tolist()]
    assert len(spent) == 1 and again.size == 2
    drawn = again.sample(2).keys.tolist()
    assert sorted(drawn) == sorted(set(keys) - set(spent))
    assert again.size == 0 and not again.can_sample(1)


def test_a_sample_whose_rows_cannot_be_read_leaves_every_row_as_it_was(monkeypatch):
    """A draw with ``max_times_sampled`` takes spent rows out as it redraws; a gather
    that then fails puts them back (it counted nothing): the rows stay, once each."""
    t = x_table(4, max_times_sampled=1, rng=1)
    keys = t.insert(scalars(4)).keys

    def gather(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(t._backing, "gather", gather)
    with pytest.raises(tables.RowsNotReadError):
        t.sample(4)
    monkeypatch.undo()
    assert t.size == 4 and t.occupied().tolist() == [0, 1, 2, 3] and t.can_sample(4)
    assert sorted(t.sample(4).keys.tolist()) == sorted(keys.tolist()) and t.size == 0


def test_no_sequences_is_an_empty_sample():
    t = x_table(8)
    t.insert(scalars(8))
    drawn = t.sample_sequences(0, 2)
    assert drawn.keys.size == 0 and drawn.lengths.size == 0 and t.samples == 0


# -- rows a caller drew itself, new columns, pages of slots (TorchRL over a table)


def test_a_read_as_a_sample_counts_like_one_and_is_refused_like_one():
    t = x_table(8, samples_per_insert=1.0, error_buffer=2.0, min_size_to_sample=2)
    t.insert(scalars(4))
    before = t.info()["rate_limiter"]["diff"]
    read = t.read([3, 3, 1], sampled=True)
    assert xs(read) == [3, 3, 1] and read.times_sampled.tolist() == [2, 2, 1]
    assert t.samples == 3 and t.info()["rate_limiter"]["diff"] == before - 3
    assert xs(t.read([3])) == [3] and t.samples == 3  # a plain read counts nothing
    assert not t.can_read_sampled(2)  # the balance is at the bottom of the window
    with pytest.raises(tables.WouldBlockError):
        t.read([0, 1], sampled=True)
    assert t.samples == 3  # refused: nothing changed
    with pytest.raises(tables.BatchTooLargeError):
        t.can_read_sampled(9)


def test_a_read_as_a_sample_removes_rows_that_reach_max_times_sampled():
    t = x_table(8, max_times_sampled=2)
    t.insert(scalars(3))
    read = t.read([0, 0, 1], sampled=True)
    assert read.removed.keys.tolist() == [0] and t.size == 2 and t.removals == 1
    assert not t.can_sample(5)  # allowance: row 1 once more, row 2 twice
    assert t.can_sample(3)


def test_added_columns_read_zeros_in_old_rows_and_are_written_by_new_ones():
    t = x_table(4)
    t.insert(scalars(2))
    specs = t.add_columns({"y": ((2,), "float32")})
    assert [s.name for s in specs] == ["y"] and [c.name for c in t.columns] == ["x", "y"]
    assert t.read([1]).values["y"].to_numpy().tolist() == [[0.0, 0.0]]
    with pytest.raises(tables.ColumnMismatchError, match="'y' is missing"):
        t.insert(scalars(1, 2))
    t.insert({"x": np.array([7]), "y": np.ones((1, 2), np.float32)})
    assert t.read([2]).values["y"].to_numpy().tolist() == [[1.0, 1.0]]
    with pytest.raises(tables.TableSpecError, match="has a column 'x'"):
        t.add_columns({"x": ((), "int64")})
    with pytest.raises(tables.TableSpecError, match="items"):
        Table(4).add_columns({"z": ((), "int8")})


def test_added_columns_of_a_table_in_files_are_files(tmp_path):
    t = Table(4, {"x": ((), "int64")}, backing=tables.MemmapBacking(str(tmp_path / "t"), keep=True))
    t.insert(scalars(2))
    t.add_columns({"y": ((), "int16")})
    assert (tmp_path / "t" / "y.memmap").stat().st_size == 4 * 2
    reopened = Table(4, {"x": ((), "int64"), "y": ((), "int16")},
                     backing=tables.MemmapBacking(str(tmp_path / "t"), keep=True, reopen=True))
    assert xs(reopened.read([0, 1])) == [0, 1]
    reopened.add_columns({"z": ((), "int8")})  # a table reopened from its files gains new files
    assert (tmp_path / "t" / "z.memmap").exists()


def test_slots_come_in_pages_in_index_order_with_their_state():
    t = x_table(10, remover=None)
    t.insert(scalars(6), priorities=[1, 2, 3, 4, 5, 6])
    t.remove([t.slots()["keys"][2]])  # a hole at slot 2
    t.read([4, 4], sampled=True)
    page = t.slots(0, limit=3)
    assert page["indices"].tolist() == [0, 1, 3] and page["next"] == 4
    assert page["priorities"].tolist() == [1, 2, 4]
    rest = t.slots(page["next"], limit=3)
    assert rest["indices"].tolist() == [4, 5] and rest["next"] is None
    assert rest["times_sampled"].tolist() == [2, 0] and rest["keys"].tolist() == [44, 55]  # seq * 10 + index
    assert t.slots(6)["indices"].tolist() == [] and t.slots(6)["next"] is None
    with pytest.raises(tables.BadArgumentError):
        t.slots(-1)
