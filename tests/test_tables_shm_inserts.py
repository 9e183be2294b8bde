"""Table inserts through shared memory (PROTOCOL.md §10.4): a same-host writer that asks
(``insert(..., shared=True)``), or by default one told by the server's replies that
the table takes rows from its files as they are (``mapped``: a table in files),
writes a large batch's columns into its incoming directory and the TINSERT names
it; the server checks it as an adopted PUT value (once, then keeps it open),
copies the rows into the table's columns from the files, and leaves the directory
for the writer's next batch.  Against a server process: rows round-trip exactly
(into a durable table too), spoilt directories are refused with nothing inserted,
and a client without verified areas sends its rows over TCP."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare.disk.layout import RECORD
from tensorshare.errors import BusyError, TooLargeError, ZeroCopyUnavailableError
from tensorshare.protocol.messages import PUT, TINSERT, Key
from tensorshare.wire.codec import encode
from serverproc import ServerProcess

SHM = "/dev/shm"
pytestmark = [pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this host"), pytest.mark.process]
N = 2048  # rows of a batch: 2048 x 268 B, above the client's bar for shared memory (512 KiB)
COLUMNS = {"obs": ((64,), torch.float32), "action": ((), torch.int64), "pix": ((2, 5), torch.uint8),
           "half": ((3,), torch.bfloat16)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("--memory-limit", str(64 << 20),
                        "--spill-dir", str(tmp_path_factory.mktemp("spill")))
    yield srv
    srv.stop()


def batch(first: int, n: int = N) -> dict:
    ids = torch.arange(first, first + n)
    return {"obs": ids.view(n, 1).expand(n, 64).float() + torch.linspace(0, 1, 64),
            "action": ids * 7, "pix": (ids.view(n, 1, 1) % 251).expand(n, 2, 5).to(torch.uint8).contiguous(),
            "half": (ids.view(n, 1).expand(n, 3).float() / 3).to(torch.bfloat16).contiguous()}


def _incoming(client) -> str | None:
    areas = client.router.home.areas
    return None if areas is None else areas.incoming


def _kept(client) -> list[str]:
    """The item directories the server left in the client's incoming directory."""
    return [e for e in os.listdir(_incoming(client)) if not e.startswith(".")]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_host_inserts_go_through_shared_memory_and_round_trip_exactly(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as local, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as tcp:
        for client, name in ((local, "shm"), (tcp, "tcp")):
            client.create_table(name, 3 * N, COLUMNS, sampler="prioritized", remover="fifo")
        priorities = torch.rand(N) + 0.5
        ends = torch.arange(N) % 100 == 99
        for client, name in ((local, "shm"), (tcp, "tcp")):
            client.insert(name, batch(0), priorities, ends=ends, shared=client is local)
        [kept] = _kept(local)  # the rows came through this directory, which the server left for the next ones
        assert sorted(os.listdir(os.path.join(_incoming(local), kept))) == \
            sorted([RECORD, "action.memmap", "half.memmap", "obs.memmap", "pix.memmap", "meta.json"])
        for first in (N, 2 * N, 3 * N):  # the ring wraps: the first batch's rows are replaced
            for client, name in ((local, "shm"), (tcp, "tcp")):
                client.insert(name, batch(first), 2.0, shared=client is local)
            assert _kept(local) == [kept]  # written into the same pages again
        slots = torch.arange(3 * N)
        shm, over_tcp = local.read("shm", slots), tcp.read("tcp", slots)
        assert _equal(shm, over_tcp)
        expected = {k: torch.cat([batch(f)[k] for f in (3 * N, N, 2 * N)]) for k in COLUMNS}  # slot order
        assert _equal(shm, expected)
        a, b = local.table_info("shm", slots=0), tcp.table_info("tcp", slots=0)
        for key in ("size", "inserts", "removals"):
            assert a[key] == b[key]
        # one more of the first kind, with priorities and episode ends: the same state as over TCP
        for client, name in ((local, "shm"), (tcp, "tcp")):
            client.insert(name, batch(4 * N), priorities, ends=ends, shared=client is local)
        assert _equal(local.read("shm", slots), tcp.read("tcp", slots))
        s, t = local.sample("shm", 64, length=32), tcp.sample("tcp", 64, length=32)
        assert s.value["action"].shape == t.value["action"].shape == (64, 32)
        ids = s.value["action"][:, :-1] // 7  # sequences never run past an episode's end (the last batch's)
        assert not bool((((ids - 4 * N) % 100 == 99) & (ids >= 4 * N)).any())
        info = local.table_info("shm")
        assert info["size"] == 3 * N and info["inserts"] == 5 * N


def test_rows_go_over_tcp_unless_asked_without_verified_areas_and_for_small_batches(server, caplog):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as local, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as tcp:
        assert _incoming(tcp) is None  # zero_copy=False: no verified areas, so no incoming directory
        tcp.create_table("by-tcp", N, COLUMNS)
        tcp.insert("by-tcp", batch(0), shared=True)
        assert _equal(tcp.read("by-tcp", torch.arange(N)), batch(0))
        local.insert("by-tcp", batch(N))  # not asked: over the socket
        assert not _kept(local)
        local.create_table("small", 100, COLUMNS)
        local.insert("small", batch(0, 10), shared=True)  # 2.7 KB: over the socket
        assert not _kept(local)
        local.insert("by-tcp", batch(2 * N), shared=True)  # asked, verified, large: through shared memory
        assert len(_kept(local)) == 1
        assert _equal(tcp.read("by-tcp", torch.arange(N)), batch(2 * N))
        local.create_table("items", 4)
        with caplog.at_level(logging.INFO, logger="tensorshare.client"):
            local.insert("items", {"obs": torch.ones(1 << 18)}, shared=True)  # refused (425): sent over the socket
        assert "did not take a value through shared memory" in caplog.text
        assert torch.equal(local.read("items", torch.tensor([0]))[0]["obs"], torch.ones(1 << 18))


def _spoil(kind: str, item: str):
    """Spoil an item directory the client wrote in one way; what must stay alive meanwhile."""
    array = os.path.join(item, "obs.memmap")
    if kind == "symlink":
        os.unlink(array)
        os.symlink("/etc/hostname", array)
    elif kind == "wrong_size":
        os.truncate(array, 100)
    elif kind == "extra_file":
        with open(os.path.join(item, "notes.txt"), "w") as f:
            f.write("x")
    elif kind == "open_for_writing":  # it could still change after the request
        return open(array, "r+b")
    elif kind == "mapped_writable":
        with open(array, "r+b") as f:
            return np.memmap(f, np.uint8, "r+")
    return None


@pytest.mark.parametrize("kind", ["symlink", "wrong_size", "extra_file", "open_for_writing", "mapped_writable",
                                  "other_value", "outside", "missing"])
def test_spoilt_or_hostile_references_are_refused_and_nothing_is_inserted(server, kind):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        table = f"spoilt-{kind}"
        c.create_table(table, 4 * N, COLUMNS)
        c.insert(table, batch(0))
        areas = c.router.home.areas
        enc = encode(batch(N))
        name = areas.write(enc)
        keep = _spoil(kind, os.path.join(areas.incoming, name))
        fields = {Key.BIN: table, Key.VALUE: enc.description, Key.SHM: name, Key.SIZE: enc.nbytes}
        if kind == "other_value":  # the request's columns are not the directory's
            other = encode({k: v[:N // 2] for k, v in batch(N).items()})
            fields.update({Key.VALUE: other.description, Key.SIZE: other.nbytes})
        elif kind == "outside":
            fields[Key.SHM] = f"../{name}"
        elif kind == "missing":
            fields[Key.SHM] = "nothing-here"
        with pytest.raises(ZeroCopyUnavailableError):
            c._call(TINSERT, fields, zero_copy=False)
        del keep
        info = c.table_info(table)
        assert info["size"] == N and info["inserts"] == N  # nothing inserted...
        assert _equal(c.read(table, torch.arange(N)), batch(0))  # ...nothing changed
        assert open("/etc/hostname").read()  # nothing followed the symlink
        c.insert(table, batch(N), shared=True)  # and the connection goes on
        assert _equal(c.read(table, torch.arange(N, 2 * N)), batch(N))


def test_a_durable_table_takes_same_host_rows_and_keeps_them_across_a_restart(tmp_path):
    srv = ServerProcess("--data-dir", str(tmp_path / "data"))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert not c.router.home.areas.takes_values  # its values go to disk from the payload, over TCP
            c.create_table("durable", 2 * N, COLUMNS, remover="fifo")
            for first in (0, N, 2 * N):  # the third batch replaces the first (through the journal)
                c.insert("durable", batch(first), ends=torch.arange(N) == N - 1, shared=True)
            assert len(_kept(c)) == 1
            c.put("value", torch.ones(1 << 20))
            assert len(_kept(c)) == 1
            areas = c.router.home.areas
            enc = encode(torch.zeros(1 << 20))
            name = areas.write(enc)  # a value named in shared memory: refused, it goes to disk over TCP
            with pytest.raises(ZeroCopyUnavailableError):
                c._call(PUT, {Key.BIN: "value", Key.VALUE: enc.description, Key.SHM: name, Key.SIZE: enc.nbytes},
                        zero_copy=False)
            areas.discard(name)
        srv.stop()
        srv.start()
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert _equal(c.read("durable", torch.arange(2 * N)),
                          {k: torch.cat([batch(2 * N)[k], batch(N)[k]]) for k in COLUMNS})
            assert torch.equal(c.peek("value")[0], torch.ones(1 << 20))
    finally:
        srv.stop()


def test_limits_hold_for_rows_from_shared_memory(server):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c:
        c.create_table("limited", 4 * N, COLUMNS, remover=None, samples_per_insert=1.0, error_buffer=(0.0, 1.5 * N),
                       min_size_to_sample=1)
        c.insert("limited", batch(0), shared=True)
        with pytest.raises(BusyError):  # the rate limiter holds the second batch: nothing inserted
            c.insert("limited", batch(N), shared=True, timeout=0.3)
        assert c.table_info("limited")["size"] == N
        c.sample("limited", N)  # now it may go on
        c.insert("limited", batch(N), shared=True)
        assert _equal(c.read("limited", torch.arange(N, 2 * N)), batch(N))
        c.create_table("bounded", N // 2, COLUMNS, remover=None)
        with pytest.raises(TooLargeError):  # more rows than a table without the fifo remover holds
            c.insert("bounded", batch(0), shared=True)
        assert c.table_info("bounded")["size"] == 0
        assert len(_kept(c)) == 1


def test_a_table_in_files_gets_large_batches_through_shared_memory_by_default(tmp_path):
    srv = ServerProcess("--memory-limit", str(2 << 20), "--spill-dir", str(tmp_path / "spill"))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c, \
                tensorshare.Client("127.0.0.1", srv.port, timeout=30, zero_copy=False) as tcp:
            c.create_table("files", 4 * N, COLUMNS, remover="fifo")  # 2.2 MB of columns: in the spill directory
            c.create_table("memory", N, {"x": ((), torch.int64)})
            assert c.table_info("files")["in_files"] and not c.table_info("memory")["in_files"]
            c.insert("files", batch(0))  # over the socket: its reply says the table takes rows from files
            assert not _kept(c) and "files" in c.router.home.areas.mapped
            c.insert("files", batch(N))  # so the next large batch goes through shared memory...
            [kept] = _kept(c)
            for first in range(2 * N, 6 * N, N):  # ...into the same files each time; the ring wraps
                c.insert("files", batch(first))
                assert _kept(c) == [kept]
            c.insert("files", batch(0, 10))  # a small batch: the socket
            c.insert("files", batch(6 * N), shared=False)  # not wanted: the socket
            assert _kept(c) == [kept]
            parts = [batch(4 * N), batch(5 * N), batch(0, 10), batch(6 * N), batch(3 * N + 10, N - 10)]  # slot order
            expected = {k: torch.cat([part[k] for part in parts]) for k in COLUMNS}
            for at in range(0, 4 * N, N):  # (a read of N rows at a time: within the server's 2 MiB)
                part = {k: v[at:at + N] for k, v in expected.items()}
                assert _equal(tcp.read("files", torch.arange(at, at + N)), part)
            info = c.table_info("files")
            assert info["inserts"] == 7 * N + 10 and info["size"] == 4 * N
            for _ in range(2):  # a table in memory copies rows with loads: never told, the socket
                c.insert("memory", {"x": torch.arange(N)})
            assert "memory" not in c.router.home.areas.mapped and _kept(c) == [kept]
            # the kept directory is checked again once it changed: cut short, it is refused
            areas = c.router.home.areas
            stored = areas._kept[next(iter(areas._kept))][0]
            enc = encode(batch(0))
            fields = {Key.BIN: "files", Key.VALUE: enc.description, Key.SHM: kept, Key.SIZE: enc.nbytes}
            for _offset, _length, file in stored.files:
                os.chmod(file, 0o600)
                os.truncate(file, 64)
            with pytest.raises(ZeroCopyUnavailableError):
                c._call(TINSERT, fields, zero_copy=False)
            assert c.table_info("files")["inserts"] == 7 * N + 10  # nothing inserted
    finally:
        srv.stop()


def test_a_directory_the_server_let_go_is_refused_once_then_sent_over_tcp_and_written_anew(tmp_path, caplog):
    srv = ServerProcess("--memory-limit", str(4 << 20), "--spill-dir", str(tmp_path / "spill"))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("files", 8 * N, COLUMNS, remover="fifo")  # 4.4 MB of columns: in files
            sizes = [N + k for k in range(9)]  # nine kinds of batch: one more than a connection's kept directories
            first = 0
            for size in [sizes[0]] + sizes:  # (the first over the socket)
                c.insert("files", batch(first, size))
                first += size
            assert len(_kept(c)) == 9
            # the first kind's directory was let go by the server for the others, while the
            # client still maps it for writing: checked again, refused (a file open for
            # writing), sent over TCP, then written anew
            with caplog.at_level(logging.INFO, logger="tensorshare.client"):
                c.insert("files", batch(first, sizes[0]))
            assert "did not take a value through shared memory" in caplog.text
            assert len(_kept(c)) == 8
            got = c.read("files", torch.arange(first, first + sizes[0]) % (8 * N))
            assert _equal(got, batch(first, sizes[0]))
            first += sizes[0]
            c.insert("files", batch(first, sizes[0]))
            assert len(_kept(c)) == 9
            assert _equal(c.read("files", torch.arange(first, first + sizes[0]) % (8 * N)), batch(first, sizes[0]))
    finally:
        srv.stop()


def test_a_table_of_many_columns_takes_its_rows_through_the_same_kept_directory(tmp_path, caplog):
    srv = ServerProcess("--memory-limit", str(2 << 20), "--spill-dir", str(tmp_path / "spill"))
    wide = {f"c{i}": ((4,), torch.float32) for i in range(12)}  # more columns than one hop's worth of files
    n = 8192  # 1.5 MiB a batch: the bar for 12 arrays (512 KiB for each 4)

    def rows(first):
        return {name: torch.arange(first, first + n, dtype=torch.float32).view(n, 1).expand(n, 4) + i
                for i, name in enumerate(wide)}

    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("wide", 2 * n, wide, remover="fifo")  # 3 MiB: in files
            with caplog.at_level(logging.INFO, logger="tensorshare.client"):
                for first in range(0, 5 * n, n):
                    c.insert("wide", rows(first))
            assert "did not take" not in caplog.text  # never refused, never resent
            assert len(_kept(c)) == 1
            for half in (0, n // 2):  # (reads within the server's 2 MiB)
                got = c.read("wide", torch.arange(half, half + n // 2))
                assert _equal(got, {k: v[half:half + n // 2] for k, v in rows(4 * n).items()})
    finally:
        srv.stop()
