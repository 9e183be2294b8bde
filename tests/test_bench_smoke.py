"""The benchmark suite runs end to end (tiny sizes); its figures are not checked here."""

import pytest


@pytest.mark.process
def test_benchmark_suite_smoke():
    smoke = pytest.importorskip("benchmarks.smoke")
    results = smoke.run_smoke()
    assert results["errors"] == [], results["errors"]
    assert results["figures"], "the smoke run produced no figures"
    # Every section ran: past its time limit the run skips the sections left, which
    # would let this pass having exercised half of them.
    dropped = [s["what"] for s in results["skipped"] if s["what"].startswith("section ") and "time limit" in s["why"]]
    assert dropped == [], f"sections dropped at the smoke profile's time limit: {dropped}"


def test_goal_lines_say_what_their_ratio_compares():
    """A goal's ratio reads the way the goal means it: "the rate", "the time",
    "faster", "the bytes"; a goal on time over figures that are rates is computed
    as the time ratio (a rate ratio of 0.150x once read as a time goal's MISS)."""
    import io

    from benchmarks.record import MISS, PASS, Recorder
    from benchmarks.report import readme_goals
    from benchmarks.stats import Sample

    rec = Recorder("quick", stream=io.StringIO())
    rec.figure("tcp", "sample over TCP", Sample.of([0.3]), "GB/s")
    rec.figure("local", "in-process sample", Sample.of([2.0]), "GB/s")
    rec.figure("slow", "torch.save", Sample.of([80.0]), "ms", better="lower")
    rec.figure("quick", "save_memmap", Sample.of([20.0]), "ms", better="lower")
    rec.figure("delta", "delta", Sample.of([4.0]), "MB", better="lower")
    rec.figure("full", "full", Sample.of([40.0]), "MB", better="lower")
    rec.goal_ratio("sample takes <= 3x the in-process time", "tcp", "local", "<=", 3, time_of_rates=True)
    rec.goal_ratio("sample >= 0.5x the in-process rate", "tcp", "local", ">=", 0.5)
    rec.goal_ratio("save_memmap >= 3x faster than torch.save", "slow", "quick", ">=", 3)
    rec.goal_ratio("delta <= 0.15x full", "delta", "full", "<=", 0.15)
    rec.goal_ratio("save_memmap within 1.2x of torch.save", "quick", "slow", "<=", 1.2)
    assert [g["status"] for g in rec.goals] == [MISS, MISS, PASS, PASS, PASS]
    cells = [line.rsplit("|", 2)[1].strip() for line in readme_goals({"goals": rec.goals}).splitlines()[4:]]
    assert cells == ["6.67x the time", "0.150x the rate", "4.00x faster", "0.100x the bytes", "0.250x the time"]
    assert rec.goals[2]["detail"].startswith("save_memmap 20.0 ms = 4.00x faster than torch.save 80.0 ms")


@pytest.mark.process
def test_a_server_whose_first_sample_fails_is_stopped_not_left_running():
    """The scale benchmark's restart timing starts servers; one that starts but cannot
    serve the sample it is timed by is stopped (and waited for) before the error goes on."""
    from benchmarks import procs, scale_bench
    from tensorshare import TensorShareError

    with procs._lock:
        before = set(procs._children)
    with pytest.raises(TensorShareError):
        scale_bench._serving()  # no data directory: no table to sample
    with procs._lock:
        started = procs._children - before
    assert started == set()
