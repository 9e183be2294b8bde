"""Section 13: a busy host -- small ops and a large put while CPU-bound processes hold every core.

RL actor hosts keep every core stepping environments, so the server and its clients
share the CPUs with work that never sleeps.  With ``busy_hogs`` CPU-bound processes
running (pure-Python loops, the default niceness), in turns, run by run:

* small round trips: ``Client.put`` + ``peek`` of 16 float32 (as users get them:
  reply polling and server busy-polling on, which back off when they lose the CPU),
  beside redis-py SET + GET of 64 bytes, a raw socket echo, the same client
  against the floor (:mod:`benchmarks.floor_server`: what the round trips cost
  with a server that does nothing but answer) and a minimal client against the
  real server (:mod:`benchmarks.floor_client`: what they cost with a client that
  does nothing but send and read the frames), so the figures say which end a
  difference from Redis lies in;
* a large put over TCP (``zero_copy=False``), beside raw loopback one way into a
  warm buffer.

The same figures without the CPU-bound processes come first, so the section shows
how much more each loses on a busy host than its peers do.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from tensorshare import Client

from .baselines import RawEcho, RawLoopback
from .floor_client import FloorClient
from .procs import FloorServer, Server, spawn, stop
from .profiles import Profile
from .record import Recorder
from .stats import Sample, gbps, interleaved_latency_runs, mib, time_runs

US = 1e6
_HOG = "while True: pass"


class Hogs:
    """``n`` CPU-bound processes (tracked: they die with this process whatever happens)."""

    def __init__(self, n: int):
        self.procs = [spawn([sys.executable, "-c", _HOG]) for _ in range(n)]
        time.sleep(0.3)  # let them reach the CPUs

    def close(self) -> None:
        for proc in self.procs:
            stop(proc, timeout=1.0)


def _measure(rec: Recorder, p: Profile, peers, server: Server, floor: FloorServer, raw: RawLoopback, where: str,
             label: str) -> None:
    value = torch.ones(16)
    redis = peers.redis(rec, f"redis-py SET/GET ({label})")
    echo = RawEcho()
    minimal = FloorClient("127.0.0.1", server.port, p.client_timeout_s)
    try:
        with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client, \
                Client("127.0.0.1", floor.port, timeout=p.client_timeout_s) as bare:
            calls = {"ts": lambda: (client.put("bench-busy", value), client.peek("bench-busy")),
                     "floor": lambda: (bare.put("bench-busy", value), bare.peek("bench-busy")),
                     "client_floor": lambda: (minimal.put("bench-busy-min", value), minimal.peek("bench-busy-min")),
                     "raw": echo.round_trip()}
            if redis is not None:
                set_, get = redis.small_calls()
                calls["redis"] = lambda: (set_(), get())
            lat = interleaved_latency_runs(calls, p.busy_small_ops, p.busy_runs, max(p.busy_small_ops // 10, 1))
        rec.figure(f"busy.{where}.raw", f"raw socket echo 64 B ({label})", lat["raw"].medians.map(lambda s: s * US),
                   "us", better="lower", baseline=True)
        rec.figure(f"busy.{where}.floor", f"Client.put + peek against the floor server ({label})",
                   lat["floor"].medians.map(lambda s: s * US), "us", better="lower", baseline=True)
        rec.figure(f"busy.{where}.client_floor", f"a minimal client's put + peek against tensorshare-server ({label})",
                   lat["client_floor"].medians.map(lambda s: s * US), "us", better="lower", baseline=True)
        vs = ["floor", "client_floor", "raw"]
        if redis is not None:
            rec.figure(f"busy.{where}.redis", f"redis-py SET + GET 64 B ({label})",
                       lat["redis"].medians.map(lambda s: s * US), "us", better="lower", baseline=True)
            vs.insert(0, "redis")
        rec.figure(f"busy.{where}.put_peek", f"Client.put + peek 16 x float32 ({label})",
                   lat["ts"].medians.map(lambda s: s * US), "us", better="lower",
                   vs=[f"busy.{where}.{v}" for v in vs])
    finally:
        echo.close()
        minimal.close()
    nbytes = p.busy_put_bytes
    big = torch.ones(nbytes // 4)
    rate = gbps(nbytes)
    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as client:
        puts, raws = [], []
        for _ in range(p.warmup):
            client.put("bench-busy-big", big)
        for _ in range(p.busy_put_reps):  # in turns: the load hits both alike
            puts.extend(time_runs(lambda: client.put("bench-busy-big", big), 1, 0))
            raws.extend(raw.one_way(nbytes, 1, 0, "warm"))
        client.delete("bench-busy-big")
    rec.figure(f"busy.{where}.raw_one_way", f"raw loopback one-way {mib(nbytes)}, warm buffer ({label})",
               Sample.of(raws).map(rate), "GB/s", baseline=True, nbytes=nbytes)
    rec.figure(f"busy.{where}.put", f"Client.put {mib(nbytes)} over TCP ({label})", Sample.of(puts).map(rate),
               "GB/s", vs=[f"busy.{where}.raw_one_way"], nbytes=nbytes)


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("13. A busy host")
    server, floor = Server(), FloorServer()
    raw = RawLoopback(p.busy_put_bytes)
    hogs = None
    try:
        _measure(rec, p, peers, server, floor, raw, "quiet", "no CPU-bound processes")
        cores = len(os.sched_getaffinity(0))
        rec.say(f"  -- {p.busy_hogs} CPU-bound processes on {cores} cores")
        hogs = Hogs(p.busy_hogs)
        _measure(rec, p, peers, server, floor, raw, "busy", f"{p.busy_hogs} CPU-bound processes")
    finally:
        rec.release(hogs, raw, server, floor)
    rec.goal_ratio(f"busy host ({p.busy_hogs} CPU-bound processes): small put + peek <= 1.0x redis-py SET + GET",
                   "busy.busy.put_peek", "busy.busy.redis", "<=", 1.0)
    rec.goal_ratio(f"busy host ({p.busy_hogs} CPU-bound processes): {mib(p.busy_put_bytes)} put >= 0.8x raw "
                   f"loopback", "busy.busy.put", "busy.busy.raw_one_way", ">=", 0.8)
