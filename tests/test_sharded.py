"""ShardedClient: bins spread over servers by rendezvous hashing; real server processes."""

from __future__ import annotations

import time

import pytest
import torch

import tensorshare
from tensorshare.errors import TensorShareError, UsageError
from tensorshare.sharded import parse_server, rendezvous
from serverproc import ServerProcess


def test_rendezvous_spreads_bins_and_moves_few_when_a_server_joins_or_leaves():
    keys = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    names = [f"bin-{i}" for i in range(3000)]
    placed = [keys[rendezvous(n, keys)] for n in names]
    counts = {k: placed.count(k) for k in keys}
    assert all(800 < c < 1200 for c in counts.values()), counts
    assert placed == [keys[rendezvous(n, list(keys))] for n in names]  # deterministic
    grown = keys + ["10.0.0.4:8000"]
    after = [grown[rendezvous(n, grown)] for n in names]
    moved = [(a, b) for a, b in zip(placed, after) if a != b]
    assert all(b == "10.0.0.4:8000" for _, b in moved)  # only to the new server
    assert 0.15 < len(moved) / len(names) < 0.35
    shrunk = keys[:2]
    after = [shrunk[rendezvous(n, shrunk)] for n in names]
    assert all(a == b for a, b in zip(placed, after) if a != keys[2])  # only the removed server's bins move
    # The order the servers are listed in does not matter.
    reordered = list(reversed(keys))
    assert placed == [reordered[rendezvous(n, reordered)] for n in names]


def test_servers_whose_addresses_share_a_long_prefix_each_take_a_share():
    """Keys past BLAKE2b's 64 bytes were cut to 64: servers of one long host name (a
    Kubernetes service) were one key, and every bin went to the first listed."""
    host = "tensorshare-replay.reinforcement-learning-team.svc.cluster.local"
    keys = [f"{host}:{port}" for port in (8000, 8001, 8002)]
    placed = [keys[rendezvous(f"bin-{i}", keys)] for i in range(3000)]
    assert all(800 < placed.count(k) < 1200 for k in keys), {k: placed.count(k) for k in keys}
    reordered = list(reversed(keys))
    assert placed == [reordered[rendezvous(f"bin-{i}", reordered)] for i in range(3000)]


@pytest.mark.parametrize("bad", ["nohost", "h:x", ":80", "h:70000", ("h",), 5])
def test_bad_server_addresses(bad):
    with pytest.raises(UsageError):
        parse_server(bad)


def test_servers_must_be_distinct_and_given():
    with pytest.raises(UsageError):
        tensorshare.ShardedClient([])
    with pytest.raises(UsageError):
        tensorshare.ShardedClient(["127.0.0.1:1", "127.0.0.1:1"])


@pytest.mark.process
def test_sharded_bins_survive_one_shards_restart(tmp_path):
    shards = [ServerProcess("--data-dir", str(tmp_path / f"d{i}")) for i in range(3)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in shards]
        with tensorshare.ShardedClient(addresses, timeout=10, max_backoff=0.2) as sharded:
            names = [f"b{i}" for i in range(24)]
            for i, name in enumerate(names):
                sharded.put(name, torch.full((4,), float(i)), tag=i)
                sharded.append(name, torch.ones(1))
            homes = {name: sharded.server_for(name) for name in names}
            assert len(set(homes.values())) == 3  # every shard holds some
            for address, shard in zip(addresses, shards):  # each bin on its own server only
                with tensorshare.Client("127.0.0.1", shard.port, timeout=10) as direct:
                    assert set(direct.list()) == {n for n in names if homes[n] == address}
            assert sharded.list() == {name: 2 for name in names}
            victim = shards[1]
            lost = [n for n in names if homes[n] == addresses[1]]
            kept = [n for n in names if homes[n] != addresses[1]]
            notes = []
            sharded.listen(lost[0], notes.append)
            victim.kill()  # kill -9
            assert torch.equal(sharded.peek(kept[0])[0], torch.full((4,), float(names.index(kept[0]))))
            with pytest.raises(TensorShareError):
                sharded.peek(lost[0])
            victim.start()  # same port, same data directory
            deadline = time.monotonic() + 20
            while True:
                try:
                    items = sharded.peek(lost[0])
                    break
                except TensorShareError:
                    assert time.monotonic() < deadline, "the restarted shard never came back"
                    time.sleep(0.05)
            assert torch.equal(items[0], torch.full((4,), float(names.index(lost[0])))) and len(items) == 2
            assert sharded.list() == {name: 2 for name in names}
            sharded.append(lost[0], torch.zeros(1))
            deadline = time.monotonic() + 20
            while not any(n.op == "APPEND" and n.n_items == 3 for n in notes):
                assert time.monotonic() < deadline, f"no notification after the restart: {notes}"
                time.sleep(0.05)
            assert [t.numel() for t in sharded.get(lost[0])] == [4, 1, 1]
    finally:
        for shard in shards:
            shard.stop()


@pytest.mark.process
def test_sharded_tables_live_on_their_servers_and_sample_there():
    """Tables are bins: each on the server its name hashes to, with every table verb
    (derived from the declarations) sent there."""
    shards = [ServerProcess() for _ in range(2)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in shards]
        with tensorshare.ShardedClient(addresses, timeout=10) as sharded:
            names = [f"replay-{i}" for i in range(24)]  # (on both servers, but for a 2**-23 chance)
            assert len({sharded.server_for(name) for name in names}) == 2
            for i, name in enumerate(names):
                assert sharded.create_table(name, 16, {"x": ((2,), torch.float32)}) == 0
                keys = sharded.insert(name, {"x": torch.full((4, 2), float(i))})
                assert sharded.update_priorities(name, keys, [2.0] * 4) == 4
            for i, name in enumerate(names):
                drawn = sharded.sample(name, 3)
                assert len(drawn) == 3 and torch.equal(drawn.value["x"], torch.full((3, 2), float(i)))
                assert sharded.table_info(name)["size"] == 4
            for address, shard in zip(addresses, shards):
                with tensorshare.Client("127.0.0.1", shard.port, timeout=10) as direct:
                    assert set(direct.list()) == {n for n in names if sharded.server_for(n) == address}
    finally:
        for shard in shards:
            shard.stop()
