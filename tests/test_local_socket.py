"""Same-host clients through the server's Unix socket (PROTOCOL.md §10.1).

The trust check is tested in memory with real files and sockets; the rest end to
end against a real server process: the client's connection (the blocking client's
and the AsyncClient's) really is the Unix socket, everything works through it
(small and large values, listens, tokens, workers), a restarted server is found
again, and ``zero_copy=False`` or a TLS server keeps the client on TCP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import tensorshare
from serverproc import ServerProcess
from tensorshare.disk.areas import local_socket, new_token, write_token


def _family(client: tensorshare.Client, member=None) -> int:
    return (member or client.router.home).link.sock.family


# -- which sockets a client trusts (in memory: real directories and sockets)


@pytest.fixture
def area(tmp_path):
    """A private directory with a token file and a listening Unix socket in it."""
    root = tmp_path / "area"
    root.mkdir(mode=0o700)
    token = new_token()
    write_token(str(root), token)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(root / "server.sock"))
    yield str(root), token
    listening.close()


def test_a_socket_in_a_verified_area_is_trusted(area):
    root, token = area
    path = os.path.join(root, "server.sock")
    assert local_socket({"token": token, "areas": [root], "socket": path}) == path


def test_an_unverified_or_odd_socket_is_never_trusted(area, tmp_path):
    root, token = area
    path = os.path.join(root, "server.sock")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    stray = socket.socket(socket.AF_UNIX)
    stray.bind(str(other / "server.sock"))  # a socket in a directory with no token
    (other / "plain").write_text("not a socket")
    os.chmod(root, 0o700)
    try:
        for offer in (
            None, "x", {},
            {"token": "0" * len(token), "areas": [root], "socket": path},  # another server's token
            {"token": token, "areas": [], "socket": path},  # not in an offered area
            {"token": token, "areas": [root], "socket": 7},
            {"token": token, "areas": [str(other)], "socket": str(other / "server.sock")},  # no token file there
            {"token": token, "areas": [root], "socket": os.path.join(root, ".tensorshare-token")},  # not a socket
            {"token": token, "areas": [root], "socket": os.path.join(root, "gone.sock")},
            {"token": token, "areas": [root], "socket": path + "\x00"},
        ):
            assert local_socket(offer) is None, offer
        os.chmod(root, 0o777)  # writable by others: anyone could have put a socket there
        assert local_socket({"token": token, "areas": [root], "socket": path}) is None
    finally:
        os.chmod(root, 0o700)
        stray.close()


# -- end to end, against a real server process


def test_a_same_host_client_talks_through_the_unix_socket(server):
    value, large = torch.arange(16.0), torch.rand(3 << 20)  # (12 MiB: many reads and sends)
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as c, \
            tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as tcp:
        assert _family(c) == socket.AF_UNIX and c.router.home.local.endswith("server.sock")
        assert _family(tcp) == socket.AF_INET and tcp.router.home.local is None
        seen, arrived = [], threading.Event()
        tcp.listen("ls-small", lambda *event: (seen.append(event), arrived.set()))
        c.put("ls-small", value)
        c.append("ls-small", value + 1)
        assert arrived.wait(10)
        assert [t.tolist() for t in tcp.peek("ls-small")] == [value.tolist(), (value + 1).tolist()]
        tcp.put("ls-large", large)
        assert torch.equal(c.get("ls-large")[0], large)
        c.put("ls-large", large * 2)
        assert torch.equal(tcp.get("ls-large")[0], large * 2)


def test_a_restarted_server_is_found_again(fresh_server):
    with tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30, max_backoff=0.2) as c:
        c.put("ls-restart", torch.ones(2))
        before = c.router.home.local
        fresh_server.restart()  # a new area, a new socket: the old path is gone
        for attempt in range(3):  # (a call that finds the connection broken fails; the next reconnects)
            try:
                c.put("ls-restart", torch.zeros(2))
                break
            except tensorshare.ConnectionLostError:
                assert attempt < 2
        after = c.router.home.local
        assert after is not None and after != before and not os.path.exists(before)
        assert _family(c) == socket.AF_UNIX
        assert c.peek("ls-restart")[0].tolist() == [0.0, 0.0]


def test_token_and_workers_through_the_unix_socket(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-long-enough-token-for-this-test-0123456789\n")
    proc = ServerProcess("--token-file", str(token_file), "--workers", "2")
    try:
        with pytest.raises(tensorshare.AuthenticationError):
            tensorshare.Client("127.0.0.1", proc.port, timeout=10, token="wrong-" + "x" * 40)
        with tensorshare.Client("127.0.0.1", proc.port, timeout=30,
                                token="a-long-enough-token-for-this-test-0123456789") as c:
            for i in range(8):  # bins on both workers
                c.put(f"ls-w{i}", torch.full((4,), float(i)))
            assert [c.peek(f"ls-w{i}")[0][0].item() for i in range(8)] == [float(i) for i in range(8)]
            members = [m for m in c.router.members if m is not None and m.link is not None]
            assert len(members) == 2
            assert {_family(c, m) for m in members} == {socket.AF_UNIX}
            assert len({m.local for m in members}) == 2  # each worker's own socket
    finally:
        proc.stop()


def test_the_async_client_talks_through_the_unix_socket(server):
    """The AsyncClient as the blocking one: the Unix socket (or TCP with zero_copy=False),
    found again after a restart, a socket per worker with a token asked there too
    (tests/async_procs.py: one reactor per process)."""
    script = os.path.join(os.path.dirname(__file__), "async_procs.py")
    result = subprocess.run([sys.executable, script, "local", str(server.port)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "local ok" in result.stdout, result.stdout + result.stderr[-3000:]
