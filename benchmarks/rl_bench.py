"""Section 5: RL -- ``RLTrainer`` / ``RLWorker`` against a server process.

Trainer and workers run as users would, so on one host large values go through
shared memory (same-host zero-copy, on by default); section 7 compares that with
the TCP path.

* Fan-out: the trainer publishes a state dict (64 MiB in quick/full: 16 float32
  tensors of 1M elements) to N ``RLWorker`` processes, each waiting in
  ``await_new_parameters``; the time from just before ``publish_parameters`` until
  the last worker holds that version (workers stamp ``time.monotonic()``, one clock
  for the machine, when ``await_new_parameters`` returns).  Beside N x the raw
  one-way loopback time of the same bytes (what N serial copies over a socket
  cost), into a fresh ``torch.empty`` (workers receive into new memory: the
  fairest bound) and into a warm buffer.  The bound leaves out the trainer's own
  upload of the state dict to the server.  The raw transfers are measured between
  the publishes (two of each kind before each), so figure and bound share the load.
* Rollout ingestion: N worker processes append rollouts
  (``{"obs": float32 [32, COLS], "reward": float32 [32]}``) as fast as they can for
  a fixed time while the trainer drains with ``get_data(timeout=...)``; appends/s
  and MB/s counted at the trainer, from the start until it has taken the last
  rollout.  Beside the same bytes RPUSHed by N processes to a Redis list that one
  client drains with LPOP (with a count) / BLPOP.
"""

from __future__ import annotations

import json
import os
import queue
import time
from typing import Callable

import torch

from tensorshare import RLTrainer

from .baselines import RawLoopback
from .procs import ChildError, Server, Worker, Workers
from .profiles import Profile
from .record import Recorder
from .stats import Sample, mib

_ROWS = 32  # rollout rows: obs [32, COLS], reward [32]
_POLL_S = 0.1  # get_data / BLPOP timeout while draining
_START_DELAY_S = 0.2  # rollout runs start this long after the command is sent


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _rollout_bytes(cols: int) -> int:
    return _ROWS * cols * 4 + _ROWS * 4


def _size_label(nbytes: int) -> str:
    return f"{nbytes / 1e3:.1f} KB" if nbytes < 1e6 else mib(nbytes)


# ------------------------------------------------------------------ fan-out


def _record_bounds(rec: Recorder, nbytes: int, n: int, fresh: list[float], warm: list[float]) -> None:
    """Raw one-way loopback of ``nbytes`` (ms), and ``n`` x that: the bound of the fan-out."""
    for suffix, seconds, what in (("fresh", fresh, "fresh torch.empty buffer"), ("warm", warm, "warm buffer")):
        one = Sample.of(seconds)
        gb = nbytes / one.median / 1e9
        rec.figure(f"rl.fan.raw_{suffix}", f"raw loopback one-way {mib(nbytes)}, {what}",
                   one.map(lambda s: s * 1e3), "ms", better="lower", baseline=True, nbytes=nbytes)
        rec.figure(f"rl.fan.bound_{suffix}", f"{n} x raw loopback one-way {mib(nbytes)}, {what}",
                   one.map(lambda s: n * s * 1e3), "ms", better="lower", baseline=True, nbytes=n * nbytes,
                   note=f"{n} serial copies at {gb:.2f} GB/s; measured between the publishes",
                   chart={"name": "rl-fanout", "series": f"{n} x raw one-way ({what})",
                          "x": f"{mib(nbytes)} to {n} workers"})


def fan_runs(trainer: RLTrainer, workers: list[Worker], state: dict, reps: int, warmup: int, wait: float,
             between: Callable[[bool], None] | None = None) -> tuple[list, list, list, int]:
    """Publish ``state`` ``warmup + reps`` times to ``rl`` workers, each waiting in its
    ``fan`` loop; returns, for the timed publishes, the milliseconds until
    ``publish_parameters`` returned, until the first and until the last worker held
    the version, and how many received state dicts were wrong.  The tensors are
    filled with the version (untimed) before each publish; ``between(timed)`` runs
    just before it (to measure baselines under the same load)."""
    nbytes = sum(t.nbytes for t in state.values())
    for w in workers:
        w.send(f"fan {warmup + reps} {wait} {nbytes}")
    for w in workers:  # every worker is in its await loop before the first publish
        w.expect(wait, "fanning")
    publish, first, last, bad = [], [], [], 0
    for rep in range(warmup + reps):
        if between is not None:
            between(rep >= warmup)
        version = trainer.version + 1
        for t in state.values():
            t.fill_(float(version))  # untimed; workers check it
        start = time.monotonic()
        got = trainer.publish_parameters(state)
        published = time.monotonic()
        if got != version:
            raise ChildError(f"publish_parameters returned version {got}, expected {version}")
        done = []
        for w in workers:
            line = w.expect(wait)
            while not line.startswith(("done ", "timeout")):
                line = w.expect(wait)
            if line.startswith("timeout"):
                raise ChildError(f"a worker did not get version {version} in {wait}s")
            _, v, t, ok = line.split()
            if int(v) != version:
                raise ChildError(f"a worker got version {v}, expected {version}")
            bad += ok != "1"
            done.append(float(t))
        if rep >= warmup:
            publish.append((published - start) * 1e3)
            first.append((min(done) - start) * 1e3)
            last.append((max(done) - start) * 1e3)
    return publish, first, last, bad


def _fan_out(rec: Recorder, p: Profile, trainer: RLTrainer, workers: list[Worker], raw: RawLoopback) -> None:
    """Publishes, each beside two raw one-way transfers of the same bytes (fresh and warm
    buffer) measured just before it, so that figure and bound see the same load."""
    n = len(workers)
    nbytes = p.rl_fan_tensors * p.rl_fan_tensor_elems * 4
    size = mib(nbytes)
    rec.say(f"  -- fan-out of a {size} state dict ({p.rl_fan_tensors} tensors) to {_plural(n, 'worker')}")
    state = {f"layer{i}.weight": torch.empty(p.rl_fan_tensor_elems) for i in range(p.rl_fan_tensors)}
    raw_fresh, raw_warm = [], []

    def measure_raw(timed: bool) -> None:
        fresh = raw.one_way(nbytes, 2, 0, "torch")
        warm = raw.one_way(nbytes, 2, 0, "warm")
        if timed:
            raw_fresh.extend(fresh)
            raw_warm.extend(warm)

    publish, first, last, bad = fan_runs(trainer, workers, state, p.rl_fan_reps, p.warmup, p.client_timeout_s,
                                         measure_raw)
    if bad:
        rec.note(f"RL fan-out: {bad} received state dict(s) had the wrong size or values")
    _record_bounds(rec, nbytes, n, raw_fresh, raw_warm)
    title = f"{size} state dict"
    rec.figure("rl.fan.publish", f"RLTrainer.publish_parameters {title} (returns)", Sample.of(publish), "ms",
               better="lower", vs=["rl.fan.raw_fresh", "rl.fan.raw_warm"], nbytes=nbytes,
               note="the trainer's upload to the server")
    rec.figure("rl.fan.first", f"RL fan-out {title}: until the first of {_plural(n, 'worker')} holds it",
               Sample.of(first), "ms", better="lower", vs=["rl.fan.raw_fresh"], nbytes=nbytes)
    rec.figure("rl.fan.all", f"RL fan-out {title}: until all {_plural(n, 'worker')} hold it", Sample.of(last), "ms",
               better="lower", vs=["rl.fan.bound_fresh", "rl.fan.bound_warm"], nbytes=n * nbytes,
               chart={"name": "rl-fanout", "series": "RLTrainer -> RLWorkers (all hold it)",
                      "x": f"{size} to {n} workers"},
               note="from just before publish_parameters; GB/s column: all workers' bytes")


# ------------------------------------------------------------------ rollout ingestion


def _results(workers: list[Worker], got: dict[int, dict]) -> None:
    """Collect, without waiting, the ``result`` lines the workers have printed."""
    for i, w in enumerate(workers):
        while i not in got:
            try:
                line = w.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                w.lines.put(None)
                w.expect(0.001)  # raises ChildError with the worker's stderr
            if line.startswith("result "):
                got[i] = json.loads(line.split(" ", 1)[1])


def _ingest_run(workers: list[Worker], cols: int, seconds: float, take: Callable[[], list],
                check: Callable[[object], bool], limit_s: float) -> tuple[float, int, int]:
    """One run: (seconds from the start until the last rollout was taken, rollouts taken, bad ones)."""
    t0 = time.monotonic() + _START_DELAY_S
    for w in workers:
        w.send(f"roll {cols} {t0!r} {seconds}")
    deadline = t0 + seconds + limit_s
    got: dict[int, dict] = {}
    received = bad = 0
    last = t0
    while True:
        items = take()
        if items:
            last = time.monotonic()
            received += len(items)
            bad += (not check(items[0])) + (len(items) > 1 and not check(items[-1]))
        _results(workers, got)
        if len(got) == len(workers):
            sent = sum(r["appends"] for r in got.values())
            if received >= sent:
                if received > sent:
                    raise ChildError(f"the trainer took {received} rollouts, the workers appended {sent}")
                return last - t0, received, bad
        if time.monotonic() > deadline:
            raise ChildError(f"rollouts not all taken {limit_s}s after the run: {received} of "
                             f"{sum(r['appends'] for r in got.values()) if len(got) == len(workers) else '?'}")


def _ingest(rec: Recorder, p: Profile, workers: list[Worker], cols: int, take, check, key: str, label: str,
            vs: list[str], baseline: bool, series: str, note: str) -> None:
    nbytes = _rollout_bytes(cols)
    rates, mbps = [], []
    bad = 0
    for i in range(p.warmup + p.rl_roll_runs):
        seconds = p.rl_roll_run_s if i >= p.warmup else min(0.5, p.rl_roll_run_s)
        elapsed, n, b = _ingest_run(workers, cols, seconds, take, check, p.client_timeout_s)
        bad += b
        if i >= p.warmup:
            rates.append(n / elapsed)
            mbps.append(n * nbytes / elapsed / 1e6)
    if bad:
        rec.note(f"{label}: {bad} rollout(s) taken were not what was appended")
    rec.figure(f"{key}.rate", f"{label}: appends/s", Sample.of(rates), "appends/s", baseline=baseline,
               vs=[f"{v}.rate" for v in vs], note=note)
    rec.figure(f"{key}.mbps", f"{label}: MB/s", Sample.of(mbps), "MB/s", baseline=baseline,
               vs=[f"{v}.mbps" for v in vs], chart={"name": "rl-ingest", "series": series, "x": _size_label(nbytes)})


def _rollouts(rec: Recorder, p: Profile, peers, trainer: RLTrainer, workers: list[Worker]) -> None:
    n = len(workers)
    redis = peers.redis(rec, "Redis RPUSH/LPOP rollout ingestion")
    with Workers() as redis_ws:
        rworkers = []
        if redis is not None:
            key = f"bench:rl:rollouts:{os.getpid()}"
            rworkers = [redis_ws.start("redis-roll", redis.server.port, key, p.rl_worker_lifetime_s)
                        for _ in range(n)]
            for w in rworkers:
                w.expect(120, "ready")
            r = redis.r
        for cols in p.rl_roll_cols:
            nbytes = _rollout_bytes(cols)
            what = f"{_plural(n, 'process')} x {_size_label(nbytes)} rollouts"
            rec.say(f"  -- rollout ingestion: {what}, appending for {p.rl_roll_run_s}s per run")
            vs = []
            if redis is not None:
                batch = max(1, (64 << 20) // nbytes)

                def take_redis() -> list:
                    items = r.lpop(key, batch)
                    if items:
                        return items
                    got = r.blpop([key], timeout=_POLL_S)
                    return [got[1]] if got else []

                _ingest(rec, p, rworkers, cols, take_redis, lambda item, nb=nbytes: len(item) == nb,
                        f"rl.roll.{cols}.redis", f"Redis RPUSH/LPOP ingestion, {what}", [], True, "Redis RPUSH/LPOP",
                        f"LPOP up to {batch} at once, BLPOP {_POLL_S}s when empty; raw bytes, nothing decoded")
                r.delete(key)
                vs = [f"rl.roll.{cols}.redis"]

            def take_ts() -> list:
                return trainer.get_data(timeout=_POLL_S)

            def check_ts(item, c=cols) -> bool:
                return (isinstance(item, dict) and tuple(item["obs"].shape) == (_ROWS, c)
                        and tuple(item["reward"].shape) == (_ROWS,))

            dropped = trainer.dropped
            _ingest(rec, p, workers, cols, take_ts, check_ts, f"rl.roll.{cols}.ts",
                    f"RL ingestion add_data/get_data, {what}", vs, False, "RLWorker -> RLTrainer",
                    f"get_data(timeout={_POLL_S}) in a loop")
            if trainer.dropped != dropped:
                rec.note(f"RLTrainer dropped {trainer.dropped - dropped} rollouts as stale")
    small = min(p.rl_roll_cols)
    rec.goal_ratio(f"RL ingestion of {_size_label(_rollout_bytes(small))} rollouts from "
                   f"{_plural(len(workers), 'process')} >= 1.0x Redis RPUSH/LPOP",
                   f"rl.roll.{small}.ts.rate", f"rl.roll.{small}.redis.rate", ">=", 1.0)


# ------------------------------------------------------------------ the section


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("5. RL")
    n = p.rl_workers
    nbytes = p.rl_fan_tensors * p.rl_fan_tensor_elems * 4
    experiment = f"bench-rl-{os.getpid()}"
    server = trainer = raw = None
    try:
        raw = RawLoopback(nbytes)
        server = Server()
        rec.say(f"  server pid {server.pid} on port {server.port}; starting {_plural(n, 'RLWorker process')}")
        with Workers() as ws:
            def start_workers() -> list[Worker]:
                started = [ws.start("rl", server.port, experiment, p.rl_worker_lifetime_s) for _ in range(n)]
                for w in started:
                    w.expect(120, "ready")
                return started

            workers = start_workers()
            trainer = RLTrainer("127.0.0.1", server.port, experiment=experiment, timeout=p.client_timeout_s)
            try:
                _fan_out(rec, p, trainer, workers, raw)
            except Exception as exc:  # one part failing must not hide the other
                rec.error("rl: fan-out", exc)
                if not server.alive():
                    raise
                ws.stop()  # they may still be waiting for versions: start afresh
                workers = start_workers()
            raw.close()
            raw = None
            _rollouts(rec, p, peers, trainer, workers)
    finally:
        rec.release(trainer)
        if raw is not None:
            raw.close()
        if server is not None:
            server.stop()
    rec.goal_ratio(f"RL fan-out {mib(nbytes)} to {_plural(n, 'worker')} within 1.5x of {n} x raw one-way "
                   "loopback (fresh buffer)", "rl.fan.all", "rl.fan.bound_fresh", "<=", 1.5)
