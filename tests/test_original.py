"""The original tensorshare's documented patterns run unchanged: its README's client
walk-through, its RLTrainer example (hosting the server: ``host_server=True,
filter_version=False``) with its RLWorker example, and its docstring's
``run_server(8000, start_reactor=False)``.  (The examples page repeats the README's
three examples word for word.)

The texts hard-code port 8000, so each runs in a network namespace of its own
(``unshare -n``, as root) where that port is surely free; elsewhere on the host's
loopback if 8000 is free there, else the test is skipped."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.process


def _own_network() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return probe.returncode == 0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_unchanged(*scripts: str, timeout: float, services: int = 0, pauses: float = 1.0) -> list[subprocess.CompletedProcess]:
    """Run the example ``scripts`` (started in order, a second apart) where port 8000
    is free; the first ``services`` of them (servers that run until stopped) are
    stopped once the others have ended.  ``pauses`` scales the scripts' own
    ``sleep`` calls (their ``--pauses``).  Their results, in order."""
    commands = [f"{sys.executable} {EXAMPLES / name}" + (f" --pauses {pauses:g}" if pauses != 1.0 else "")
                for name in scripts]
    outs = [f"/tmp/out-{os.getpid()}-{i}" for i in range(len(scripts))]
    steps = " sleep 1; ".join(f"({c} > {o}.out 2> {o}.err; echo $? > {o}.rc) & p{i}=$!;"
                              for i, (c, o) in enumerate(zip(commands, outs)))
    waits = " ".join(f"wait $p{i};" for i in range(services, len(scripts)))
    kills = " ".join(f"kill $p{i} 2>/dev/null; pkill -f {EXAMPLES / scripts[i]};" for i in range(services))
    shell = f"{steps} {waits} {kills} wait"
    if _own_network():
        argv = ["unshare", "-n", "sh", "-c", f"ip link set lo up && {shell}"]
    elif _port_free(8000):
        argv = ["sh", "-c", shell]
    else:
        pytest.skip("port 8000 is taken and no network namespace can be made for the original's text")
    try:
        subprocess.run(argv, timeout=timeout, check=False)
        results = []
        for cmd, o in zip(commands, outs):
            rc_file = Path(f"{o}.rc")
            rc = int(rc_file.read_text().strip()) if rc_file.exists() else -1
            results.append(subprocess.CompletedProcess(cmd, rc, Path(f"{o}.out").read_text(),
                                                       Path(f"{o}.err").read_text()))
        return results
    finally:
        for o in outs:
            for ext in (".out", ".err", ".rc"):
                Path(o + ext).unlink(missing_ok=True)


def test_readme_client_walk_through_runs_unchanged():
    """The README's ``TensorShare`` example, against ``run_server(8000)`` in its own process."""
    server, client = run_unchanged("original_server.py", "original_client.py", timeout=90, services=1)
    assert client.returncode == 0, client.stderr[-3000:]
    out = client.stdout
    assert re.search(r"peek data_bin \{'status': 'OK', 'data': \{'a': tensor\(", out), out  # the object itself
    # The example's two gets race with its appends (as in the original): whichever
    # comes after an append gets a list, one before them the put's object itself.
    assert re.search(r"get xyz \{'status': 'OK', 'data': \[(\{'a': )?tensor\(", out), out
    assert re.search(r"Bin xyz updated\. Num items:  [0-9]", out), out
    assert "{'status': 'OK', 'data': {" in out and "'data_bin': 1" in out


def test_rl_trainer_hosting_the_server_and_rl_worker_run_unchanged():
    # As written, the worker's 0.2 s between rollouts make the trainer's 10 batches
    # of 16 take 40 s; a tenth of each pause runs the same calls in order.
    trainer, worker = run_unchanged("original_rl_trainer.py", "original_rl_worker.py", timeout=170, pauses=0.1)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert "Iteration 9 Loss:" in trainer.stdout
    # The worker runs until its trainer, which hosts the server, is gone; then it stops.
    assert worker.returncode == 0, worker.stderr[-3000:]


def test_run_server_without_starting_the_reactor_hosts_the_server_in_process():
    [result] = run_unchanged("original_in_process.py", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "put response: Status = OK" in result.stdout
    assert "list result: {'bin1': 1}" in result.stdout
