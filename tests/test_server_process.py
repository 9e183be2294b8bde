"""The server as a program: CLI, signals, embedding, devices."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

import tensorshare
from serverproc import ServerProcess


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_clean_shutdown_on_signal(sig):
    if sig == signal.SIGINT and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started as a background job (POSIX shells ignore SIGINT there), the test
        # process and so the server inherit that, and Twisted leaves it ignored.
        pytest.skip("SIGINT is ignored in this process, hence in the server it starts")
    proc = ServerProcess()
    with tensorshare.Client("127.0.0.1", proc.port) as c:
        c.put("x", 1)
    assert proc.stop(sig) == 0


@pytest.mark.process
def test_binds_loopback_by_default():
    proc = ServerProcess()
    try:
        with tensorshare.Client("127.0.0.1", proc.port) as c:
            assert c.ping() < 5
    finally:
        proc.stop()


@pytest.mark.process
def test_cli_help_and_bad_size():
    out = subprocess.run([sys.executable, "-m", "tensorshare_server", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--port" in out.stdout and "--host" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tensorshare_server", "--max-frame", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a size" in bad.stderr


@pytest.mark.process
def test_embedded_server_in_process():
    from tensorshare_server import EmbeddedServer

    with EmbeddedServer(port=0) as server:
        assert server.port > 0
        with tensorshare.Client("127.0.0.1", server.port) as c:
            c.put("e", {"t": torch.arange(3)})
            assert torch.equal(c.peek("e")[0]["t"], torch.arange(3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip(server):
    src = torch.randn(1000, device="cuda")
    with tensorshare.Client("127.0.0.1", server.port, device="cuda") as c:
        c.put("gpu", {"t": src, "cpu": torch.ones(2)})
        [back] = c.peek("gpu")
        assert back["t"].device.type == "cuda" and torch.equal(back["t"], src)
        assert back["cpu"].device.type == "cuda"
    with tensorshare.Client("127.0.0.1", server.port) as c:
        assert c.peek("gpu")[0]["t"].device.type == "cpu"


def test_the_server_raises_its_soft_limit_on_open_files_within_the_hard_one():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1024) if hard == resource.RLIM_INFINITY else min(soft, hard, 1024)
    srv = ServerProcess(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    try:
        with open(f"/proc/{srv.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        now = int(line.split()[3])
        expected = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        assert now == max(low, expected)
    finally:
        srv.stop()
