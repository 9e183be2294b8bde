"""Issue #31, the third hardening round, where a process, a disk or a signal decides:
real ``tensorshare-server`` processes on loopback, real files and file systems.

Each test failed on the code the issue was filed against and states the behaviour
the fix gives (the findings and their figures are in docs/reliability.md, "Third
round").  The cases the protocol alone decides are tested in memory, in
``tests/test_hardening_three_paired.py`` (the table engine's in ``tests/test_tables_engine.py``).

Bounded: small sizes, small file systems, every wait with a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import tensorshare
from opsproc import OpsServer, http_get
from serverproc import ServerProcess, small_tmpfs
from tensorshare.errors import NoSuchBinError, StorageFullError, TensorShareError, TooLargeError
from tensorshare.protocol.messages import PEEK, Key
from wiretools import RawConnection, raw_frame, wait_for
from tensorshare_server.ops.web import MAX_CONNECTIONS

MiB = 1 << 20
TOKEN = "round-three-token-8f3c61d2e0b94a57"
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
                else ["--memory-limit", "1MiB", "--spill-dir", str(mount)])
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


# -- 8: the metrics port's own limits


def _http_head(port: int, head: bytes, timeout: float = 5.0) -> bytes:
    """Send ``head`` (request line and headers, no body) and read what comes back
    until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        got = b""
        with contextlib.suppress(socket.timeout):
            while chunk := sock.recv(65536):
                got += chunk
        return got


def _workers(n: int) -> tuple:
    return ("--workers", str(n)) if n > 1 else ()


@pytest.mark.parametrize("workers", [1, 2])  # 2: the parent's port (issue #42, item 3)
def test_8_a_request_body_is_refused_before_a_byte_of_it_is_read(tmp_path, workers):
    """A body was spooled to disk before the token was checked (300 MiB accepted
    without a token): now the headers alone get the answer, and the socket closes."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    srv = OpsServer("--token-file", str(token), *_workers(workers), log_path=tmp_path / "server.log")
    try:
        head = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (300 * MiB)
        began = time.monotonic()
        assert _http_head(srv.metrics_port, head).startswith(b"HTTP/1.1 401")
        authorized = head.replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer " + TOKEN.encode())
        assert _http_head(srv.metrics_port, authorized).startswith(b"HTTP/1.1 413")
        chunked = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert _http_head(srv.metrics_port, chunked).startswith(b"HTTP/1.1 401")
        assert time.monotonic() - began < 10
        assert http_get(srv.url("/status.json"), {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_8_half_sent_http_requests_are_bounded_and_leave_the_data_port_alone(tmp_path, workers):
    """HTTP connections were not counted: half-sent requests could take every
    descriptor the data port needs.  Past MAX_CONNECTIONS they are closed as they come."""
    srv = OpsServer(*_workers(workers), log_path=tmp_path / "server.log")
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            sock = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
            sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(sock)
        assert all(_closed(sock, wait=5) for sock in socks[MAX_CONNECTIONS:])
        assert not any(_closed(sock) for sock in socks[:MAX_CONNECTIONS])
        with tensorshare.Client("127.0.0.1", srv.port, timeout=10) as c:
            c.put("still", torch.arange(3))
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the closes
            status = http_get(srv.url("/status.json"))[0] if _accepts(srv.metrics_port) else None
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
    finally:
        for sock in socks:
            sock.close()
        srv.stop()


def _accepts(port: int) -> bool:
    """The status port answers a GET (it is not at its connection limit)."""
    try:
        return _http_head(port, b"GET /status.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                          timeout=2).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _closed(sock: socket.socket, wait: float = 0.0) -> bool:
    """The server has closed (or reset) ``sock``, or does within ``wait`` seconds."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except (BlockingIOError, socket.timeout):
        return False


# -- 12: a data directory is locked by the server using it


def test_12_a_second_server_on_a_data_directory_stops_at_once_naming_the_holder(tmp_path):
    """The second server started, and its writes failed later with a misleading 452."""
    data = tmp_path / "data"
    first = ServerProcess("--data-dir", str(data), log_path=tmp_path / "first.log")
    try:
        second = subprocess.run([sys.executable, "-m", "tensorshare_server", "--port", "0", "--data-dir", str(data)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 75, second
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid} " in lines[0] and "in use" in lines[0], second.stderr
        with tensorshare.Client("127.0.0.1", first.port, timeout=10) as c:
            c.put("kept", torch.arange(3))
    finally:
        first.stop()
    again = ServerProcess("--data-dir", str(data), log_path=tmp_path / "again.log")  # the lock went with it
    try:
        with tensorshare.Client("127.0.0.1", again.port, timeout=10) as c:
            assert torch.equal(c.peek("kept")[0], torch.arange(3))
    finally:
        again.stop()


# -- 14: smaller ones


def test_14_a_value_over_max_frame_raises_too_large_on_both_routes(tmp_path):
    """A TCP client got a broken pipe, a same-host client 501; both now raise
    TooLargeError (552) before sending, and the connection goes on."""
    srv = ServerProcess("--max-frame", "64KiB", "--zero-copy-min", "4KiB", log_path=tmp_path / "server.log")
    try:
        for zero_copy in (False, True):
            with tensorshare.Client("127.0.0.1", srv.port, timeout=10, zero_copy=zero_copy) as c:
                assert c.same_host == zero_copy
                with pytest.raises(TooLargeError, match="max-frame"):
                    c.put("big", torch.zeros(1 << 15))  # 128 KiB
                c.put("small", torch.zeros(1 << 12))  # 16 KiB: the same connection goes on
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_14_a_token_file_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    from tensorshare.disk.areas import TOKEN_FILE, write_token

    with small_tmpfs(tmp_path / "small", "64k") as mount:
        filler = mount / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
        with pytest.raises(OSError):
            write_token(str(mount), "ab" * 16)
        assert sorted(os.listdir(mount)) == ["filler"], TOKEN_FILE


# -- 1: a held read notices its peer's close and takes nothing


def _clients(srv: OpsServer) -> int:
    status, _, body = http_get(srv.url("/status.json"))
    assert status == 200
    return len(json.loads(body)["clients"])


def test_1_a_held_get_or_sample_whose_client_closed_takes_nothing_and_frees_its_slot(tmp_path):
    """While a GET (or TSAMPLE) waited the server read nothing of its connection, so
    it did not see the close: the next acknowledged APPEND went to the dead GET and
    was lost, and 4 such connections locked every client out of --max-connections 4."""
    srv = OpsServer("--max-connections", "5", log_path=tmp_path / "server.log")
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=10) as setup:
            setup.create_table("t", 8, {"x": ((), torch.int64)}, max_times_sampled=1)
        dead = [RawConnection(srv.port) for _ in range(4)]
        for i, conn in enumerate(dead):
            if i % 2:
                conn.send(raw_frame(1, "TSAMPLE", "t", extra={Key.N: 1, Key.WAIT: 60.0}))
            else:
                conn.send(raw_frame(1, "GET", "q", extra={Key.WAIT: 60.0}))
            conn.close()
        assert wait_for(lambda: _clients(srv) == 0, timeout=10), "the server kept the closed connections"
        with tensorshare.Client("127.0.0.1", srv.port, timeout=10) as c:  # a slot is free
            c.append("q", torch.arange(3))
            c.insert("t", {"x": torch.arange(1)})
            assert [v.tolist() for v in c.get("q")] == [[0, 1, 2]]  # not taken by a dead GET
            assert c.sample("t", 1).value["x"].tolist() == [0]  # nor sampled out by a dead TSAMPLE
    finally:
        srv.stop()


# -- 9: a relay never deletes an ephemeral bin someone else now owns


def test_9_a_relay_spares_an_ephemeral_bin_its_client_no_longer_owns(tmp_path):
    """When the relay's client disconnected, a plain DELETE went upstream, deleting
    the bin another worker had put (ephemeral) since, against PROTOCOL.md §4.6."""
    head = ServerProcess(log_path=tmp_path / "head.log")
    relay = ServerProcess("--follow", f"127.0.0.1:{head.port}", log_path=tmp_path / "relay.log")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as direct:
            via_relay = tensorshare.Client("127.0.0.1", relay.port, timeout=15)
            via_relay.put("members/w1", {"host": "old"}, ephemeral=True)
            via_relay.put("members/only-mine", {"host": "old"}, ephemeral=True)
            direct.put("members/w1", {"host": "new"}, ephemeral=True)  # a new worker under the same name
            via_relay.close()
            # The relay ends both of its client's bins in one go: once its own is gone, it is done.
            assert wait_for(lambda: "members/only-mine" not in direct.list(), timeout=15)
            assert direct.peek("members/w1") == [{"host": "new"}]
    finally:
        relay.stop()
        head.stop()


# -- 3: a relay resets its view of the upstream when it reconnects


def _relay_tag(port: int, name: str):
    with tensorshare.Client("127.0.0.1", port, timeout=15) as c:
        try:
            return c._call(PEEK, {Key.BIN: name, Key.TAGS: True}, then=lambda reply: reply.header.get(Key.TAGS))
        except TensorShareError:
            return None


def test_3_a_relay_serves_a_restarted_upstreams_new_numbering(tmp_path):
    """Without a data dir a restarted head numbers its changes from 1 again; the relay
    kept the old run's highest seq, ignored the new copies and said it was not
    behind, and answered 550 for a bin the new head holds."""
    head = ServerProcess(log_path=tmp_path / "head.log")
    relay = ServerProcess("--follow", f"127.0.0.1:{head.port}", "--follow-timeout", "10",
                          log_path=tmp_path / "relay.log")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as up:
            for version in range(40):  # seq 40 and more on the old head
                up.put("params", torch.tensor([version]), tag=version)
        assert wait_for(lambda: _relay_tag(relay.port, "params") == [39], timeout=15)
        assert _relay_tag(relay.port, "later") is None  # mirrored: it does not exist yet
        head.kill()
        head.start()  # the same port, nothing kept: numbering starts again
        with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:  # it has listened again
            assert wait_for(lambda: rel.relay_status()["connected"], timeout=15)
            assert wait_for(lambda: rel.relay_status()["behind"] == 0, timeout=15)
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as up:
            up.put("params", torch.tensor([100]), tag=100)
            up.put("later", torch.tensor([1]), tag=1)
        assert wait_for(lambda: _relay_tag(relay.port, "params") == [100], timeout=15), "stale after the restart"
        assert wait_for(lambda: _relay_tag(relay.port, "later") == [1], timeout=15), "550 for a bin the head holds"
    finally:
        relay.stop()
        head.stop()


# -- 4: made-up names do not lock bins out of a relay


def test_4_made_up_names_read_through_a_relay_do_not_use_up_its_upstream_listens(tmp_path):
    """Every name read through a relay became a permanent mirror and an upstream
    LISTEN, also names the head lacks: past the head's quota of listens for the
    relay's connection, new bins were unreadable through the relay until it restarted."""
    head = ServerProcess("--max-listens", "40", log_path=tmp_path / "head.log")
    relay = ServerProcess("--follow", f"127.0.0.1:{head.port}", "--follow-timeout", "10", "--max-listens", "40",
                          log_path=tmp_path / "relay.log")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as up, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            for i in range(120):  # 3 times the quota, none of them on the head
                with pytest.raises(NoSuchBinError):
                    rel.peek(f"made-up/{i}")
            for i in range(60):  # more real bins than the quota: the least recently read give way
                up.put(f"real/{i}", torch.tensor([i]))
            for i in range(60):
                assert rel.peek(f"real/{i}")[0].tolist() == [i]
            listened = []
            with pytest.raises(TooLargeError, match="may listen to 10"):  # a quarter of 40 per connection
                for i in range(40):
                    listened.append(rel.listen(f"waited/{i}", lambda note: None))
            assert len(listened) == 10
            up.put("after", torch.tensor([7]))
            assert rel.peek("after")[0].tolist() == [7]  # still room for a new bin
            assert rel.relay_status()["bins"] <= 40
    finally:
        relay.stop()
        head.stop()
