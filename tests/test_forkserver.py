"""Servers the tests fork (tests/forkserver.py) behave as servers started by exec do."""

import os
import signal
import subprocess
import sys

import pytest
import torch

import tensorshare
from forkserver import fork_server
from serverproc import ServerProcess

pytestmark = pytest.mark.process


@pytest.fixture
def forks():
    server = fork_server()
    if server is None:
        pytest.skip("the fork server is not in use (TENSORSHARE_TESTS_EXEC, or it could not start)")
    return server


def test_a_refused_start_exits_and_says_why_as_by_exec(forks):
    forked = forks.start(["--port", "-5"], None)
    execd = subprocess.run([sys.executable, "-m", "tensorshare_server", "--port", "-5"], capture_output=True,
                           text=True, timeout=60)
    assert forked.wait(30) == execd.returncode == 2
    assert forked.stderr.read() == execd.stderr and "--port" in execd.stderr
    assert forked.stdout.read() == execd.stdout == ""


def test_forked_servers_serve_at_once_each_with_its_own_reactor_and_exit_codes(forks, tmp_path):
    log = tmp_path / "server.log"
    first, second = ServerProcess(), ServerProcess("--log-level", "INFO", log_path=log)
    try:
        for server in (first, second):
            assert server.forkable
            with open(f"/proc/{server.pid}/status") as f:
                parent = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            assert parent == forks.proc.pid
        clients = [tensorshare.Client(port=s.port) for s in (first, second)]
        for i, client in enumerate(clients):
            client.put("x", torch.full((3,), i))
        for i, client in enumerate(clients):  # neither saw the other's connection or bin
            assert torch.equal(client.get("x")[0], torch.full((3,), i))
            client.close()
        os.kill(first.pid, signal.SIGKILL)
        assert first.proc.wait(30) == -signal.SIGKILL
        assert second.stop() == 0
        assert "127.0.0.1" in log.read_text()  # its log went to the file it was given
    finally:
        first.stop()
        second.stop()
