"""Sequences and the fifo ring end to end: the client's ``sample(length=)`` and
``ends``, TorchRL's slice samplers served by a table, and episode marks through a
checkpoint and a durable restart.  Real server processes, real sockets."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare.errors import BadRequestError
from serverproc import ServerProcess

pytestmark = pytest.mark.process


def episode(first: int, n: int) -> tuple[dict, torch.Tensor]:
    ends = torch.zeros(n, dtype=torch.bool)
    ends[-1] = True
    return {"x": torch.arange(first, first + n)}, ends


def fill(client, name: str, lengths: list[int]) -> list[range]:
    """Episodes of these lengths, x counting up; returns each one's x values."""
    spans, first = [], 0
    for n in lengths:
        batch, ends = episode(first, n)
        client.insert(name, batch, ends=ends)
        spans.append(range(first, first + n))
        first += n
    return spans


def within_one(row: list[int], spans: list[range]) -> bool:
    return any(row[0] in span and row[-1] in span for span in spans) and row == list(range(row[0], row[-1] + 1))


def test_a_client_samples_sequences_of_one_episode_padded_or_whole(client):
    client.create_table("seq-c", 100, {"x": ((), torch.int64)}, sampler="prioritized")
    spans = fill(client, "seq-c", [3, 10, 2, 8])
    s = client.sample("seq-c", 50, length=4)
    assert s.value["x"].shape == (50, 4) and s.keys.shape == (50, 4) and s.indices.shape == (50, 4)
    assert s.probabilities.shape == (50,) and s.lengths.tolist() == [4] * 50
    assert all(within_one(row, spans) for row in s.value["x"].tolist())
    # a sequence's priority is its first row's: raise one, it comes up more often
    start = s.keys[0, 0]
    client.update_priorities("seq-c", start.reshape(1), [1000.0])
    s = client.sample("seq-c", 50, length=4)
    assert (s.keys[:, 0] == start).float().mean() > 0.8
    # (its priority back: with it at 1000, 200 draws were all of whole sequences 1 run in 10)
    client.update_priorities("seq-c", start.reshape(1), [1.0])
    padded = client.sample("seq-c", 200, length=5, pad=True)
    for row, length in zip(padded.value["x"].tolist(), padded.lengths.tolist()):
        assert within_one(row[:length], spans) and row[length:] == [row[length - 1]] * (5 - length)
    assert min(padded.lengths.tolist()) < 5
    with pytest.raises(tensorshare.errors.BusyError, match="no sequence of 11 rows"):
        client.sample("seq-c", 1, length=11)
    client.delete("seq-c")


def test_a_batch_larger_than_a_fifo_table_keeps_the_newest_rows(client):
    client.create_table("ring-c", 5, {"x": ((), torch.int64)})
    keys = client.insert("ring-c", {"x": torch.arange(12)})
    assert keys.numel() == 12
    rows = client.read("ring-c", torch.arange(5))["x"]
    assert sorted(rows.tolist()) == [7, 8, 9, 10, 11]
    assert client.update_priorities("ring-c", keys, [2.0]) == 5  # the first 7 keys name no row
    client.delete("ring-c")


def test_episode_marks_survive_a_checkpoint_and_a_wrapped_ring_stays_apart(client, tmp_path):
    client.create_table("seq-ck", 10, {"x": ((), torch.int64)})
    client.insert("seq-ck", {"x": torch.arange(7)})
    batch, ends = episode(7, 6)  # the ring wraps: slots 7, 8, 9, 0, 1, 2
    ends[2] = True  # an episode ends at x = 9
    client.insert("seq-ck", batch, ends=ends)
    client.save("seq-ck", tmp_path / "ck")
    client.delete("seq-ck")
    client.load_table(tmp_path / "ck")
    x = client.sample("seq-ck", 300, length=2).value["x"].tolist()
    pairs = {tuple(row) for row in x}
    assert all(b == a + 1 for a, b in pairs)
    # neither across the episode's end (9 -> 10) nor from the newest row to the oldest (12 -> 3)
    assert pairs == {(3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (10, 11), (11, 12)}
    client.delete("seq-ck")


def test_a_loaded_copy_keeps_the_rows_age_order_and_the_newest_row_open(client, tmp_path):
    """Rows are written back in the order of their keys: a wrapped fifo ring removes,
    and a fifo sampler draws, the oldest first in the copy as in the table (written in
    slot order, the copy's oldest was the row of slot 0); and the newest row is not
    marked as an episode's end, so the rows inserted after it follow it in both."""
    for name in ("age", "age-copy"):
        client.delete(name) if name in client.list() else None
    client.create_table("age", 4, {"x": ((), torch.int64)}, sampler="fifo")
    client.insert("age", {"x": torch.arange(4)})
    client.insert("age", {"x": torch.arange(4, 6)})  # slots hold x = 4, 5, 2, 3
    client.save("age", tmp_path / "age")
    client.load_table(tmp_path / "age", "age-copy")
    for name in ("age", "age-copy"):
        assert client.sample(name, 1).value["x"].tolist() == [2]  # the oldest
        client.insert(name, {"x": torch.tensor([100])})
    assert (sorted(client.read("age-copy", torch.arange(4))["x"].tolist())
            == sorted(client.read("age", torch.arange(4))["x"].tolist()) == [3, 4, 5, 100])
    client.create_table("open", 8, {"x": ((), torch.int64)})
    client.insert("open", {"x": torch.arange(3)})
    client.save("open", tmp_path / "open")
    client.load_table(tmp_path / "open", "open-copy")
    for name in ("open", "open-copy"):
        client.insert(name, {"x": torch.arange(3, 6)})
        pairs = {tuple(row) for row in client.sample(name, 200, length=2).value["x"].tolist()}
        assert (2, 3) in pairs, name
        client.delete(name)
    client.delete("age")
    client.delete("age-copy")


def test_a_copy_made_while_rows_change_keeps_only_whole_rows(client, tmp_path, monkeypatch):
    """Rows that change between the slots' state and the read of their columns (one
    replaced by an insert, one removed) are left out of the copy; every row in it is
    the one its key, priority and mark came with (before, a replaced row's columns came
    with the old row's key and priority, and a removed one failed the whole save)."""
    from tensorshare import table_copy

    client.create_table("moving", 4, {"x": ((), torch.int64)}, sampler="prioritized", max_times_sampled=1)
    client.insert("moving", {"x": torch.arange(4)}, priorities=[1.0, 2.0, 3.0, 4.0])
    before = table_copy.occupied(client, "moving", 4)
    client.insert("moving", {"x": torch.tensor([10])}, priorities=[10.0])  # replaces the row of slot 0
    client.read("moving", [1], sample=True)  # sampled out: slot 1 holds no row now
    monkeypatch.setattr(table_copy, "occupied", lambda *args: before)
    assert client.save("moving", tmp_path / "moving") == 2
    copy = tensorshare.load_memmap(tmp_path / "moving")
    saved = np.fromfile(tmp_path / "moving" / "_slots" / "priority.bin", "<f8")
    assert copy["x"].tolist() == [2, 3] and saved.tolist() == [3.0, 4.0]
    client.delete("moving")


def test_a_durable_tables_compact_state_and_marks_survive_kill_9(tmp_path):
    data = tmp_path / "data"
    srv = ServerProcess("--data-dir", str(data))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("seq-d", 64, {"x": ((), torch.int64)}, sampler="prioritized")
            fill(c, "seq-d", [5, 30, 40])  # 75 rows into 64: wrapped, rows 11-74 held
            drawn = c.sample("seq-d", 20)
            c.update_priorities("seq-d", drawn.keys[:3], [0.25, 4.0, 9.0])
            before = c.table_info("seq-d", slots=0)["slots"]
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(10)
        srv = ServerProcess("--data-dir", str(data))
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            after = c.table_info("seq-d", slots=0)["slots"]
            for what in ("indices", "keys", "priorities", "times_sampled", "ends"):
                assert torch.equal(before[what], after[what]), what
            x = c.sample("seq-d", 100, length=8).value["x"].tolist()
            assert all(row == list(range(row[0], row[0] + 8)) for row in x)
            assert all(within_one(row, [range(11, 35), range(35, 75)]) for row in x)  # (rows 0-10 were overwritten)
    finally:
        srv.stop()


# -- TorchRL's slice samplers


def test_torchrls_slice_samplers_are_served_by_the_table(client):
    torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl)")
    del torchrl
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    from tensorshare.torchrl import TablePrioritizedSliceSampler, TableSliceSampler, TableStorage, TableWriter

    def steps(first: int, n: int) -> TensorDict:
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[-1] = True
        return TensorDict({"obs": torch.arange(first, first + n).float(), "episode": torch.full((n,), first),
                           "next": TensorDict({"done": done}, [n])}, [n])

    rb = TensorDictReplayBuffer(storage=TableStorage("trl-slices", client, max_size=200),
                                sampler=TableSliceSampler(slice_len=4), writer=TableWriter(), batch_size=32)
    for first, n in ((0, 6), (6, 3), (9, 12)):
        rb.extend(steps(first, n))
    s = rb.sample()
    obs = s["obs"].reshape(8, 4)
    assert (obs.diff(dim=1) == 1).all() and (s["episode"].reshape(8, 4) == s["episode"].reshape(8, 4)[:, :1]).all()
    assert s[("next", "truncated")].reshape(8, 4)[:, -1].all() and not s[("next", "truncated")].reshape(8, 4)[:, :-1].any()
    ragged = TensorDictReplayBuffer(storage=TableStorage("trl-slices", client),
                                    sampler=TableSliceSampler(slice_len=4, strict_length=False, pad_output=True),
                                    batch_size=64)
    s = ragged.sample()
    mask = s[("collector", "mask")].reshape(16, 4)
    assert (mask.sum(1) >= 1).all() and (~mask).any()  # some start near an episode's end
    # prioritized: a sequence by its first step's priority
    per = TensorDictReplayBuffer(storage=TableStorage("trl-pslices", client, max_size=200),
                                 sampler=TablePrioritizedSliceSampler(alpha=1.0, beta=0.5, slice_len=4),
                                 writer=TableWriter(), batch_size=32)
    for first, n in ((0, 6), (6, 3), (9, 12)):
        per.extend(steps(first, n))
    per.update_priority(torch.arange(21), torch.where(torch.arange(21) == 10, 100.0, 1e-6))
    s = per.sample()
    assert (s["obs"].reshape(8, 4)[:, 0] == 10).float().mean() > 0.9
    assert s["priority_weight"].shape == (32,)
    # episodes told by traj_key alone (no done flags): TorchRL's __init__ fills end_key in
    # with ("next", "done"), which hid traj_key (slices crossed episodes)
    by_id = TensorDictReplayBuffer(storage=TableStorage("trl-traj", client, max_size=200),
                                   sampler=TableSliceSampler(slice_len=4, traj_key="episode"), writer=TableWriter(),
                                   batch_size=64)
    for first, n in ((0, 5), (5, 7), (12, 4)):
        by_id.extend(TensorDict({"obs": torch.arange(first, first + n).float(),
                                 "episode": torch.full((n,), first)}, [n]))
    s = by_id.sample()
    assert (s["episode"].reshape(16, 4) == s["episode"].reshape(16, 4)[:, :1]).all()
    client.delete("trl-slices")
    client.delete("trl-pslices")
    client.delete("trl-traj")


def test_sample_counts_survive_a_checkpoint_and_max_times_sampled_counts_on(client, tmp_path):
    """A checkpoint keeps each row's sample count, and the table made again from it
    has them: a row sampled twice of three allowed leaves after one more sample in
    the copy as in the table, and a row never sampled still has three to give."""
    for name in ("counted", "counted-copy"):
        client.delete(name) if name in client.list() else None
    client.create_table("counted", 4, {"x": ((), torch.int64)}, sampler="fifo", remover=None, max_times_sampled=3)
    client.insert("counted", {"x": torch.arange(4)})
    client.sample("counted", 1)  # the fifo sampler draws the oldest: x = 0 twice, x = 1 once
    client.sample("counted", 1)
    client.read("counted", torch.tensor([1]), sample=True)
    counts = client.table_info("counted", slots=0)["slots"]["times_sampled"].tolist()
    assert counts == [2, 1, 0, 0]
    client.save("counted", tmp_path / "counted")
    client.load_table(tmp_path / "counted", "counted-copy")
    for name in ("counted", "counted-copy"):
        assert client.table_info(name, slots=0)["slots"]["times_sampled"].tolist() == [2, 1, 0, 0], name
        assert client.sample(name, 1).value["x"].tolist() == [0]  # its third sample: it leaves
        assert sorted(client.read(name, torch.arange(4), empty=True)["x"].tolist()) == [0, 1, 2, 3]
        info = client.table_info(name, slots=0)["slots"]
        assert info["indices"].tolist() == [1, 2, 3], name
        assert info["times_sampled"].tolist() == [1, 0, 0], name
    # a count the table's rows could not have is refused, and the table is as it was
    with pytest.raises(BadRequestError, match="max_times_sampled"):
        client.write("counted-copy", [0], {"x": torch.tensor([9])}, times_sampled=[3])
    with pytest.raises(BadRequestError, match=">= 0"):
        client.write("counted-copy", [0], {"x": torch.tensor([9])}, times_sampled=[-1])
    with pytest.raises(BadRequestError, match="sample counts"):
        client.write("counted-copy", [0], {"x": torch.tensor([9])}, times_sampled=[1, 1])
    assert client.table_info("counted-copy", slots=0)["slots"]["indices"].tolist() == [1, 2, 3]
    client.write("counted-copy", [0], {"x": torch.tensor([9])}, times_sampled=[2])
    assert client.table_info("counted-copy", slots=0)["slots"]["times_sampled"].tolist() == [2, 1, 0, 0]
    for name in ("counted", "counted-copy"):
        client.delete(name)
