"""A user's program, as a type checker reads it: every public class and verb, with
the types they must have (``assert_type`` fails the check if one is ``Any``).
tests/test_typing.py runs ``mypy --strict`` on it; it is never run."""

from __future__ import annotations

from typing import Any

import torch
from twisted.internet.defer import Deferred
from typing_extensions import assert_type

import tensorshare
from tensorshare import (
    AsyncClient, Client, Listening, Notification, RLTrainer, RLWorker, ShardedClient, TensorShare, connect,
    load_memmap, save_memmap,
)
from tensorshare.errors import BusyError, NoSuchBinError, TensorShareError
from tensorshare.rl import Rollout, WorkerInfo


def on_change(note: Notification) -> None:
    assert_type(note.seq, int)


def blocking(client: Client) -> None:
    assert_type(client.put("params", {"w": torch.ones(2)}, tag=1), int)
    assert_type(client.append("rollouts", [1, 2], below=256), int)
    assert_type(client.list(), dict[str, int])
    assert_type(client.list("roll*"), dict[str, int])
    assert_type(client.delete("params"), None)
    assert_type(client.ping(), float)
    assert_type(client.listen("rollouts", on_change), Listening)
    assert_type(client.save("params", "ckpt"), int)
    assert_type(client.load_table("ckpt"), int)
    assert_type(client.create_table("replay", 100, {"obs": ((4,), torch.float32)}), int)
    assert_type(client.sample("replay", 32).keys, torch.Tensor)
    assert_type(client.table_info("replay"), dict[str, Any])
    assert_type(client.update_priorities("replay", [1], [0.5]), int)
    assert_type(client.update_priorities_nowait("replay", [1], [0.5]), None)
    assert_type(client.relay_status(), dict[str, Any] | None)
    items = client.get("rollouts", wait=1.0, least=4, max_items=8)
    newer = client.peek("params", since=3, wait=10.0)
    print(items, newer, client.same_host, client.workers)


def deferred(client: AsyncClient) -> None:
    assert_type(client.put("params", torch.ones(2)), Deferred[int])
    assert_type(client.list(), Deferred[dict[str, int]])
    assert_type(client.listen("bin", on_change), Deferred[Listening])
    assert_type(client.load_table("ckpt"), Deferred[int])
    assert_type(AsyncClient.connect("127.0.0.1", 8000), Deferred[AsyncClient])


def sharded(client: ShardedClient) -> None:
    assert_type(client.put("params", 1), int)
    assert_type(client.list(), dict[str, int])
    assert_type(client.ping(), list[float])
    assert_type(client.client_for("params"), Client)


def rl(trainer: RLTrainer, worker: RLWorker) -> None:
    assert_type(trainer.publish_parameters({"w": torch.ones(2)}, dtype=torch.bfloat16, delta=True), int)
    assert_type(trainer.workers, dict[str, WorkerInfo])
    assert_type(trainer.dropped, int)
    assert_type(worker.get_parameters(), dict[Any, Any] | None)
    assert_type(worker.add_data({"obs": torch.ones(2)}), None)
    rollouts: list[Rollout] = trainer.get_data(max_items=32, return_info=True)
    print(rollouts, worker.stop_requested)


def the_rest() -> None:
    with connect("127.0.0.1", 8000, retry_for=5) as client:
        assert_type(client, Client)
    assert_type(Client("127.0.0.1", 8000).__enter__(), Client)
    with TensorShare("127.0.0.1", 8000) as ts:
        assert_type(ts, TensorShare)
        ts.put("bin", 1, callback=print)
    save_memmap({"w": torch.ones(2)}, "ckpt")
    print(load_memmap("ckpt"), tensorshare.__version__)
    try:
        tensorshare.run_server(0, start_reactor=False)
    except (NoSuchBinError, BusyError, TensorShareError):
        pass
