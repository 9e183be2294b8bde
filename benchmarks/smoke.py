"""``run_smoke()``: every section of the suite at tiny sizes, one run each, for the test suite.

It exercises the same code paths as ``--profile quick`` (server and worker
processes, peers when installed, goals, the Markdown report) in a minute or two
on 2 cores, and returns the results dict; figures from it mean nothing.  It writes
files only when given ``out_dir``.
"""

from __future__ import annotations

from pathlib import Path

from . import report, runner
from .profiles import SMOKE


def run_smoke(out_dir: str | Path | None = None, sections: tuple[str, ...] | None = None) -> dict:
    """Run the smoke profile; returns the results dict (with ``markdown``, the report text).

    The dict has ``figures``, ``goals``, ``skipped``, ``notes``, ``errors`` (a
    healthy run has none) and ``machine``.  With ``out_dir`` the JSON, Markdown and
    plots are written there too.
    """
    results = runner.run(SMOKE, sections)
    if out_dir is not None:
        report.write_all(results, Path(out_dir))
    results["markdown"] = report.markdown(results)
    return results
