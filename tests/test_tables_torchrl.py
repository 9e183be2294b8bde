"""tensorshare.torchrl: a TorchRL ReplayBuffer over a table of a real server process,
shared by several clients (as by several processes).  Skips where torchrl is not
installed (the torchrl extra; CI installs it)."""

from __future__ import annotations

import pytest
import torch

import tensorshare

torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl)")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import ReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers import RandomSampler, RoundRobinWriter  # noqa: E402

from tensorshare.torchrl import TableStorage, TableWriter  # noqa: E402


def transitions(first: int, n: int) -> TensorDict:
    ids = torch.arange(first, first + n)
    return TensorDict({"obs": ids.view(n, 1).expand(n, 4).float(), "action": ids,
                       "next": TensorDict({"obs": ids.view(n, 1).expand(n, 4).float() + 0.5}, [n])}, [n])


def test_a_replay_buffer_shared_by_two_clients(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as actor, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30) as learner:
        actor_rb = ReplayBuffer(storage=TableStorage("trl-shared", actor, max_size=100), writer=TableWriter(),
                                batch_size=16)
        indices = actor_rb.extend(transitions(0, 30))
        assert indices.tolist() == list(range(30))
        info = actor.table_info("trl-shared")  # made on the first write, from the batch
        assert info["columns"] == {"obs": {"shape": [4], "dtype": "float32"}, "action": {"shape": [], "dtype": "int64"},
                                   "next__obs": {"shape": [4], "dtype": "float32"}}
        learner_rb = ReplayBuffer(storage=TableStorage("trl-shared", learner), sampler=RandomSampler(),
                                  batch_size=16)
        actor_rb.add(transitions(30, 1)[0])
        assert len(learner_rb) == 31
        batch = learner_rb.sample()
        assert batch.batch_size == torch.Size([16])
        assert torch.equal(batch["obs"][:, 0], batch["action"].float())  # rows come whole
        assert torch.equal(batch["next", "obs"], batch["obs"] + 0.5)
        row = learner_rb[5]
        assert row["action"].item() == 5 and row.batch_size == torch.Size([])
        assert learner_rb[2:5]["action"].tolist() == [2, 3, 4]
        learner_rb.empty()
        assert "trl-shared" not in learner.list()


def test_torchrls_round_robin_writer_laps_the_table(client):
    rb = ReplayBuffer(storage=TableStorage("trl-ring", client, max_size=5), writer=RoundRobinWriter(), batch_size=4)
    rb.extend(transitions(0, 7))
    assert len(rb) == 5 and rb[:]["action"].tolist() == [5, 6, 2, 3, 4]


def test_a_storage_needs_a_table_or_a_size(client):
    with pytest.raises(tensorshare.errors.UsageError, match="give max_size"):
        TableStorage("trl-none", client)
