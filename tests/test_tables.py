"""Tables against a real server process (issue #19): the client API as the README
shows it, TensorDict batches, clear timeouts, and actors and learners in separate
processes with nothing lost or duplicated.  Protocol edges are in
test_tables_protocol.py, the engine's rules in test_tables_engine.py."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter

import pytest
import torch

import tensorshare
from tensorshare.errors import BadNameError, BadRequestError, BusyError, NoSuchBinError, UsageError

import table_procs


def test_the_readme_example(client):
    client.create_table("replay", capacity=1000,
                        columns={"obs": ((4, 8, 8), torch.uint8), "action": ((), torch.int64),
                                 "reward": ((), torch.float32)},
                        sampler="prioritized", priority_exponent=0.6, remover="fifo", min_size_to_sample=10)
    batch = {"obs": torch.randint(0, 255, (32, 4, 8, 8), dtype=torch.uint8), "action": torch.arange(32),
             "reward": torch.rand(32)}
    keys = client.insert("replay", batch, priorities=torch.rand(32) + 0.1)
    assert keys.dtype == torch.int64 and keys.shape == (32,)
    s = client.sample("replay", 256, timeout=10)
    assert s.value["obs"].shape == (256, 4, 8, 8) and s.value["action"].shape == (256,)
    assert s.keys.shape == s.probabilities.shape == (256,)
    assert torch.equal(s.value["obs"], batch["obs"][s.value["action"]])  # rows come whole
    assert client.update_priorities("replay", s.keys, torch.full((256,), 2.0)) == len(set(s.keys.tolist()))
    assert torch.equal(client.read("replay", [5])["reward"], batch["reward"][5:6])
    client.write("replay", torch.tensor([999]), {k: v[:1] for k, v in batch.items()})
    info = client.table_info("replay")
    assert (info["size"], info["capacity"], info["inserts"], info["samples"]) == (33, 1000, 33, 256)
    assert client.list()["replay"] == 33
    client.delete("replay")
    assert "replay" not in client.list()


def test_a_tensordict_batch(client):
    tensordict = pytest.importorskip("tensordict")
    client.create_table("td", 100, {"x": ((3,), torch.float32), "done": ((), torch.bool)})
    td = tensordict.TensorDict({"x": torch.ones(4, 3), "done": torch.zeros(4, dtype=torch.bool)}, batch_size=[4])
    assert client.insert("td", td).shape == (4,)
    drawn = client.sample("td", 2).value
    assert isinstance(drawn, tensordict.TensorDict) and drawn.batch_size == torch.Size([2])
    assert drawn["x"].shape == (2, 3) and drawn["done"].dtype == torch.bool
    assert isinstance(client.read("td", [0, 1, 2]), tensordict.TensorDict)


def test_bad_input_gets_clear_errors_and_the_server_goes_on(client):
    client.create_table("strict", 10, {"x": ((3,), torch.float32)})
    with pytest.raises(BadRequestError, match=r"rows of shape \[3\]"):
        client.insert("strict", {"x": torch.zeros(2, 4)})
    with pytest.raises(BadRequestError, match="holds float32, not float64"):
        client.insert("strict", {"x": torch.zeros(2, 3, dtype=torch.float64)})
    with pytest.raises(BadRequestError, match="out of range"):
        client.read("strict", [10])
    client.put("plain-bin", 1)
    with pytest.raises(BadNameError):
        client.create_table("plain-bin", 10)
    assert client.ping() < 5


def test_priority_updates_sent_without_waiting_apply_before_the_next_sample(client):
    """A learner's loop: update_priorities_nowait returns at once, the server
    applies it before the sample sent after it, and the sample's call reads its
    reply on the way (no thread is started for it)."""
    client.create_table("learn-loop", 8, {"x": ((), torch.int64)}, sampler="prioritized")
    keys = client.insert("learn-loop", {"x": torch.arange(4)}, priorities=torch.ones(4))
    for chosen in (3, 0, 2):
        only = torch.zeros(4)
        only[chosen] = 1.0
        assert client.update_priorities_nowait("learn-loop", keys, only) is None
        assert client.sample("learn-loop", 64).value["x"].tolist() == [chosen] * 64
    assert client.router.home.reader.thread is None and client._dispatcher is None
    client.flush()
    assert client.table_info("learn-loop", slots=0)["slots"]["priorities"].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_a_sample_carries_the_last_update_in_the_same_request(client):
    """sample(update=(keys, priorities)): one request a step; the update is set
    before the draw, and a bad one is refused with the table as it was."""
    client.create_table("learn-one", 8, {"x": ((), torch.int64)}, sampler="prioritized")
    keys = client.insert("learn-one", {"x": torch.arange(4)}, priorities=torch.ones(4))
    for chosen in (1, 3, 0):
        only = torch.zeros(4)
        only[chosen] = 1.0
        assert client.sample("learn-one", 64, update=(keys, only)).value["x"].tolist() == [chosen] * 64
    with pytest.raises(BadRequestError, match="priority"):
        client.sample("learn-one", 4, update=(keys, torch.tensor([1.0, -1.0, 1.0, 1.0])))
    with pytest.raises(UsageError, match="pair"):
        client.sample("learn-one", 4, update=keys)
    info = client.table_info("learn-one", slots=0)
    assert info["samples"] == 3 * 64 and info["slots"]["priorities"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_an_update_sent_without_waiting_raises_its_error_on_the_next_update_or_flush(client):
    client.create_table("learn-errors", 8, {"x": ((), torch.int64)}, sampler="prioritized")
    keys = client.insert("learn-errors", {"x": torch.arange(4)})
    assert client.update_priorities_nowait("nosuch", keys, torch.ones(4)) is None
    assert len(client.sample("learn-errors", 4)) == 4  # (another call goes on: it read that reply on the way)
    with pytest.raises(NoSuchBinError, match="nosuch"):
        client.update_priorities_nowait("learn-errors", keys, torch.ones(4))
    client.flush()  # that one was sent and succeeded: nothing to raise, and no error raised twice
    client.update_priorities_nowait("learn-errors", keys, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(BadRequestError, match="priority"):
        client.flush()
    client.flush()
    assert client.update_priorities("learn-errors", keys, torch.full((4,), 2.0)) == 4  # the connection goes on


def test_an_update_sent_without_waiting_and_followed_by_nothing_still_reaches_the_server(server, client):
    """The kernel holds such an update back for the next request to go with it
    (one segment, one wake-up of the server): with none, it goes within Linux's
    0.2 s ceiling all the same, and flush() sends it at once."""
    client.create_table("learn-later", 8, {"x": ((), torch.int64)}, sampler="prioritized")
    keys = client.insert("learn-later", {"x": torch.arange(4)})
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as other:
        def priorities():
            return other.table_info("learn-later", slots=0)["slots"]["priorities"].tolist()

        client.update_priorities_nowait("learn-later", keys, torch.full((4,), 3.0))
        deadline = time.monotonic() + 10
        while priorities() != [3.0] * 4:
            assert time.monotonic() < deadline, "an update sent without waiting never reached the server"
            time.sleep(0.01)
        client.update_priorities_nowait("learn-later", keys, torch.full((4,), 5.0))
        client.flush()
        assert priorities() == [5.0] * 4


def test_a_sample_waits_for_rows_and_times_out_clearly(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as learner, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30) as actor:
        learner.create_table("slow", 10, {"x": ((), torch.int64)}, min_size_to_sample=2)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not let through within 0.3s"):
            learner.sample("slow", 1, timeout=0.3)
        assert 0.25 < time.monotonic() - start < 3
        got = []
        t = threading.Thread(target=lambda: got.append(learner.sample("slow", 2, timeout=10)))
        t.start()
        time.sleep(0.2)
        actor.insert("slow", {"x": torch.tensor([7])})
        assert actor.table_info("slow")["waiting_samples"] == 1
        actor.insert("slow", {"x": torch.tensor([8])})
        t.join(10)
        assert sorted(got[0].value["x"].tolist()) in ([7, 7], [7, 8], [8, 8])


def test_an_insert_waits_for_samples_and_limits_change_at_run_time(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        c.create_table("ratio", 100, {"x": ((), torch.int64)}, min_size_to_sample=1, samples_per_insert=1.0,
                       error_buffer=2.0)
        c.insert("ratio", {"x": torch.arange(3)})
        with pytest.raises(BusyError):  # 3 inserts ahead of samples: the window is full
            c.insert("ratio", {"x": torch.tensor([3])}, timeout=0.2)
        c.sample("ratio", 2)
        c.insert("ratio", {"x": torch.tensor([3])}, timeout=5)
        info = c.set_table_limits("ratio", samples_per_insert=None)
        assert info["rate_limiter"]["samples_per_insert"] is None
        c.insert("ratio", {"x": torch.arange(50)}, timeout=1)  # no ratio any more


@pytest.mark.process
def test_actor_and_learner_processes_lose_and_duplicate_nothing(server):
    """Two actor processes insert 300 numbered rows each; two learner processes sample
    a fifo table whose rows leave after one sample: every row is drawn exactly once,
    whole."""
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        c.create_table("relay", 1000, {"id": ((), torch.int64), "obs": ((16,), torch.int32)}, sampler="fifo",
                       remover=None, max_times_sampled=1)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorshare.client", "table_procs"])
    with ctx.Pool(4) as pool:
        learners = [pool.apply_async(table_procs.learner, (server.port, "relay", 10, 3.0)) for _ in range(2)]
        actors = [pool.apply_async(table_procs.actor, (server.port, "relay", a * 300, 300, 25)) for a in range(2)]
        keys = [k for a in actors for k in a.get(timeout=60)]
        drawn = Counter(i for r in learners for i in r.get(timeout=60))
    assert len(set(keys)) == 600
    assert [i for i, n in drawn.items() if n > 1] == []
    assert sorted(drawn) == list(range(600))
