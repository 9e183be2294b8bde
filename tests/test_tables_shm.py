"""Table samples and reads through shared memory (PROTOCOL.md §12, §10.3): a same-host
client that asks for references gets the stacked rows as one item in the server's
shared-memory area, maps it, and the server removes it once released or once the
connection closes; anyone else (remote, zero-copy off, small rows, area full) gets
them over TCP.  In memory with a paired session, then against a server process."""

from __future__ import annotations

import gc
import glob
import os

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare.errors import BusyError
from pairing import Pair
from serverproc import ServerProcess, small_tmpfs
from wiretools import wait_for
from tensorshare._client.connection import read_reply
from tensorshare._client.zerocopy import SharedAreas
from tensorshare.disk.areas import inside
from tensorshare.protocol.messages import LIST, TCREATE, TINSERT, TREAD, TSAMPLE, Key, TableKey

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this host")
OBS = (4, 84, 84)  # 28 KB a row, as the tables bench
COLUMNS = {"obs": {"shape": list(OBS), "dtype": "uint8"}, "reward": {"shape": [], "dtype": "float32"}}


def rows(first: int, n: int) -> dict:
    ids = torch.arange(first, first + n)
    return {"obs": (ids.view(n, 1, 1, 1) % 251).to(torch.uint8).expand(n, *OBS).contiguous(),
            "reward": ids.to(torch.float32)}


def _reply(pair: Pair, command, fields: dict):
    """Send one request; its raw frame and its decoded reply (mapping what it refers to)."""
    rid = pair.send_request(command, fields)
    [frame] = [f for f in pair.receive() if f.header.get("id") == rid]
    return frame, read_reply(command, frame, areas=SharedAreas.of(pair.client.greeting))


def _item_dir(pair: Pair, header: dict) -> str:
    [[area, path]] = header[Key.REFS]
    return inside(pair.state.storage.areas[area].root, path)


# ------------------------------------------------------------------ in memory


def test_same_host_sample_and_read_refer_to_shared_memory_until_released(tmp_path):
    pair = Pair(same_host=True, shm_dir=str(tmp_path))
    remote = Pair(same_host=False, state=pair.state)
    try:
        pair.call(TCREATE, {Key.BIN: "t", TableKey.SPEC: {"capacity": 64, "columns": COLUMNS}})
        pair.call(TINSERT, {Key.BIN: "t"}, rows(0, 32))
        ref = {Key.REF: [0]}
        frame, reply = _reply(pair, TSAMPLE, {Key.BIN: "t", Key.N: 16, **ref})
        sampled = _item_dir(pair, frame.header)
        assert frame.payload_len == 0 and os.path.isdir(sampled)  # the rows are in shared memory
        value = reply.values[0]
        slots = torch.from_numpy(np.frombuffer(frame.header[TableKey.INDICES], "<i8").copy())
        assert torch.equal(value["reward"], slots.to(torch.float32))  # row i was inserted at slot i
        assert torch.equal(value["obs"], rows(0, 32)["obs"][slots])

        indices = {TableKey.INDICES: np.arange(8, dtype="<i8").tobytes()}
        frame, reply = _reply(pair, TREAD, {Key.BIN: "t", **indices, **ref})
        read = _item_dir(pair, frame.header)
        assert frame.payload_len == 0 and torch.equal(reply.values[0]["obs"], rows(0, 8)["obs"])
        # the same read over TCP: without ref, from a remote peer, or too small to gain
        for who, fields in ((pair, indices), (remote, {**indices, **ref}),
                            (pair, {TableKey.INDICES: np.arange(2, dtype="<i8").tobytes(), **ref})):
            frame, plain = _reply(who, TREAD, {Key.BIN: "t", **fields})
            assert Key.REFS not in frame.header and frame.payload_len > 0
            n = len(fields[TableKey.INDICES]) // 8
            assert torch.equal(plain.values[0]["obs"], rows(0, n)["obs"])

        del value, reply, plain
        gc.collect()
        assert os.path.isdir(sampled) and os.path.isdir(read)  # pinned until released
        _release(pair, [_pinned_ids(pair)[0]])
        assert not os.path.exists(sampled) and os.path.isdir(read)
        pair.session.connection_lost()  # the connection's end lets the rest go
        gc.collect()
        assert not os.path.exists(read)
        assert not os.listdir(os.path.dirname(read))
    finally:
        remote.session.connection_lost()
        pair.state.storage.close()
    assert not os.listdir(tmp_path)  # the area goes with the server


def test_a_table_of_items_and_a_server_without_shared_memory_answer_over_tcp(tmp_path):
    for config, spec in (({"shm_dir": str(tmp_path)}, {"capacity": 4}),  # items: sent as they are
                         ({"zero_copy": False}, {"capacity": 4, "columns": COLUMNS})):
        pair = Pair(same_host=True, **config)
        try:
            pair.call(TCREATE, {Key.BIN: "t", TableKey.SPEC: spec})
            value = rows(0, 8) if "columns" in spec else torch.ones(1 << 18)
            pair.call(TINSERT, {Key.BIN: "t"}, rows(0, 4) if "columns" in spec else value)
            frame, _ = _reply(pair, TSAMPLE, {Key.BIN: "t", Key.N: 4, Key.REF: [0]})
            assert Key.REFS not in frame.header and frame.payload_len > 0
        finally:
            pair.close()


def test_samples_that_wait_are_gathered_into_shared_memory_and_refused_ones_leave_nothing(tmp_path):
    pair = Pair(same_host=True, shm_dir=str(tmp_path))
    try:
        pair.call(TCREATE, {Key.BIN: "t", TableKey.SPEC: {"capacity": 64, "columns": COLUMNS}})
        items = pair.state.storage.shm.items
        with pytest.raises(BusyError):  # an empty table, no wait: refused after its files were made
            pair.call(TSAMPLE, {Key.BIN: "t", Key.N: 16, Key.REF: [0]})
        gc.collect()
        assert not os.listdir(items)
        waiting = pair.send_request(TSAMPLE, {Key.BIN: "t", Key.N: 16, Key.WAIT: 5.0, Key.REF: [0]})
        pair.clock.advance(0)
        assert not pair.receive()  # parked until rows come
        Pair(state=pair.state).call(TINSERT, {Key.BIN: "t"}, rows(0, 32))  # another connection
        pair.clock.advance(0)
        [frame] = [f for f in pair.receive() if f.header.get("id") == waiting]
        reply = read_reply(TSAMPLE, frame, areas=SharedAreas.of(pair.client.greeting))
        slots = torch.from_numpy(np.frombuffer(frame.header[TableKey.INDICES], "<i8").copy())
        assert frame.payload_len == 0 and torch.equal(reply.values[0]["obs"], rows(0, 32)["obs"][slots])
        assert os.listdir(items) == [os.path.basename(_item_dir(pair, frame.header))]  # no leftovers
    finally:
        pair.close()


def _pinned_ids(pair: Pair) -> list[int]:
    return list(pair.session.shared._pins)


def _release(pair: Pair, ids: list[int]) -> None:
    pair.call(LIST, {Key.RELEASE: ids})
    gc.collect()


# ------------------------------------------------------------------ a server process


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()


def _area_items(srv: ServerProcess) -> str:
    [area] = glob.glob(os.path.join(SHM, f"tensorshare-{srv.pid}-*"))
    return os.path.join(area, "items")


@pytest.mark.process
def test_a_same_host_sample_is_mapped_equals_tcp_and_leaves_nothing(server):
    items = _area_items(server)
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as local, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as tcp:
        assert local.same_host and not tcp.same_host
        local.create_table("replay", 512, {"obs": (OBS, torch.uint8), "reward": ((), torch.float32)})
        local.insert("replay", rows(0, 300))
        assert not os.listdir(items)
        frames = {}
        for who, client in (("local", local), ("tcp", tcp)):
            reply = client._call(TSAMPLE, {Key.BIN: "replay", Key.N: 256}, then=lambda reply: reply)
            frames[who] = reply.frame.payload_len, reply.header.get(Key.REFS)
            if who == "local":
                [first] = os.listdir(items)  # the 256 rows, as one item in shared memory
        assert frames["local"][0] == 0 and frames["local"][1]  # mapped: nothing came over TCP
        assert frames["tcp"][0] >= 256 * 28224 and frames["tcp"][1] is None
        del reply
        s = local.sample("replay", 256, shared=True)  # its request releases the first sample
        assert wait_for(lambda: first not in os.listdir(items)) and len(os.listdir(items)) == 1
        assert s.value["obs"].shape == (256, *OBS)
        assert torch.equal(s.value["reward"], s.indices.to(torch.float32))
        read_tcp = tcp.read("replay", s.indices)
        assert torch.equal(read_tcp["obs"], s.value["obs"]) and torch.equal(read_tcp["reward"], s.value["reward"])
        before = set(os.listdir(items))
        read_local = local.read("replay", s.indices, shared=True)
        after = set(os.listdir(items))
        assert after and after != before  # that read came by reference too (its request released the sample's)
        assert local.sample("replay", 256).value["obs"].shape == (256, *OBS)  # by default: over TCP
        assert not set(os.listdir(items)) - after
        assert torch.equal(read_local["obs"], read_tcp["obs"])
        local.ping()  # carries the last releases
        assert wait_for(lambda: not os.listdir(items))  # released: gone
        # one more, never released: the connection's end removes it
        held = local.sample("replay", 256, shared=True)
        assert len(os.listdir(items)) == 1
    assert wait_for(lambda: not os.listdir(items))
    assert held.value["obs"].shape == (256, *OBS)  # the mapping outlives the file's name


@pytest.mark.process
def test_a_full_shared_memory_area_means_tcp_for_that_sample(tmp_path):
    with small_tmpfs(tmp_path / "small", "4m") as mount:  # 256 rows of 28 KB do not fit
        srv = ServerProcess("--shm-dir", str(mount))
        try:
            with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
                assert c.same_host
                c.create_table("replay", 512, {"obs": (OBS, torch.uint8), "reward": ((), torch.float32)})
                c.insert("replay", rows(0, 300))
                reply = c._call(TREAD, {Key.BIN: "replay", TableKey.INDICES: np.arange(256, dtype="<i8").tobytes()},
                                then=lambda reply: reply)
                assert reply.header.get(Key.REFS) is None and reply.frame.payload_len >= 256 * 28224
                assert torch.equal(reply.values[0]["obs"], rows(0, 256)["obs"])
                small = c.read("replay", list(range(8)))  # under the threshold: over TCP anyway
                assert torch.equal(small["obs"], rows(0, 8)["obs"])
                area = glob.glob(os.path.join(str(mount), "tensorshare-*", "items"))[0]
                assert not os.listdir(area)  # the failed write left nothing behind
        finally:
            srv.stop()
