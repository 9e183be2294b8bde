"""scripts/dev.py's choice of how the suite runs, and the order tests/conftest.py gives it."""

import importlib.util
import os
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dev():
    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "scripts" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_suite_runs_a_module_per_process_one_more_than_the_cpus_at_most_four(dev, monkeypatch):
    for cpus, workers in ((2, "3"), (3, "4"), (16, "4")):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert dev.parallel([]) == ["-n", workers, "--dist", "loadfile", "--no-loadscope-reorder"]
        assert dev.parallel(["tests/test_wire.py", "-x"])[:2] == ["-n", workers]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert dev.parallel([]) == []  # one CPU: one process


@pytest.mark.parametrize("args", [["-n", "3"], ["-n3"], ["--numprocesses=auto"], ["-p", "no:xdist"],
                                  ["-pno:xdist"], ["--dist", "load"]])
def test_arguments_that_choose_for_themselves_are_left_alone(dev, monkeypatch, args):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert dev.parallel(args) == []


def test_where_bytecode_is_not_written_the_jobs_cache_it_in_the_environment(dev, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    dev.keep_bytecode()
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(ROOT / ".venv" / "pycache")  # (ignored by git)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")  # a cache of the user's own stays theirs
    dev.keep_bytecode()
    assert os.environ["PYTHONPYCACHEPREFIX"] == "/elsewhere"
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    dev.keep_bytecode()  # bytecode written beside the sources, as Python does by default: left so
    assert "PYTHONPYCACHEPREFIX" not in os.environ


def test_the_longest_modules_named_first_are_test_modules():
    """A module renamed or removed must leave the list too (it would run wherever it falls)."""
    modules = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    assert set(conftest.LONGEST_FIRST) <= modules
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
