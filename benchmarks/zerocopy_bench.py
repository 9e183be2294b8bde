"""Section 7: same-host zero-copy -- references to the server's shared memory instead of bytes.

* put, peek and get of one tensor of the profile's size (1 GiB in full, 256 MiB in
  quick) through the same-host path (``Client``, zero-copy on) beside the TCP path
  (``Client(zero_copy=False)``, same server) and raw loopback one way, all in this
  run.  Puts twice: of an ordinary tensor (written once into shared memory) and of
  a ``Client.shared`` tensor (its pages handed over, nothing copied).
* peek + reading every byte (``sum()``), both paths: what a reader that uses the
  whole value pays, page faults of the mapping included.
* fan-out of a state dict (256 MiB: 16 tensors) from an ``RLTrainer`` to N local
  ``RLWorker`` processes: from just before ``publish_parameters`` until the last
  worker holds it, zero-copy beside TCP (trainer and workers ``zero_copy=False``)
  and N x raw one-way loopback of the same bytes.
"""

from __future__ import annotations

import os
import time

import torch

from tensorshare import Client, RLTrainer

from .baselines import RawLoopback
from .procs import Server, Worker, Workers
from .profiles import Profile
from .record import Recorder
from .rl_bench import fan_runs
from .stats import Sample, gbps, mib, time_runs


def _ops(rec: Recorder, p: Profile, client: Client, key: str, label: str, value: torch.Tensor, vs: dict,
         shared_puts: bool) -> None:
    """put, peek, get (and peek + sum) of ``value`` through ``client``, in GB/s."""
    nbytes = value.nbytes
    rate = gbps(nbytes)
    reps, warm = p.zc_reps, p.warmup
    name = f"bench-zc-{key}"
    holder: list = []

    rec.figure(f"zc.{key}.put", f"{label} put {mib(nbytes)}",
               Sample.of(time_runs(lambda: client.put(name, value), reps, warm)).map(rate), "GB/s", vs=vs["put"])
    if shared_puts:
        def fresh_shared() -> None:  # untimed: a producer computes into shared memory
            holder.clear()
            holder.append(client.shared(torch.empty(value.shape, dtype=value.dtype, device="meta")))
            holder[0].fill_(1.0)

        rec.figure(f"zc.{key}.put_shared", f"{label} put {mib(nbytes)} of a Client.shared tensor (pages handed over)",
                   Sample.of(time_runs(lambda: client.put(name, holder[0]), reps, warm, setup=fresh_shared))
                   .map(rate), "GB/s", vs=vs["put"])
        holder.clear()
        client.put(name, value)
    [back] = client.peek(name)
    if not torch.equal(back, value):
        rec.note(f"{label} peek did not return what was put")
    del back
    rec.figure(f"zc.{key}.peek", f"{label} peek {mib(nbytes)}",
               Sample.of(time_runs(lambda: holder.append(client.peek(name)), reps, warm, setup=holder.clear))
               .map(rate), "GB/s", vs=vs["peek"])
    rec.figure(f"zc.{key}.peek_read", f"{label} peek {mib(nbytes)} + sum() of every element",
               Sample.of(time_runs(lambda: holder.append(client.peek(name)[0].sum()), reps, warm,
                                   setup=holder.clear)).map(rate), "GB/s", vs=vs["peek_read"])

    def refill() -> None:
        holder.clear()
        client.put(name, value)

    rec.figure(f"zc.{key}.get", f"{label} get {mib(nbytes)}",
               Sample.of(time_runs(lambda: holder.append(client.get(name)), reps, warm, setup=refill))
               .map(rate), "GB/s", vs=vs["get"], note="each get follows an untimed put of the value")
    holder.clear()
    client.delete(name)


def _large(rec: Recorder, p: Profile) -> bool:
    nbytes = p.zc_bytes
    reps, warm = p.zc_reps, p.warmup
    size = mib(nbytes)
    with RawLoopback(nbytes) as raw:
        for suffix, buffer, what in (("raw_warm", "warm", "warm buffer"), ("raw_fresh", "torch", "fresh buffer")):
            rec.figure(f"zc.{suffix}", f"raw loopback one-way {size}, {what}",
                       Sample.of(raw.one_way(nbytes, reps, warm, buffer)).map(gbps(nbytes)), "GB/s", baseline=True,
                       note="torch.empty, as the client's receive buffer" if buffer == "torch" else None)
    raw = ["zc.raw_warm", "zc.raw_fresh"]
    value = torch.ones(nbytes // 4)
    with Server() as server, Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as tcp, \
            Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as zc:
        if not zc.same_host:
            rec.skip("same-host zero-copy", "the server's shared memory was not offered or not verified here")
            return False
        rec.say(f"  server pid {server.pid} on port {server.port}; {size} tensors")
        _ops(rec, p, tcp, "tcp", "TCP path (zero_copy=False)", value,
             {"put": raw, "peek": raw, "peek_read": [], "get": raw}, False)
        _ops(rec, p, zc, "shm", "same-host zero-copy", value,
             {op: [f"zc.tcp.{op}"] + (raw if op != "peek_read" else []) for op in ("put", "peek", "peek_read", "get")},
             True)
    return True


def _fan(rec: Recorder, p: Profile) -> None:
    n, tensors = p.zc_fan_workers, 16
    nbytes = p.zc_fan_bytes
    size = mib(nbytes)
    state = {f"layer{i}.weight": torch.empty(nbytes // tensors // 4) for i in range(tensors)}
    wait = p.client_timeout_s
    with RawLoopback(nbytes) as raw:
        one = Sample.of(raw.one_way(nbytes, p.zc_reps, p.warmup, "torch"))
    rec.figure("zc.fan.bound", f"{n} x raw loopback one-way {size}, fresh buffer",
               one.map(lambda s: n * s * 1e3), "ms", better="lower", baseline=True,
               note=f"{n} serial copies at {nbytes / one.median / 1e9:.2f} GB/s")
    paths = (("tcp", False, "TCP path (zero_copy=False)"), ("shm", True, "same-host zero-copy"))
    with Server() as server, Workers() as ws:
        # Both sets start at once (their start-up overlaps); each waits for its own experiment.
        workers: dict[str, list[Worker]] = {
            key: [ws.start("rl", server.port, f"bench-zc-{key}-{os.getpid()}", p.rl_worker_lifetime_s, int(zc))
                  for _ in range(n)] for key, zc, _label in paths}
        for w in workers["tcp"] + workers["shm"]:
            w.expect(120, "ready")
        for key, zero_copy, label in paths:
            rec.say(f"  -- fan-out of a {size} state dict ({tensors} tensors) to {n} RLWorker processes, {label}")
            trainer = RLTrainer("127.0.0.1", server.port, experiment=f"bench-zc-{key}-{os.getpid()}", timeout=wait,
                                zero_copy=zero_copy)
            try:
                if zero_copy:  # publishes alternate between with and without files prepared ahead
                    runs = _alternating(trainer, workers[key], state, p, wait)
                else:
                    runs = [(key, "", fan_runs(trainer, workers[key], state, p.zc_reps, p.warmup, wait))]
            finally:
                trainer.stop()
            for run_key, suffix, (publish, _first, last, bad) in runs:
                if bad:
                    rec.note(f"zero-copy fan-out ({label}{suffix}): {bad} received state dict(s) had the "
                             "wrong size or values")
                rec.figure(f"zc.fan.{run_key}.publish", f"{label}{suffix}: RLTrainer.publish_parameters {size} "
                           "(returns)", Sample.of(publish), "ms", better="lower")
                rec.figure(f"zc.fan.{run_key}.all", f"{label}{suffix}: fan-out of {size} until all {n} workers "
                           "hold it", Sample.of(last), "ms", better="lower",
                           vs=["zc.fan.bound"] + (["zc.fan.tcp.all"] if zero_copy else [])
                           + (["zc.fan.shm_fresh.all"] if run_key == "shm" else []),
                           note="from just before publish_parameters"
                           + ("; publishes alternated with those of the line above" if run_key == "shm" else ""))
            for w in workers[key]:  # done: they let go of what they hold
                w.send("quit")


def _alternating(trainer: RLTrainer, workers: list, state: dict, p: Profile, wait: float) -> list:
    """Same-host fan-out, publishes alternating between files prepared ahead (the
    default) and fresh files (the baseline of that change: the prepared files are
    set aside and none are made), with the same trainer and workers; the two
    figures' runs as ``[(key, label suffix, fan_runs result), ...]``."""
    warmup = p.warmup + 2  # two puts of the same shapes before files are prepared
    areas = trainer.client._shared_areas()
    calls, set_aside = [0], {}

    def between(timed: bool) -> None:
        i = calls[0]
        calls[0] += 1
        if areas is None:
            return
        deadline = time.monotonic() + 10
        while areas._preparing and time.monotonic() < deadline:  # untimed: let the last preparation end
            time.sleep(0.01)
        with areas._spare_lock:
            if timed and (i - warmup) % 2 == 1:  # fresh files for this one
                set_aside.update(areas._spares)
                areas._spares = {}
                areas.prepare_bytes = 0
            else:
                for size, paths in set_aside.items():
                    areas._spares.setdefault(size, []).extend(paths)
                set_aside.clear()
                areas.__dict__.pop("prepare_bytes", None)

    publish, first, last, bad = fan_runs(trainer, workers, state, 2 * p.zc_reps, warmup, wait, between)
    return [("shm_fresh", " (no files prepared ahead)", (publish[1::2], first[1::2], last[1::2], bad)),
            ("shm", "", (publish[::2], first[::2], last[::2], bad))]


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("7. Same-host zero-copy")
    size, fan = mib(p.zc_bytes), mib(p.zc_fan_bytes)
    if not _large(rec, p):
        return
    _fan(rec, p)
    for op in ("peek", "get"):
        rec.goal_ratio(f"zero-copy {op} {size} >= 10x the TCP path", f"zc.shm.{op}", f"zc.tcp.{op}", ">=", 10)
    rec.goal_ratio(f"zero-copy put {size} of a Client.shared tensor >= 10x the TCP path", "zc.shm.put_shared",
                   "zc.tcp.put", ">=", 10)
    rec.goal_ratio(f"zero-copy put {size} of an ordinary tensor (one copy) >= 1x the TCP path", "zc.shm.put",
                   "zc.tcp.put", ">=", 1)
    rec.goal_ratio(f"zero-copy peek {size} + reading every byte >= 1x the TCP path", "zc.shm.peek_read",
                   "zc.tcp.peek_read", ">=", 1)
    rec.goal_ratio(f"zero-copy fan-out {fan} to {p.zc_fan_workers} workers >= 5x faster than over TCP",
                   "zc.fan.tcp.all", "zc.fan.shm.all", ">=", 5)
