"""Issue #31, the third hardening round, where a process, a disk or a signal decides:
real ``tensorshare-server`` processes on loopback, real files and file systems.

Each test failed on the code the issue was filed against and states the behaviour
the fix gives (the findings and their figures are in docs/reliability.md, "Third
round").  The cases the protocol alone decides are tested in memory, in
``tests/test_hardening_three_paired.py`` (the table engine's in ``tests/test_tables_engine.py``).

Bounded: small sizes, small file systems, every wait with a timeout.
"""

from __future__ import annotations

import signal

import pytest
import torch

import tensorshare
from serverproc import ServerProcess, small_tmpfs
from tensorshare.errors import StorageFullError

MiB = 1 << 20
pytestmark = pytest.mark.process

COLUMNS = {"id": ((), torch.int64), "obs": ((1024,), torch.uint8)}  # 1 KiB + 8 bytes a row


def _rows(first: int, n: int) -> dict:
    ids = torch.arange(first, first + n)
    return {"id": ids, "obs": (ids.view(n, 1) % 251).to(torch.uint8).expand(n, 1024).contiguous()}


def _fill_or_refuse(client: tensorshare.Client, name: str, capacity: int) -> None:
    """Make a table larger than the file system and write every row of it: it must be
    refused (452) when made, or take every row; never kill the server."""
    try:
        client.create_table(name, capacity, COLUMNS, sampler="fifo", remover="fifo")
    except StorageFullError:
        return
    for first in range(0, capacity, 256):
        client.insert(name, _rows(first, 256))


@pytest.mark.parametrize("mode", ["data-dir", "spill-dir", "slots"])
def test_2_a_table_larger_than_its_disk_is_refused_with_452_never_a_sigbus(tmp_path, mode):
    """Table files were sparse and written through shared mappings: the first store
    into a page the file system had no room for killed the server with SIGBUS.  Their
    blocks are now reserved when the table is made: 452, the server serves on."""
    with small_tmpfs(tmp_path / "small", "4m") as mount:
        args = (["--data-dir", str(mount)] if mode != "spill-dir"
                else ["--memory-limit", "64KiB", "--spill-dir", str(mount)])
        srv = ServerProcess(*args, log_path=tmp_path / "server.log")
        try:
            with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
                if mode == "slots":  # no columns to speak of: the per-slot state alone is 24 MiB
                    with pytest.raises(StorageFullError):
                        c.create_table("slots", 1 << 20, {"x": ((), torch.uint8)})
                else:
                    _fill_or_refuse(c, "big", 8192)  # 8 MiB of columns on a 4 MiB file system
                c.create_table("small", 256, COLUMNS, sampler="fifo", remover="fifo")
                c.insert("small", _rows(0, 256))
                assert torch.equal(c.read("small", torch.arange(256))["id"], torch.arange(256))
                c.put("bin", torch.arange(4))
                assert torch.equal(c.peek("bin")[0], torch.arange(4))
            assert srv.proc.poll() is None, f"the server died: {srv.proc.returncode}"
        finally:
            code = srv.stop()
        assert code != -signal.SIGBUS
