"""Section 9: the cost of metrics (``--metrics-port``), measured on and off in the same run.

Two servers, one with the operations port on and scraped (``/metrics`` and
``/status.json``) every second, harsher than Prometheus' usual 15 s, one without.
Small-op round trips (``Client.put``/``peek`` of 16 float32) are timed in turns,
run by run, and pipelined callback-client appends alternate between the two, so
a change in the machine's load falls on both alike; all of it in ``ops_rounds``
rounds of fresh servers (three in quick and full), runs pooled, since on a shared
2-CPU machine where the OS places a process can make it 10-15% slower for its whole
life, whichever server it is.
Goal: under 3% cost.
"""

from __future__ import annotations

import threading
import urllib.request

import torch

from tensorshare import Client, TensorShare

from .procs import Server
from .profiles import Profile
from .record import Recorder
from .small_ops import _callback_rates, _latency_figures
from .stats import LatencyRuns, Sample, interleaved_latency_runs


class Scraper:
    """Fetches /metrics and /status.json every ``interval`` seconds until stopped."""

    def __init__(self, port: int, interval: float = 1.0):
        self.port, self.interval = port, interval
        self.scrapes = self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for path in ("/metrics", "/status.json"):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                        r.read()
                    self.scrapes += 1
                except OSError:
                    self.failures += 1
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _round(p: Profile, first: str, runs: int, pipe_runs: int, warm: bool) -> tuple[dict, dict, int]:
    """One pair of servers (``first`` started first): latency runs and pipelined rates."""
    value = torch.ones(16, dtype=torch.float32)
    servers: dict[str, Server] = {}
    clients: list = []
    scraper = None
    try:
        # --metrics-port 0: a port picked here and freed could go to the other server's
        # --port 0 before this one binds it.
        for name in (first, "on" if first == "off" else "off"):
            servers[name] = Server("--metrics-port", "0") if name == "on" else Server()
        scraper = Scraper(servers["on"].metrics_port)
        calls = {}
        for name in ("off", "on"):
            client = Client("127.0.0.1", servers[name].port, timeout=p.client_timeout_s)
            clients.append(client)
            client.put("bench-ops", value)
            calls[f"put_{name}"] = lambda c=client: c.put("bench-ops", value)
            calls[f"peek_{name}"] = lambda c=client: c.peek("bench-ops")
        warm_ops = max(p.small_ops // 5, 10) if warm else 0
        lat = interleaved_latency_runs(calls, p.small_ops, runs, warm_ops)
        pipes = {name: TensorShare("127.0.0.1", servers[name].port, timeout=p.client_timeout_s)
                 for name in ("off", "on")}
        clients.extend(pipes.values())
        # Short runs, alternating: on a shared machine a pipelined run's rate swings
        # with the neighbours' load.
        rates: dict[str, list[float]] = {"off": [], "on": []}
        count = max(p.pipelined_ops // 2, 100)
        for r in range(pipe_runs):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rates[name] += _callback_rates(pipes[name], value, count, 1, p.warmup if r == 0 and warm else 0,
                                               p.client_timeout_s)
        scraper.stop()
        if scraper.failures or not scraper.scrapes:
            raise RuntimeError(f"the metrics port answered {scraper.scrapes} scrapes and failed {scraper.failures}")
        return lat, rates, scraper.scrapes
    finally:
        if scraper is not None:
            scraper.stop()
        for client in clients:
            client.close()
        for server in servers.values():
            server.stop()


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("9. Metrics on vs off")
    rounds = p.ops_rounds
    runs = max(p.small_runs // rounds, 2)
    pipe_runs = max(p.pipelined_runs, 1)
    medians: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    scrapes = 0
    for i in range(rounds):
        lat, round_rates, n = _round(p, "off" if i % 2 == 0 else "on", runs, pipe_runs, warm=bool(p.warmup))
        scrapes += n
        for name, runs_of in lat.items():
            medians.setdefault(name, []).extend(runs_of.medians.values)
            p99s.setdefault(name, []).extend(runs_of.p99s.values)
        for name in rates:
            rates[name] += round_rates[name]
    lat = {name: LatencyRuns(Sample.of(medians[name]), Sample.of(p99s[name])) for name in medians}
    on = "metrics on (scraped every 1 s)"
    _latency_figures(rec, "ops.put_off", "Client.put 16 x float32, metrics off", lat["put_off"], baseline=True)
    _latency_figures(rec, "ops.put_on", f"Client.put 16 x float32, {on}", lat["put_on"], vs=["ops.put_off"])
    _latency_figures(rec, "ops.peek_off", "Client.peek 16 x float32, metrics off", lat["peek_off"], baseline=True)
    _latency_figures(rec, "ops.peek_on", f"Client.peek 16 x float32, {on}", lat["peek_on"], vs=["ops.peek_off"])
    rec.figure("ops.pipe_off", "TensorShare.append 16 x float32 pipelined, metrics off", Sample.of(rates["off"]),
               "ops/s", baseline=True)
    rec.figure("ops.pipe_on", f"TensorShare.append 16 x float32 pipelined, {on}", Sample.of(rates["on"]), "ops/s",
               vs=["ops.pipe_off"])
    rec.note(f"metrics section: {rounds} fresh pair(s) of servers, runs pooled; {scrapes} scrapes answered")
    rec.goal_ratio("metrics on: Client.put median latency <= 1.03x off", "ops.put_on.median", "ops.put_off.median",
                   "<=", 1.03)
    rec.goal_ratio("metrics on: Client.peek median latency <= 1.03x off", "ops.peek_on.median",
                   "ops.peek_off.median", "<=", 1.03)
    rec.goal_ratio("metrics on: pipelined appends >= 0.97x off", "ops.pipe_on", "ops.pipe_off", ">=", 0.97)
