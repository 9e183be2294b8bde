"""``python -m benchmarks.torchrl_suite [TORCHRL_CHECKOUT]``: TorchRL's replay-buffer tests over tables.

Runs TorchRL's own ``test/rb`` suite with :mod:`.plugin`, which adds a
``tensorshare.torchrl.TableStorage`` case beside every case the suite
parametrizes with ``LazyTensorStorage``, and compares each with its twin in the
same run.  A case is *applicable* when its ``LazyTensorStorage`` twin passed;
the summary gives how many applicable cases passed, the failures grouped by
their first line, and how long passing cases took beside their twins.

TORCHRL_CHECKOUT is a git checkout of pytorch/rl whose ``test/rb`` matches the
installed torchrl (0.14.1: commit ``ae9719f17``).  Without one, ``--fetch`` clones
it (network needed) into ``--cache``.  The run is bounded: ``--timeout`` seconds a
case, ``--budget`` seconds in all.  ``--smoke`` runs one small file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "ae9719f17"  # pytorch/rl, 2026-08-22: test/rb as torchrl 0.14.1 ships it
REPOSITORY = "https://github.com/pytorch/rl"
SMOKE = ("test_storages.py",)
GOAL = 0.95


def fetch(cache: Path) -> Path:
    """A checkout of pytorch/rl at COMMIT in ``cache`` (cloned the first time)."""
    checkout = cache / f"pytorch-rl-{COMMIT}"
    if not (checkout / "test" / "rb").is_dir():
        checkout.mkdir(parents=True, exist_ok=True)
        for cmd in (["git", "init", "-q"], ["git", "remote", "add", "origin", REPOSITORY],
                    ["git", "fetch", "-q", "--depth", "1", "origin", COMMIT], ["git", "checkout", "-q", "FETCH_HEAD"]):
            subprocess.run(cmd, cwd=checkout, check=True)
    return checkout


def run(checkout: Path, files: list[str], report: Path, timeout: int, budget: int, extra: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    env.pop("TORCHRL_SUITE_PORT", None)
    targets = [str(checkout / "test" / "rb" / f) for f in files] or [str(checkout / "test" / "rb")]
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "benchmarks.torchrl_suite.plugin", "-p", "no:cacheprovider",
           "-q", "--no-header", "-rN", f"--timeout={timeout}", f"--table-report={report}", *extra]
    print("+", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=checkout, env=env, timeout=budget).returncode
    except subprocess.TimeoutExpired:
        print(f"stopped after {budget}s: the report holds what finished", flush=True)
        return 124


def summarize(cases: list[dict]) -> dict:
    """Counts, failures grouped by cause, and passing cases' time beside their twins'."""
    applicable = [c for c in cases if c["twin_outcome"] == "passed"]
    by_outcome = collections.Counter(c["outcome"] for c in applicable)
    causes = collections.Counter(c["message"] or "(no message)" for c in applicable if c["outcome"] == "failed")
    per_test = collections.defaultdict(collections.Counter)
    for c in applicable:
        per_test[c["id"].split("[")[0]][c["outcome"]] += 1
    ratios = sorted(c["seconds"] / c["twin_seconds"] for c in applicable
                    if c["outcome"] == "passed" and c.get("twin_seconds"))
    return {
        "cases": len(cases), "applicable": len(applicable), "passed": by_outcome["passed"],
        "failed": by_outcome["failed"], "skipped": by_outcome["skipped"],
        "pass_rate": by_outcome["passed"] / len(applicable) if applicable else 0.0,
        "twin_not_passed": len(cases) - len(applicable),
        "causes": causes.most_common(), "per_test": {k: dict(v) for k, v in sorted(per_test.items())},
        "time_ratio_median": ratios[len(ratios) // 2] if ratios else None,
        "failures": sorted(c["id"] for c in applicable if c["outcome"] != "passed"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchrl_suite", description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, help="a pytorch/rl checkout (else --fetch)")
    parser.add_argument("--fetch", action="store_true", help=f"clone pytorch/rl at {COMMIT} into --cache")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tensorshare-torchrl")
    parser.add_argument("--files", help="comma-separated test files of test/rb (default: all)")
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE)}")
    parser.add_argument("--timeout", type=int, default=120, help="seconds a case may take")
    parser.add_argument("--budget", type=int, default=3600, help="seconds the whole run may take")
    parser.add_argument("--out", type=Path, help="write the summary here (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.checkout is None:
        if not args.fetch:
            parser.error("give a pytorch/rl checkout, or --fetch")
        args.checkout = fetch(args.cache)
    if not (args.checkout / "test" / "rb").is_dir():
        parser.error(f"{args.checkout} has no test/rb")
    files = list(SMOKE) if args.smoke else [f for f in (args.files or "").split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cases.json"
        start = time.monotonic()
        run(args.checkout, files, report, args.timeout, args.budget, args.pytest_args)
        if not report.exists():
            print("no report: the run did not finish its session", flush=True)
            return 1
        cases = json.loads(report.read_text())["cases"]
    summary = summarize(cases)
    summary["seconds"] = round(time.monotonic() - start, 1)
    print(f"\n{summary['cases']} TableStorage cases; {summary['applicable']} applicable (twin passed): "
          f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped "
          f"= {summary['pass_rate']:.1%} (goal {GOAL:.0%}); {summary['twin_not_passed']} whose twin did not pass")
    if summary["time_ratio_median"]:
        print(f"passing cases took {summary['time_ratio_median']:.2f}x their twins' time (median)")
    for cause, n in summary["causes"][:30]:
        print(f"  {n:4d}  {cause}")
    for test, counts in summary["per_test"].items():
        if counts.get("failed") or counts.get("skipped"):
            print(f"  {test}: {counts}")
    if args.out:
        args.out.write_text(json.dumps({**summary, "commit": COMMIT, "cases_detail": cases}, indent=1))
    return 0 if summary["pass_rate"] >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
