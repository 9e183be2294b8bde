"""The server's state as plain data: what ``/status.json``, the status page and ``/metrics`` show.

:func:`snapshot` reads the storage through its read-only view
(:class:`~..bins.view.StorageView`: bins, items and bytes by tier, tables), the
live connections and the counters (:mod:`.counters`) when someone asks, on the
reactor thread.  Walking the bins takes time per item (about a second per million
items), paid by the scrape, never by requests.  :class:`Throughput` keeps the server's
byte and request totals every few seconds for the page's chart.
"""

from __future__ import annotations

import os
import time
from collections import deque

from tensorshare.protocol.messages import TINSERT, TSAMPLE
from tensorshare.version import __version__

from ..bins.store import TIERS
from .counters import LATENCY_BUCKETS, PARAMETERS, Counters, bytes_out, experiment_of

MAX_BINS_SHOWN = 10_000  # bins listed one by one (the largest first); totals count them all


def rss_bytes() -> int | None:
    """This process's resident memory (Linux), or None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None



def limits_of(config) -> dict:
    """The limits a status snapshot shows: a server's (a worker's: its share of them;
    the whole server's page shows the parent's, :func:`~.merge.merge`)."""
    return {"max_connections": config.max_connections, "max_bins": config.max_bins,
            "max_items_per_bin": config.max_items_per_bin, "max_frame": config.max_frame,
            "memory_limit": config.memory_limit, "max_outbound": config.max_outbound,
            "idle_timeout": config.idle_timeout, "outbound_stall_timeout": config.outbound_stall_timeout}


class Throughput:
    """The server's (bytes in, bytes out, requests) totals, sampled every ``interval``
    seconds over the last ``span`` seconds; :meth:`rates` gives per-second rates.
    With ``state``, each table's rows inserted and sampled too (:meth:`table_rates`)."""

    def __init__(self, counters: Counters, interval: float = 2.0, span: float = 600.0, clock=time.time,
                 state=None):
        self.counters = counters
        self.interval = interval
        self.clock = clock
        self.samples: deque[tuple[float, int, int, int]] = deque(maxlen=int(span / interval) + 1)
        self.state = state
        self.table_samples: deque[tuple[float, dict]] = deque(maxlen=2)

    def sample(self) -> None:
        now = self.clock()
        self.samples.append((now, *self.counters.totals()))
        if self.state is not None:
            self.table_samples.append((now, self.state.storage.view.table_counts()))

    def table_rates(self) -> dict[str, tuple[float, float]]:
        """``{table: (rows inserted per second, rows sampled per second)}`` between the
        last two samples (tables made since are left out)."""
        if len(self.table_samples) < 2:
            return {}
        (t0, old), (t1, new) = self.table_samples
        dt = max(t1 - t0, 1e-6)
        # (a table made again under its name since counts from 0: left out, as a new one)
        return {name: ((i1 - old[name][0]) / dt, (s1 - old[name][1]) / dt)
                for name, (i1, s1) in new.items() if name in old and i1 >= old[name][0] and s1 >= old[name][1]}

    def rates(self) -> list[dict]:
        """``[{t, bytes_in, bytes_out, requests}]`` per second between consecutive samples."""
        out, samples = [], list(self.samples)
        for (t0, i0, o0, r0), (t1, i1, o1, r1) in zip(samples, samples[1:]):
            dt = max(t1 - t0, 1e-6)
            out.append({"t": round(t1, 3), "bytes_in": (i1 - i0) / dt, "bytes_out": (o1 - o0) / dt,
                        "requests": (r1 - r0) / dt})
        return out


def snapshot(state, throughput: Throughput | None = None, now: float | None = None,
             data_port: int | None = None) -> dict:
    """Everything the status page shows, as JSON-ready data (see the module docstring)."""
    now = time.time() if now is None else now
    config, view, counters = state.config, state.storage.view, state.counters
    tiers = {tier: {"items": 0, "bytes": 0} for tier in TIERS}
    bins = []
    for found in view.bins():
        bins.append({"name": found.name, "items": found.items, "bytes": found.bytes, "seq": found.seq,
                     "tag": found.tag, "tiers": found.tiers})
        for tier, nbytes in found.tiers.items():
            tiers[tier]["items"] += found.tier_items[tier]
            tiers[tier]["bytes"] += nbytes
    bins.sort(key=lambda row: (-row["bytes"], row["name"]))
    experiments = _experiments(state, counters)
    data = {
        "server": {"version": __version__, "pid": os.getpid(), "host": config.host, "port": config.port if data_port is None else data_port,
                   "started": counters.started if counters else None,
                   "uptime": now - counters.started if counters else None, "time": now,
                   "authentication": state.token is not None, "tls": bool(config.tls_cert),
                   "durable": config.data_dir is not None},
        "limits": limits_of(config),
        "memory": {"rss": rss_bytes(), **view.memory(), "memory_limit": config.memory_limit,
                   "receive_pool": state.recv_pool.held_bytes if state.recv_pool is not None else 0},
        "totals": {"bins": len(bins), "items": sum(t["items"] for t in tiers.values()),
                   "bytes": sum(t["bytes"] for t in tiers.values())},
        "tiers": tiers,
        "bins": bins[:MAX_BINS_SHOWN],
        "connections": {"open": state.connections},
        "clients": [],
        "experiments": experiments,
        "tables": tables(state, throughput),
    }
    if getattr(state, "relay", None) is not None:  # a relay's upstream and copies arriving (PROTOCOL.md §11)
        data["relay"] = state.relay.status()
    if counters is None:
        return data
    bytes_in, bytes_out_, requests = counters.totals()
    data["connections"].update(accepted=counters.accepted, refused=counters.turned_away)
    data["clients"] = [_client(session, experiments, now) for session in counters.live.values()]
    data["traffic"] = {"bytes_in": bytes_in, "bytes_out": bytes_out_, "requests": requests,
                       "sendfile_bytes": counters.sendfile_bytes}
    data["verbs"] = {verb: {"requests": v.requests, "bytes_in": v.bytes_in, "bytes_out": v.bytes_out,
                            "latency_mean": v.seconds / v.requests if v.requests else None,
                            "latency_buckets": dict(zip([*map(str, LATENCY_BUCKETS), "+Inf"], v.buckets))}
                     for verb, v in counters.verbs.items()}
    data["refused"] = {str(code): n for code, n in sorted(counters.refused.items())}
    data["events"] = {"auth_failures": counters.auth_failures, "storage_full": counters.refused.get(452, 0),
                      "notifications_coalesced": counters.coalesced(),
                      "slow_readers_dropped": counters.slow_readers_dropped}
    data["throughput"] = throughput.rates() if throughput is not None else []
    return data


def tables(state, throughput: Throughput | None = None) -> list[dict]:
    """Per table (replay buffers, datasets): rows and capacity, bytes, the counts of
    rows inserted, sampled and removed, their rates (with ``throughput``), the
    seconds requests waited for its rate limiter and the requests waiting now."""
    rates = throughput.table_rates() if throughput is not None else {}
    waits = state.waits
    rows = state.storage.view.tables()
    for row in rows:
        row["inserts_per_s"], row["samples_per_s"] = rates.get(row["name"], (None, None))
        row["waiting"] = {"insert": waits.waiting((row["name"], TINSERT.lane)),
                          "sample": waits.waiting((row["name"], TSAMPLE.lane))}
    rows.sort(key=lambda row: (-row["bytes"], row["name"]))
    return rows


def _experiments(state, counters: Counters | None) -> dict:
    """Per RL experiment: the latest version (the tag of its parameters bin), rollouts
    received and stale, the version each connection was last seen with (``workers``)
    and what each is in it (``roles``: ``"trainer"``, or the id of the worker whose
    presence bin it put), by connection id."""
    found: dict[str, dict] = {}
    view = state.storage.view
    for name in view.names():
        experiment = experiment_of(name, PARAMETERS)
        if experiment is not None:
            found[experiment] = {"latest": view.tag(name), "rollouts": 0, "stale": 0, "workers": {},
                                 "roles": {}}
    if counters is not None:
        for experiment, stats in counters.experiments.items():
            row = found.setdefault(experiment, {"latest": None, "rollouts": 0, "stale": 0, "workers": {},
                                                "roles": {}})
            if row["latest"] is None and stats.published >= 0:
                row["latest"] = stats.published
            row["rollouts"], row["stale"] = stats.rollouts, stats.stale
        for session in counters.live.values():
            for experiment, version in session.stats.versions.items():
                if experiment in found:
                    found[experiment]["workers"][str(session.stats.id)] = version
            for experiment, role in session.stats.roles.items():
                if experiment in found:
                    found[experiment]["roles"][str(session.stats.id)] = role
    return found


def _client(session, experiments: dict, now: float) -> dict:
    stats = session.stats
    versions = dict(stats.versions)
    lag = {}
    for experiment, version in versions.items():
        latest = experiments.get(experiment, {}).get("latest")
        if latest is not None:
            lag[experiment] = latest - version
    return {"id": stats.id, "peer": stats.peer, "authenticated": stats.authenticated,
            "age": now - stats.opened, "bytes_in": stats.bytes_in, "bytes_out": bytes_out(session),
            "requests": stats.requests, "listening": len(session.listening), "versions": versions, "lag": lag,
            "roles": dict(stats.roles),
            "coalesced": session.notifier.coalesced}
