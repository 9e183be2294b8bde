"""``python -m benchmarks --profile smoke|quick|full``: run the suite and write the report.

quick and full write ``benchmarks/results/latest.{json,md}`` and ``latest-*.png``;
smoke writes nothing unless ``--out DIR`` is given.  The exit status is 0 when
every section ran (goals may MISS: a benchmark is not a test), 1 when a section
failed, 2 when the run was stopped (time limit, SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from . import report, runner
from .profiles import PROFILES
from .procs import stop_all


def _raise(exc_type, text):
    def handler(signum, frame):
        raise exc_type(text)
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(runner.SECTIONS)}")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; smoke: none)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no files")
    parser.add_argument("--json", type=Path, help="also write the results dict alone to this file (no report)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    sections = None
    if args.sections:
        sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
        unknown = [s for s in sections if s not in runner.SECTIONS]
        if unknown:
            parser.error(f"unknown section(s) {unknown}; choose from {list(runner.SECTIONS)}")

    signal.signal(signal.SIGTERM, _raise(runner.Interrupted, "SIGTERM"))
    signal.signal(signal.SIGALRM, _raise(runner.RunTimeout, f"time limit of {profile.time_limit_s}s reached"))
    signal.alarm(profile.time_limit_s)
    try:
        results = runner.run(profile, sections)
    finally:
        signal.alarm(0)
        stop_all()

    if args.json:
        args.json.write_text(json.dumps(results, default=str))
    out = args.out or (None if profile.name == "smoke" else report.RESULTS_DIR)
    if args.no_write or out is None:
        print("results not written (smoke profile without --out, or --no-write)", flush=True)
    else:
        for path in report.write_all(results, out):
            print(f"wrote {path}", flush=True)
    if any("stopped early" in n for n in results["notes"]):
        return 2
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
