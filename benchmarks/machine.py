"""What a run ran on: cores, memory, CPU, kernel, and the versions of everything measured."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from .procs import ROOT


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "?"))


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def memory_environment() -> dict:
    """What makes fresh memory slow or fast here: THP mode, free page reporting, DAMON."""
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp[thp.index("[") + 1 : thp.index("]")] if thp and "[" in thp else thp
    reporting = _read("/sys/module/page_reporting/parameters/page_reporting_order")
    damon = _read("/sys/kernel/mm/damon/admin/kdamonds/0/state")
    return {"transparent_hugepage": mode,
            "free_page_reporting": reporting is not None,
            "damon": damon}


def describe() -> dict:
    """A dict of the machine and software versions (None where a package is missing)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    redis_server = shutil.which("redis-server")
    redis_server_version = None
    if redis_server:
        text = _run([redis_server, "--version"]) or ""
        redis_server_version = next((w.split("=", 1)[1] for w in text.split() if w.startswith("v=")), text or None)
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cores": os.cpu_count(), "usable_cores": usable,
        "memory_bytes": _meminfo_total(),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"), "numpy": _version("numpy"), "twisted": _version("twisted"),
        "msgpack": ".".join(map(str, __import__("msgpack").version)) if _version("msgpack") is not None else None,
        "tensorshare": _version("tensorshare"),
        "redis_py": _version("redis"), "redis_server": redis_server_version,
        "matplotlib": _version("matplotlib"),
        "git_commit": (commit + ("+dirty" if dirty else "")) if commit else None,
        "load_avg_1m_at_start": load,
        "memory_environment": memory_environment(),
        "executable": sys.executable,
    }


def one_line(m: dict) -> str:
    """``2 cores, 23.4 GiB, AMD EPYC, Linux 6.18, Python 3.11.7, torch 2.13.0+cpu``."""
    mem = f"{m['memory_bytes'] / (1 << 30):.1f} GiB" if m.get("memory_bytes") else "? GiB"
    return (f"{m['cores']} cores ({m['usable_cores']} usable), {mem} memory, {m['cpu']}, Linux {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, Twisted {m['twisted']}")
