"""The examples run as the documentation shows, against a real server (the original's own:
tests/test_original.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.process
def test_tables_dqn_example_trains_with_actor_processes():
    """examples/tables_dqn.py: a server, two actor processes inserting into a table,
    the learner sampling it, for 300 updates (learning CartPole takes minutes)."""
    pytest.importorskip("gymnasium", reason="gymnasium is not installed (pip install gymnasium)")
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    result = subprocess.run([sys.executable, str(EXAMPLES / "tables_dqn.py"), "--actors", "2", "--seconds", "100",
                             "--max-updates", "300", "--report-every", "100"], capture_output=True, text=True,
                            timeout=160, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "updates    300" in result.stdout and "done: 300 updates" in result.stdout, result.stdout
    assert "episodes      0" not in result.stdout  # the actors played, and reported their returns
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.process
def test_tables_dqn_example_solves_cartpole_through_a_torchrl_replay_buffer():
    """examples/tables_dqn.py --torchrl: the learner samples through a TorchRL
    ReplayBuffer over the table (TableStorage with TorchRL's own RandomSampler, whose
    reads the table counts, so its rate limiter paces learner and actor) and solves
    CartPole as the native path does: a mean return of 195 over 20 episodes.  One
    actor, stopping on success (about 30 s on the 2-core machine under load 15)."""
    pytest.importorskip("gymnasium", reason="gymnasium is not installed (pip install gymnasium)")
    pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl)")
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    result = subprocess.run([sys.executable, str(EXAMPLES / "tables_dqn.py"), "--torchrl", "--actors", "1",
                             "--seconds", "200", "--report-every", "100"], capture_output=True, text=True,
                            timeout=260, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "solved: mean return" in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


WITHOUT = """
import runpy, sys
sys.modules[sys.argv[1]] = None  # as where that package is not installed: importing it fails
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("example, module, extra", [("ray_rl.py", "ray", "ray"),
                                                    ("tables_dqn.py", "gymnasium", "torchrl")])
def test_an_example_names_the_extra_it_needs(example, module, extra):
    result = subprocess.run([sys.executable, "-c", WITHOUT, module, str(EXAMPLES / example)], capture_output=True,
                            text=True, timeout=120, cwd=EXAMPLES)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"needs {module}, of the {extra} extra: pip install 'torch-tensorshare[{extra}]'" in result.stderr


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("original_*.py") if p.name != "original_args.py"))
def test_the_originals_examples_take_help_and_a_port(example):
    result = run([str(EXAMPLES / example), "--help"])
    assert result.returncode == 0 and "--port PORT" in result.stdout, result.stderr
    assert "default: 8000" in result.stdout


@pytest.mark.process
def test_the_originals_server_example_serves_on_the_port_given():
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "original_server.py"), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "tensorshare-server listening on 127.0.0.1:" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
