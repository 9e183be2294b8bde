"""TorchRL's own prioritized replay in one process: the baseline of the scale section's side by side.

    python -m benchmarks.torchrl_side ROWS SCRATCH [--stand-in WHY]

fills a ``LazyMemmapStorage`` of ROWS rows (the scale section's 64-byte rows, under
SCRATCH) with a ``PrioritizedSampler`` (alpha 0.6, beta 0.4) and prints one JSON
line, ``{"ready": what samples}``.  Then each line ``run REPS WARMUP`` on stdin times
REPS rounds of a learner's step (a sample of 256 and the update of their
priorities, after WARMUP untimed ones) and prints ``{"times": [seconds...]}``; at
the end of stdin it prints the memory the process grew by and exits.  The caller
takes turns with it, timing the table's loops in between, so that the machine's
speed, which wanders, falls on both sides alike.

It imports nothing of tensorshare, so it can run in an environment of its own:
TorchRL's sampler needs its C++ segment trees, whose wheels are built for one torch
release each (``make bench`` keeps such an environment, ``.venv-torchrl``, when the
project's torch is another).  Where the sampler cannot load, it prints
``{"error": why}`` and exits 3; the caller then runs it again with ``--stand-in
WHY``: this checkout's table engine in process stands in for TorchRL's sampler
(the storage still TorchRL's), and says so.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

from .stats import time_runs  # (the standard library only: it loads in any environment)

BATCH = 256
ROW_FLOATS = 14  # an observation of 14 float32 and an int64 action: 64 bytes a row
CHUNK = 1 << 20  # rows filled at a time


class SamplerUnavailable(Exception):
    """TorchRL's ``PrioritizedSampler`` does not load beside this torch."""


def memory() -> dict[str, int]:
    """The memory lines of this process's /proc status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _chunks(rows: int):
    """``(first, rows of the chunk as a TensorDict)`` for the whole table."""
    import torch
    from tensordict import TensorDict

    for first in range(0, rows, CHUNK):
        k = min(CHUNK, rows - first)
        ids = torch.arange(first, first + k)
        yield first, TensorDict({"obs": ids.view(k, 1).expand(k, ROW_FLOATS).float(), "action": ids}, [k])


def torchrl_step(rows: int, scratch: str) -> tuple[Callable[[], None], str]:
    """A filled TorchRL buffer's learner step, and what samples in it."""
    import torch
    import torchrl
    from torchrl.data import LazyMemmapStorage, PrioritizedSampler, ReplayBuffer

    try:
        sampler = PrioritizedSampler(rows, alpha=0.6, beta=0.4)
    except RuntimeError as exc:  # its C++ extension does not load beside this torch
        raise SamplerUnavailable(str(exc)[:200]) from None
    rb = ReplayBuffer(storage=LazyMemmapStorage(rows, scratch_dir=scratch), sampler=sampler, batch_size=BATCH)
    g = torch.Generator().manual_seed(0)
    for _, td in _chunks(rows):
        rb.update_priority(rb.extend(td), torch.rand(len(td), generator=g) + 0.01)
    new = torch.rand(BATCH) + 0.01

    def step():
        _, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], new)

    return step, f"TorchRL {torchrl.__version__} PrioritizedSampler (torch {torch.__version__})"


def stand_in_step(rows: int, scratch: str, why: str) -> tuple[Callable[[], None], str]:
    """The same step with TorchRL's storage and this checkout's table engine sampling."""
    import torch
    from torchrl.data import LazyMemmapStorage

    from .tables_engine_bench import load_engine

    storage = LazyMemmapStorage(rows, scratch_dir=scratch)
    engine = load_engine().Table(rows, {"i": ((), "int64")}, sampler="prioritized", priority_exponent=0.6)
    g = torch.Generator().manual_seed(0)
    for first, td in _chunks(rows):
        k = len(td)
        storage.set(torch.arange(first, first + k), td)
        engine.insert({"i": torch.arange(first, first + k).numpy()},
                      priorities=(torch.rand(k, generator=g) + 0.01).numpy())
    new = (torch.rand(BATCH) + 0.01).numpy()

    def step():
        s = engine.sample(BATCH)
        storage.get(torch.from_numpy(s.indices))
        engine.update_priorities(s.keys, new)

    return step, f"the table engine in process (TorchRL's PrioritizedSampler: {why[:80]})"


_OUT = sys.stdout  # the caller's channel: main() sends whatever else prints to stderr


def _say(**fields) -> None:
    print(json.dumps(fields), file=_OUT, flush=True)


def main(argv: list[str]) -> int:
    rows, scratch = int(argv[0]), argv[1]
    sys.stdout = sys.stderr  # (what the libraries print stays off the caller's channel)
    import torch

    torch.set_num_threads(1)
    before = memory()
    try:
        if argv[2:3] == ["--stand-in"]:
            step, what = stand_in_step(rows, scratch, argv[3])
        else:
            step, what = torchrl_step(rows, scratch)
    except SamplerUnavailable as exc:
        _say(error=str(exc))
        return 3
    _say(ready=what)
    for line in sys.stdin:  # "run REPS WARMUP"
        reps, warm = (int(word) for word in line.split()[1:3])
        _say(times=time_runs(step, reps, warm))
    after = memory()
    _say(anon=after["RssAnon"] - before["RssAnon"], rss=after["VmRSS"] - before["VmRSS"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
