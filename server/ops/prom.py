"""Prometheus exposition of a server's status (``/metrics``), with ``prometheus_client``.

A custom collector (the pattern of Prometheus exporters): nothing of
``prometheus_client`` is touched while requests are served; each scrape turns one
:func:`~.status.snapshot` into metric families.  ``prometheus_client`` is an
optional dependency (the ``metrics`` extra: ``pip install prometheus_client``): :func:`available` says
whether it is installed.
"""

from __future__ import annotations

from itertools import accumulate

from .counters import LATENCY_BUCKETS


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def exposition(data: dict) -> tuple[bytes, str]:
    """``(body, content type)`` of ``/metrics`` for a :func:`~.status.snapshot`."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(data))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Families:
    def __init__(self, data: dict):
        self.data = data

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        data = self.data
        yield GaugeMetricFamily("tensorshare_bins", "Bins the server holds", value=data["totals"]["bins"])
        items = GaugeMetricFamily("tensorshare_items", "Items stored, by where their payload lives", labels=["tier"])
        nbytes = GaugeMetricFamily("tensorshare_item_bytes", "Payload bytes stored, by where they live",
                                   labels=["tier"])
        for tier, row in data["tiers"].items():
            items.add_metric([tier], row["items"])
            nbytes.add_metric([tier], row["bytes"])
        yield items
        yield nbytes
        memory = data["memory"]
        if memory["rss"] is not None:
            yield GaugeMetricFamily("tensorshare_process_resident_memory_bytes", "The server process's RSS",
                                    value=memory["rss"])
        yield GaugeMetricFamily("tensorshare_payload_in_memory_bytes", "Stored payload bytes held in RAM",
                                value=memory["payload_in_memory"])
        if memory["memory_limit"] is not None:
            yield GaugeMetricFamily("tensorshare_memory_limit_bytes", "--memory-limit", value=memory["memory_limit"])
        yield GaugeMetricFamily("tensorshare_connections", "Connections open", value=data["connections"]["open"])
        if "workers" in data:  # a multi-worker server: each worker too
            yield from _worker_families(data["workers"])
        yield from _tables(data["tables"])
        if "verbs" not in data:  # nothing counted
            return
        yield CounterMetricFamily("tensorshare_connections_accepted", "Connections admitted",
                                  value=data["connections"]["accepted"])
        yield CounterMetricFamily("tensorshare_connections_refused", "Connections refused (max_connections)",
                                  value=data["connections"]["refused"])
        yield CounterMetricFamily("tensorshare_received_bytes", "Bytes received on all connections",
                                  value=data["traffic"]["bytes_in"])
        yield CounterMetricFamily("tensorshare_sent_bytes", "Bytes sent on all connections",
                                  value=data["traffic"]["bytes_out"])
        yield CounterMetricFamily("tensorshare_sendfile_bytes", "Reply bytes the kernel sent from spilled or "
                                  "durable items' files (sendfile)", value=data["traffic"]["sendfile_bytes"])
        requests = CounterMetricFamily("tensorshare_requests", "Requests handled, by verb", labels=["verb"])
        bytes_in = CounterMetricFamily("tensorshare_request_payload_bytes", "Request payload bytes, by verb",
                                       labels=["verb"])
        bytes_out = CounterMetricFamily("tensorshare_reply_payload_bytes", "Reply payload bytes, by verb",
                                        labels=["verb"])
        latency = HistogramMetricFamily("tensorshare_request_latency_seconds",
                                        "Time to handle a request in the server (not counting waits for the "
                                        "disk or for room)", labels=["verb"])
        bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
        for verb, row in data["verbs"].items():
            requests.add_metric([verb], row["requests"])
            bytes_in.add_metric([verb], row["bytes_in"])
            bytes_out.add_metric([verb], row["bytes_out"])
            counts = list(accumulate(row["latency_buckets"].values()))
            mean = row["latency_mean"] or 0.0
            latency.add_metric([verb], list(zip(bounds, counts)), sum_value=mean * row["requests"])
        yield from (requests, bytes_in, bytes_out, latency)
        refused = CounterMetricFamily("tensorshare_refusals", "Error replies, by reply code", labels=["code"])
        for code, n in data["refused"].items():
            refused.add_metric([code], n)
        yield refused
        events = data["events"]
        yield CounterMetricFamily("tensorshare_auth_failures", "Connections that failed to authenticate",
                                  value=events["auth_failures"])
        yield CounterMetricFamily("tensorshare_storage_full_refusals", "Requests refused with 452 (memory or "
                                  "disk full)", value=events["storage_full"])
        yield CounterMetricFamily("tensorshare_notifications_coalesced", "Notifications replaced by a newer one "
                                  "while their slow reader's connection was congested",
                                  value=events["notifications_coalesced"])
        yield CounterMetricFamily("tensorshare_slow_readers_dropped", "Connections dropped for not reading "
                                  "their replies (outbound stall timeout)", value=events["slow_readers_dropped"])
        latest = GaugeMetricFamily("tensorshare_rl_latest_version", "Latest parameters version of an RL "
                                   "experiment (the tag of <experiment>/parameters)", labels=["experiment"])
        rollouts = CounterMetricFamily("tensorshare_rl_rollouts", "Rollouts appended to <experiment>/rollouts",
                                       labels=["experiment"])
        stale = CounterMetricFamily("tensorshare_rl_rollouts_stale", "Rollouts received stamped with a version "
                                    "older than the latest published (a trainer with max_staleness=0 drops "
                                    "them)", labels=["experiment"])
        worker = GaugeMetricFamily("tensorshare_rl_worker_version", "Parameters version each connection was last "
                                   "seen with (read, published or stamped on a rollout)",
                                   labels=["experiment", "conn", "peer"])
        peers = {str(c["id"]): c["peer"] for c in data["clients"]}
        for experiment, row in data["experiments"].items():
            if row["latest"] is not None:
                latest.add_metric([experiment], row["latest"])
            rollouts.add_metric([experiment], row["rollouts"])
            stale.add_metric([experiment], row["stale"])
            for conn, version in row["workers"].items():
                worker.add_metric([experiment, conn, peers.get(conn, "?")], version)
        yield from (latest, rollouts, stale, worker)


def _worker_families(workers: list[dict]):
    """Per worker of a multi-worker server (label ``worker``): up, bins, items, bytes,
    connections, requests, memory."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily("tensorshare_worker_up", "1 if the worker answered the last scrape", labels=["worker"])
    gauges = {key: GaugeMetricFamily(f"tensorshare_worker_{name}", text, labels=["worker"]) for key, name, text in (
        ("bins", "bins", "Bins the worker holds"), ("items", "items", "Items the worker stores"),
        ("bytes", "item_bytes", "Payload bytes the worker stores"),
        ("connections", "connections", "Connections open to the worker"),
        ("rss", "resident_memory_bytes", "The worker process's RSS"))}
    requests = CounterMetricFamily("tensorshare_worker_requests", "Requests the worker handled", labels=["worker"])
    for row in workers:
        label = [str(row["worker"])]
        up.add_metric(label, 1 if row["up"] else 0)
        if not row["up"]:
            continue
        for key, family in gauges.items():
            if row.get(key) is not None:
                family.add_metric(label, row[key])
        if row.get("requests") is not None:
            requests.add_metric(label, row["requests"])
    yield up
    yield from gauges.values()
    yield requests


def _tables(rows: list[dict]):
    """Per table: rows, capacity, bytes; rows inserted, sampled and removed (rates:
    Prometheus's ``rate()``); seconds requests waited for the rate limiter, and
    requests waiting now (Reverb exports the like)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    size = GaugeMetricFamily("tensorshare_table_rows", "Rows a table holds", labels=["table"])
    capacity = GaugeMetricFamily("tensorshare_table_capacity_rows", "Rows a table can hold", labels=["table"])
    nbytes = GaugeMetricFamily("tensorshare_table_bytes", "Column bytes a table holds (preallocated)",
                               labels=["table", "where"])
    inserts = CounterMetricFamily("tensorshare_table_inserted_rows", "Rows inserted into (or written to) a table",
                                  labels=["table"])
    samples = CounterMetricFamily("tensorshare_table_sampled_rows", "Rows sampled from a table (and reads counted "
                                  "as samples)", labels=["table"])
    removals = CounterMetricFamily("tensorshare_table_removed_rows", "Rows that left a table", labels=["table"])
    blocked = CounterMetricFamily("tensorshare_table_rate_limiter_blocked_seconds", "Seconds requests waited for a "
                                  "table's rate limiter (ended waits)", labels=["table", "op"])
    waiting = GaugeMetricFamily("tensorshare_table_waiting_requests", "Requests waiting for a table's rate limiter "
                                "now", labels=["table", "op"])
    for row in rows:
        name = row["name"]
        size.add_metric([name], row["size"])
        capacity.add_metric([name], row["capacity"])
        nbytes.add_metric([name, row["where"]], row["bytes"])
        inserts.add_metric([name], row["inserts"])
        samples.add_metric([name], row["samples"])
        removals.add_metric([name], row["removals"])
        for op in ("insert", "sample"):
            blocked.add_metric([name, op], row["blocked_seconds"][op])
            waiting.add_metric([name, op], row["waiting"][op])
    yield from (size, capacity, nbytes, inserts, samples, removals, blocked, waiting)
