"""The client process of the load test (tests/test_load.py): a seeded mix of
blocking operations whose appends and takes are recorded for the exactly-once check."""

from __future__ import annotations

import random
import threading
import time

import torch

import tensorshare

SHARED_BINS = 4
OPS = ("append", "get", "put", "peek", "list", "listen")
WEIGHTS = (35, 15, 15, 15, 5, 15)


def shared_bin(k: int) -> str:
    return f"load/q{k}"


def item_of(worker: int, i: int) -> torch.Tensor:
    """The uniquely tagged item a worker appends as its ``i``-th."""
    return torch.tensor([worker, i], dtype=torch.int64)


def run(port: int, worker: int, n_ops: int, seed: int) -> dict:
    """Do ``n_ops`` operations; return what was appended, what was taken, latencies, errors."""
    rng = random.Random(seed * 1000 + worker)
    appended: list[tuple[int, int]] = []
    taken: list[tuple[int, int]] = []
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors: list[str] = []
    notes = {"count": 0, "disorder": 0}
    lock = threading.Lock()
    last_seq: dict[str, int] = {}

    def on_note(note) -> None:
        with lock:
            notes["count"] += 1
            if note.seq <= last_seq.get(note.bin, -1):
                notes["disorder"] += 1
            last_seq[note.bin] = note.seq

    own = f"load/own{worker}"
    own_value = None
    listening = None
    try:
        with tensorshare.Client("127.0.0.1", port, timeout=60) as client:
            for i in range(n_ops):
                op = rng.choices(OPS, WEIGHTS)[0]
                start = time.perf_counter()
                try:
                    if op == "append":
                        client.append(shared_bin(rng.randrange(SHARED_BINS)), item_of(worker, len(appended)),
                                      tag=worker)
                        appended.append((worker, len(appended)))
                    elif op == "get":
                        for item in client.get(shared_bin(rng.randrange(SHARED_BINS))):
                            taken.append(tuple(item.tolist()))
                    elif op == "put":
                        own_value = torch.full((8,), float(i))
                        client.put(own, own_value)
                    elif op == "peek":
                        if own_value is not None:
                            [back] = client.peek(own)
                            if not torch.equal(back, own_value):
                                errors.append(f"peek of {own} gave {back.tolist()}, not {own_value.tolist()}")
                    elif op == "list":
                        client.list()
                    elif listening is None:
                        with lock:
                            last_seq.clear()
                        listening = client.listen(shared_bin(rng.randrange(SHARED_BINS)), on_note)
                    else:
                        listening.stop()
                        listening = None
                except tensorshare.NoSuchBinError:
                    pass  # a get of a shared bin nobody has appended to yet
                except Exception as exc:  # counted: the test wants none
                    errors.append(f"{op}: {exc!r}")
                latencies[op].append(time.perf_counter() - start)
    except Exception as exc:
        errors.append(f"client: {exc!r}")
    return {"worker": worker, "appended": appended, "taken": taken, "latencies": latencies,
            "errors": errors, "notes": notes}
