"""Processes for the CUDA tests (run as scripts): a publisher that puts by device reference, a reader, an RL worker.

CUDA IPC opens only another process's memory, so each side runs in a process of
its own.  ``python gpu_procs.py publish PORT BIN VERSIONS``: puts VERSIONS states
by device reference (each tensor filled with its version number), printing
``put V`` after each, then, twice a second until killed, asks the server which
references it holds no more and prints ``held H mem M`` (the snapshots still
kept, and the bytes torch's allocator holds: a snapshot freed by the client but
kept by torch shows as M beyond H snapshots).  ``python gpu_procs.py read PORT
BIN SECONDS``: prints ``reading`` once up, reads the bin onto the GPU for that
long, checking that every read is one whole version, and prints ``read N versions
[...] errors [...]``.
``python gpu_procs.py work PORT EXPERIMENT VERSIONS``: an ``RLWorker(device="cuda")``
that loads each new version into its model (``load_into``) and prints
``loaded V values [...] by-reference K`` (the model's distinct values, and how
many reads so far were copied device to device from the publisher's memory).
"""

from __future__ import annotations

import sys
import time

import torch

import tensorshare

SIZE = 4 << 20  # floats per state
VERSION_BYTES = SIZE * 4


def state_for(version: int, n: int = 8) -> dict:
    return {f"p{i}": torch.full((SIZE // n,), float(version), device="cuda") for i in range(n)}


def version_of(state: dict) -> int:
    """The version of ``state``, or raise if it mixes versions or holds garbage (a torn read)."""
    values = torch.cat([t.flatten() for t in state.values()]).unique()
    if values.numel() != 1:
        raise AssertionError(f"torn or garbage read: {values[:5].tolist()}")
    return int(values.item())


def model_for() -> torch.nn.Module:
    """The model of the RL tests (trainer and worker make the same)."""
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()


def publish(port: int, name: str, versions: int) -> None:
    with tensorshare.Client("127.0.0.1", port, timeout=60) as c:
        assert c.same_host, "the publisher must be on the server's host"
        for v in range(versions):
            c.put(name, state_for(v), by_reference=True)
            print(f"put {v}", flush=True)
            time.sleep(0.1)  # readers read several versions meanwhile
        while True:  # until killed
            c.ping()  # its reply says which references the server holds no more
            print(f"held {c._exported().held()} mem {torch.cuda.memory_allocated()}", flush=True)
            time.sleep(0.5)


def read(port: int, name: str, seconds: float) -> None:
    seen, errors = [], []
    deadline = time.monotonic() + seconds
    with tensorshare.Client("127.0.0.1", port, timeout=60, device="cuda") as c:
        torch.zeros(1, device="cuda")  # CUDA up before saying so
        print("reading", flush=True)
        while time.monotonic() < deadline:
            try:
                items = c.peek(name)
            except tensorshare.errors.NoSuchBinError:  # nothing published yet
                time.sleep(0.01)
                continue
            except tensorshare.errors.TensorShareError as exc:  # a clear error, never garbage
                errors.append(type(exc).__name__)
                continue
            if items:
                seen.append(version_of(items[0]))
    print(f"read {len(seen)} versions {sorted(set(seen))} errors {sorted(set(errors))}", flush=True)


def work(port: int, experiment: str, versions: int) -> None:
    import tensorshare.device.ipc as ipc

    copied = [0]
    load = ipc.load

    def counted(*args, **kw):  # the test's instrument: reads copied from the publisher's memory
        value = load(*args, **kw)
        copied[0] += 1
        return value

    ipc.load = counted
    model = model_for()
    deadline = time.monotonic() + 120
    with tensorshare.RLWorker("127.0.0.1", port, experiment=experiment, device="cuda") as worker:
        print("ready", flush=True)
        held, loaded = -1, 0
        while loaded < versions and time.monotonic() < deadline:
            version = worker.load_into(model)  # reads only once a newer version was announced
            if version == held:
                time.sleep(0.005)
                continue
            held, loaded = version, loaded + 1
            values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()
            print(f"loaded {version} values {values[:4]} by-reference {copied[0]}", flush=True)


if __name__ == "__main__":
    role, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if role == "publish":
        publish(port, name, int(sys.argv[4]))
    elif role == "read":
        read(port, name, float(sys.argv[4]))
    else:
        work(port, name, int(sys.argv[4]))
