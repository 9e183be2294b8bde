"""Writes a run's results: ``latest.json``, ``latest.md`` and ``latest-*.png`` plots.

Files are written atomically (``*.tmp`` then rename) and kept small (PNG at 80 dpi),
so ``benchmarks/results/`` can be committed.  Plots need matplotlib (Agg backend);
without it they are skipped with a line saying so.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .machine import one_line
from .record import fmt

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# chart name -> (file suffix, title, y label, log scale)
CHARTS = {
    "wire": ("wire", "Wire codec (time, lower is better)", "ms", True),
    "large": ("large", "Large values through Client (higher is better)", "GB/s", True),
    "small": ("small", "Small-op round trip (lower is better)", "us", True),
    "pipelined": ("small", "Pipelined small appends (higher is better)", "ops/s", False),
    "scaling-ops": ("scaling", "Concurrent clients: total ops/s", "ops/s", False),
    "scaling-p99": ("scaling", "Concurrent clients: p99 latency", "ms", False),
    "fanout": ("scaling", "Fan-out: put until all listeners hold it", "ms", False),
    "rss": ("scaling", "Server RSS per stored GiB (lower is better)", "GiB", False),
    "rl-fanout": ("rl", "RL fan-out: publish until all workers hold it (lower is better)", "ms", False),
    "rl-ingest": ("rl", "RL rollout ingestion at the trainer (higher is better)", "MB/s", True),
}


def _write(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


def write_all(results: dict, out_dir: Path = RESULTS_DIR, say=print) -> list[Path]:
    """Write JSON, Markdown and plots of ``results`` under ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        plots = write_plots(results, out_dir, say)
    except Exception as exc:  # a plotting problem must not lose the results
        say(f"plots failed: {type(exc).__name__}: {exc}")
        plots = []
    results = dict(results, plots=[p.name for p in plots])
    path = out_dir / "latest.json"
    _write(path, json.dumps(results, indent=1, default=str) + "\n")
    written.append(path)
    path = out_dir / "latest.md"
    _write(path, markdown(results))
    written.append(path)
    path = out_dir / "latest-goals.md"  # README's table of goals
    _write(path, readme_goals(results))
    written.append(path)
    return written + plots


def readme_goals(results: dict) -> str:
    """The goals of a run as README's table: goal, status, and the ratio (or the
    figure) that decided it."""
    m = results.get("machine", {})
    lines = [f"Quick run of {results.get('started', '?')}, {one_line(m) if m else '?'}, commit "
             f"{m.get('git_commit', '?')}.", "", "| Goal | Result | Ratio or figure |", "|---|---|---|"]
    for g in results.get("goals", []):
        mark = {"PASS": "**PASS**", "MISS": "**MISS**"}.get(g["status"], g["status"])
        detail = g["detail"]
        ratio = re.search(r"= ([0-9.,]+x(?: the \w+| faster)?)", detail)
        figure = re.search(r" ([0-9.,]+ [^ (]+) \(need", detail)
        short = ratio.group(1) if ratio else figure.group(1) if figure else detail[:60]
        lines.append(f"| {_cell(g['goal'])} | {mark} | {_cell(short)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ Markdown


def _spread(f: dict) -> str:
    return f"{fmt(f['min'])}–{fmt(f['max'])}"


def _gbps(f: dict) -> str:
    if f.get("nbytes") and f["unit"] == "ms" and f["median"]:
        return fmt(f["nbytes"] / (f["median"] / 1e3) / 1e9)
    return ""


def _vs(f: dict) -> str:
    return "; ".join(f"{fmt(v['ratio'])}x {v['label']}" for v in f["vs"]) or "—"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(results: dict) -> str:
    m = results.get("machine", {})
    lines = [f"# tensorshare benchmarks — {results['profile']} profile", ""]
    lines.append(f"- Date: {results['started']} (run took {results['duration_s']} s)")
    lines.append(f"- Machine: {one_line(m)}" if m else "- Machine: ?")
    peers = []
    if m.get("redis_server"):
        peers.append(f"redis-server {m['redis_server']} via redis-py {m.get('redis_py')}")
    peers.append(f"torch.distributed.TCPStore (torch {m.get('torch')})")
    lines.append(f"- Peers: {', '.join(peers)}; tensorshare {m.get('tensorshare')}, commit {m.get('git_commit')}")
    env = m.get("memory_environment") or {}
    if env:
        lines.append(f"- Memory: transparent huge pages `{env.get('transparent_hugepage')}`, free page reporting "
                     f"{'on' if env.get('free_page_reporting') else 'off'}, DAMON {env.get('damon') or 'absent'}"
                     + (" (freed memory goes back to the host: first touch of new buffers is slow, so figures "
                        "with fresh buffers are shown beside warm ones)" if env.get("free_page_reporting") else ""))
    if m.get("load_avg_1m_at_start") is not None:
        end = m.get("load_avg_1m_at_end")
        lines.append(f"- Load average (1 min): {m['load_avg_1m_at_start']:.2f} at start"
                     + (f", {end:.2f} at end" if end is not None else ""))
    lines += ["", "Every figure is the median of several runs after a warm-up; min–max is the spread over "
              "those runs. *vs* is figure ÷ baseline in the same unit, both measured in this run "
              "(GB/s, MB/s, ops/s: higher is better; ms, us, GiB: lower is better). "
              "Rows marked *(baseline)* are the physical and peer references.", ""]

    goals = results.get("goals", [])
    if goals:
        lines += ["## Goals", "", "| Goal | Result | Detail |", "|---|---|---|"]
        for g in goals:
            mark = {"PASS": "**PASS**", "MISS": "**MISS**"}.get(g["status"], g["status"])
            lines.append(f"| {_cell(g['goal'])} | {mark} | {_cell(g['detail'])} |")
        lines.append("")

    sections: dict[str, list[dict]] = {}
    for f in results.get("figures", []):
        sections.setdefault(f["section"], []).append(f)
    for section, figs in sections.items():
        lines += [f"## {section}", "", "| Measurement | Median | Min–max | Unit | GB/s | Runs | vs |",
                  "|---|---:|---:|---|---:|---:|---|"]
        for f in figs:
            label = f["label"] + (" *(baseline)*" if f.get("baseline") else "")
            if f.get("note"):
                label += f" — {f['note']}"
            lines.append(f"| {_cell(label)} | {fmt(f['median'])} | {_spread(f)} | {f['unit']} | {_gbps(f)} | "
                         f"{f['runs']} | {_cell(_vs(f))} |")
        lines.append("")

    for title, key, render in (
        ("Skipped", "skipped", lambda s: f"- {s['what']}: {s['why']}"),
        ("Notes", "notes", lambda n: f"- {n}"),
        ("Errors", "errors", lambda e: f"- {e['where']}: `{e['error']}`"),
    ):
        items = results.get(key, [])
        if items:
            lines += [f"## {title}", ""] + [render(i) for i in items] + [""]
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------ plots


def write_plots(results: dict, out_dir: Path, say=print) -> list[Path]:
    """One PNG per chart file (``latest-wire.png``...); [] without matplotlib."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("latest-*.png"):
        old.unlink()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: plots skipped (pip install matplotlib)")
        return []
    by_chart: dict[str, list[dict]] = {}
    for f in results.get("figures", []):
        if f.get("chart"):
            by_chart.setdefault(f["chart"]["name"], []).append(f)
    files: dict[str, list[str]] = {}
    for name, (suffix, *_rest) in CHARTS.items():
        if name in by_chart:
            files.setdefault(suffix, []).append(name)
    written = []
    for suffix, names in files.items():
        cols = 1 if len(names) == 1 else 2
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(9 * cols, 4.2 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            _plot(ax, name, by_chart[name])
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        fig.suptitle(f"tensorshare — {results['profile']} profile, {results['started'][:10]}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"latest-{suffix}.png"
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, dpi=80, format="png")
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


def _plot(ax, name: str, figs: list[dict]) -> None:
    from matplotlib.ticker import FormatStrFormatter

    _suffix, title, unit, log = CHARTS[name]
    series: dict[str, list[dict]] = {}
    for f in figs:
        series.setdefault(f["chart"]["series"], []).append(f)
    numeric = all(isinstance(f["chart"]["x"], (int, float)) for f in figs)
    if numeric:
        for label, fs in series.items():
            fs = sorted(fs, key=lambda f: f["chart"]["x"])
            xs = [f["chart"]["x"] for f in fs]
            ys = [f["median"] for f in fs]
            err = [[f["median"] - f["min"] for f in fs], [f["max"] - f["median"] for f in fs]]
            style = "--" if all(f.get("baseline") for f in fs) else "-"
            ax.errorbar(xs, ys, yerr=err, marker="o", linestyle=style, capsize=3, label=label)
        if name == "large":
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({f["chart"]["x"] for f in figs}))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.set_xlabel("value size (MiB)")
        else:
            ax.set_xlabel("processes")
            ax.set_xticks(sorted({f["chart"]["x"] for f in figs}))
    else:
        cats: list = []
        for f in figs:
            if f["chart"]["x"] not in cats:
                cats.append(f["chart"]["x"])
        width = 0.8 / max(len(series), 1)
        for i, (label, fs) in enumerate(series.items()):
            pos = {f["chart"]["x"]: f for f in fs}
            xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(cats)) if cats[c] in pos]
            sel = [pos[c] for c in cats if c in pos]
            err = [[f["median"] - f["min"] for f in sel], [f["max"] - f["median"] for f in sel]]
            ax.bar(xs, [f["median"] for f in sel], width, yerr=err, capsize=2, label=label)
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([str(c) for c in cats], rotation=20, ha="right", fontsize=7)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.3)
