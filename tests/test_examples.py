"""The examples run as README shows, against a real server (the original's own:
tests/test_original.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(args, timeout=60):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)



def test_blocking_client_example(server):
    result = run([str(EXAMPLES / "blocking_client.py"), "--port", str(server.port)])
    assert result.returncode == 0, result.stderr
    assert "got 3 rollouts, steps [0, 1, 2]" in result.stdout


def test_listen_example(server):
    result = run([str(EXAMPLES / "listen.py"), "--port", str(server.port)])
    assert result.returncode == 0, result.stderr
    assert "DELETE, now 0 item(s)" in result.stdout
    assert result.stdout.count("APPEND") == 2
