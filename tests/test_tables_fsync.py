"""Durable tables under --fsync: each acknowledged change is on the disk before its
reply, not left to the kernel's writeback (5-30 s later).  Real server processes,
a real data directory on a disk-backed file system.

What is looked at: the dirty pages of the table's files (``cachestat``, Linux 6.5),
right after the reply.  A change the server only wrote leaves its pages dirty in
the page cache until writeback; one it flushed leaves none.  (``/proc/<pid>/io``'s
``write_bytes`` cannot tell: the kernel counts a page there when it is dirtied,
not when it reaches the disk.)"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess

pytestmark = pytest.mark.process
_CACHESTAT = 451  # the syscall's number on x86-64 and arm64
_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def dirty_pages(path: str) -> int:
    """Pages of the file ``path`` changed in the page cache and not yet on the disk."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Stat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
        return stat.dirty + stat.writeback
    finally:
        os.close(fd)


def file_system_type(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it)."""
    best, kind = "", ""
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            point, fstype = line.split()[1:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fstype
    return kind


@pytest.fixture
def data_dir(tmp_path):
    """A data directory on a disk (skips where tmp_path is in memory or the kernel
    cannot say which pages are dirty); checks first that a plain write leaves dirty
    pages there, so that none after a reply means the server flushed them."""
    kind = file_system_type(str(tmp_path))
    if kind in _MEMORY_FILE_SYSTEMS:
        pytest.skip(f"{tmp_path} is on {kind}, not a disk: nothing to flush")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 65536)
    try:
        dirty = dirty_pages(str(probe))
    except OSError as exc:
        pytest.skip(f"cachestat is not available here ({exc.strerror}): dirty pages cannot be seen")
    if dirty == 0:
        pytest.skip(f"a write to {kind} leaves no dirty page to see here")
    return str(tmp_path / "data")


def dirty_table_pages(data: str) -> dict:
    """The files of the data directory's tables with dirty pages, and how many; not
    the samplers' trees, which a server rebuilds from the rows' state after a kill."""
    found = {}
    for directory, _dirs, files in os.walk(os.path.join(data, "tables")):
        for name in files:
            if name.startswith("tree"):
                continue
            path = os.path.join(directory, name)
            dirty = dirty_pages(path)
            if dirty:
                found[os.path.relpath(path, data)] = dirty
    return found


def batch(first: int, n: int) -> dict:
    ids = torch.arange(first, first + n)
    return {"id": ids, "obs": (ids.view(n, 1) % 251).to(torch.uint8).expand(n, 4096).contiguous()}


@contextlib.contextmanager
def fsync_client(data_dir: str):
    """A client of a server run with ``--data-dir data_dir --fsync``."""
    srv = ServerProcess("--data-dir", data_dir, "--fsync")
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            yield c
    finally:
        srv.stop()


def make(c, capacity: int = 256) -> None:
    c.create_table("replay", capacity, {"id": ((), torch.int64), "obs": ((4096,), torch.uint8)},
                   sampler="prioritized", remover="fifo")


def test_each_acknowledged_change_is_on_the_disk_before_its_reply(data_dir):
    """Insert (filling slots, then replacing rows as a ring buffer does), a priority
    update and a write to rows: nothing of the table's files is left dirty when the
    reply comes back."""
    with fsync_client(data_dir) as c:
        make(c)
        assert dirty_table_pages(data_dir) == {}  # the new table's files and descriptions
        keys = c.insert("replay", batch(0, 64), priorities=torch.arange(64) + 1.0)
        assert dirty_table_pages(data_dir) == {}
        assert c.update_priorities("replay", keys[:8], torch.full((8,), 50.0)) == 8
        assert dirty_table_pages(data_dir) == {}
        c.write("replay", [5, 200], batch(1000, 2))  # one over a row, one into an empty slot
        assert dirty_table_pages(data_dir) == {}
        for first in range(64, 320, 64):  # past the capacity: each batch replaces rows (journaled)
            c.insert("replay", batch(first, 64))
            assert dirty_table_pages(data_dir) == {}
        got = c.read("replay", torch.arange(256))
        assert sorted(got["id"].tolist()) == sorted(range(64, 320))
        assert torch.equal(got["obs"][:, 7], (got["id"] % 251).to(torch.uint8))


def test_sample_counts_are_flushed_where_they_remove_rows(data_dir):
    with fsync_client(data_dir) as c:
        c.create_table("once", 16, {"id": ((), torch.int64)}, sampler="fifo", remover="fifo",
                       max_times_sampled=1)
        c.insert("once", {"id": torch.arange(16)})
        assert torch.equal(c.sample("once", 4).value["id"], torch.arange(4))
        assert dirty_table_pages(data_dir) == {}
        assert c.list() == {"once": 12}


def test_rows_and_priorities_inserted_under_fsync_survive_kill_9(data_dir):
    srv = ServerProcess("--data-dir", data_dir, "--fsync")
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            make(c, capacity=100)
            keys = torch.cat([c.insert("replay", batch(i, 40), priorities=torch.arange(i, i + 40) + 1.0)
                              for i in range(0, 120, 40)])
            c.update_priorities("replay", keys[-10:], torch.full((10,), 1000.0))
            before = c.table_info("replay", slots=0)["slots"]
            rows = c.read("replay", torch.arange(100))
        srv.stop(signal.SIGKILL)
        srv = ServerProcess("--data-dir", data_dir, "--fsync")
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list() == {"replay": 100}
            after = c.table_info("replay", slots=0)["slots"]
            for field in ("indices", "keys", "priorities"):
                assert torch.equal(after[field], before[field])
            again = c.read("replay", torch.arange(100))
            assert torch.equal(again["id"], rows["id"]) and torch.equal(again["obs"], rows["obs"])
            assert c.update_priorities("replay", keys[-10:], torch.ones(10)) == 10
    finally:
        srv.stop()


# -- a flush the disk refuses (the engine, in memory, on real files)

def refusing_flushes(backing) -> list:
    """Make each of ``backing``'s state files refuse ``fdatasync`` (their descriptors
    swapped for a pipe's, which the kernel refuses with EINVAL, as a failing disk does
    with EIO); returns what puts them back."""
    read_end, write_end = os.pipe()
    kept = list(backing._state_files)
    backing._state_files[:] = [write_end] * len(kept)
    return [kept, read_end, write_end]


def flushing_again(backing, undo: list) -> None:
    kept, read_end, write_end = undo
    backing._state_files[:] = kept
    os.close(read_end)
    os.close(write_end)


@pytest.fixture
def engine():
    from tensorshare_server.bins import tables
    return tables


def test_a_change_whose_flush_is_refused_is_undone(tmp_path, engine):
    backing = engine.MemmapBacking(str(tmp_path / "t"), keep=True, fsync=True)
    table = engine.Table(4, {"x": ((), "int64")}, sampler="prioritized", remover="fifo", backing=backing)
    keys = table.insert({"x": np.arange(2, dtype=np.int64)}, priorities=[1.0, 2.0]).keys
    undo = refusing_flushes(backing)
    with pytest.raises(engine.NotFlushedError, match="not in the table") as refused:
        table.insert({"x": np.array([7], dtype=np.int64)})
    assert refused.value.code == 451 and table.size == 2 and table.occupied().tolist() == [0, 1]
    with pytest.raises(engine.NotFlushedError, match="as they were"):
        table.update_priorities(keys, [5.0, 5.0])
    assert table.read([0, 1]).priorities.tolist() == [1.0, 2.0]
    flushing_again(backing, undo)
    table.insert({"x": np.arange(2, 4, dtype=np.int64)})  # full now
    undo = refusing_flushes(backing)
    with pytest.raises(engine.NotFlushedError):  # replaces a row: recorded in the journal first
        table.insert({"x": np.array([9], dtype=np.int64)})
    assert backing.journal._clear and table.size == 3  # the record is forgotten; the row replaced left
    held = table.occupied().tolist()
    assert table._sampler.tree.total == pytest.approx(sum(table.read(held).priorities))  # (the trees agree)
    assert set(table.sample(50).indices.tolist()) <= set(held)
    flushing_again(backing, undo)
    written = table.insert({"x": np.array([8, 9], dtype=np.int64)})  # the free slot, then the oldest row's
    assert len(set(written.indices.tolist())) == 2 and table.size == 4
    assert sorted(table.read(table.occupied()).values["x"].to_numpy().tolist()) == [2, 3, 8, 9]


def test_a_replacing_change_killed_midway_is_finished_and_flushed_by_the_restart(tmp_path, data_dir, engine, monkeypatch):
    """Killed once the rows' bytes are in the columns, before their keys: the record
    (flushed first) is applied at the next start, and flushed before it is cleared."""
    from tensorshare_server.bins.tables.slots import Slots

    directory = str(tmp_path / "t")

    def durable(reopen: bool = False):
        return engine.Table(4, {"v": ((), "int64")}, remover="fifo",
                            backing=engine.MemmapBacking(directory, keep=True, reopen=reopen, fsync=True))

    table = durable()
    table.insert({"v": np.arange(4, dtype=np.int64)})

    class Killed(BaseException):
        pass

    def fill(self, *args, **kwargs):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(Slots, "fill", fill)
        with pytest.raises(Killed):
            table.insert({"v": np.arange(10, 12, dtype=np.int64)})
    with open(os.path.join(directory, "_slots", "journal.bin"), "rb") as f:
        assert f.read(4) == b"TSJ2"  # the record counts
    again = durable(reopen=True)
    assert sorted(again.read(again.occupied()).values["v"].to_numpy().tolist()) == [2, 3, 10, 11]
    assert dirty_pages(os.path.join(directory, "_slots", "journal.bin")) == 0
    assert dirty_pages(os.path.join(directory, "_slots", "key.bin")) == 0
    with open(os.path.join(directory, "_slots", "journal.bin"), "rb") as f:
        assert f.read(32) == bytes(32)
