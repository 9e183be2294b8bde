"""Section 4: scaling -- concurrent clients, fan-out to listeners, server memory.

* N client processes each doing put/append/get of one value in a cycle for a fixed
  time: total ops/s, MB/s of payload moved, p99 latency; beside the same workload
  through Redis (DEL+RPUSH / RPUSH / LRANGE+DEL transactions) with N processes.
* Workers: the most clients against servers of 1, 2, 4... workers (``--workers``),
  beside Redis, with the server's CPU per request over all its workers.
* Fan-out: one value put (PUT notification) and fetched (peek) by N listener
  processes: time from the put until the last listener has the value; beside
  Redis SET + PUBLISH with N subscribers that GET it.
* Server RSS per stored GiB: VmRSS of a fresh server before and after storing the
  profile's total across several bins (and after deleting them), beside redis-server.
"""

from __future__ import annotations

import json
import os
import time

import torch

from tensorshare import Client

from .procs import PeerMissing, RedisServer, Server, Workers
from .profiles import Profile
from .record import Recorder
from .stats import Sample, mib, percentile


SERVER_CORES = 1  # cores the server can use: one Twisted reactor thread


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class MixedClients:
    """The mixed-load worker processes of the section, kept from one measurement to the
    next (each start costs a second or more of importing torch): :meth:`get` points
    ``k`` of a peer's at a server, starting those it lacks."""

    def __init__(self):
        self._workers = Workers()
        self._of: dict[str, list] = {}

    def get(self, peer: str, port: int, k: int, size: int) -> list:
        have = self._of.setdefault(peer, [])
        for w in have[:k]:
            w.send(f"target {port} {size}")
        have += [self._workers.start("mixed", port, peer, size, i) for i in range(len(have), k)]
        for w in have[:k]:
            w.expect(120, "ready")
        return have[:k]

    def stop(self) -> None:
        self._workers.stop()
        self._of.clear()


def _mixed_runs(p: Profile, clients_of: MixedClients, peer: str, port: int, clients: int,
                counted: list | None = None, cpu: list | None = None,
                size: int | None = None) -> tuple[Sample, Sample, Sample]:
    """(ops/s, MB/s, p99 ms) over the profile's runs, ``clients`` worker processes
    putting values of ``size`` bytes (default: the profile's ``scale_value_bytes``);
    ``counted`` gets the ops of every run, warm-up included; ``cpu``, each measured
    run's client CPU seconds per request, all clients together."""
    run_s = p.scale_run_s
    ops, mbps, p99 = [], [], []
    workers = clients_of.get(peer, port, clients, size or p.scale_value_bytes)
    for i in range(p.warmup + p.scale_runs):
        duration = run_s if i >= p.warmup else min(0.5, run_s)
        for w in workers:
            w.send(f"go {duration}")
        results = [json.loads(w.expect(duration + 120, "result").split(" ", 1)[1]) for w in workers]
        if counted is not None:
            counted.append(sum(r["ops"] for r in results))
        if i < p.warmup:
            continue
        ops.append(sum(r["ops"] / r["seconds"] for r in results))
        if cpu is not None:
            cpu.append(sum(r["cpu_s"] for r in results) / sum(r["ops"] for r in results))
        mbps.append(sum(r["bytes"] / r["seconds"] for r in results) / 1e6)
        p99.append(percentile([lat for r in results for lat in r["lat_us"]], 99) / 1e3)
    return Sample.of(ops), Sample.of(mbps), Sample.of(p99)


def concurrent_clients(rec: Recorder, p: Profile, peers, server: Server, clients_of: MixedClients) -> None:
    size = mib(p.scale_value_bytes)
    redis = peers.redis(rec, "Redis concurrent clients")
    for k in p.scale_clients:
        rec.say(f"  -- {k} client process(es), {size} values, {p.scale_run_s}s per run")
        vs_ops, vs_mb, vs_p99 = [], [], []
        if redis is not None:
            o, m, q = _mixed_runs(p, clients_of, "redis", redis.server.port, k)
            rec.figure(f"scale.{k}.redis.ops", f"Redis mixed, {_plural(k, 'client')}: ops/s", o, "ops/s", baseline=True,
                       chart={"name": "scaling-ops", "series": "Redis", "x": k})
            rec.figure(f"scale.{k}.redis.mbps", f"Redis mixed, {_plural(k, 'client')}: MB/s", m, "MB/s", baseline=True)
            rec.figure(f"scale.{k}.redis.p99", f"Redis mixed, {_plural(k, 'client')}: p99 latency", q, "ms", better="lower",
                       baseline=True, chart={"name": "scaling-p99", "series": "Redis", "x": k})
            vs_ops, vs_mb, vs_p99 = [f"scale.{k}.redis.ops"], [f"scale.{k}.redis.mbps"], [f"scale.{k}.redis.p99"]
        o, m, q = _mixed_runs(p, clients_of, "ts", server.port, k)
        rec.figure(f"scale.{k}.ts.ops", f"tensorshare mixed, {_plural(k, 'client')}: ops/s", o, "ops/s",
                   vs=vs_ops + ["scale.1.ts.ops"] * (k > 1), chart={"name": "scaling-ops", "series": "tensorshare", "x": k})
        rec.figure(f"scale.{k}.ts.mbps", f"tensorshare mixed, {_plural(k, 'client')}: MB/s", m, "MB/s", vs=vs_mb)
        rec.figure(f"scale.{k}.ts.p99", f"tensorshare mixed, {_plural(k, 'client')}: p99 latency", q, "ms", better="lower",
                   vs=vs_p99, chart={"name": "scaling-p99", "series": "tensorshare", "x": k})
    if 8 in p.scale_clients and 1 in p.scale_clients:
        # The server runs one reactor thread: it can use one core.  Issue #22: 8 clients
        # keep at least 0.9x one client's rate, and match Redis at 8 clients.
        rec.goal_ratio(f"8 concurrent clients >= 0.9x single-client ops/s x {SERVER_CORES} server core(s)",
                       "scale.8.ts.ops", "scale.1.ts.ops", ">=", 0.9 * SERVER_CORES)
        rec.goal_ratio("8 concurrent clients >= 1.0x Redis with 8 clients (mixed put/append/get)",
                       "scale.8.ts.ops", "scale.8.redis.ops", ">=", 1.0)


def workers_scaling(rec: Recorder, p: Profile, peers, server: Server, clients_of: MixedClients) -> None:
    """The most clients of the profile against servers of 1, 2, 4... workers (``--workers``),
    beside Redis with as many clients; and the server's CPU per request per worker."""
    k = max(p.scale_clients)
    size = mib(p.scale_value_bytes)
    redis = peers.redis(rec, f"Redis with {k} clients (workers scaling)")
    vs = [f"scale.{k}.redis.ops"] if redis is not None else []
    for workers in p.scale_workers:
        rec.say(f"  -- {_plural(k, 'client')} against --workers {workers}, {size} values")
        counted: list[int] = []
        with Server("--workers", str(workers)) as multi:
            before = multi.cpu_seconds()
            o, m, q = _mixed_runs(p, clients_of, "ts", multi.port, k, counted)
            cpu = multi.cpu_seconds() - before
        ops_key = f"scale.workers.{workers}.ops"
        rec.figure(ops_key, f"tensorshare mixed, {_plural(k, 'client')}, --workers {workers}: ops/s", o, "ops/s",
                   vs=vs + [f"scale.workers.{p.scale_workers[0]}.ops"] * (workers != p.scale_workers[0]),
                   chart={"name": "scaling-workers", "series": "tensorshare", "x": workers})
        rec.figure(f"scale.workers.{workers}.p99", f"tensorshare mixed, {_plural(k, 'client')}, --workers {workers}: "
                   f"p99 latency", q, "ms", better="lower")
        rec.figure(f"scale.workers.{workers}.cpu", f"server CPU per request, --workers {workers} (all workers)",
                   Sample.of([cpu / max(sum(counted), 1) * 1e6]), "us", better="lower",
                   note="the server processes' CPU time over the runs (warm-up too), divided by their requests")
    best = max(p.scale_workers, key=lambda w: rec.get(f"scale.workers.{w}.ops")["median"])
    if redis is not None:
        rec.goal_ratio(f"{k} clients, the best --workers ({best}) >= 1.0x Redis (mixed put/append/get)",
                       f"scale.workers.{best}.ops", f"scale.{k}.redis.ops", ">=", 1.0)
    cores = os.cpu_count() or 1
    if cores >= 16 and p.scale_workers[0] == 1 and best != 1:  # issue #32's goal for a many-core host
        rec.goal_ratio(f"{k} clients on {cores} cores: the best --workers ({best}) >= 4x --workers 1",
                       f"scale.workers.{best}.ops", "scale.workers.1.ops", ">=", 4.0)


def _fanout_times(p: Profile, peer: str, port: int, listeners: int, publish) -> Sample:
    """Seconds from publishing until the last of ``listeners`` processes holds the value."""
    times = []
    with Workers() as ws:
        workers = [ws.start("listen", port, peer, "bench-fan") for _ in range(listeners)]
        for w in workers:
            w.expect(120, "ready")
        for rep in range(p.warmup + p.fanout_reps):
            start = time.monotonic()
            publish(rep)
            done = [w.expect(60, f"done {rep} ") for w in workers]
            if rep >= p.warmup:
                times.append(max(float(line.split()[2]) for line in done) - start)
    return Sample.of(times)


def fan_out(rec: Recorder, p: Profile, peers, server: Server, clients_of: MixedClients) -> None:
    nbytes = p.fanout_value_bytes
    size = mib(nbytes)
    tensor = torch.ones(nbytes // 4)
    data = tensor.numpy().tobytes()
    redis = peers.redis(rec, "Redis fan-out")
    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
        for n in p.fanout_listeners:
            rec.say(f"  -- fan-out of {size} to {n} listener process(es)")
            vs = []
            if redis is not None:
                r = redis.r

                def publish_redis(rep: int) -> None:
                    r.set("bench-fan", data)
                    r.publish("bench-fan", rep)

                ms = _fanout_times(p, "redis", redis.server.port, n, publish_redis).map(lambda s: s * 1e3)
                rec.figure(f"fan.{n}.redis", f"Redis SET+PUBLISH {size} to {_plural(n, 'subscriber')}, all fetched", ms, "ms",
                           better="lower", baseline=True, chart={"name": "fanout", "series": "Redis", "x": n})
                vs = [f"fan.{n}.redis"]
            ms = _fanout_times(p, "ts", server.port, n,
                               lambda rep: client.put("bench-fan", {"rep": rep, "value": tensor})).map(lambda s: s * 1e3)
            rec.figure(f"fan.{n}.ts", f"tensorshare put {size} to {_plural(n, 'listener')}, all peeked", ms, "ms",
                       better="lower", vs=vs + ["fan.1.ts"] * (n > 1),
                       chart={"name": "fanout", "series": "tensorshare", "x": n})
            client.delete("bench-fan")


def _rss_runs(p: Profile, start, store, delete, measure=lambda server: server.rss()) -> tuple[Sample, Sample]:
    """(memory growth per stored byte, memory still held after deleting / stored) over
    fresh servers; ``measure(server)`` is the server's memory (RSS by default)."""
    total, bins = p.rss_total_bytes, p.rss_bins
    per = total // bins
    grown, held = [], []
    for _ in range(p.rss_runs):
        server, conn = start()
        try:
            before = measure(server)
            for i in range(bins):
                store(conn, f"bench-rss-{i}", per)
            time.sleep(0.5)  # items move to shared memory in the background
            after = measure(server)
            for i in range(bins):
                delete(conn, f"bench-rss-{i}")
            time.sleep(0.5)
            released = measure(server)
        finally:
            conn.close()
            server.stop()
        grown.append((after - before) / (per * bins))
        held.append((released - before) / (per * bins))
    return Sample.of(grown), Sample.of(held)


def server_memory(rec: Recorder, p: Profile) -> None:
    per = p.rss_total_bytes // p.rss_bins
    what = f"{mib(per * p.rss_bins)} in {p.rss_bins} bins of {mib(per)}"
    rec.say(f"  -- server RSS storing {what}")
    value = torch.ones(per // 4)
    data = value.numpy().tobytes()
    chart = lambda series: {"name": "rss", "series": series, "x": "RSS per stored GiB"}  # noqa: E731

    vs_grow, vs_held = [], []
    try:
        def start_redis():
            s = RedisServer()
            return s, s.client()

        grown, held = _rss_runs(p, start_redis, lambda r, k, n: r.set(k, data), lambda r, k: r.delete(k))
        rec.figure("rss.redis.grow", f"redis-server RSS growth per stored GiB ({what})", grown, "GiB",
                   better="lower", baseline=True, chart=chart("redis-server"))
        rec.figure("rss.redis.held", "redis-server RSS still held after DEL, per stored GiB", held, "GiB",
                   better="lower", baseline=True)
        vs_grow, vs_held = ["rss.redis.grow"], ["rss.redis.held"]
    except PeerMissing as exc:
        rec.skip("redis-server RSS per stored GiB", str(exc))
    data = None  # noqa: F841 (frees it)

    def start_ts():
        s = Server()
        return s, Client("127.0.0.1", s.port, timeout=p.client_timeout_s)

    # Stored items move into the server's shared-memory area (out of its RSS) for
    # same-host readers: count those pages too, or the figure says nothing.
    grown, held = _rss_runs(p, start_ts, lambda c, k, n: c.put(k, value), lambda c, k: c.delete(k),
                            lambda server: server.footprint())
    rec.figure("rss.ts.grow", f"tensorshare-server memory growth per stored GiB, RSS + shared-memory files "
               f"({what})", grown, "GiB", better="lower", vs=vs_grow, chart=chart("tensorshare-server"))
    rec.figure("rss.ts.held", "tensorshare-server memory (RSS + shared-memory files) still held after DELETE, "
               "per stored GiB", held, "GiB", better="lower", vs=vs_held)


CLIENT_CPU_CLIENTS = 8  # client processes of the client-CPU figure (issue #39: 8 on 2 cores), at most
CLIENT_CPU_BYTES = 1 << 10  # their values: small requests, where the client's own work shows


def client_cpu(rec: Recorder, p: Profile, peers, server: Server, clients_of: MixedClients) -> None:
    """The clients' CPU per small request (mixed 1 KiB put/append/get, 8 processes),
    tensorshare.Client beside redis-py in the same run: the client's half of the bill,
    whatever the server costs (issue #39: <= 0.9x redis-py's)."""
    redis = peers.redis(rec, "Redis client CPU per request")
    if redis is None:
        return
    k = min(CLIENT_CPU_CLIENTS, max(p.scale_clients))  # (the smoke profile's one)
    for peer, port, key, label in (("redis", redis.server.port, "cpu.client.redis", "redis-py"),
                                   ("ts", server.port, "cpu.client.ts", "tensorshare.Client")):
        per_request: list[float] = []
        _mixed_runs(p, clients_of, peer, port, k, cpu=per_request, size=CLIENT_CPU_BYTES)
        rec.figure(key, f"{label} CPU per request, mixed {mib(CLIENT_CPU_BYTES)}, {k} client processes",
                   Sample.of([s * 1e6 for s in per_request]), "us", better="lower", baseline=peer == "redis",
                   vs=[] if peer == "redis" else ["cpu.client.redis"])
    rec.goal_ratio("tensorshare.Client CPU per small request <= 0.9x redis-py's", "cpu.client.ts",
                   "cpu.client.redis", "<=", 0.9)


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("4. Scaling")
    server = Server()
    clients_of = MixedClients()  # (every part takes them; fan-out has listener processes of its own)
    try:
        for part in (concurrent_clients, workers_scaling, fan_out, client_cpu):
            try:
                part(rec, p, peers, server, clients_of)
            except Exception as exc:  # one part failing must not hide the others
                rec.error(f"scaling: {part.__name__}", exc)
                if not server.alive():
                    rec.note(f"the server died: {server.log_tail()[-500:]}")
                    server.stop()
                    server = Server()
    finally:
        clients_of.stop()
        server.stop()
    server_memory(rec, p)
