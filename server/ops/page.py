"""The status page: one self-refreshing HTML document rendered from a :func:`~.status.snapshot`.

No script, no external asset: tables and an inline SVG chart of throughput over
the last minutes; the browser reloads it every few seconds (``<meta refresh>``).
Every value that came from a client (bin names, peers) is HTML-escaped.
"""

from __future__ import annotations

import time
from html import escape

from tensorshare.humanize import human_bytes, rl_roles

REFRESH_SECONDS = 5
MAX_ROWS = 200  # bins and clients shown on the page (status.json has more)


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s < 172800 else f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _limit(name: str, value) -> str:
    if name in ("max_frame", "max_outbound"):
        return human_bytes(value)
    if name.endswith("timeout"):
        return f"{value:g}s" if value else "none"
    return str(value)


def _rate(per_second: float | None) -> str:
    return "-" if per_second is None else f"{per_second:,.0f}"


def _table(table_id: str, headers: list[str], rows: list[list], empty: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers) if any(headers) else ""
    head_row = f"<tr>{head}</tr>" if head else ""
    if not rows:
        return f'<table id="{table_id}">{head_row}<tr><td colspan="{len(headers)}">{escape(empty)}</td></tr></table>'
    body = "".join("<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}">{head_row}{body}</table>'


def chart(points: list[dict], width: int = 640, height: int = 160) -> str:
    """An SVG line chart of bytes in/out per second (left scale) over time."""
    if len(points) < 2:
        return (f'<svg id="throughput" width="{width}" height="{height}" role="img"><text x="10" y="20">'
                'collecting samples...</text></svg>')
    t0, t1 = points[0]["t"], points[-1]["t"]
    top = max(max(p["bytes_in"], p["bytes_out"]) for p in points) or 1.0
    pad = 40

    def line(key: str, colour: str) -> str:
        xy = " ".join(f"{pad + (p['t'] - t0) / max(t1 - t0, 1e-6) * (width - pad - 5):.1f},"
                      f"{height - 20 - p[key] / top * (height - 30):.1f}" for p in points)
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{xy}"/>'

    span = human_seconds(t1 - t0)
    return (f'<svg id="throughput" width="{width}" height="{height}" role="img" '
            f'aria-label="throughput over the last {span}">'
            f'<rect x="{pad}" y="10" width="{width - pad - 5}" height="{height - 30}" fill="#fafafa" stroke="#ccc"/>'
            f'{line("bytes_in", "#1f77b4")}{line("bytes_out", "#d62728")}'
            f'<text x="2" y="18" font-size="10">{escape(human_bytes(top))}/s</text>'
            f'<text x="2" y="{height - 20}" font-size="10">0</text>'
            f'<text x="{pad}" y="{height - 5}" font-size="10">-{escape(span)}</text>'
            f'<text x="{width - 40}" y="{height - 5}" font-size="10">now</text>'
            f'<text x="{pad + 60}" y="{height - 5}" font-size="10" fill="#1f77b4">in</text>'
            f'<text x="{pad + 80}" y="{height - 5}" font-size="10" fill="#d62728">out</text></svg>')


def render(data: dict, query: str = "") -> str:
    """The page for ``data``; ``query`` (``?token=...`` or empty) is kept on its links."""
    server, memory, limits = data["server"], data["memory"], data["limits"]
    bins = [[b["name"], b["items"], human_bytes(b["bytes"]),
             ", ".join(f"{t} {human_bytes(n)}" for t, n in b["tiers"].items()) or "-",
             "-" if b["tag"] is None else b["tag"], b["seq"]] for b in data["bins"][:MAX_ROWS]]
    clients = []
    for c in data["clients"][:MAX_ROWS]:
        clients.append([c["id"], c["peer"], "yes" if c["authenticated"] else "-", rl_roles(c),
                        human_bytes(c["bytes_in"]), human_bytes(c["bytes_out"]), c["requests"],
                        c["listening"], human_seconds(c["age"])])
    experiments = [[e or "(default)", "-" if r["latest"] is None else r["latest"], r["rollouts"], r["stale"],
                    len(r["workers"])] for e, r in data["experiments"].items()]
    tables = [[t["name"], f"{t['size']} / {t['capacity']}", human_bytes(t["bytes"]), t["where"], t["sampler"],
               t["remover"] or "-", t["inserts"], t["samples"], _rate(t["inserts_per_s"]), _rate(t["samples_per_s"]),
               "-" if t["samples_per_insert"] is None else f"{t['samples_per_insert']:g}",
               f"{t['blocked_seconds']['insert']:.1f}s / {t['blocked_seconds']['sample']:.1f}s",
               f"{t['waiting']['insert']} / {t['waiting']['sample']}"] for t in data.get("tables", [])[:MAX_ROWS]]
    events = data.get("events", {})
    traffic = data.get("traffic", {})
    summary = [
        ["bins", data["totals"]["bins"]], ["items", data["totals"]["items"]],
        ["payload", human_bytes(data["totals"]["bytes"])],
        *[[f"in {tier}", f"{row['items']} items, {human_bytes(row['bytes'])}"] for tier, row in data["tiers"].items()],
        ["connections open", data["connections"]["open"]],
        ["requests", traffic.get("requests", "-")],
        ["received / sent", f"{human_bytes(traffic.get('bytes_in'))} / {human_bytes(traffic.get('bytes_out'))}"],
        ["auth failures", events.get("auth_failures", "-")], ["storage full (452)", events.get("storage_full", "-")],
        ["notifications coalesced", events.get("notifications_coalesced", "-")],
        ["slow readers dropped", events.get("slow_readers_dropped", "-")],
    ]
    limit_rows = [
        ["process RSS", human_bytes(memory["rss"])], ["payload in RAM", human_bytes(memory["payload_in_memory"])],
        # (in bytes too: --memory-limit 64MB is 64,000,000 bytes, which shows as 61.0 MiB)
        ["memory limit", f"{human_bytes(memory['memory_limit'])} = {memory['memory_limit']:,} bytes"
         if memory["memory_limit"] else "none"],
        ["receive pool", human_bytes(memory["receive_pool"])],
        *[[k.replace("_", " "), _limit(k, v)] for k, v in limits.items() if k != "memory_limit"],
    ]
    workers = [[w["worker"], "up" if w["up"] else "not answering", w.get("pid", "-"), w.get("bins", "-"),
                w.get("items", "-"), human_bytes(w.get("bytes")), w.get("connections", "-"),
                w.get("requests", "-") if w.get("requests") is not None else "-", human_bytes(w.get("rss")),
                human_seconds(w.get("uptime"))] for w in data.get("workers", [])]
    workers_html = "" if not workers else (
        "<h2>Workers</h2>" + _table("workers", ["worker", "state", "pid", "bins", "items", "bytes", "connections",
                                                "requests", "RSS", "up"], workers, ""))
    title = f"tensorshare {server['host']}:{server['port']}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(server["time"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>{escape(title)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:1.2em;color:#222}} h1{{font-size:1.3em}} h2{{font-size:1.05em;margin-top:1.2em}}
table{{border-collapse:collapse;font-size:.85em}} td,th{{border:1px solid #ddd;padding:2px 8px;text-align:left}}
th{{background:#f0f0f0}} .cols{{display:flex;gap:2em;flex-wrap:wrap}} small{{color:#777}}
</style></head><body>
<h1>{escape(title)}</h1>
<small>tensorshare {escape(server['version'])}, pid {server['pid']}, up {human_seconds(server['uptime'])},
{stamp}; refreshes every {REFRESH_SECONDS}s &middot; <a href="status.json{escape(query)}">status.json</a>
&middot; <a href="metrics{escape(query)}">metrics</a></small>
<h2>Throughput</h2>
{chart(data.get("throughput", []))}
<div class="cols"><div><h2>Summary</h2>{_table("summary", ["", ""], summary, "")}</div>
<div><h2>Limits and memory</h2>{_table("limits", ["", ""], limit_rows, "")}</div></div>
{workers_html}
<h2>Bins</h2>
{_table("bins", ["bin", "items", "bytes", "where", "tag", "seq"], bins, "no bins")}
<h2>Tables</h2>
{_table("tables", ["table", "rows", "bytes", "where", "sampler", "remover", "inserted", "sampled", "inserts/s",
                   "samples/s", "samples per insert", "rate limiter waited (inserts / samples)",
                   "waiting (inserts / samples)"], tables, "no tables")}
<h2>Clients</h2>
{_table("clients", ["conn", "address", "authenticated", "RL experiment: role, version", "in", "out", "requests", "listens", "connected"], clients, "no clients")}
<h2>RL experiments</h2>
{_table("experiments", ["experiment", "latest version", "rollouts", "older than latest", "connections"], experiments, "none")}
</body></html>
"""
