"""Trainer and worker processes for the multi-process RL test (run as scripts)."""

from __future__ import annotations

import sys
import time

import torch

from tensorshare import RLTrainer, RLWorker


def state_for(version: int) -> dict:
    """Parameters whose every element says which version they belong to."""
    return {"w": torch.full((128, 128), float(version)), "b": torch.full((16,), float(version))}


def version_of(params: dict) -> int:
    """The version of ``params``, or raise if they mix versions (a torn read)."""
    values = torch.cat([params["w"].flatten(), params["b"]]).unique()
    if values.numel() != 1:
        raise AssertionError(f"torn parameters: {values.tolist()[:5]}")
    return int(values.item())


def trainer(port: int, versions: int, per_version: int) -> None:
    with RLTrainer("127.0.0.1", port, experiment="mp", filter_version=True, max_staleness=0) as t:
        for _ in range(versions):
            v = t.publish_parameters(state_for(t.version + 1))
            got = 0
            while got < per_version:
                for data, version in zip(*t.get_data(return_versions=True, timeout=20)):
                    assert version == v, f"stale rollout {version} reached the trainer at {v}"
                    assert data["v"] == version
                    got += 1
            print(f"version {v} done", flush=True)
        print(f"trainer finished; dropped {t.dropped}", flush=True)


def worker(port: int) -> None:
    with RLWorker("127.0.0.1", port, experiment="mp") as w:
        last = -1
        while True:
            params = w.await_new_parameters(timeout=0.02) or w.get_parameters()
            if params is None:
                continue
            v = version_of(params)
            assert v == w.version, (v, w.version)
            assert v >= last, f"versions went back: {last} -> {v}"
            if v != last:
                print(f"seen {v}", flush=True)
                last = v
            w.add_data({"v": v})
            time.sleep(0.005)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    if role == "trainer":
        trainer(port, int(sys.argv[3]), int(sys.argv[4]))
    else:
        try:
            worker(port)
        except KeyboardInterrupt:
            pass
