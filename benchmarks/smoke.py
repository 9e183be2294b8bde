"""``run_smoke()``: every section of the suite at tiny sizes, one run each, for the test suite.

It exercises the same code paths as ``--profile quick`` (server and worker
processes, peers when installed, goals, the Markdown report) in under a minute
on 2 cores, and returns the results dict; figures from it mean nothing.  It writes
files only when given ``out_dir``.

The sections run in two halves at once: :data:`APART` in a child process
(``python -m benchmarks --profile smoke --sections ... --json FILE``), the others
here.  A smoke section is mostly process starts and waits, so the two halves
share 2 cores well: the test suite waits about half as long.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import report, runner
from .profiles import SMOKE
from .record import Recorder

# The child's half: about as long as the rest (2 cores, seconds of the smoke profile:
# scale 17, multihost 13, zerocopy 5, versions 5, small 4, busy 2; here scaling 14,
# disk 11, rl 6, tables 5, floor 3, large 3, ops 2, wire 1).
APART = ("scale", "multihost", "zerocopy", "versions", "small", "busy")

_ROOT = Path(__file__).resolve().parent.parent


def run_smoke(out_dir: str | Path | None = None, sections: tuple[str, ...] | None = None,
              apart: tuple[str, ...] = APART) -> dict:
    """Run the smoke profile; returns the results dict (with ``markdown``, the report text).

    The dict has ``figures``, ``goals``, ``skipped``, ``notes``, ``errors`` (a
    healthy run has none), ``section_s`` and ``machine``.  With ``out_dir`` the
    JSON, Markdown and plots are written there too.  ``apart``: the sections run
    in a child process meanwhile (``()``: all of them here, one after another).
    """
    chosen = tuple(sections or SMOKE.sections)
    away = tuple(s for s in chosen if s in apart)
    here = tuple(s for s in chosen if s not in apart)
    with tempfile.TemporaryDirectory(prefix="tensorshare-smoke-") as scratch:
        child = _start(away, Path(scratch)) if away else None
        try:
            results = runner.run(SMOKE, here) if here else None
        finally:
            other = _finish(child, away, Path(scratch)) if child else None
    results = _merged(results, other)
    if out_dir is not None:
        report.write_all(results, Path(out_dir))
    results["markdown"] = report.markdown(results)
    return results


def _start(sections: tuple[str, ...], scratch: Path) -> subprocess.Popen:
    log = open(scratch / "child.log", "wb")
    with log:
        return subprocess.Popen([sys.executable, "-m", "benchmarks", "--profile", "smoke",
                                 "--sections", ",".join(sections), "--json", str(scratch / "child.json")],
                                cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)})


def _finish(child: subprocess.Popen, sections: tuple[str, ...], scratch: Path) -> dict:
    """The child's results once it ends (bounded by the profile's time limit); an
    error naming its sections and the end of its output if it left none."""
    try:
        child.wait(SMOKE.time_limit_s + 60)
    except subprocess.TimeoutExpired:
        child.terminate()  # (a stop: it stops the processes it started, then exits)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    try:
        return json.loads((scratch / "child.json").read_text())
    except (OSError, ValueError):
        tail = (scratch / "child.log").read_bytes()[-2000:].decode(errors="replace")
        results = Recorder(SMOKE.name, stream=io.StringIO()).as_dict()  # (a run with nothing in it)
        results.update(section_s={}, machine={}, errors=[{
            "where": f"sections {', '.join(sections)} (child process)",
            "error": f"exit status {child.returncode}, no results", "traceback": tail}])
        return results


def _merged(mine: dict | None, other: dict | None) -> dict:
    """One results dict of the two halves (the child's lists after this process's)."""
    if mine is None:
        return other
    if other is not None:
        for key in ("figures", "goals", "skipped", "notes", "errors"):
            mine[key] = mine[key] + other[key]
        mine["section_s"] = {**mine["section_s"], **other["section_s"]}
        mine["duration_s"] = max(mine["duration_s"], other["duration_s"])
    return mine
