"""Issue #42, the fourth hardening round, where a process, a signal or a file decides:
real ``tensorshare-server`` processes on loopback, real files.

Each test failed on the code the issue was filed against and states the behaviour
the fix gives (the findings and their figures are in docs/reliability.md, "Fourth
round").  The cases the protocol alone decides are tested in memory, in
``tests/test_hardening_four_paired.py``.

Bounded: small sizes, every wait with a timeout.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import resource
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
import torch

import tensorshare
from opsproc import OpsServer, http_get
from serverproc import ServerProcess
from tensorshare import TensorShare
from tensorshare.disk.layout import LayoutError
from tensorshare.errors import BadRequestError, TensorShareError, TooLargeError
from tensorshare._client.connection import NO_VALUE, request_frame
from tensorshare.protocol.messages import PUT, Key, TableKey
from tensorshare.wire.codec import encode
from test_device_ipc import reference
from wiretools import RawConnection, request_parts, wait_for

MiB = 1 << 20
pytestmark = pytest.mark.process


# ============================================================ 1. a TWRITE cut by kill -9


def _unread_by_server(server_port: int, client_port: int) -> int | None:
    """Bytes the server's kernel holds for it on the connection from ``client_port``
    (/proc/net/tcp's rx_queue of the server's socket), or None if not found."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                return int(fields[4].split(":")[1], 16)
    return None


def _versions(client: tensorshare.Client, capacity: int) -> list[int]:
    """The version each slot holds; AssertionError for a slot whose row is not whole."""
    got = client.read("t", torch.arange(capacity))
    versions = got["v"].tolist()
    for slot, version in enumerate(versions):
        assert bool((got["obs"][slot] == version % 251).all()), f"slot {slot}: a torn row"
    return versions


def test_1_a_twrite_cut_by_kill_9_leaves_the_old_rows_or_the_new_ones(tmp_path):
    """A TWRITE over occupied slots marked them empty, then copied the new rows over the
    old: a kill during the copy left every slot of the write empty (TREAD: 501 "slot N
    holds no row"), rows acknowledged long before included.  Now the write is recorded
    whole first and a restart finds the old rows or the new ones.  Each round sends
    the whole TWRITE but its last byte, waits until the server has read all of it,
    sends the last byte and kills the server a moment later: in the middle of the
    write, or (on a very slow machine) after it."""
    capacity, width = 8, 2 * MiB  # 16 MiB a write: milliseconds of copying
    columns = {"v": ((), torch.int64), "obs": ((width,), torch.uint8)}
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("t", capacity, columns, sampler="uniform", remover="fifo")
            c.write("t", torch.arange(capacity), {"v": torch.zeros(capacity, dtype=torch.int64),
                                                  "obs": torch.zeros(capacity, width, dtype=torch.uint8)})
        version = 0
        for delay in (0.001, 0.002, 0.004):
            new = version + 1
            value = {"v": torch.full((capacity,), new), "obs": torch.full((capacity, width), new % 251,
                                                                          dtype=torch.uint8)}
            fields = {Key.BIN: "t", TableKey.INDICES: torch.arange(capacity).numpy().astype("<i8").tobytes()}
            frame = b"".join(bytes(p) for p in request_parts(7, "TWRITE", extra=fields, value=value))
            conn = RawConnection(srv.port, timeout=30)
            client_port = conn.sock.getsockname()[1]
            conn.send(frame[:-1])
            outq = lambda: fcntl.ioctl(conn.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # noqa: E731
            assert wait_for(lambda: int.from_bytes(outq(), "little") == 0
                            and _unread_by_server(srv.port, client_port) == 0, 20)
            conn.send(frame[-1:])
            time.sleep(delay)
            srv.stop(signal.SIGKILL)
            conn.close()
            srv = ServerProcess("--data-dir", data)
            with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
                assert c.table_info("t")["size"] == capacity
                versions = _versions(c, capacity)
            print(f"[1] killed {delay * 1000:g} ms after the last byte: slots at {versions}, was {version}")
            assert set(versions) in ({version}, {new}), versions  # all or nothing
            version = versions[0]
    finally:
        srv.stop()


# ============================================================ 2. the callback API after a server restart


def _submitted(client: tensorshare.Client, timeout: float = 15.0):
    """PUT through ``client.submit``: the error its callback got (None: it worked)."""
    heard = queue.Queue()
    client.submit("PUT", "b", torch.ones(4), lambda result, error: heard.put(error))
    return heard.get(timeout=timeout)


def _until(attempt, seconds: float = 20.0):
    """Call ``attempt()`` until it returns None (success), for ``seconds`` at most;
    the last error if it never did."""
    deadline = time.monotonic() + seconds
    while True:
        error = attempt()
        if error is None or time.monotonic() > deadline:
            return error
        time.sleep(0.1)


@pytest.mark.parametrize("workers", [1, 2])
def test_2_client_submit_reconnects_after_a_server_restart(workers):
    """``submit`` passed the DEFAULT sentinel where a deadline goes: once the connection
    was gone, every later call raised TypeError (``DEFAULT - time.monotonic()``)."""
    srv = ServerProcess(*(("--workers", str(workers)) if workers > 1 else ()))
    client = tensorshare.Client("127.0.0.1", srv.port, timeout=5)
    try:
        assert _submitted(client) is None
        srv.stop(signal.SIGKILL)
        assert isinstance(_submitted(client), TensorShareError)  # made while the server is down
        srv.start()
        assert _until(lambda: _submitted(client)) is None
        assert client.peek("b")[0].tolist() == [1.0] * 4
    finally:
        client.close()
        srv.stop()


def test_2_tensorshare_callbacks_go_on_after_a_server_restart():
    srv = ServerProcess()
    ts = TensorShare("127.0.0.1", srv.port, timeout=5)

    def put() -> str | None:
        heard = queue.Queue()
        ts.put("b", torch.ones(2), heard.put)
        message = heard.get(timeout=15)
        return None if message["status"] == "OK" else message["msg"]

    try:
        assert put() is None
        srv.stop(signal.SIGKILL)
        assert put() is not None
        srv.start()
        assert _until(put) is None
    finally:
        ts.stop()
        srv.stop()


# ============================================================ 3. a multi-worker server's parent


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (its workers)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_3_a_killed_worker_is_started_again_after_descriptors_ran_out_once(tmp_path):
    """With idle status connections holding the parent's descriptors, the restart of a
    killed worker failed (EMFILE in a timed call) and nothing tried again: the worker
    never came back.  Now a failed start is tried again with backoff.  The parent's
    descriptor limit is lowered so that eight idle status connections use it up."""
    srv = OpsServer("--workers", "2", log_path=tmp_path / "server.log")
    parent = srv.pid
    soft, hard = resource.prlimit(parent, resource.RLIMIT_NOFILE)
    socks = []
    try:
        workers = _children(parent)
        assert len(workers) == 2
        limit = _descriptors(parent) + 8
        resource.prlimit(parent, resource.RLIMIT_NOFILE, (limit, hard))
        for _ in range(8):
            socks.append(socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5))
        assert wait_for(lambda: _descriptors(parent) >= limit, 10)
        os.kill(workers[1], signal.SIGKILL)
        assert wait_for(lambda: "Too many open files" in srv.log(), 10), srv.log()[-2000:]  # the restart failed
        resource.prlimit(parent, resource.RLIMIT_NOFILE, (soft, hard))
        for sock in socks:
            sock.close()
        assert wait_for(lambda: len(_children(parent)) == 2, 20), srv.log()[-2000:]
        with tensorshare.Client("127.0.0.1", srv.port, timeout=10) as c:  # bins on every worker
            for k in range(8):
                c.put(f"b{k}", torch.tensor([k]))
            assert [c.peek(f"b{k}")[0].item() for k in range(8)] == list(range(8))
        assert "(pid None)" not in srv.log()  # item 12: the pid of a worker that ended is logged
        assert f"worker 1 (pid {workers[1]}) was killed by SIGKILL" in srv.log()
    finally:
        for sock in socks:
            sock.close()
        srv.stop()


# ============================================================ 5. a waiting get interrupted


_INTERRUPTED_GET = """
import sys, torch, tensorshare
client = tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=60)
client.put("warm", torch.zeros(1))
print("waiting", flush=True)
try:
    client.get("q", wait=60)
except KeyboardInterrupt:  # a notebook's stop button
    print("interrupted", flush=True)
sys.stdin.readline()
client.put("after", torch.ones(2))  # the client used on afterwards
print("after", client.peek("after")[0].tolist(), flush=True)
"""


def test_5_a_waiting_get_interrupted_by_ctrl_c_takes_nothing_appended_later(tmp_path):
    """A GET waiting in the server, interrupted by KeyboardInterrupt, stayed in the
    server: the next item another client appended was taken by it, sent to a caller
    who had left, and lost.  The interrupted call now resets its connection, and the
    server drops the waiting GET (which takes nothing)."""
    srv = OpsServer(log_path=tmp_path / "server.log")
    child = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_GET, str(srv.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(0.5)  # the GET is in the server, waiting
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted"
        wait_for(lambda: _clients(srv) == 0, 5)  # the server has seen the reset (not asserted: the test is below)
        with tensorshare.Client("127.0.0.1", srv.port, timeout=10) as other:
            other.append("q", torch.arange(3))
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "after [1.0, 1.0]"
            assert [v.tolist() for v in other.get("q")] == [[0, 1, 2]]  # not taken for the caller who left
    finally:
        child.kill()
        child.wait(10)
        srv.stop()


def _clients(srv: OpsServer) -> int:
    status, _, body = http_get(srv.url("/status.json"))
    assert status == 200
    return len(json.loads(body)["clients"])


# ============================================================ 6. a device-reference PUT whose bytes never come


def test_6_a_put_by_reference_whose_bytes_never_come_does_not_freeze_a_relay():
    """The relay's PEEK of a bin whose item was put by device reference, bytes not
    sent, was held 60 s at a time at the head of its upstream connection: every later
    request on it waited (another mirrored bin stale, a forwarded PUT unanswered).
    The relay now asks with ``wait`` 0 (refused at once, 451) and fetches again."""
    upstream = ServerProcess()
    relay = ServerProcess("--follow", f"127.0.0.1:{upstream.port}", "--follow-timeout", "3")
    publisher = RawConnection(upstream.port)  # on the upstream's host: it may put by reference
    try:
        value = encode(torch.arange(4.0))
        fields = {Key.BIN: "ref", Key.VALUE: value.description, Key.SIZE: value.nbytes,
                  Key.CUDA: dict(reference(7), digest=[1])}  # one digest: one array
        publisher.send(b"".join(bytes(p) for p in request_frame(1, PUT, fields, NO_VALUE)))
        assert publisher.read_frame().header["code"] == 250  # stored, without its bytes
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=10) as up, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=10) as c:
            up.put("other", torch.tensor([1]))
            assert c.peek("other")[0].item() == 1  # mirrored
            with pytest.raises(TensorShareError):  # its bytes are not there: no copy to serve yet
                c.peek("ref", timeout=4)
            up.put("other", torch.tensor([2]))
            began = time.monotonic()
            assert wait_for(lambda: c.peek("other")[0].item() == 2, 5), "the relay's mirror of 'other' is stale"
            c.put("other", torch.tensor([3]))  # forwarded upstream on the same connection
            assert time.monotonic() - began < 8
            assert up.peek("other")[0].item() == 3
            publisher.send(b"".join(bytes(p) for p in request_frame(
                2, PUT, {Key.BIN: "ref", Key.VALUE: value.description, Key.FILL: 7}, value)))
            assert publisher.read_frame().header["code"] == 250
            assert wait_for(lambda: _peeked(c, "ref") == [0.0, 1.0, 2.0, 3.0], 10)  # the bytes came: mirrored
    finally:
        publisher.close()
        relay.stop()
        upstream.stop()


def _peeked(client: tensorshare.Client, name: str):
    try:
        return client.peek(name, timeout=2)[0].tolist()
    except TensorShareError:
        return None


# ============================================================ 10. a refused load_table


def _checkpoint_with(path, **settings) -> None:
    """Change settings of the table checkpoint at ``path`` (as a hand-edited or foreign one may)."""
    record = path / "table.json"
    saved = json.loads(record.read_text())
    saved["spec"].update(settings)
    record.write_text(json.dumps(saved))


def test_10_a_refused_load_table_leaves_the_live_table_as_it_was(tmp_path):
    """load_table deleted the live table before the server had accepted the
    checkpoint's settings: a refused load (sampler "bogus", capacity 2**40) left no
    table.  The server now replaces the table (TCREATE ``replace``) only once the new
    settings pass every check."""
    srv = ServerProcess()
    columns = {"x": ((), torch.int64)}
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.create_table("t", 8, columns)
            c.insert("t", {"x": torch.arange(5)})
            c.save("t", tmp_path / "good")
            c.insert("t", {"x": torch.arange(5, 8)})  # the live table: 8 rows, the checkpoint 5
            for bad, settings, error in (("bogus", {"sampler": "bogus"}, BadRequestError),
                                         ("huge", {"capacity": 1 << 40}, TooLargeError)):
                shutil.copytree(tmp_path / "good", tmp_path / bad)
                _checkpoint_with(tmp_path / bad, **settings)
                with pytest.raises(error):
                    c.load_table(tmp_path / bad, "t")
                assert c.table_info("t")["size"] == 8 and c.read("t", torch.arange(8))["x"].tolist() == list(range(8))
            # rows the server would refuse once the table was emptied: refused before anything is sent
            for bad, state, row, value in (("nan", "priority", 1, float("nan")), ("twice", "index", 1, 0),
                                           ("outside", "index", 4, 8), ("no-columns", None, 0, None)):
                shutil.copytree(tmp_path / "good", tmp_path / bad)
                if state is None:
                    _checkpoint_with(tmp_path / bad, columns=None)
                else:
                    path = tmp_path / bad / "_slots" / f"{state}.bin"
                    array = np.fromfile(path, "<f8" if state == "priority" else "<i8")
                    array[row] = value
                    array.tofile(path)
                with pytest.raises(LayoutError):
                    c.load_table(tmp_path / bad, "t")
                assert c.table_info("t")["size"] == 8 and c.read("t", torch.arange(8))["x"].tolist() == list(range(8))
            cli = subprocess.run([sys.executable, "-m", "tensorshare.cli", "--port", str(srv.port), "table", "load",
                                  str(tmp_path / "bogus"), "t"], capture_output=True, text=True, timeout=60,
                                 env={k: v for k, v in os.environ.items() if k != "TENSORSHARE_TOKEN"})
            assert cli.returncode != 0 and "bogus" in cli.stderr
            assert c.table_info("t")["size"] == 8
            assert c.load_table(tmp_path / "good", "t") == 5  # an accepted one replaces it
            assert c.table_info("t")["size"] == 5 and c.read("t", torch.arange(5))["x"].tolist() == list(range(5))
    finally:
        srv.stop()
