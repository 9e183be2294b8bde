"""Section 12: lighter RL parameter versions -- ``publish_parameters(dtype=..., delta=...)``.

A state dict of float32 tensors (40 of 256K elements, 40 MiB, in quick/full) and a
step counter; before each version (untimed) a tenth of the tensors change, as
when one part of a model trains.  N ``RLWorker`` processes await each version;
four ways of publishing, all in one run, against one server:

* ``full``: the original call, every tensor in float32 (the baseline);
* ``bf16``: ``dtype=torch.bfloat16``;
* ``delta``: ``delta=True`` (float32);
* ``delta+bf16``: both.

For each: the tensor bytes a worker reads per version (``RLWorker.parameter_bytes``,
per worker), the bytes the trainer uploads per version (``RLTrainer.last_publish``:
with the keyframes it puts in the chain now and then), and the time from just
before ``publish_parameters`` (diff and cast included) until the last worker holds
the version (workers stamp ``time.monotonic()``, one clock for the machine, when
``await_new_parameters`` returns).  Each worker's checksum of what it holds is
compared with the trainer's of what it published: a wrong one is reported.  The
first version of each way is untimed (a delta way starts with a keyframe), and a
keyframe that comes within the timed versions is counted where it falls.  Beside:
what a worker that missed versions reads (the chain, at the end of a delta way).
"""

from __future__ import annotations

import os
import random
import time

import torch

from tensorshare import Client, RLTrainer
from tensorshare.rl.versions import tensor_bytes

from .procs import ChildError, Server, Worker, Workers
from .profiles import Profile
from .record import Recorder
from .stats import Sample

_WAYS = (  # key, label, publish options
    ("full", "full float32", {}),
    ("bf16", "bf16", {"dtype": torch.bfloat16}),
    ("delta", "delta float32", {"delta": True}),
    ("delta_bf16", "delta + bf16", {"delta": True, "dtype": torch.bfloat16}),
)


def _checksum(state: dict, dtype) -> float:
    """The workers' checksum (benchmarks/workers.py ``hold``) of ``state`` published with ``dtype``."""
    total = 0.0
    for k in sorted(state):
        t = state[k]
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        total += float(t.double().sum())
    return total


def _way(rec: Recorder, p: Profile, trainer: RLTrainer, workers: list[Worker], state: dict, rng: random.Random,
         key: str, label: str, options: dict, prefix: str) -> None:
    tensors = [k for k in state if k.startswith("layer")]
    changing = max(1, round(len(tensors) * p.versions_change))
    noise = torch.randn(p.versions_tensor_elems) * 1e-2
    reps = 1 + p.versions_reps  # the first: untimed
    for w in workers:
        w.send(f"hold {reps} {p.client_timeout_s}")
    for w in workers:
        w.expect(p.client_timeout_s, "holding")
    read: dict[int, int] = {i: None for i in range(len(workers))}
    times, worker_bytes, uploaded, publish = [], [], [], []
    bad = 0
    for rep in range(reps):
        for name in rng.sample(tensors, changing):  # a training step (untimed)
            state[name].add_(noise)
        state["step"] += 1
        expected = _checksum(state, options.get("dtype"))
        start = time.monotonic()
        version = trainer.publish_parameters(state, **options)
        published = time.monotonic()
        done, got_bytes = [], []
        for i, w in enumerate(workers):
            line = w.expect(p.client_timeout_s)
            while not line.startswith(("held ", "timeout")):
                line = w.expect(p.client_timeout_s)
            if line.startswith("timeout"):
                raise ChildError(f"a worker did not get version {version} in {p.client_timeout_s}s")
            _, v, t, checksum, nbytes = line.split()
            if int(v) != version:
                raise ChildError(f"a worker got version {v}, expected {version}")
            bad += abs(float(checksum) - expected) > 1e-9 * max(1.0, abs(expected))  # summation order may differ
            done.append(float(t))
            if read[i] is not None:
                got_bytes.append(int(nbytes) - read[i])
            read[i] = int(nbytes)
        if rep >= 1:
            times.append((max(done) - start) * 1e3)
            publish.append((published - start) * 1e3)
            worker_bytes.append(sum(got_bytes) / len(got_bytes) / 1e6)
            uploaded.append(trainer.last_publish.uploaded_bytes / 1e6)
    if bad:
        rec.note(f"RL versions, {label}: {bad} worker checksum(s) differed from the trainer's")
    n = len(workers)
    baseline = key == "full"
    vs = [] if baseline else [f"versions.{prefix}full"]
    if prefix:
        label += ", TCP"
    key = prefix + key
    rec.figure(f"versions.{key}.worker_mb", f"RL versions, {label}: MB each worker reads per version",
               Sample.of(worker_bytes), "MB", better="lower", baseline=baseline,
               vs=[f"{v}.worker_mb" for v in vs], note="tensor bytes (RLWorker.parameter_bytes)")
    rec.figure(f"versions.{key}.upload_mb", f"RL versions, {label}: MB the trainer uploads per version",
               Sample.of(uploaded), "MB", better="lower", baseline=baseline, vs=[f"{v}.upload_mb" for v in vs],
               note=f"mean {sum(uploaded) / len(uploaded):.2f} MB (keyframes included)")
    rec.figure(f"versions.{key}.publish", f"RL versions, {label}: publish_parameters returns", Sample.of(publish),
               "ms", better="lower", baseline=baseline, vs=[f"{v}.publish" for v in vs],
               note="cast and diff included")
    rec.figure(f"versions.{key}.all", f"RL versions, {label}: until all {n} workers hold a version",
               Sample.of(times), "ms", better="lower", baseline=baseline, vs=[f"{v}.all" for v in vs],
               chart={"name": "rl-versions", "series": label.replace(", TCP", ""),
                      "x": f"{n} workers, {'TCP' if prefix else 'same host'}"},
               note=f"mean {sum(times) / len(times):.1f} ms")


def _transport(rec: Recorder, p: Profile, server: Server, state: dict, rng: random.Random, zero_copy: bool,
               prefix: str) -> None:
    """The four ways, with N fresh workers and a fresh trainer (of one experiment)."""
    n = p.versions_workers
    experiment = f"bench-versions-{os.getpid()}-{int(zero_copy)}"
    whole = p.versions_tensors * p.versions_tensor_elems * 4
    trainer = None
    with Workers() as ws:
        workers = [ws.start("rl", server.port, experiment, p.rl_worker_lifetime_s, int(zero_copy)) for _ in range(n)]
        for w in workers:
            w.expect(120, "ready")
        try:
            trainer = RLTrainer("127.0.0.1", server.port, experiment=experiment, timeout=p.client_timeout_s,
                                zero_copy=zero_copy)
            for key, label, options in _WAYS:
                _way(rec, p, trainer, workers, state, rng, key, label, options, prefix)
                if options.get("delta"):  # what a worker that missed versions reads: the chain
                    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as c:
                        chain = c.peek(trainer.chain_bin)
                    nbytes = tensor_bytes(chain)
                    rec.note(f"RL versions, {label}: a worker that missed versions reads the chain, "
                             f"{nbytes / 1e6:.1f} MB ({len(chain)} items) = {nbytes / whole:.2f}x the float32 state")
        finally:
            if trainer is not None:
                try:
                    trainer.stop()
                except Exception as exc:  # cleanup must go on
                    rec.say(f"  cleanup of RLTrainer failed: {exc}")


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("12. RL parameter versions")
    n = p.versions_workers
    whole = p.versions_tensors * p.versions_tensor_elems * 4
    rec.say(f"  {p.versions_tensors} float32 tensors ({whole / 1e6:.1f} MB), {p.versions_change:.0%} of them "
            f"changing per version, {n} RLWorker processes, {p.versions_reps} timed versions per way")
    rng = random.Random(12)
    torch.manual_seed(12)
    state = {f"layer{i}.weight": torch.randn(p.versions_tensor_elems) for i in range(p.versions_tensors)}
    state["step"] = torch.tensor(0)
    server = Server()
    try:
        for zero_copy, prefix, what in ((True, "", "same host (shared memory)"),
                                        (False, "tcp.", "over TCP (as from another host)")):
            rec.say(f"  -- {what}")
            _transport(rec, p, server, state, rng, zero_copy, prefix)
    finally:
        server.stop()
    for prefix, what in (("", ""), ("tcp.", ", over TCP")):
        rec.goal_ratio(f"RL delta version (10% of tensors changed){what}: bytes per worker <= 0.15x full",
                       f"versions.{prefix}delta.worker_mb", f"versions.{prefix}full.worker_mb", "<=", 0.15)
        rec.goal_ratio(f"RL bf16 version{what}: bytes per worker about 0.5x full (<= 0.51x: the step counter "
                       "stays int64)", f"versions.{prefix}bf16.worker_mb", f"versions.{prefix}full.worker_mb",
                       "<=", 0.51)
        rec.goal_ratio(f"RL delta + bf16 version{what}: bytes per worker <= 0.075x full",
                       f"versions.{prefix}delta_bf16.worker_mb", f"versions.{prefix}full.worker_mb", "<=", 0.075)
        rec.goal_ratio(f"RL delta version{what}: until {n} workers hold it <= 0.5x full",
                       f"versions.{prefix}delta.all", f"versions.{prefix}full.all", "<=", 0.5)
        rec.goal_ratio(f"RL delta + bf16 version{what}: until {n} workers hold it <= 0.5x full",
                       f"versions.{prefix}delta_bf16.all", f"versions.{prefix}full.all", "<=", 0.5)
