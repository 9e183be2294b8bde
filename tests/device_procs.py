"""Another process on the server's host with the stand-in device (run as a script): a reader or a publisher by device reference.

CUDA IPC opens only another process's memory, so the by-reference paths are
tested with the other side in a process of its own.  ``python device_procs.py
PORT`` reads commands on stdin, one per line, and answers each with one line of
JSON on stdout:

* ``peek BIN``: ``Client(device="cpu").peek(BIN)`` under a stream of its own with a
  kernel queued on it (a caller's work in flight), then that stream run; answers
  ``{"sums": {key: sum}, "device": every tensor in device memory, "opened": blocks
  opened by IPC, "unmapped": streams the clean-up of those blocks synchronised,
  "caller": the caller's stream}``.
* ``publish BIN SEED``: puts ``state(SEED)`` by device reference and waits for its
  bytes to be uploaded; answers ``{"n": items}``.
* ``exit``.
"""

from __future__ import annotations

import json
import sys

import torch

import tensorshare
import tensorshare.device as device_engines
from devicesim import DeferredStreams, DeviceTensor, to_device
from tensorshare.device.engine import Engine


def state(seed: int, n: int = 24) -> dict:
    """The state dict both sides make for ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(20_000 + i, generator=generator) for i in range(n)}


def sums(value: dict) -> dict:
    return {k: float(v.double().sum()) for k, v in leaves(value).items()}


def leaves(value: dict, prefix: str = "") -> dict:
    """The tensors of nested dicts, by dotted key."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out.update(leaves(item, f"{prefix}{key}."))
        elif isinstance(item, torch.Tensor):
            out[f"{prefix}{key}"] = item
    return out


def main(port: int) -> None:
    engine = Engine(DeferredStreams(), bucket=256 << 10, inline_max=0)
    device_engines._ENGINES["cpu"] = engine
    sim = engine.streams
    with tensorshare.Client("127.0.0.1", port, timeout=30, device="cpu") as client:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "exit":
                break
            if words[0] == "peek":
                caller = sim.stream("caller")
                with sim.using(caller):
                    sim.later(caller, lambda: None)  # the caller's work in flight
                    [value] = client.peek(words[1])
                sim.flush(caller)
                answer = {"sums": sums(value), "device": all(isinstance(v, DeviceTensor) for v in leaves(value).values()),
                          "opened": sim.opened, "unmapped": [s.name for s in sim.unmapped], "caller": caller.name}
            else:
                n = client.put(words[1], to_device(state(int(words[2]))), by_reference=True)
                client._exported().idle(30)
                answer = {"n": n}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
