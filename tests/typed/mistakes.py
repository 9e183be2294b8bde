"""Calls a type checker must refuse: the line's comment names mypy's error code.
tests/test_typing.py checks that ``mypy --strict`` reports each, and nothing else."""

from __future__ import annotations

import tensorshare
from tensorshare import AsyncClient, Client, RLTrainer


def mistakes(client: Client, aclient: AsyncClient, trainer: RLTrainer) -> None:
    client.put(123, "x")  # E: arg-type
    client.put("x", 1, tagg=1)  # E: call-arg
    client.get("x", timeout="soon")  # E: arg-type
    count: str = client.append("x", 1)  # E: assignment
    items: list[int] = aclient.list()  # E: assignment
    tensorshare.Clinet("127.0.0.1", 8000)  # E: attr-defined
    Client("127.0.0.1", 8000, tls_ca=1)  # E: arg-type
    trainer.get_data(max_itmes=32)  # E: call-arg
