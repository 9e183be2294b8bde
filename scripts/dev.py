#!/usr/bin/env python3
"""Set up a virtual environment and run the project's jobs; needs only Python 3.10+.

    python3 scripts/dev.py demo    # set up, run the RL demo (server + trainer + 4 workers), then the examples
    python3 scripts/dev.py test    # set up with the test and docs extras, run the test suite
    python3 scripts/dev.py docs    # set up with the docs extra, build the documentation site into site/
    python3 scripts/dev.py bench   # set up with the bench extra, run the quick benchmark
    python3 scripts/dev.py bench-full

The environment lives in ``.venv`` and is re-installed only when setup.cfg,
setup.py, pyproject.toml or the C extension's source change.  torch is installed pinned (``torch==2.13.0``, a CPU build)
when missing, so that the package's range does not pull a CUDA build.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
TORCH_PIN = "torch==2.13.0"
# a change to these re-installs (the last: the C extension setup.py builds)
PACKAGING = ("setup.cfg", "setup.py", "pyproject.toml", "server/bins/tables/_loops.c")
OLD_NAME = "tensorshare"  # the distribution name this project had (taken on the package index by another)


def sh(*cmd: str, **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def ensure_env(extra: str | None) -> None:
    """Create .venv and install the package (editable) with ``extra``."""
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / f".installed-{extra or 'base'}"
    digest = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in PACKAGING)).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    quiet = ["--quiet", "--disable-pip-version-check"]
    has_torch = subprocess.run([str(PY), "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        sh(str(PY), "-m", "pip", "install", *quiet, TORCH_PIN)
    old = subprocess.run([str(PY), "-m", "pip", "show", OLD_NAME], capture_output=True, text=True)
    if old.returncode == 0 and str(ROOT) in old.stdout:  # our own earlier install, under the old name
        sh(str(PY), "-m", "pip", "uninstall", *quiet, "--yes", OLD_NAME)
    target = f".[{extra}]" if extra else "."
    sh(str(PY), "-m", "pip", "install", *quiet, "-e", target)
    stamp.write_text(digest)


def start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([str(PY), "-m", "tensorshare_server", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r":(\d+)$", line.strip())
    if not match:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    print(line.strip(), flush=True)
    return proc, int(match.group(1))


def demo() -> None:
    ensure_env(None)
    print("== examples/rl_demo.py: a server, a trainer and 4 workers learning together", flush=True)
    sh(str(PY), "examples/rl_demo.py", "--workers", "4", "--versions", "30", timeout=900)
    proc, port = start_server()
    try:
        for example in ("blocking_client.py", "listen.py"):
            print(f"\n== examples/{example}", flush=True)
            sh(str(PY), f"examples/{example}", "--port", str(port), timeout=300)
    finally:
        proc.terminate()
        proc.wait(10)


# The torchrl extra, installed for the tests without dependency resolution: torchrl
# 0.14 asks for tensordict<0.15, and works with the tensordict (and torch) installed.
TORCHRL = ("torchrl==0.14.1", "pyvers", "hoptorch", "cloudpickle", "farama-notifications", "gymnasium")


def ensure_torchrl() -> None:
    """Install torchrl and gymnasium if missing, leaving torch and tensordict as they are
    (their tests skip, saying so, if this fails)."""
    if subprocess.run([str(PY), "-c", "import torchrl, gymnasium"], capture_output=True).returncode == 0:
        return
    print("+ pip install --no-deps " + " ".join(TORCHRL), flush=True)
    subprocess.run([str(PY), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    *TORCHRL], cwd=ROOT, check=False)


def keep_bytecode() -> None:
    """Give the processes a job starts a bytecode cache where writing one is turned off
    (``PYTHONDONTWRITEBYTECODE``): in ``.venv/pycache`` (``PYTHONPYCACHEPREFIX``), so
    nothing is written beside the sources.  Without it each of the suite's ~390 server
    processes compiled the package from source and each pytest process rewrote every
    test module's assertions (a whole run's CPU on 2 cores: 1,265 s, with it 1,131 s).
    A new cache is filled once, here, before the job (:func:`warm_bytecode`)."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        os.environ.setdefault("PYTHONPYCACHEPREFIX", str(VENV / "pycache"))
        warm_bytecode(Path(os.environ["PYTHONPYCACHEPREFIX"]))


# What the suite's processes import (those not installed are passed over).
WARM = ("torch", "numpy", "msgpack", "twisted.internet.reactor", "tensorshare", "tensorshare.client",
        "tensorshare.rl", "tensorshare.torchrl", "tensorshare_server.cli", "tensordict", "torchrl", "ray",
        "pytest", "xdist", "benchmarks.runner")


def warm_bytecode(cache: Path) -> None:
    """Compile what the job's processes import into a new ``cache``, in one process.
    Otherwise the first processes of a fresh clone's suite compiled the same modules
    side by side (torch: 9.8 s of an import cold, 3.6 s warm), on the suite's clock."""
    if cache.exists():
        return
    load = "import importlib, sys\nfor name in sys.argv[1:]:\n    try:\n        importlib.import_module(name)\n" \
           "    except Exception:\n        pass"
    subprocess.run([str(PY), "-c", load, *WARM], cwd=ROOT, check=False, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test(pytest_args: list[str]) -> None:
    ensure_env("test,docs")  # the suite builds the documentation site too
    ensure_torchrl()
    keep_bytecode()
    os.execv(str(PY), [str(PY), "-m", "pytest", *parallel(pytest_args), *pytest_args])


def parallel(pytest_args: list[str]) -> list[str]:
    """pytest-xdist's options for the suite: a test module per process, one process
    more than the CPUs, at most four (a test spends much of its time waiting for the
    server and client processes it starts: alone, the suite kept 2 cores 43% busy; in
    two processes 69%, in three 74%, 649 -> 571 s).  None where the arguments choose
    for themselves (``-n``, ``-p no:xdist``) or one CPU is all."""
    chosen = any(a.startswith(("-n", "--numprocesses", "--dist", "-pno:xdist")) or a == "no:xdist"
                 for a in pytest_args)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if chosen or cpus < 2:
        return []
    # (modules in the order tests/conftest.py sorts them, the longest first: xdist's default
    # order, by count of tests, left the benchmark's smoke run to the end)
    return ["-n", str(min(cpus + 1, 4)), "--dist", "loadfile", "--no-loadscope-reorder"]


def docs() -> None:
    """Build the documentation site into site/, warnings as errors (as the tests do)."""
    ensure_env("docs")
    os.execv(str(PY), [str(PY), "-m", "mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site")])


# TorchRL's prioritized sampler needs its C++ segment trees, whose wheels are built for
# one torch release each (0.14.1: torch 2.14); where the project's torch is another,
# the benchmark's side by side runs TorchRL in an environment of its own.
TORCHRL_VENV = ROOT / ".venv-torchrl"
TORCHRL_ENV = ("torch==2.14.1", TORCHRL[0], "tensordict==0.14.3", "numpy")  # (the same TorchRL)
_SAMPLER_LOADS = "from torchrl.data import PrioritizedSampler; PrioritizedSampler(2, 0.6, 0.4)"


def torchrl_python() -> Path | None:
    """An interpreter whose TorchRL loads its prioritized sampler: the project's, or
    ``.venv-torchrl``'s (made here when the project's cannot); None if neither."""
    for python in (PY, TORCHRL_VENV / "bin" / "python"):
        if python.exists() and subprocess.run([str(python), "-c", _SAMPLER_LOADS],
                                              capture_output=True).returncode == 0:
            return python
    print(f"+ {TORCHRL_VENV.name}: {' '.join(TORCHRL_ENV)} (TorchRL's sampler beside the project's torch)",
          flush=True)
    if not TORCHRL_VENV.exists():
        venv.EnvBuilder(with_pip=True).create(TORCHRL_VENV)
    python = TORCHRL_VENV / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *TORCHRL_ENV],
                   cwd=ROOT, check=False)
    if subprocess.run([str(python), "-c", _SAMPLER_LOADS], capture_output=True).returncode == 0:
        return python
    print("TorchRL's prioritized sampler does not load: the side by side measures the table's engine instead",
          flush=True)
    return None


def bench(profile: str) -> None:
    ensure_env("bench")
    ensure_torchrl()  # the tables section's in-process baseline
    python = torchrl_python()
    if python is not None:
        os.environ["TENSORSHARE_TORCHRL_PYTHON"] = str(python)
    if shutil.which("redis-server") is None:
        install_redis()
    keep_bytecode()
    os.execv(str(PY), [str(PY), "-m", "benchmarks", "--profile", profile])


def install_redis() -> None:
    """Install redis-server with the system package manager when we may; else say so."""
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], env=env, check=False)
    if shutil.which("redis-server") is None:
        print("redis-server is not installed: the Redis baselines will be skipped", flush=True)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test", "docs", "bench", "bench-full"):
        raise SystemExit(__doc__)
    job, rest = sys.argv[1], sys.argv[2:]
    if job == "demo":
        demo()
    elif job == "test":
        test(rest or ["-q"])
    elif job == "docs":
        docs()
    else:
        bench("full" if job == "bench-full" else "quick")


if __name__ == "__main__":
    main()
