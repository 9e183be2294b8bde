"""Client processes of the table tests (tests/test_tables.py): actors that insert
uniquely numbered rows and learners that sample them, recording what they did."""

from __future__ import annotations

import torch

import tensorshare


def rows(first: int, n: int) -> dict:
    """``n`` rows numbered ``first``.. (``id``), each with an observation that repeats its number."""
    ids = torch.arange(first, first + n, dtype=torch.int64)
    return {"id": ids, "obs": ids.view(n, 1).expand(n, 16).to(torch.int32).contiguous()}


def actor(port: int, name: str, first: int, n: int, batch: int) -> list[int]:
    """Insert rows ``first .. first + n`` in batches; returns the keys the server gave."""
    keys = []
    with tensorshare.Client("127.0.0.1", port, timeout=30) as client:
        for start in range(first, first + n, batch):
            keys += client.insert(name, rows(start, min(batch, first + n - start)), timeout=30).tolist()
    return keys


def learner(port: int, name: str, batch: int, idle: float) -> list[int]:
    """Sample batches until none comes for ``idle`` seconds; returns every id drawn,
    after checking that each row's observation matches its id."""
    drawn = []
    with tensorshare.Client("127.0.0.1", port, timeout=30) as client:
        while True:
            try:
                sample = client.sample(name, batch, timeout=idle)
            except tensorshare.TimeoutError:
                return drawn
            ids, obs = sample.value["id"], sample.value["obs"]
            if not bool((obs == ids.view(-1, 1).to(torch.int32)).all()):
                raise AssertionError("a row's columns do not belong together")
            drawn += ids.tolist()
