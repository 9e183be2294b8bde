"""Collects what a run measured: figures, their ratios to baselines, goals, skips, errors.

Every figure is the median of several runs with its min/max; a figure names the
baselines it is compared with (figures recorded earlier in the same run) and gets a
ratio ``figure / baseline`` in the same unit.  Goals are checked against those
figures and print PASS or MISS (SKIP when a baseline could not be measured).
Everything is printed as it is recorded, so a long run shows progress.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from .stats import Sample

PASS, MISS, SKIP = "PASS", "MISS", "SKIP"
_OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__}


def reads_as(unit: str, op: str) -> str:
    """How a ratio of two figures in ``unit`` reads in a goal: ``the rate`` (per
    second), ``the time``, or ``faster`` (times compared with ``>=``: a baseline's
    time over ours), ``the bytes`` (sizes)."""
    if unit.endswith("/s"):
        return "the rate"
    if unit in ("s", "ms", "us", "ns"):
        return "faster" if op in (">", ">=") else "the time"
    if unit in ("B", "KB", "MB", "GB", "KiB", "MiB", "GiB"):
        return "the bytes"
    return ""


def fmt(value: float) -> str:
    """A number with about three significant digits."""
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    if a >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


class Recorder:
    """The results of one run, as they come; ``as_dict()`` is what the report writes."""

    def __init__(self, profile: str, stream=None):
        self.profile = profile
        self.stream = stream or sys.stdout
        self.started = time.time()
        self.figures: list[dict] = []
        self._by_key: dict[str, dict] = {}
        self.goals: list[dict] = []
        self.skipped: list[dict] = []
        self.notes: list[str] = []
        self.errors: list[dict] = []
        self.section = ""

    # -- output

    def release(self, *things) -> None:
        """Close (or stop) each of ``things`` that is not None, in order; a failure is
        said and the others are still released (a section's cleanup must go on)."""
        for thing in things:
            if thing is not None:
                try:
                    (thing.close if hasattr(thing, "close") else thing.stop)()
                except Exception as exc:
                    self.say(f"  cleanup of {type(thing).__name__} failed: {exc}")

    def say(self, text: str) -> None:
        elapsed = time.time() - self.started
        print(f"[{elapsed:6.1f}s] {text}", file=self.stream, flush=True)

    def begin(self, section: str) -> None:
        self.section = section
        self.say(f"== {section}")

    # -- figures

    def figure(self, key: str, label: str, sample: Sample, unit: str, *, better: str = "higher",
               vs: list[str] = (), nbytes: int | None = None, chart: dict | None = None,
               note: str | None = None, baseline: bool = False) -> dict:
        """Record a figure; ``vs`` names baseline figures (keys) recorded earlier in this run."""
        fig: dict[str, Any] = {
            "key": key, "section": self.section, "label": label, "unit": unit, "better": better,
            "median": sample.median, "min": sample.min, "max": sample.max, "runs": sample.runs,
            "values": list(sample.values), "baseline": baseline, "vs": [],
        }
        if nbytes is not None:
            fig["nbytes"] = nbytes
        if chart is not None:
            fig["chart"] = chart
        if note:
            fig["note"] = note
        for base_key in vs:
            base = self._by_key.get(base_key)
            if base is None or base["unit"] != unit or not base["median"]:
                continue
            fig["vs"].append({"key": base_key, "label": base["label"], "median": base["median"],
                              "ratio": sample.median / base["median"]})
        self.figures.append(fig)
        self._by_key[key] = fig
        line = (f"{label}: {fmt(sample.median)} {unit} "
                f"(median of {sample.runs}; min {fmt(sample.min)}, max {fmt(sample.max)})")
        for v in fig["vs"]:
            line += f" | {fmt(v['ratio'])}x {v['label']} ({fmt(v['median'])} {unit})"
        if note:
            line += f"  [{note}]"
        self.say(("  baseline " if baseline else "  ") + line)
        return fig

    def get(self, key: str) -> dict | None:
        return self._by_key.get(key)

    # -- goals

    def goal(self, name: str, status: str, detail: str) -> None:
        self.goals.append({"goal": name, "status": status, "detail": detail, "section": self.section})
        self.say(f"  GOAL {status}: {name} -- {detail}")

    def goal_ratio(self, name: str, key: str, base_key: str, op: str, threshold: float, *,
                   time_of_rates: bool = False) -> None:
        """Goal on ``figure(key) / figure(base_key)``; ``op`` is one of < <= > >=.

        The ratio is said as what it measures (:func:`reads_as`): "1.84x the rate",
        "0.81x the time", "4.5x faster" (a baseline's time over ours).  A goal on
        time whose figures are rates gives ``time_of_rates``: the ratio is then
        ``base / figure``, the time ours takes over the baseline's."""
        fig, base = self._by_key.get(key), self._by_key.get(base_key)
        if fig is None or base is None:
            missing = key if fig is None else base_key
            self.goal(name, SKIP, f"{missing} was not measured")
            return
        if time_of_rates:
            ratio, what = base["median"] / fig["median"], "the time"
        else:
            ratio, what = fig["median"] / base["median"], reads_as(fig["unit"], op)
        ok = _OPS[op](float(ratio), float(threshold))
        ours, theirs = f"{fig['label']} {fmt(fig['median'])} {fig['unit']}", \
            f"{base['label']} {fmt(base['median'])} {base['unit']}"
        said = (f"{theirs} = {fmt(ratio)}x faster than {ours}" if what == "faster"
                else f"{ours} against {theirs} = {fmt(ratio)}x {what}".rstrip())
        self.goal(name, PASS if ok else MISS, f"{said} (need {op} {fmt(threshold)}x)")

    def goal_value(self, name: str, key: str, op: str, threshold: float) -> None:
        """Goal on a figure's median itself."""
        fig = self._by_key.get(key)
        if fig is None:
            self.goal(name, SKIP, f"{key} was not measured")
            return
        ok = _OPS[op](float(fig["median"]), float(threshold))
        self.goal(name, PASS if ok else MISS,
                  f"{fig['label']} {fmt(fig['median'])} {fig['unit']} (need {op} {fmt(threshold)} {fig['unit']})")

    # -- everything else

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"what": what, "why": why, "section": self.section})
        self.say(f"  skipped: {what} ({why})")

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(f"  note: {text}")

    def error(self, where: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append({"where": where, "error": f"{type(exc).__name__}: {exc}", "traceback": text[-4000:]})
        self.say(f"  ERROR in {where}: {type(exc).__name__}: {exc}")

    def as_dict(self) -> dict:
        return {
            "profile": self.profile,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "duration_s": round(time.time() - self.started, 1),
            "figures": self.figures, "goals": self.goals, "skipped": self.skipped,
            "notes": self.notes, "errors": self.errors,
        }
