"""Processes for the CUDA tests (run as scripts): a publisher that puts by device reference, a reader.

``python gpu_procs.py publish PORT BIN VERSIONS``: puts VERSIONS states by device
reference (each tensor filled with its version number), printing ``put V`` after
each, then waits to be killed.  ``python gpu_procs.py read PORT BIN SECONDS``:
reads the bin onto the GPU for that long, checking that every read is one whole
version, and prints ``read N versions [...] errors [...]``.
"""

from __future__ import annotations

import sys
import time

import torch

import tensorshare

SIZE = 4 << 20  # floats per tensor


def state_for(version: int, n: int = 8) -> dict:
    return {f"p{i}": torch.full((SIZE // n,), float(version), device="cuda") for i in range(n)}


def version_of(state: dict) -> int:
    """The version of ``state``, or raise if it mixes versions or holds garbage (a torn read)."""
    values = torch.cat([t.flatten() for t in state.values()]).unique()
    if values.numel() != 1:
        raise AssertionError(f"torn or garbage read: {values[:5].tolist()}")
    return int(values.item())


def publish(port: int, name: str, versions: int) -> None:
    with tensorshare.Client("127.0.0.1", port, timeout=60) as c:
        assert c.same_host, "the publisher must be on the server's host"
        for v in range(versions):
            c.put(name, state_for(v), by_reference=True)
            print(f"put {v}", flush=True)
        time.sleep(600)  # until killed


def read(port: int, name: str, seconds: float) -> None:
    seen, errors = [], []
    deadline = time.monotonic() + seconds
    with tensorshare.Client("127.0.0.1", port, timeout=60, device="cuda") as c:
        while time.monotonic() < deadline:
            try:
                items = c.peek(name)
            except tensorshare.errors.TensorShareError as exc:  # a clear error, never garbage
                errors.append(type(exc).__name__)
                continue
            if items:
                seen.append(version_of(items[0]))
    print(f"read {len(seen)} versions {sorted(set(seen))} errors {sorted(set(errors))}", flush=True)


if __name__ == "__main__":
    role, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if role == "publish":
        publish(port, name, int(sys.argv[4]))
    else:
        read(port, name, float(sys.argv[4]))
