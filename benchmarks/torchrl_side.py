"""TorchRL's own prioritized replay in one process: the baseline of the scale section's side by side.

    python -m benchmarks.torchrl_side ROWS REPS WARMUP SCRATCH

fills a ``LazyMemmapStorage`` of ROWS rows (the scale section's 64-byte rows, under
SCRATCH) with a ``PrioritizedSampler`` (alpha 0.6, beta 0.4), then times REPS rounds
of a learner's step, a sample of 256 and the update of their priorities, and prints
one JSON line: the times (seconds), what sampled, and the memory the process grew by.

It imports nothing of tensorshare, so it can run in an environment of its own:
TorchRL's sampler needs its C++ segment trees, whose wheels are built for one torch
release each (``make bench`` keeps such an environment, ``.venv-torchrl``, when the
project's torch is another).  Where the sampler cannot load, it says so and exits 3,
and the caller measures what it can instead.
"""

from __future__ import annotations

import json
import sys
import time

BATCH = 256
ROW_FLOATS = 14  # an observation of 14 float32 and an int64 action: 64 bytes a row
EPISODE = 1000


def memory() -> dict[str, int]:
    """The memory lines of this process's /proc status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def main(argv: list[str]) -> int:
    rows, reps, warm, scratch = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    import torch

    torch.set_num_threads(1)
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, PrioritizedSampler, ReplayBuffer

    before = memory()
    try:
        sampler = PrioritizedSampler(rows, alpha=0.6, beta=0.4)
    except RuntimeError as exc:  # its C++ extension does not load beside this torch
        print(json.dumps({"error": str(exc)[:200]}))
        return 3
    rb = ReplayBuffer(storage=LazyMemmapStorage(rows, scratch_dir=scratch), sampler=sampler, batch_size=BATCH)
    g = torch.Generator().manual_seed(0)
    chunk = 1 << 20
    for first in range(0, rows, chunk):
        k = min(chunk, rows - first)
        ids = torch.arange(first, first + k)
        td = TensorDict({"obs": ids.view(k, 1).expand(k, ROW_FLOATS).float(), "action": ids}, [k])
        rb.update_priority(rb.extend(td), torch.rand(k, generator=g) + 0.01)
    new = torch.rand(BATCH) + 0.01

    def once():
        _, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], new)

    for _ in range(warm):
        once()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    after = memory()
    print(json.dumps({"times": times, "what": f"TorchRL {_version()} PrioritizedSampler (torch {torch.__version__})",
                      "anon": after["RssAnon"] - before["RssAnon"], "rss": after["VmRSS"] - before["VmRSS"]}))
    return 0


def _version() -> str:
    import torchrl

    return torchrl.__version__


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
