"""Load: 32 client processes x 2,000 mixed blocking operations against one server.

Appends are counted at both ends: every item appended (acknowledged by a 250) must
be taken exactly once, by some process's GET or by the final drain.  Latencies are
printed (``pytest -s``) and written to ``load.json`` in the test's tmp dir.
"""

from __future__ import annotations

import pytest
import json
import multiprocessing
import os
import time
from collections import Counter

import tensorshare
from load_procs import OPS, SHARED_BINS, run, shared_bin
from serverproc import ServerProcess

PROCESSES = 32
OPS_PER_PROCESS = 2_000
SEED = int(os.environ.get("TENSORSHARE_LOAD_SEED", "7"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.process
def test_32_processes_2000_mixed_ops_exactly_once(tmp_path):
    server = ServerProcess(log_path=tmp_path / "server.log")
    # One forkserver that has imported torch once: 32 fresh interpreters each
    # importing torch would take longer than the load itself on two cores.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorshare.client", "load_procs"])
    try:
        baseline = server.rss()
        start = time.monotonic()
        with ctx.Pool(PROCESSES) as pool:
            pending = pool.starmap_async(run, [(server.port, w, OPS_PER_PROCESS, SEED) for w in range(PROCESSES)])
            results = pending.get(timeout=240)
        elapsed = time.monotonic() - start
        peak = server.rss()

        errors = [e for r in results for e in r["errors"]]
        assert not errors, errors[:10]
        appended = Counter(a for r in results for a in r["appended"])
        taken = Counter(t for r in results for t in r["taken"])
        with tensorshare.Client("127.0.0.1", server.port) as client:
            for k in range(SHARED_BINS):
                try:
                    taken.update(tuple(item.tolist()) for item in client.get(shared_bin(k)))
                except tensorshare.NoSuchBinError:
                    pass
        assert all(n == 1 for n in appended.values())  # tags are unique by construction
        duplicates = [t for t, n in taken.items() if n > 1]
        assert not duplicates, f"taken more than once: {duplicates[:10]}"
        assert taken == appended, (f"lost: {list((appended - taken).elements())[:10]}, "
                                   f"never appended: {list((taken - appended).elements())[:10]}")
        assert sum(r["notes"]["disorder"] for r in results) == 0
        assert server.proc.poll() is None and "Traceback" not in server.log()

        latencies = {op: [x for r in results for x in r["latencies"][op]] for op in OPS}
        every = [x for values in latencies.values() for x in values]
        report = {
            "processes": PROCESSES, "ops_per_process": OPS_PER_PROCESS, "ops": len(every),
            "seconds": round(elapsed, 2), "ops_per_second": round(len(every) / elapsed),
            "appended": sum(appended.values()),
            "taken_by_get": sum(len(r["taken"]) for r in results),
            "notifications": sum(r["notes"]["count"] for r in results),
            "p50_ms": round(percentile(every, 0.50) * 1e3, 3),
            "p99_ms": round(percentile(every, 0.99) * 1e3, 3),
            "max_ms": round(max(every) * 1e3, 3),
            "p99_ms_by_op": {op: round(percentile(v, 0.99) * 1e3, 3) for op, v in latencies.items() if v},
            "server_rss_mib": {"before": round(baseline / 2**20, 1), "after": round(peak / 2**20, 1)},
        }
        (tmp_path / "load.json").write_text(json.dumps(report, indent=1))
        print(f"\nload: {json.dumps(report)}\n(written to {tmp_path / 'load.json'})")
        assert len(every) == PROCESSES * OPS_PER_PROCESS
    finally:
        server.stop()
