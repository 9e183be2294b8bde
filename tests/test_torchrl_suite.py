"""The runner of TorchRL's own replay-buffer tests over tables (benchmarks/torchrl_suite),
on a small suite of its own: a TableStorage twin beside every LazyTensorStorage case,
each compared with its twin in the same run.  (The real suite needs a pytorch/rl
checkout: ``python -m benchmarks.torchrl_suite PATH``, README "Tables".)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl)")

ROOT = Path(__file__).resolve().parent.parent
SUITE = '''
import functools

import pytest
import torch
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer


@pytest.mark.parametrize("storage", [ListStorage, LazyTensorStorage])
def test_extend(storage):
    rb = ReplayBuffer(storage=storage(10), batch_size=2)
    rb.extend(torch.arange(4).view(4, 1))
    assert len(rb) == 4 and rb.sample().shape == (2, 1)


@pytest.mark.parametrize("rb_type,storage", [(ReplayBuffer, functools.partial(LazyTensorStorage, 8))],
                         ids=["partial"])
def test_index(rb_type, storage):
    rb = rb_type(storage=storage())
    rb.extend(torch.arange(5))
    assert rb[1:3].tolist() == [1, 2]


@pytest.mark.parametrize("storage", [LazyTensorStorage])
def test_local_memory(storage):
    s = storage(4)
    s.set(range(2), torch.zeros(2))
    assert isinstance(s._storage, torch.Tensor)  # how LazyTensorStorage keeps its rows


def test_unrelated():
    assert True
'''


def test_the_runner_pairs_every_lazy_tensor_storage_case_with_a_table_twin(tmp_path):
    (tmp_path / "test" / "rb").mkdir(parents=True)
    (tmp_path / "test" / "rb" / "test_small.py").write_text(SUITE)
    out = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.torchrl_suite", str(tmp_path), "--out", str(out),
                             "--budget", "200"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    summary = json.loads(out.read_text())
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # 2 of 3: under the goal
    assert (summary["cases"], summary["applicable"], summary["passed"], summary["failed"]) == (3, 3, 2, 1)
    twins = {case["id"].split("::")[-1]: case["twin"].split("::")[-1] for case in summary["cases_detail"]}
    assert twins == {"test_extend[SuiteTableStorage]": "test_extend[LazyTensorStorage]",
                     "test_index[partial-table]": "test_index[partial]",
                     "test_local_memory[SuiteTableStorage]": "test_local_memory[LazyTensorStorage]"}
    assert summary["failures"] == ["test/rb/test_small.py::test_local_memory[SuiteTableStorage]"]
    assert "2 deselected" in result.stdout, result.stdout[-2000:]  # test_unrelated and the ListStorage case
