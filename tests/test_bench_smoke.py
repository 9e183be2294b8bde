"""The benchmark suite runs end to end (tiny sizes); its figures are not checked here."""

import pytest


@pytest.mark.process
def test_benchmark_suite_smoke():
    smoke = pytest.importorskip("benchmarks.smoke")
    results = smoke.run_smoke()
    assert results["errors"] == [], results["errors"]
    assert results["figures"], "the smoke run produced no figures"
