"""Tables on disk (issue #19): columns memory-mapped in the spill area past
--memory-limit, and durable in the data directory in tensordict's memmap layout,
reopened by a server restarted after kill -9.  Real server processes, real files."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import torch

import tensorshare
from serverproc import ServerProcess

MiB = 1 << 20
pytestmark = pytest.mark.process


def anon_rss(proc: ServerProcess) -> int:
    """The server's anonymous resident memory (not the page cache of mapped files)."""
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon line")


def rows(first: int, n: int, width: int) -> dict:
    ids = torch.arange(first, first + n)
    return {"id": ids, "obs": (ids.view(n, 1) % 251).to(torch.uint8).expand(n, width).contiguous()}


def test_a_table_far_larger_than_the_memory_limit_lives_in_mapped_files(tmp_path):
    """256 MiB of columns under a 16 MiB limit: the columns are files in the spill
    area, the server's own memory does not grow by the table, every row reads back."""
    spill = tmp_path / "spill"
    srv = ServerProcess("--memory-limit", "16MiB", "--spill-dir", str(spill))
    try:
        width, capacity = 64 << 10, 4096
        with tensorshare.Client("127.0.0.1", srv.port, timeout=60) as c:
            base = anon_rss(srv)
            c.create_table("big", capacity, {"id": ((), torch.int64), "obs": ((width,), torch.uint8)},
                           sampler="fifo", remover="fifo")
            files = [os.path.join(d, f) for d, _, fs in os.walk(spill) for f in fs if f.endswith(".memmap")]
            assert sorted(os.path.basename(f) for f in files) == ["id.memmap", "obs.memmap"]
            assert max(os.path.getsize(f) for f in files) == capacity * width
            peak = 0
            for first in range(0, capacity, 64):
                c.insert("big", rows(first, 64, width))
                peak = max(peak, anon_rss(srv))
            got = c.read("big", torch.arange(0, capacity, 97))
            assert torch.equal(got["id"], torch.arange(0, capacity, 97))
            assert torch.equal(got["obs"], rows(0, capacity, width)["obs"][::97])
            drawn = c.sample("big", 64).value
            assert torch.equal(drawn["obs"][:, 0], (drawn["id"] % 251).to(torch.uint8))
            c.delete("big")
            assert not any(f.endswith(".memmap") for _, _, fs in os.walk(spill) for f in fs)
        grown = peak - base
        print(f"anonymous memory grew by {grown / MiB:.0f} MiB holding a {capacity * width // MiB} MiB table")
        assert grown < 96 * MiB  # the table's 256 MiB are file pages the kernel may drop
    finally:
        srv.stop()


def test_a_durable_table_survives_kill_9_and_opens_with_load_memmap(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("replay", 100, {"id": ((), torch.int64), "obs": ((3, 4), torch.float32)},
                           sampler="prioritized", priority_exponent=0.5, remover="lowest_priority",
                           min_size_to_sample=5)
            batch = {"id": torch.arange(120), "obs": torch.randn(120, 3, 4)}
            keys = torch.cat([c.insert("replay", {k: v[i:i + 40] for k, v in batch.items()},
                                       priorities=torch.arange(i, i + 40) + 1.0) for i in range(0, 120, 40)])
            c.update_priorities("replay", keys[-10:], torch.full((10,), 1000.0))
            c.write("replay", [3], tensordict.TensorDict({k: v[:1] for k, v in batch.items()}, batch_size=[1]))
            before = c.read("replay", torch.arange(100))
            info = c.table_info("replay")
            drawn = c.sample("replay", 500)
            chance = dict(zip(drawn.keys.tolist(), drawn.probabilities.tolist()))
        srv.stop(signal.SIGKILL)
        srv = ServerProcess("--data-dir", data)
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list() == {"replay": 100}
            after = c.read("replay", torch.arange(100))
            assert isinstance(after, tensordict.TensorDict)  # rows written as TensorDicts, said so on disk
            assert torch.equal(after["id"], before["id"]) and torch.equal(after["obs"], before["obs"])
            again = c.table_info("replay")
            for key in ("capacity", "size", "sampler", "priority_exponent", "remover", "columns"):
                assert again[key] == info[key]
            # keys and priorities came back: each row's chance is what it was
            drawn = c.sample("replay", 500)
            again_chance = dict(zip(drawn.keys.tolist(), drawn.probabilities.tolist()))
            common = set(chance) & set(again_chance)
            assert len(common) > 20 and all(abs(chance[k] - again_chance[k]) < 1e-9 for k in common)
            assert c.update_priorities("replay", keys[-10:], torch.ones(10)) == 10
            new = c.insert("replay", {k: v[:1] for k, v in batch.items()})
            assert new.item() not in keys.tolist()  # keys keep growing across restarts
        directory = os.path.join(data, "tables", hashlib.sha256(b"replay").hexdigest()[:32])
        td = tensordict.TensorDict.load_memmap(directory)
        assert td.batch_size == torch.Size([100])
        assert torch.equal(td["id"][:3], before["id"][:3]) and torch.equal(td["obs"][5], before["obs"][5])
    finally:
        srv.stop()


def test_deleting_a_durable_table_removes_it_for_good_and_tables_of_items_are_not_kept(tmp_path):
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("items", 10)  # a table of items: in memory only
            c.insert("items", {"any": "value"})
            c.create_table("gone", 10, {"x": ((), torch.int64)})
            c.insert("gone", {"x": torch.arange(3)})
            c.delete("gone")
        srv.stop(signal.SIGKILL)
        srv = ServerProcess("--data-dir", data)
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list() == {}
    finally:
        srv.stop()
