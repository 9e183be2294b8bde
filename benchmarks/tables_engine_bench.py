"""The table engine (server/bins/tables) on its own: sampler cost and row gathers.

    python -m benchmarks.tables_engine_bench            # both measurements, about a minute
    python -m benchmarks.tables_engine_bench --memmap   # the gather also from memory-mapped columns

* prioritized sample of 256 + priority update of 256 on a table of 1,000,000 rows
  (one int64 column, so the gather is negligible), with the fifo remover (the sum
  tree only) and the lowest-priority remover (its argmin tree too); beside it, the
  same draw done without a tree (``cumsum`` of the weights + ``searchsorted``), and
  the sum tree's own search + update.  Goal: under 2 ms for sample + update.
* the engine's compiled loops against its numpy paths on a table of 10^7 rows
  (sample + update of 256, and the tree's search + refresh alone), in turns.
* gather of 256 random rows of 28,224 bytes (4x84x84 uint8) from a 100,000-row
  table: ``Table.sample`` (allocating, and into a given buffer) beside plain numpy
  on the same array (``column[idx]``, and ``np.take`` into a preallocated buffer,
  whose default ``mode="raise"`` gathers into a temporary first) and a memcpy of
  the same 7.2 MB, all in this run and in turns; and what ``Table.sample(256)`` costs
  beside the gather (a table whose only column is one byte wide).

Not a test: figures are printed, not checked.  The engine is loaded from this
checkout by path (the installed ``tensorshare_server`` may be another checkout's).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

from .stats import Sample, median

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = _ROOT / "server" / "bins" / "tables"


def load_engine():
    """The table engine package of this checkout."""
    name = "_tables_engine_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PACKAGE / "__init__.py",
                                                      submodule_search_locations=[str(_PACKAGE)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def turns(fns: dict, rounds: int, reps: int) -> dict[str, Sample]:
    """Seconds per call of each function: ``rounds`` rounds of ``reps`` calls of each in
    turn (the median of each round is one run), so that load from elsewhere on the
    machine falls on all of them alike."""
    runs: dict[str, list] = {name: [] for name in fns}
    for name, fn in fns.items():  # warm-up
        fn()
    for r in range(rounds):
        names = list(fns)
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            runs[name].append(median(times))
    return {name: Sample.of(v) for name, v in runs.items()}


def show_time(label: str, s: Sample) -> None:
    print(f"  {label:<58} {s.median * 1e3:8.3f} ms  (min {s.min * 1e3:.3f}, max {s.max * 1e3:.3f}, {s.runs} runs)")


def show_rate(label: str, s: Sample, nbytes: int) -> None:
    print(f"  {label:<58} {nbytes / s.median / 1e9:8.2f} GB/s  ({s.median * 1e3:.3f} ms; "
          f"best {nbytes / s.min / 1e9:.2f} GB/s, {s.runs} runs)")


def prioritized(engine, rows: int = 1_000_000, batch: int = 256) -> None:
    print(f"prioritized sample of {batch} + priority update of {batch}, table of {rows:,} rows")
    rng = np.random.default_rng(0)
    fns = {}
    trees = []
    for remover in ("fifo", "lowest_priority"):
        t = engine.Table(rows, {"a": ((), "int64")}, sampler="prioritized", priority_exponent=0.6, remover=remover,
                         rng=1)
        for start in range(0, rows, 100_000):
            t.insert({"a": np.arange(start, start + 100_000)}, priorities=rng.random(100_000) + 0.01)
        trees.append((t._sampler.tree, t._slots))

        def step(t=t):
            s = t.sample(batch)
            t.update_priorities(s.keys, rng.random(batch))

        fns[f"Table.sample + update_priorities (remover {remover})"] = step
    tree, state = trees[0]
    weights = rng.random(rows) ** 0.6

    def tree_only():  # (the tree computes a block's weights from the rows' priorities)
        slots = np.unique(tree.find(rng.random(batch) * tree.total))
        state.priority[slots] = rng.random(slots.size)
        tree.changed(slots)

    def no_tree():  # what a sampler without an index pays per sample
        cdf = np.cumsum(weights)
        slots = np.searchsorted(cdf, rng.random(batch) * cdf[-1], side="right")
        weights[slots] = rng.random(batch)

    fns["SumTree.find + SumTree.changed alone"] = tree_only
    fns["baseline: cumsum + searchsorted + assign (no tree)"] = no_tree
    for label, s in turns(fns, rounds=5, reps=60).items():
        show_time(label, s)


def compiled_or_numpy(engine, rows: int = 10_000_000, batch: int = 256) -> None:
    """The engine's compiled loops (``_loops.c``) against its numpy paths, in turns on
    one table: a sample of ``batch`` and the update of their priorities (fresh random
    rows each time, as a learner's are), and the sum tree's search and refresh alone."""
    compiled = sys.modules[f"{engine.__name__}.compiled"]
    loops = compiled.loops
    if loops is None:
        print("the compiled loops are not built here: nothing to compare")
        return
    print(f"compiled loops or numpy: table of {rows:,} rows, batches of {batch}")
    rng = np.random.default_rng(6)
    t = engine.Table(rows, {"a": ((), "int64")}, sampler="prioritized", priority_exponent=0.6, rng=7)
    for start in range(0, rows, 1 << 20):
        k = min(1 << 20, rows - start)
        t.insert({"a": np.arange(start, start + k)}, priorities=rng.random(k) + 0.01)
    tree, state = t._sampler.tree, t._slots
    new = rng.random(batch) + 0.01

    def step():
        t.update_priorities(t.sample(batch).keys, new)

    def search_refresh():
        slots = np.unique(tree.find(rng.random(batch) * tree.total))
        state.priority[slots] = rng.random(slots.size) + 0.01
        tree.changed(slots)

    def numpy_path(fn):
        def run():
            compiled.loops = None
            try:
                fn()
            finally:
                compiled.loops = loops
        return run

    fns = {"Table.sample + update_priorities, compiled": step, "Table.sample + update_priorities, numpy": numpy_path(step),
           "SumTree.find + changed alone, compiled": search_refresh,
           "SumTree.find + changed alone, numpy": numpy_path(search_refresh)}
    for label, s in turns(fns, rounds=5, reps=60).items():
        show_time(label, s)


def gather(engine, memmap_dir: str | None, rows: int = 100_000, batch: int = 256) -> None:
    shape = (4, 84, 84)
    row_bytes = int(np.prod(shape))
    nbytes = batch * row_bytes
    where = f"memory-mapped files in {memmap_dir}" if memmap_dir else "memory"
    print(f"gather of {batch} random rows of {row_bytes:,} bytes from {rows:,} rows "
          f"({rows * row_bytes / 2**30:.1f} GiB, in {where}): GB/s")
    backing = engine.MemmapBacking(memmap_dir) if memmap_dir else engine.MemoryBacking()
    t = engine.Table(rows, {"obs": (shape, "uint8")}, backing=backing, rng=2)
    chunk = np.random.default_rng(3).integers(0, 256, (10_000, *shape), dtype=np.uint8)
    for _ in range(0, rows, chunk.shape[0]):
        t.insert({"obs": chunk})
    column = t._data[0]  # the very array the table gathers from: the baselines use it too
    rng = np.random.default_rng(4)
    out = np.empty((batch, row_bytes), np.uint8)
    out.fill(0)  # touched: no first-touch page faults in what is timed
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    fns = {
        "Table.sample(256, out=buffer)": lambda: t.sample(batch, out={"obs": out}),
        "Table.sample(256) (allocates its result)": lambda: t.sample(batch),
        "baseline: numpy column[idx] (allocates)": lambda: column[rng.integers(0, rows, batch)],
        "baseline: np.take(column, idx, axis=0, out=buffer)":
            lambda: np.take(column, rng.integers(0, rows, batch), axis=0, out=out),
        "baseline: np.take(..., out=buffer, mode='clip')":
            lambda: np.take(column, rng.integers(0, rows, batch), axis=0, out=out, mode="clip"),
        "baseline: memcpy of the same bytes (np.copyto, contiguous)": lambda: np.copyto(dst, src),
    }
    for label, s in turns(fns, rounds=5, reps=40).items():
        show_rate(label, s, nbytes)
    t.close()
    small = engine.Table(rows, {"b": ((), "uint8")}, rng=5)
    small.insert({"b": np.zeros(rows, np.uint8)})
    show_time("Table.sample(256) of 1-byte rows: the cost beside the gather",
              turns({"": lambda: small.sample(batch)}, rounds=5, reps=200)[""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memmap", action="store_true", help="also gather from memory-mapped columns")
    args = parser.parse_args()
    engine = load_engine()
    print(f"numpy {np.__version__}, {os.cpu_count()} CPUs")
    prioritized(engine)
    compiled_or_numpy(engine)
    gather(engine, None)
    if args.memmap:
        with tempfile.TemporaryDirectory(prefix="tables-bench-") as directory:
            gather(engine, directory)


if __name__ == "__main__":
    main()
