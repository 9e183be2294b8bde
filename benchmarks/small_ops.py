"""Section 3: small operations.

Round-trip latency (median and p99 of many ops, per run; the figure is the median
over runs) of ``Client.put``/``peek`` of a 16-element float32 tensor, beside a raw
socket echo, redis-py SET/GET and TCPStore set/get of 64 bytes, all measured in
turns, run by run.  Ours are measured as users get them (the client polls for its
reply and the server for the next request, tensorshare/_client/spin.py and
server/net/busypoll.py) and, for comparison, with both sleeping at once.  Then pipelined
small appends per second from the callback client (``TensorShare.append`` with a
callback, the original API, on ``Client.submit``) counting completions in callbacks,
and from ``AsyncClient`` with many Deferreds in flight (in a worker process with its
own reactor), beside redis-py pipelined RPUSH.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from tensorshare import Client, TensorShare

from .baselines import RawEcho
from .procs import Server, Worker
from .profiles import Profile
from .record import Recorder
from .stats import LatencyRuns, Sample, interleaved_latency_runs

US = 1e6


def _latency_figures(rec: Recorder, key: str, label: str, lat: LatencyRuns, vs: list[str] = (),
                     baseline: bool = False, note: str | None = None) -> None:
    rec.figure(f"{key}.median", f"{label} median", lat.medians.map(lambda s: s * US), "us", better="lower",
               vs=[f"{v}.median" for v in vs], baseline=baseline, note=note,
               chart={"name": "small", "series": "median", "x": label})
    rec.figure(f"{key}.p99", f"{label} p99", lat.p99s.map(lambda s: s * US), "us", better="lower",
               vs=[f"{v}.p99" for v in vs], baseline=baseline,
               chart={"name": "small", "series": "p99", "x": label})


def _callback_rates(ts: TensorShare, value: torch.Tensor, n: int, runs: int, warmup: int,
                    timeout: float) -> list[float]:
    """Appends/s through the callback client, time until the n-th callback has run."""
    rates = []
    for i in range(warmup + runs):
        count = n if i >= warmup else max(n // 4, 1)
        done = threading.Event()
        state = {"n": 0, "errors": []}

        def completed(reply, count=count, done=done, state=state):
            if reply["status"] != "OK":
                state["errors"].append(reply["msg"])
            state["n"] += 1  # callbacks run one at a time on the dispatcher thread
            if state["n"] == count:
                done.set()

        start = time.perf_counter()
        for _ in range(count):
            ts.append("bench-pipe", value, completed)
        if not done.wait(timeout):
            raise TimeoutError(f"only {state['n']} of {count} pipelined appends completed in {timeout}s")
        elapsed = time.perf_counter() - start
        if state["errors"]:
            raise RuntimeError(f"{len(state['errors'])} pipelined appends failed: {state['errors'][0]!r}")
        ts.client.delete("bench-pipe")
        if i >= warmup:
            rates.append(count / elapsed)
    return rates


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("3. Small ops")
    ops, runs, warm_ops = p.small_ops, p.small_runs, max(p.small_ops // 5, 10) if p.warmup else 0
    value = torch.ones(16, dtype=torch.float32)
    server = client = echo = sleeper = sleepy = ts = None
    try:
        server = Server()
        client = Client("127.0.0.1", server.port, timeout=p.client_timeout_s)
        sleeper = Server("--busy-poll", "0")
        sleepy = Client("127.0.0.1", sleeper.port, timeout=p.client_timeout_s, spin=0)
        echo = RawEcho()
        calls = {"small.raw": echo.round_trip()}
        redis = peers.redis(rec, "Redis SET/GET 64 B latency")
        if redis is not None:
            calls["small.redis_set"], calls["small.redis_get"] = redis.small_calls()
        store = peers.tcpstore(rec, "TCPStore set/get 64 B latency")
        if store is not None:
            calls["small.tcpstore_set"], calls["small.tcpstore_get"] = store.small_calls()
        client.put("bench-small", value)
        calls["small.put"] = lambda: client.put("bench-small", value)
        calls["small.peek"] = lambda: client.peek("bench-small")
        calls["small.ping"] = lambda: client.ping()
        sleepy.put("bench-small", value)
        calls["small.put_sleep"] = lambda: sleepy.put("bench-small", value)
        calls["small.peek_sleep"] = lambda: sleepy.peek("bench-small")
        # In turns, run by run: a change in the machine's load hits ours and the peers' alike.
        lat = interleaved_latency_runs(calls, ops, runs, warm_ops)
        echo.close()
        echo = None
        _latency_figures(rec, "small.raw", "raw socket echo 64 B round trip", lat["small.raw"], baseline=True)
        if redis is not None:
            _latency_figures(rec, "small.redis_set", "redis-py SET 64 B", lat["small.redis_set"], baseline=True)
            _latency_figures(rec, "small.redis_get", "redis-py GET 64 B", lat["small.redis_get"], baseline=True)
        if store is not None:
            _latency_figures(rec, "small.tcpstore_set", "TCPStore set 64 B", lat["small.tcpstore_set"], baseline=True,
                             note="set does not wait for a reply")
            _latency_figures(rec, "small.tcpstore_get", "TCPStore get 64 B", lat["small.tcpstore_get"], baseline=True)
        _latency_figures(rec, "small.put", "Client.put 16 x float32", lat["small.put"],
                         vs=["small.redis_set", "small.tcpstore_get", "small.raw"])
        _latency_figures(rec, "small.peek", "Client.peek 16 x float32", lat["small.peek"],
                         vs=["small.redis_get", "small.tcpstore_get", "small.raw"])
        _latency_figures(rec, "small.ping", "Client.ping (NOOP)", lat["small.ping"], vs=["small.raw"])
        _latency_figures(rec, "small.put_sleep", "Client.put, no polling (spin=0, --busy-poll 0)",
                         lat["small.put_sleep"], vs=["small.redis_set", "small.put"])
        _latency_figures(rec, "small.peek_sleep", "Client.peek, no polling (spin=0, --busy-poll 0)",
                         lat["small.peek_sleep"], vs=["small.redis_get", "small.peek"])

        # -- pipelined appends
        n, pruns = p.pipelined_ops, p.pipelined_runs
        if redis is not None:
            rec.figure("pipe.redis", "redis-py pipelined RPUSH 64 B (256 per round trip)",
                       Sample.of(redis.pipelined_rpush_rates(n, pruns, p.warmup)), "ops/s", baseline=True,
                       chart={"name": "pipelined", "series": "ops/s", "x": "redis-py pipeline"})
        ts = TensorShare("127.0.0.1", server.port, timeout=p.client_timeout_s)
        rec.figure("pipe.callback", "TensorShare.append 16 x float32 (callback client), pipelined",
                   Sample.of(_callback_rates(ts, value, n, pruns, p.warmup, p.client_timeout_s)), "ops/s",
                   vs=["pipe.redis"], chart={"name": "pipelined", "series": "ops/s", "x": "TensorShare (callbacks)"})
        worker = Worker("async-append", server.port, n, p.async_window, pruns, p.warmup)
        try:
            result = json.loads(worker.expect(max(300.0, p.client_timeout_s), "result").split(" ", 1)[1])
        finally:
            worker.stop()
        if "error" in result:
            raise RuntimeError(f"AsyncClient worker: {result['error']}")
        rec.figure("pipe.async", f"AsyncClient.append 16 x float32, {p.async_window} in flight",
                   Sample.of(result["rates"]), "ops/s", vs=["pipe.redis"],
                   chart={"name": "pipelined", "series": "ops/s", "x": "AsyncClient"})
    finally:
        for thing in (echo, client, sleepy, ts):
            if thing is not None:
                thing.close()
        for proc in (server, sleeper):
            if proc is not None:
                proc.stop()

    rec.goal_ratio("Client.put median latency <= 1.0x redis-py SET", "small.put.median", "small.redis_set.median",
                   "<=", 1.0)
    rec.goal_ratio("Client.peek median latency <= 1.0x redis-py GET", "small.peek.median", "small.redis_get.median",
                   "<=", 1.0)
    rec.goal_value("pipelined callback-client (TensorShare) appends >= 20,000/s", "pipe.callback", ">=", 20_000)
    rec.goal_value("pipelined AsyncClient appends >= 20,000/s", "pipe.async", ">=", 20_000)
