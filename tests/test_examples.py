"""The examples run as README shows, against a real server; the seed example unchanged."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(args, timeout=60):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_seed_readme_client_example_runs_unchanged(server, tmp_path):
    source = (EXAMPLES / "original_client.py").read_text()
    # The only change: the port (the seed hard-codes 8000).
    patched = source.replace("TensorShare('localhost', 8000)", f"TensorShare('localhost', {server.port})")
    assert patched != source
    script = tmp_path / "seed_client.py"
    script.write_text(patched)
    result = run([str(script)])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "peek data_bin {'status': 'OK', 'data': [{'a': tensor(" in out
    assert re.search(r"Bin xyz updated\. Num items:  [12]", out)
    assert "{'status': 'OK', 'data': {" in out and "'data_bin': 1" in out


def test_blocking_client_example(server):
    result = run([str(EXAMPLES / "blocking_client.py"), "--port", str(server.port)])
    assert result.returncode == 0, result.stderr
    assert "got 3 rollouts, steps [0, 1, 2]" in result.stdout


def test_listen_example(server):
    result = run([str(EXAMPLES / "listen.py"), "--port", str(server.port)])
    assert result.returncode == 0, result.stderr
    assert "DELETE, now 0 item(s)" in result.stdout
    assert result.stdout.count("APPEND") == 2
