"""Rows of wide file-backed columns read with ``preadv`` (the engine's ``rowreads``):
the reads themselves on real files, then through real server processes -- spilled
and durable tables, across a ring's wrap, rows taken twice, files evicted from the
page cache, and a column file cut short (451, and the server serves on)."""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess
from tensorshare.errors import ServerLocalError
from test_tables_engine import tables  # noqa: F401  (loads the engine as its own package)

rowreads = sys.modules["_tables_engine_under_test.rowreads"]

OBS = (1, 65, 64)  # 4,160 bytes a row (not a whole number of pages): read with preadv
WIDTH = int(np.prod(OBS))
COLUMNS = {"obs": (OBS, torch.uint8), "action": ((), torch.int64), "reward": ((), torch.float32)}


def obs_of(ids: torch.Tensor) -> torch.Tensor:
    """Each row's observation, different for every id and every byte of it."""
    g = torch.Generator().manual_seed(7)
    noise = torch.randint(0, 256, (WIDTH,), dtype=torch.int64, generator=g)
    return ((ids.view(-1, 1) * 131 + noise) % 251).to(torch.uint8).view(-1, *OBS)


def batch(first: int, n: int) -> dict:
    ids = torch.arange(first, first + n)
    return {"obs": obs_of(ids), "action": ids, "reward": ids.float() / 4}


def check_rows(got: dict) -> torch.Tensor:
    """Every row returned is whole: its columns are those of one inserted row.  Returns the ids."""
    ids = got["action"]
    assert torch.equal(got["obs"], obs_of(ids))
    assert torch.equal(got["reward"], ids.float() / 4)
    return ids


def evict(directory: str) -> None:
    """Drop the clean pages of every file under ``directory`` from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)  # (dirty pages stay)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- the reads


@pytest.mark.parametrize("threads", [1, 4, 16])
def test_rows_read_from_files_are_the_rows_at_their_slots_repeats_and_all(tmp_path, threads):
    data = np.random.default_rng(0).integers(0, 256, (300, 5000), np.uint8)
    narrow = np.arange(300, dtype=np.int64).view(np.uint8).reshape(300, 8)
    fds = []
    for name, array in (("a", data), ("b", narrow)):
        array.tofile(tmp_path / name)
        fds.append(rowreads.open_for_reads(str(tmp_path / name)))
    reads = rowreads.RowReads(threads)
    try:
        slots = np.array([299, 0, 7, 7, 150, 8, 6, 0, 299])
        for attempt in range(2):  # evicted (the threads read them), then from the page cache
            if attempt == 0:
                evict(str(tmp_path))
            outs = [np.zeros((slots.size, 5000), np.uint8), np.zeros((slots.size, 8), np.uint8)]
            reads.read(list(zip(fds, outs)), slots)
            assert (outs[0] == data[slots]).all() and (outs[1] == narrow[slots]).all()
    finally:
        reads.close()
        for fd in fds:
            os.close(fd)


def test_every_row_goes_to_the_threads_where_the_page_cache_cannot_be_asked_first(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, (64, 4096), np.uint8)
    data.tofile(tmp_path / "a")
    fd = rowreads.open_for_reads(str(tmp_path / "a"))
    reads = rowreads.RowReads(4, cached_first=False)
    try:
        slots = np.arange(63, -1, -3)
        out = np.zeros((slots.size, 4096), np.uint8)
        reads.read([(fd, out)], slots)
        assert (out == data[slots]).all() and reads.from_disk == slots.size
        reads.read([(fd, out)], slots[:1])  # one row: read on the calling thread
        assert reads.from_disk == slots.size + 1
    finally:
        reads.close()
        os.close(fd)


def test_rows_missing_from_the_page_cache_are_read_without_threads_where_the_kernel_starts_their_reads(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, (64, 4096), np.uint8)
    data.tofile(tmp_path / "a")
    fd = rowreads.open_for_reads(str(tmp_path / "a"))
    reads = rowreads.RowReads(4)
    try:
        evict(str(tmp_path))
        if reads._cached(fd, memoryview(bytearray(4096)), 0):
            pytest.skip("this file system keeps the file in the page cache")
        slots = np.arange(1, 64, 4)
        out = np.zeros((slots.size, 4096), np.uint8)
        reads.read([(fd, out)], slots)
        # (most rows come from the disk; the kernel's readahead for one may have brought in another)
        first = reads.from_disk
        assert (out == data[slots]).all() and 0 < first <= slots.size and reads._pool is None
        out[:] = 0
        reads.read([(fd, out)], slots)  # from the page cache now
        assert (out == data[slots]).all() and reads.from_disk == first
    finally:
        reads.close()
        os.close(fd)


def test_a_file_cut_short_is_an_oserror_and_the_rows_before_its_end_still_read(tmp_path):
    np.arange(10 * 4096, dtype=np.uint32).astype(np.uint8).reshape(10, 4096).tofile(tmp_path / "a")
    os.truncate(tmp_path / "a", 5 * 4096 + 100)  # row 5 is cut, 6 and on are gone
    fd = rowreads.open_for_reads(str(tmp_path / "a"))
    reads = rowreads.RowReads(4)
    try:
        for slots in ([1, 5], [8, 2, 3]):
            with pytest.raises(OSError, match="ends at byte"):
                reads.read([(fd, np.zeros((len(slots), 4096), np.uint8))], np.array(slots))
        out = np.zeros((2, 4096), np.uint8)
        reads.read([(fd, out)], np.array([4, 0]))
        assert out[0, 1] == 1 and out[1, 1] == 1
    finally:
        reads.close()
        os.close(fd)


def test_only_rows_of_a_page_or_more_are_read_with_preadv():
    assert rowreads.wide(4096) and rowreads.wide(4 * 84 * 84) and not rowreads.wide(4095)


# -- through a server


def table_files(root: str) -> str:
    """The directory of the one table under ``root`` (a spill or data directory)."""
    found = {d for d, _, fs in os.walk(root) for f in fs if f == "obs.memmap"}
    assert len(found) == 1, found
    return found.pop()


@pytest.mark.process
@pytest.mark.parametrize("where", ["spilled", "durable"])
def test_rows_sampled_and_read_from_files_are_the_rows_inserted(tmp_path, where):
    root = str(tmp_path / where)
    args = ("--memory-limit", "8MiB", "--spill-dir", root) if where == "spilled" else ("--data-dir", root)
    srv = ServerProcess(*args)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=60, zero_copy=False) as c:
            c.create_table("t", 2400, COLUMNS, remover="fifo")  # 10 MB of columns: spilled past 8 MiB
            directory = table_files(root)
            for first in range(0, 7200, 200):  # three times round the ring, runs that wrap
                c.insert("t", batch(first, 200))
            c.write("t", [17, 2350, 3], batch(9000, 3))  # and three slots written where they are
            for attempt in range(3):
                if attempt < 2:
                    evict(directory)
                drawn = c.sample("t", 600)  # (some rows come twice: 600 of 2,400)
                ids = check_rows(drawn.value)
                assert ids.unique().numel() < ids.numel()
                assert ((ids >= 4800) & (ids < 7200) | (ids >= 9000)).all()
                got = c.read("t", [17, 2350, 3, 17, 2399, 0])
                assert check_rows(got)[:4].tolist() == [9000, 9001, 9002, 9000]
            assert c.table_info("t")["samples"] == 1800
    finally:
        srv.stop()


@pytest.mark.process
def test_a_column_file_cut_short_is_refused_451_counts_nothing_and_the_server_serves_on(tmp_path):
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=60, zero_copy=False) as c:
            c.create_table("t", 100, COLUMNS, remover="fifo")
            c.insert("t", batch(0, 100))
            directory = os.path.join(data, "tables", hashlib.sha256(b"t").hexdigest()[:32])
            assert directory == table_files(data)
            os.truncate(os.path.join(directory, "obs.memmap"), 50 * WIDTH)  # rows 50 and on are gone
            with pytest.raises(ServerLocalError, match="could not read the rows"):
                c.read("t", [10, 60])
            with pytest.raises(ServerLocalError, match="nothing was counted"):
                c.sample("t", 100)  # (it draws some of the rows past the end)
            with pytest.raises(ServerLocalError):
                c.read("t", [70], sample=True)
            assert c.table_info("t")["samples"] == 0
            assert check_rows(c.read("t", [49, 0, 10])).tolist() == [49, 0, 10]
            assert c.ping() >= 0 and c.list() == {"t": 100}
    finally:
        srv.stop()
