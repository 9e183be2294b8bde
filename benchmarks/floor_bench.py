"""Section 14: the floor -- what a small request costs the server beside what its stack needs.

``floor_clients`` client processes of mixed 1 KiB put/append/get (the scaling
section's load), ``floor_ops`` requests each, in turns round by round against:

* tensorshare-server, as users start it (its clients, on its host, reach it through
  its Unix socket: PROTOCOL.md §10.1);
* the floor (:mod:`benchmarks.floor_server`): a minimal Twisted server of the same
  framing that answers the same requests from a dict, taking the same two
  shortcuts past Twisted and the same Unix socket; the same client processes talk to it;
* redis-server, the same load through redis-py (the scaling section's transactions)
  over TCP, as redis-py connects by default (the goal's baseline), and over Redis's
  own Unix socket (``unix_socket_path``), which its users may configure: beside it.

Each figure is beside ops/s: the server's CPU per request (user and system time
from ``/proc/PID/stat`` around the fixed count, all its threads) and the clients'
(their own ``os.times()`` around it).  Throughput moves by 15% from run to run on a
shared machine; CPU per request by a few per cent, so the goal on the server's
cost is stated against the floor measured in the same run.
"""

from __future__ import annotations

import json
import os

from .procs import FloorServer, Server, Workers
from .profiles import Profile
from .record import SKIP, Recorder
from .stats import Sample, mib

US = 1e6
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def counted_round(workers: list, count: int, target: int, pid: int) -> dict:
    """Every worker does ``count`` ops against its ``target``-th server (process
    ``pid``) at once: ops/s over the round, and server and client CPU per op."""
    before = process_cpu(pid)
    for w in workers:
        w.send(f"count {count} {target}")
    results = [json.loads(w.expect(count + 300, "result").split(" ", 1)[1]) for w in workers]
    after = process_cpu(pid)
    ops = sum(r["ops"] for r in results)
    seconds = max(r["seconds"] for r in results)
    return {"ops_s": ops / seconds,
            "server_user": (after[0] - before[0]) / ops * US, "server_sys": (after[1] - before[1]) / ops * US,
            "client": sum(r["cpu_s"] for r in results) / ops * US}


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("14. The floor: a small request's CPU")
    k, size = p.floor_clients, p.floor_value_bytes
    redis = peers.redis(rec, "Redis beside the floor")
    ts = floor = None
    try:
        ts = Server()
        floor = FloorServer()
        with Workers() as ws:
            ours = [ws.start("mixed", f"{ts.port},{floor.port}", "ts", size, f"floor-{i}") for i in range(k)]
            theirs = [ws.start("mixed", f"{redis.server.port},{redis.server.unix_path}", "redis", size,
                               f"floor-{i}") for i in range(k)] if redis is not None else []
            for w in ours + theirs:
                w.expect(120, "ready")
            rec.say(f"  -- {k} client processes of mixed {mib(size)} put/append/get, {p.floor_ops} ops each, "
                    f"in turns")
            targets = {"ts": (ours, 0, ts.pid), "floor": (ours, 1, floor.pid)}
            if theirs:
                targets["redis"] = (theirs, 0, redis.server.pid)
                targets["redis_unix"] = (theirs, 1, redis.server.pid)
            rounds: dict[str, list[dict]] = {name: [] for name in targets}
            for i in range(p.warmup + p.floor_runs):
                for name, (workers, target, pid) in targets.items():
                    measured = counted_round(workers, p.floor_ops if i >= p.warmup else p.floor_ops // 4 + 3,
                                             target, pid)
                    if i >= p.warmup:
                        rounds[name].append(measured)
    finally:
        rec.release(ts, floor)
    names = {"ts": "tensorshare", "floor": "the floor (minimal Twisted server)", "redis": "Redis",
             "redis_unix": "Redis over its Unix socket"}
    for name in sorted(rounds, key=lambda name: name == "ts"):  # the baselines first: ours is compared with them
        measured = rounds[name]
        server = Sample.of([m["server_user"] + m["server_sys"] for m in measured])
        user = Sample.of([m["server_user"] for m in measured]).median
        system = Sample.of([m["server_sys"] for m in measured]).median
        rec.figure(f"floor.{name}.ops", f"{names[name]}, {k} clients mixed {mib(size)}: ops/s",
                   Sample.of([m["ops_s"] for m in measured]), "ops/s", baseline=name != "ts",
                   vs=["floor.redis.ops", "floor.redis_unix.ops", "floor.floor.ops"] if name == "ts" else ())
        rec.figure(f"floor.{name}.server_cpu", f"{names[name]}: server CPU per request", server, "us",
                   better="lower", baseline=name != "ts", note=f"user {user:.1f}, system {system:.1f}",
                   vs=["floor.floor.server_cpu", "floor.redis.server_cpu"] if name == "ts" else ())
        if name != "floor":  # (the floor's clients are ours: the same as tensorshare's)
            rec.figure(f"floor.{name}.client_cpu", f"{names[name]}: client CPU per request",
                       Sample.of([m["client"] for m in measured]), "us", better="lower", baseline=name != "ts",
                       vs=["floor.redis.client_cpu", "floor.redis_unix.client_cpu"] if name == "ts" else ())
    goal = f"server CPU per request, mixed {mib(size)} from {k} clients <= 1.5x the floor"
    if not rec.get("floor.floor.server_cpu")["median"]:  # (a few requests take no clock tick: smoke runs)
        rec.goal(goal, SKIP, "too few requests to measure the floor's CPU in clock ticks")
    else:
        rec.goal_ratio(goal, "floor.ts.server_cpu", "floor.floor.server_cpu", "<=", 1.5)
    rec.goal_ratio(f"{k} clients, mixed {mib(size)}: >= 1.0x Redis with {k} clients",
                   "floor.ts.ops", "floor.redis.ops", ">=", 1.0)
