"""The status of a multi-worker server: its workers' snapshots merged into one, and each worker's own.

Each worker of ``tensorshare-server --workers N`` takes its own
:func:`~.status.snapshot`; :func:`merge` makes the whole server's from them in the
same shape, so the status page, ``/status.json`` and ``/metrics`` render it as
they render one process's.  Sizes, counts, traffic, per-verb counters and
histograms add up (each bin and each connection is one worker's); the memory
limit is the whole budget (each worker has its share); bins, tables and clients
are listed together, each table and client with its ``worker``; an RL experiment's latest
version is the highest any worker has seen.  ``workers`` lists each worker's
summary: whether it answered, its process, bins, items, bytes, connections,
requests and memory.
"""

from __future__ import annotations

from .status import MAX_BINS_SHOWN

_SUMMED_MEMORY = ("rss", "payload_in_memory", "payload", "descriptions", "replies_in_flight", "receive_pool")


def _add(total: dict, part: dict) -> None:
    """Add the numbers of ``part`` into ``total`` (nested dicts too)."""
    for key, value in part.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
        else:
            total.setdefault(key, value)


def _summary(index: int, snapshot: dict | None) -> dict:
    if snapshot is None:
        return {"worker": index, "up": False}
    return {"worker": index, "up": True, "pid": snapshot["server"]["pid"],
            "uptime": snapshot["server"].get("uptime"), "bins": snapshot["totals"]["bins"],
            "items": snapshot["totals"]["items"], "bytes": snapshot["totals"]["bytes"],
            "connections": snapshot["connections"]["open"], "rss": snapshot["memory"]["rss"],
            "payload_in_memory": snapshot["memory"]["payload_in_memory"],
            "requests": snapshot.get("traffic", {}).get("requests"),
            "bytes_in": snapshot.get("traffic", {}).get("bytes_in"),
            "bytes_out": snapshot.get("traffic", {}).get("bytes_out")}


def merge(snapshots: list[dict | None], server: dict, limits: dict) -> dict:
    """The whole server's snapshot from its workers' (None: a worker that did not
    answer); ``server`` replaces the ``server`` section (the parent's process, the
    public port), ``limits`` the workers' shares of the limits (the whole server's:
    :func:`~.status.limits_of` its configuration)."""
    memory_limit = limits["memory_limit"]
    answered = [s for s in snapshots if s is not None]
    if not answered:
        return {"server": server, "workers": [_summary(k, None) for k in range(len(snapshots))]}
    first = answered[0]
    data: dict = {"server": {**first["server"], **server}, "limits": dict(limits)}
    data["memory"] = {key: sum(s["memory"][key] or 0 for s in answered) for key in _SUMMED_MEMORY}
    data["memory"]["memory_limit"] = memory_limit
    for key in ("totals", "tiers", "connections", "traffic", "refused", "events"):
        total: dict = {}
        for snap in answered:
            _add(total, snap.get(key, {}))
        if total or key in first:
            data[key] = total
    bins = [row for snap in answered for row in snap["bins"]]
    bins.sort(key=lambda row: (-row["bytes"], row["name"]))
    data["bins"] = bins[:MAX_BINS_SHOWN]
    tables = [{**row, "worker": k} for k, snap in enumerate(snapshots) if snap is not None
              for row in snap.get("tables", [])]  # (each table is one worker's)
    tables.sort(key=lambda row: (-row["bytes"], row["name"]))
    data["tables"] = tables
    data["clients"] = [{**client, "id": f"{k}.{client['id']}", "worker": k}  # (connection ids are per worker)
                       for k, snap in enumerate(snapshots) if snap is not None for client in snap["clients"]]
    data["experiments"] = _experiments(snapshots)
    if any("verbs" in snap for snap in answered):
        data["verbs"] = _verbs(answered)
    if any("throughput" in snap for snap in answered):
        data["throughput"] = _throughput([snap.get("throughput", []) for snap in answered])
    data["workers"] = [_summary(k, snap) for k, snap in enumerate(snapshots)]
    return data


def _experiments(snapshots: list[dict | None]) -> dict:
    merged: dict = {}
    for k, snap in enumerate(snapshots):
        for name, row in (snap or {}).get("experiments", {}).items():
            into = merged.setdefault(name, {"latest": None, "rollouts": 0, "stale": 0, "workers": {}})
            if row["latest"] is not None and (into["latest"] is None or row["latest"] > into["latest"]):
                into["latest"] = row["latest"]
            into["rollouts"] += row["rollouts"]
            into["stale"] += row["stale"]
            into["workers"].update({f"{k}.{conn}": version for conn, version in row["workers"].items()})
    return merged


def _verbs(snapshots: list[dict]) -> dict:
    verbs: dict = {}
    for snap in snapshots:
        for verb, row in snap.get("verbs", {}).items():
            into = verbs.setdefault(verb, {"requests": 0, "bytes_in": 0, "bytes_out": 0, "seconds": 0.0,
                                           "latency_buckets": {}})
            into["requests"] += row["requests"]
            into["bytes_in"] += row["bytes_in"]
            into["bytes_out"] += row["bytes_out"]
            into["seconds"] += (row["latency_mean"] or 0.0) * row["requests"]
            for bound, n in row["latency_buckets"].items():
                into["latency_buckets"][bound] = into["latency_buckets"].get(bound, 0) + n
    for row in verbs.values():
        seconds = row.pop("seconds")
        row["latency_mean"] = seconds / row["requests"] if row["requests"] else None
    return verbs


def _throughput(series: list[list[dict]]) -> list[dict]:
    """Per-second rates summed over workers; each worker samples on its own clock
    every few seconds, so their latest samples are added up, then the ones before."""
    length = min((len(s) for s in series), default=0)
    out = []
    for i in range(length):
        points = [s[len(s) - length + i] for s in series]
        out.append({"t": max(p["t"] for p in points),
                    **{key: sum(p[key] for p in points) for key in ("bytes_in", "bytes_out", "requests")}})
    return out


__all__ = ["merge"]
