"""tensorshare.torchrl: TorchRL replay buffers over tables of a real server process,
shared by several clients (as by several processes, and by real child processes
where pickling is the point).  Skips where torchrl is not installed (the torchrl
extra; CI installs it).  TorchRL's own replay-buffer suite runs
over tables with ``python -m benchmarks.torchrl_suite`` (README, "Tables")."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import time

import pytest
import torch

import tensorshare

torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl)")

from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, tensorclass  # noqa: E402
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers import RandomSampler, RoundRobinWriter  # noqa: E402

from serverproc import ServerProcess  # noqa: E402
from tensorshare.errors import BadRequestError, BusyError, UsageError  # noqa: E402
from tensorshare.torchrl import TablePrioritizedSampler, TableSampler, TableStorage, TableWriter  # noqa: E402


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


def transitions(first: int, n: int) -> TensorDict:
    ids = torch.arange(first, first + n)
    return TensorDict({"obs": ids.view(n, 1).expand(n, 4).float(), "action": ids,
                       "next": TensorDict({"obs": ids.view(n, 1).expand(n, 4).float() + 0.5}, [n])}, [n])


def until(condition, timeout: float = 10.0) -> None:
    """Wait for ``condition()`` (news from the server), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.005)


class Calls:
    """Counts a client's requests (the real calls go through)."""

    def __init__(self, client, monkeypatch):
        self.n = 0
        real = client._call

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(client, "_call", counted)


# -- one buffer, many clients


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
        assert len(learner_rb) == 30
        actor_rb.add(transitions(30, 1)[0])
        until(lambda: len(learner_rb) == 31)  # heard from the server, not asked
        batch = learner_rb.sample()
        assert batch.batch_size == torch.Size([16])
        assert torch.equal(batch["obs"][:, 0], batch["action"].float())  # rows come whole
        assert torch.equal(batch["next", "obs"], batch["obs"] + 0.5)
        row = learner_rb[5]
        assert row["action"].item() == 5 and row.batch_size == torch.Size([])
        assert learner_rb[2:5]["action"].tolist() == [2, 3, 4]
        assert "trl-shared" in str(learner_rb) and "len=31" in str(learner_rb)  # a buffer prints
        learner_rb.empty()  # for every process: the table stays, with no rows
        assert learner.list()["trl-shared"] == 0 and len(learner_rb) == 0
        until(lambda: len(actor_rb) == 0)
        actor_rb.extend(transitions(0, 2))
        assert len(actor_rb) == 2


def test_torchrls_round_robin_writer_laps_the_table(client):
    rb = ReplayBuffer(storage=TableStorage("trl-ring", client, max_size=5), writer=RoundRobinWriter(), batch_size=4)
    rb.extend(transitions(0, 7))
    assert len(rb) == 5 and rb[:]["action"].tolist() == [5, 6, 2, 3, 4]


def test_a_storage_needs_a_table_or_a_size(client):
    with pytest.raises(UsageError, match="give max_size"):
        TableStorage("trl-none", client)
    client.create_table("trl-items", 4)
    with pytest.raises(UsageError, match="holds items"):
        TableStorage("trl-items", client)


def test_len_costs_no_round_trip(client, monkeypatch):
    rb = ReplayBuffer(storage=TableStorage("trl-len", client, max_size=50), writer=TableWriter())
    rb.extend(transitions(0, 10))
    assert len(rb) == 10  # (the first len() starts listening to the table)
    calls = Calls(client, monkeypatch)
    for _ in range(1000):
        assert len(rb) == 10
    assert calls.n == 0


# -- values of every kind, ndim, new keys


def _values(kind: str, n: int):
    ids = torch.arange(n)
    if kind == "tensor":
        return ids.view(n, 1).expand(n, 3).clone()
    if kind == "tensordict":
        return transitions(0, n)
    if kind == "tensorclass":
        return Step(obs=ids.view(n, 1).float().expand(n, 2).clone(), reward=ids.float(), batch_size=[n])
    if kind == "pytree":
        return {"a": ids.clone(), "b": {"c": [ids.float().view(n, 1), (ids.view(n, 1, 1).expand(n, 2, 2).clone(),)]},
                30: -ids.view(n, 1).float()}
    if kind == "lazy stack":  # members of different shapes within each element
        return LazyStackedTensorDict(TensorDict(a=ids.view(n, 1, 1).expand(n, 4, 8).float(), batch_size=[n]),
                                     TensorDict(a=ids.view(n, 1, 1).expand(n, 3, 8).float(), batch_size=[n]),
                                     stack_dim=1)
    raise AssertionError(kind)


def _leaves(value) -> list[torch.Tensor]:
    if isinstance(value, LazyStackedTensorDict):
        return [leaf for td in value.tensordicts for leaf in _leaves(td)]
    if hasattr(value, "items") and not isinstance(value, dict):
        return [value.get(k) for k in sorted(value.keys(True, True), key=str)]
    return torch.utils._pytree.tree_leaves(value)


@pytest.mark.parametrize("kind", ["tensor", "tensordict", "tensorclass", "pytree", "lazy stack"])
def test_values_of_every_kind_come_back_as_they_went_in_to_every_client(server, client, kind):
    name = f"trl-kind-{kind.replace(' ', '-')}"
    data = _values(kind, 6)
    rb = ReplayBuffer(storage=TableStorage(name, client, max_size=10), batch_size=4)
    assert rb.extend(data).tolist() == list(range(6))
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as other:
        elsewhere = ReplayBuffer(storage=TableStorage(name, other), batch_size=4)  # the table's meta says how
        for buffer in (rb, elsewhere):
            back = buffer[:]
            assert type(back) is type(data) or kind == "lazy stack" and isinstance(back, LazyStackedTensorDict)
            assert all(torch.equal(a, b) for a, b in zip(_leaves(back), _leaves(data)))
            one = buffer[2]
            assert all(torch.equal(a, b) for a, b in zip(_leaves(one), _leaves(_values(kind, 6)[2] if kind != "pytree"
                                                                            else torch.utils._pytree.tree_map(
                                                                                lambda x: x[2], data))))
        drawn, info = elsewhere.sample(return_info=True)
        assert all(leaf.shape[0] == 4 for leaf in _leaves(drawn)) and info["index"].shape == (4,)


def test_a_storage_of_ndim_2_holds_trajectories_in_a_grid_as_torchrls_does(server, client):
    from torchrl.data import LazyTensorStorage

    data = TensorDict({"step": torch.arange(12).view(3, 4), "obs": torch.arange(24).float().view(3, 4, 2)}, [3, 4])
    rb = ReplayBuffer(storage=TableStorage("trl-grid", client, max_size=20, ndim=2), batch_size=5)
    twin = ReplayBuffer(storage=LazyTensorStorage(20, ndim=2), batch_size=5)
    for buffer in (rb, twin):
        buffer.extend(data)
    assert len(rb) == len(twin) == 12 and rb.storage.shape == twin.storage.shape
    assert client.table_info("trl-grid")["capacity"] == twin.storage.max_size == 21  # whole rows of the grid
    assert (rb[:] == twin[:]).all() and (rb.storage[1] == twin.storage[1]).all()
    assert (rb.storage[1:3] == twin.storage[1:3]).all() and (rb.storage[1, 2] == twin.storage[1, 2]).all()
    drawn, info = rb.sample(return_info=True)
    assert drawn.shape == twin.sample().shape and isinstance(info["index"], tuple)
    expected = twin.storage[info["index"]]
    assert (drawn == expected).all()
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as other:
        storage = TableStorage("trl-grid", other)
        assert storage.ndim == 2 and (storage[2] == twin.storage[2]).all()
        with pytest.raises(UsageError, match="ndim 2"):
            TableStorage("trl-grid", other, ndim=1)


def test_a_new_key_becomes_a_column_and_a_key_a_table_cannot_hold_is_named(client):
    rb = ReplayBuffer(storage=TableStorage("trl-newkey", client, max_size=102))
    rb.extend(TensorDict({"a": torch.arange(100), ("b", "c"): torch.arange(100)}, [100]))
    rb[3:4] = TensorDict({"a": torch.tensor([0]), ("b", "c"): torch.tensor([0]), "d": torch.ones(1)}, [1])
    assert "d" in rb[3].keys() and rb[3:5]["d"].tolist() == [1.0, 0.0]  # rows written before: zeros
    assert client.table_info("trl-newkey")["columns"]["d"] == {"shape": [], "dtype": "float32"}
    with pytest.raises(UsageError, match="key 'text' holds NonTensorData"):
        rb.extend(TensorDict({"a": torch.arange(2), ("b", "c"): torch.arange(2), "d": torch.ones(2),
                              "text": NonTensorData("hello", batch_size=[2])}, [2]))
    with pytest.raises(UsageError, match="key 'a' holds .*float32 per element, the table's column 'a'"):
        rb.extend(TensorDict({"a": torch.zeros(2), ("b", "c"): torch.arange(2), "d": torch.ones(2)}, [2]))
    assert len(rb) == 100  # nothing written by the refused batches


def test_a_batch_larger_than_the_capacity_keeps_the_newest_rows(client):
    rb = ReplayBuffer(storage=TableStorage("trl-big", client, max_size=5), writer=TableWriter())
    index = rb.extend(transitions(0, 12))
    assert len(rb) == 5 and sorted(rb[:]["action"].tolist()) == [7, 8, 9, 10, 11]
    assert index.shape == (12,) and torch.equal(index[:7], index[5:])  # a left-out row: its replacement's slot
    assert rb[index[-1].item()]["action"].item() == 11


# -- pickling: the address, never the token


def _in_child(storage, secret: bytes) -> None:  # (multiprocessing: a module-level function)
    """In a process of its own: write through an unpickled storage, and fail to open
    one whose server needs a token this process has not got."""
    ReplayBuffer(storage=storage, writer=TableWriter()).extend(transitions(100, 3))
    try:
        pickle.loads(secret)
    except UsageError as exc:
        raise SystemExit(0 if "needs a token" in str(exc) else 3)
    raise SystemExit(4)


def test_a_storage_pickles_to_its_address_and_token_source_and_reconnects_in_another_process(
        client, tmp_path, monkeypatch):
    storage = TableStorage("trl-pickled", client, max_size=20)
    ReplayBuffer(storage=storage, writer=TableWriter()).extend(transitions(0, 2))
    token = "a-long-enough-secret-token-for-this-test"
    token_file = tmp_path / "token"
    token_file.write_text(token)
    secured = ServerProcess("--token-file", str(token_file))
    try:
        with tensorshare.Client("127.0.0.1", secured.port, token=token, timeout=30) as c:
            with pytest.raises(UsageError, match="token_file"):
                pickle.dumps(TableStorage("trl-secret", c, max_size=4))  # given directly, found nowhere else
            blob = pickle.dumps(TableStorage("trl-secret", c, max_size=4, token_file=str(token_file)))
            assert token.encode() not in blob
            ReplayBuffer(storage=pickle.loads(blob), writer=TableWriter()).extend(transitions(0, 1))
            monkeypatch.setenv("TENSORSHARE_TOKEN", token)
            blob = pickle.dumps(TableStorage("trl-secret", c))  # the environment holds it: the source is that
            assert token.encode() not in blob and len(pickle.loads(blob)) == 1
            monkeypatch.delenv("TENSORSHARE_TOKEN")  # the child's environment has it not
            child = multiprocessing.get_context("spawn").Process(target=_in_child, args=(storage, blob))
            child.start()
            child.join(60)
            assert child.exitcode == 0
    finally:
        secured.stop()
    assert sorted(ReplayBuffer(storage=storage)[:]["action"].tolist()) == [0, 1, 100, 101, 102]
    copy = pickle.loads(pickle.dumps(ReplayBuffer(storage=storage, batch_size=2)))  # a whole buffer too
    assert copy.storage.client is not client and len(copy) == 5


# -- state dicts and checkpoints carry the rows


def test_state_dicts_and_checkpoints_carry_the_rows(client, tmp_path):
    from tensordict import TensorDict as TD

    rb = ReplayBuffer(storage=TableStorage("trl-state", client, max_size=8, sampler="prioritized"),
                      writer=TableWriter())
    rb.extend(transitions(0, 5))
    client.update_priorities("trl-state", client.table_info("trl-state", slots=0)["slots"]["keys"], [1, 2, 3, 4, 5])
    client.read("trl-state", [0, 3, 0], sample=True)  # sample counts 2, 0, 0, 1, 0
    state = rb.state_dict()
    other = ReplayBuffer(storage=TableStorage("trl-state-copy", client, max_size=3), writer=TableWriter())
    other.load_state_dict(state)  # the table made as the saved one was, with its rows, priorities and counts
    assert other[:]["action"].tolist() == [0, 1, 2, 3, 4] and client.table_info("trl-state-copy")["capacity"] == 8
    assert client.table_info("trl-state-copy", slots=0)["slots"]["priorities"].tolist() == [1, 2, 3, 4, 5]
    assert client.table_info("trl-state-copy", slots=0)["slots"]["times_sampled"].tolist() == [2, 0, 0, 1, 0]

    rb.dumps(tmp_path / "rb")  # TorchRL's checkpoint: the storage's part is a table checkpoint
    checkpoint = tmp_path / "rb" / "storage"
    columns = tensorshare.load_memmap(checkpoint)
    assert columns["action"].tolist() == [0, 1, 2, 3, 4] and columns["next__obs"].shape == (5, 4)
    assert TD.load_memmap(checkpoint)["action"].tolist() == [0, 1, 2, 3, 4]  # tensordict opens it too
    rb.extend(transitions(10, 3))
    rb.loads(tmp_path / "rb")
    assert rb[:]["action"].tolist() == [0, 1, 2, 3, 4]
    assert client.load_table(checkpoint, "trl-state-loaded") == 5
    assert client.table_info("trl-state-loaded", slots=0)["slots"]["priorities"].tolist() == [1, 2, 3, 4, 5]
    assert client.table_info("trl-state-loaded", slots=0)["slots"]["times_sampled"].tolist() == [2, 0, 0, 1, 0]


def test_loaded_rows_take_priority_updates_and_a_refused_state_leaves_the_table(tmp_path):
    """After ``loads`` or ``load_state_dict`` the rows have new keys: updates by index
    reach them (the storage's remembered keys named nothing, and the server skipped
    them); a state whose settings the server refuses leaves the table as it was (it
    was deleted first)."""
    srv = ServerProcess("--max-table-rows", "40")
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            storage = TableStorage("per", c, max_size=8)
            rb = TensorDictReplayBuffer(storage=storage, sampler=TablePrioritizedSampler(), writer=TableWriter(),
                                        batch_size=4)
            rb.extend(transitions(0, 8))
            rb.update_priority(torch.arange(8), torch.full((8,), 2.0))
            rb.dumps(tmp_path / "rb")
            state = rb.state_dict()
            for load in (lambda: rb.loads(tmp_path / "rb"), lambda: rb.load_state_dict(state)):
                load()
                rb.update_priority(torch.arange(8), torch.full((8,), 5.0))
                assert c.table_info("per", slots=0)["slots"]["priorities"].tolist() == pytest.approx([5.0] * 8)
            mine = storage.state_dict()
            mine["spec"]["capacity"] = 64  # more rows than the server allows
            with pytest.raises(tensorshare.errors.TooLargeError):
                storage.load_state_dict(mine)
            assert c.table_info("per")["size"] == 8
    finally:
        srv.stop()


# -- reads count, samplers draw in the server


def test_reads_a_torchrl_sampler_makes_count_as_samples_and_wait_for_the_rate_limiter(server, client):
    client.create_table("trl-paced", 100, {"x": ((), torch.int64)}, min_size_to_sample=2, samples_per_insert=1.0,
                        error_buffer=4.0)
    rb = ReplayBuffer(storage=TableStorage("trl-paced", client), sampler=RandomSampler(), writer=TableWriter(),
                      batch_size=2)
    rb.extend({"x": torch.arange(6)})  # the balance: 6 (samples may take it down to -2)
    rb.sample()
    rb.sample()
    assert client.table_info("trl-paced")["samples"] == 4
    assert rb[0]["x"].item() == 0 and client.table_info("trl-paced")["samples"] == 4  # by index: not a sample
    with tensorshare.Client("127.0.0.1", server.port, timeout=0.5) as impatient:
        learner = ReplayBuffer(storage=TableStorage("trl-paced", impatient), sampler=RandomSampler(), batch_size=2)
        learner.sample()
        learner.sample()  # -2
        with pytest.raises(BusyError, match="not let through"):
            learner.sample()  # the rate limiter waits for inserts
    rb.extend({"x": torch.arange(2)})
    rb.sample()


def test_a_table_sampler_takes_one_round_trip(client, monkeypatch):
    rb = ReplayBuffer(storage=TableStorage("trl-one-trip", client, max_size=64), sampler=TableSampler(),
                      writer=TableWriter(), batch_size=8)
    rb.extend(transitions(0, 40))
    calls = Calls(client, monkeypatch)
    for _ in range(3):
        drawn, info = rb.sample(return_info=True)
        assert torch.equal(drawn["obs"][:, 0], drawn["action"].float())
        assert torch.equal(drawn["action"], info["index"])  # row i lives in slot i
    assert calls.n == 3 and client.table_info("trl-one-trip")["samples"] == 24


def test_a_prioritized_table_sampler_makes_the_table_and_updates_its_priorities(client):
    sampler = TablePrioritizedSampler(alpha=0.7, beta=0.5)
    rb = TensorDictReplayBuffer(storage=TableStorage("trl-per", client, max_size=16), sampler=sampler,
                                writer=TableWriter(), batch_size=64, priority_key="td_error")
    rb.extend(transitions(0, 4))
    info = client.table_info("trl-per")
    assert info["sampler"] == "prioritized" and info["priority_exponent"] == 0.7
    rb.update_priority(torch.tensor([0, 1, 2, 3]), torch.tensor([0.0, 0.0, 0.0, 10.0]))
    slots = client.table_info("trl-per", slots=0)["slots"]
    assert slots["priorities"].tolist() == pytest.approx([1e-8, 1e-8, 1e-8, 10 + 1e-8])
    drawn = rb.sample()
    assert (drawn["action"] == 3).all() and torch.allclose(drawn["priority_weight"], torch.ones(64))
    drawn.set("td_error", torch.where(drawn["action"] == 3, 1.0, 0.0))
    rb.update_tensordict_priority(drawn)  # TorchRL's own path: PrioritizedSampler.update_priority
    assert client.table_info("trl-per", slots=0)["slots"]["priorities"][3].item() == pytest.approx(1.0)
    rb.extend(transitions(4, 1))  # a new row gets the highest priority seen
    assert client.table_info("trl-per", slots=0)["slots"]["priorities"][4].item() == pytest.approx(10.0)
    with pytest.raises(UsageError, match="prioritized"):
        client.create_table("trl-uniform", 4, {"x": ((), torch.int64)})
        ReplayBuffer(storage=TableStorage("trl-uniform", client), sampler=TablePrioritizedSampler()).sample(1)


def test_update_priority_does_not_wait_and_a_refusal_comes_with_the_next(client):
    """rb.update_priority goes out without waiting for its reply (the learner goes on
    at once); the next request on the client reads that reply on the way and sees
    the new priorities.  A NaN or a negative priority is refused at once, with nothing
    sent; a weight only the table refuses (past its largest) is raised by the next
    update_priority, and neither changes a priority."""
    sampler = TablePrioritizedSampler(alpha=1.0, beta=0.5, eps=0.0)
    rb = TensorDictReplayBuffer(storage=TableStorage("trl-nowait", client, max_size=16), sampler=sampler,
                                writer=TableWriter(), batch_size=8)
    rb.extend(transitions(0, 4))
    rb.sample()

    def priorities():
        return client.table_info("trl-nowait", slots=0)["slots"]["priorities"].tolist()

    rb.update_priority(torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert client._unawaited, "update_priority waited for its reply"
    assert priorities() == [1.0, 2.0, 3.0, 4.0]  # (applied before the next request)
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(BadRequestError, match="is not a finite number >= 0"):
            rb.update_priority(torch.tensor([0, 1]), torch.tensor([5.0, bad]))
    huge = torch.tensor([1e308], dtype=torch.float64)  # past the largest weight a 16-row table takes
    rb.update_priority(torch.tensor([1]), huge)
    with pytest.raises(BadRequestError, match="is over"):
        rb.update_priority(torch.tensor([2]), torch.tensor([7.0]))  # (raises the one before; not sent)
    assert priorities() == [1.0, 2.0, 3.0, 4.0]
    rb.update_priority(torch.tensor([2]), torch.tensor([7.0]))
    client.flush()
    assert priorities() == [1.0, 2.0, 7.0, 4.0]


# -- prioritized replay through a table trains


@pytest.fixture
def one_thread():
    """Small networks: torch's thread pool only contends with the server (and other work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_prioritized_torchrl_buffer_over_a_table_trains(client, one_thread):
    """TorchRL's prioritized replay (TensorDictReplayBuffer, priority_key, importance
    weights, update_tensordict_priority), drawn and reprioritized by the table: a
    small network learns a function whose hard part is a few percent of the rows."""
    torch.manual_seed(0)
    n = 2048
    x = torch.rand(n, 1)
    y = torch.where(x > 0.95, torch.sin(60 * x), 0.3 * x)  # the last 5% is where the error is
    rb = TensorDictReplayBuffer(storage=TableStorage("trl-per-train", client, max_size=n),
                                sampler=TablePrioritizedSampler(alpha=0.7, beta=0.5), writer=TableWriter(),
                                priority_key="td_error", batch_size=64)
    rb.extend(TensorDict({"x": x, "y": y}, [n]))
    net = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)

    def loss_on_all() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(x), y))

    before = loss_on_all()
    for _ in range(400):
        batch = rb.sample()
        error = net(batch["x"]) - batch["y"]
        loss = (batch["priority_weight"].unsqueeze(1) * error.pow(2)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch.set("td_error", error.detach().abs().squeeze(1))
        rb.update_tensordict_priority(batch)
    after = loss_on_all()
    assert after < before / 5, (before, after)
    priorities = client.table_info("trl-per-train", slots=0)["slots"]["priorities"]
    hard = (x > 0.95).squeeze(1)
    assert priorities[hard].mean() > 3 * priorities[~hard].mean()  # the server holds where the error is
    assert client.table_info("trl-per-train")["samples"] == 400 * 64


def test_the_length_follows_the_table_after_a_server_restart(tmp_path):
    """A restarted server counts the table's seqs anew: the storage took every later
    change for an old one, and its length stayed what it was before the restart."""
    srv = ServerProcess("--data-dir", str(tmp_path / "data"))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            storage = TableStorage("kept", c, max_size=64)
            rb = ReplayBuffer(storage=storage, writer=TableWriter())
            for first in range(0, 20, 2):  # the seq climbs past what the restarted server starts from
                rb.extend(transitions(first, 2))
            assert len(storage) == 20
            srv.stop(signal.SIGKILL)
            srv.start()
            until(lambda: _ping(c))
            c.insert("kept", c.read("kept", torch.arange(3)))  # another client's writes, as it were
            until(lambda: len(storage) == 23)
    finally:
        srv.stop()


def _ping(client) -> bool:
    try:
        client.ping()
    except tensorshare.errors.ConnectionLostError:
        return False
    return True
