"""Section 9: the cost of metrics (``--metrics-port``), measured on and off in the same run.

Two servers, one with the operations port on and scraped (``/metrics`` and
``/status.json``) every second, harsher than Prometheus' usual 15 s, one without.
Small-op round trips (``Client.put``/``peek`` of 16 float32) are timed in turns,
run by run, and pipelined callback-client appends alternate between the two, so
a change in the machine's load falls on both alike.  Goal: under 3% cost.
"""

from __future__ import annotations

import socket
import threading
import urllib.request

import torch

from tensorshare import Client, TensorShare

from .procs import Server
from .profiles import Profile
from .record import Recorder
from .small_ops import _callback_rates, _latency_figures
from .stats import Sample, interleaved_latency_runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("9. Metrics on vs off")
    value = torch.ones(16, dtype=torch.float32)
    ops, runs, warm = p.small_ops, p.small_runs, max(p.small_ops // 5, 10) if p.warmup else 0
    servers: dict[str, Server] = {}
    clients: list = []
    scraper = None
    try:
        servers["off"] = Server()
        metrics_port = _free_port()
        servers["on"] = Server("--metrics-port", str(metrics_port))
        scraper = Scraper(metrics_port)
        calls = {}
        for name, server in servers.items():
            client = Client("127.0.0.1", server.port, timeout=p.client_timeout_s)
            clients.append(client)
            client.put("bench-ops", value)
            calls[f"ops.put_{name}"] = lambda c=client: c.put("bench-ops", value)
            calls[f"ops.peek_{name}"] = lambda c=client: c.peek("bench-ops")
        lat = interleaved_latency_runs(calls, ops, runs, warm)
        _latency_figures(rec, "ops.put_off", "Client.put 16 x float32, metrics off", lat["ops.put_off"], baseline=True)
        _latency_figures(rec, "ops.put_on", "Client.put 16 x float32, metrics on (scraped every 1 s)",
                         lat["ops.put_on"], vs=["ops.put_off"])
        _latency_figures(rec, "ops.peek_off", "Client.peek 16 x float32, metrics off", lat["ops.peek_off"],
                         baseline=True)
        _latency_figures(rec, "ops.peek_on", "Client.peek 16 x float32, metrics on (scraped every 1 s)",
                         lat["ops.peek_on"], vs=["ops.peek_off"])
        rates: dict[str, list[float]] = {"off": [], "on": []}
        pipes = {name: TensorShare("127.0.0.1", server.port, timeout=p.client_timeout_s)
                 for name, server in servers.items()}
        clients.extend(pipes.values())
        # More, shorter runs than section 3's, alternating: on a shared machine a
        # pipelined run's rate swings with the neighbours' load.
        count = max(p.pipelined_ops // 2, 100)
        for r in range(3 * p.pipelined_runs):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rates[name] += _callback_rates(pipes[name], value, count, 1, p.warmup if r == 0 else 0,
                                               p.client_timeout_s)
        rec.figure("ops.pipe_off", "TensorShare.append 16 x float32 pipelined, metrics off", Sample.of(rates["off"]),
                   "ops/s", baseline=True)
        rec.figure("ops.pipe_on", "TensorShare.append 16 x float32 pipelined, metrics on (scraped every 1 s)",
                   Sample.of(rates["on"]), "ops/s", vs=["ops.pipe_off"])
        scraper.stop()
        rec.note(f"metrics section: {scraper.scrapes} scrapes answered, {scraper.failures} failed")
        if scraper.failures or not scraper.scrapes:
            raise RuntimeError(f"the metrics port answered {scraper.scrapes} scrapes and failed {scraper.failures}")
    finally:
        if scraper is not None:
            scraper.stop()
        for client in clients:
            client.close()
        for server in servers.values():
            server.stop()
    rec.goal_ratio("metrics on: Client.put median latency <= 1.03x off", "ops.put_on.median", "ops.put_off.median",
                   "<=", 1.03)
    rec.goal_ratio("metrics on: Client.peek median latency <= 1.03x off", "ops.peek_on.median",
                   "ops.peek_off.median", "<=", 1.03)
    rec.goal_ratio("metrics on: pipelined appends >= 0.97x off", "ops.pipe_on", "ops.pipe_off", ">=", 0.97)
