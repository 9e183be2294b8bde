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
first version of each block is untimed (a delta way starts with a keyframe), and a
keyframe that comes within the timed versions is counted where it falls.  The ways
take turns, in two blocks each (after the untimed first version of a block, six
timed ones in quick: a delta way makes its periodic keyframe within them).  The
trainer (this process) runs torch ops on one intra-op thread during the section
(see ``run``).  Beside:
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

_ROUNDS = 2  # each way's timed versions come in this many blocks, the ways taking turns
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


class _Samples:
    """One way's timed versions, gathered over its blocks."""

    def __init__(self):
        self.times, self.worker_bytes, self.uploaded, self.publish = [], [], [], []
        self.bad = 0


def _block(p: Profile, trainer: RLTrainer, workers: list[Worker], state: dict, rng: random.Random,
           options: dict, reps: int, got: _Samples) -> None:
    """``1 + reps`` versions published one way (the first untimed: after another way,
    a delta way starts with a keyframe), each awaited by every worker."""
    tensors = [k for k in state if k.startswith("layer")]
    changing = max(1, round(len(tensors) * p.versions_change))
    noise = torch.randn(p.versions_tensor_elems) * 1e-2
    for w in workers:
        w.send(f"hold {1 + reps} {p.client_timeout_s}")
    for w in workers:
        w.expect(p.client_timeout_s, "holding")
    read: dict[int, int | None] = {i: None for i in range(len(workers))}
    for rep in range(1 + reps):
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
            got.bad += abs(float(checksum) - expected) > 1e-9 * max(1.0, abs(expected))  # summation order may differ
            done.append(float(t))
            if read[i] is not None:
                got_bytes.append(int(nbytes) - read[i])
            read[i] = int(nbytes)
        if rep >= 1:
            got.times.append((max(done) - start) * 1e3)
            got.publish.append((published - start) * 1e3)
            got.worker_bytes.append(sum(got_bytes) / len(got_bytes) / 1e6)
            got.uploaded.append(trainer.last_publish.uploaded_bytes / 1e6)


def _record(rec: Recorder, n: int, key: str, label: str, prefix: str, got: _Samples) -> None:
    if got.bad:
        rec.note(f"RL versions, {label}: {got.bad} worker checksum(s) differed from the trainer's")
    baseline = key == "full"
    vs = [] if baseline else [f"versions.{prefix}full"]
    if prefix:
        label += ", TCP"
    key = prefix + key
    rec.figure(f"versions.{key}.worker_mb", f"RL versions, {label}: MB each worker reads per version",
               Sample.of(got.worker_bytes), "MB", better="lower", baseline=baseline,
               vs=[f"{v}.worker_mb" for v in vs], note="tensor bytes (RLWorker.parameter_bytes)")
    rec.figure(f"versions.{key}.upload_mb", f"RL versions, {label}: MB the trainer uploads per version",
               Sample.of(got.uploaded), "MB", better="lower", baseline=baseline, vs=[f"{v}.upload_mb" for v in vs],
               note=f"mean {sum(got.uploaded) / len(got.uploaded):.2f} MB (keyframes included)")
    rec.figure(f"versions.{key}.publish", f"RL versions, {label}: publish_parameters returns",
               Sample.of(got.publish), "ms", better="lower", baseline=baseline, vs=[f"{v}.publish" for v in vs],
               note="cast and diff included")
    rec.figure(f"versions.{key}.all", f"RL versions, {label}: until all {n} workers hold a version",
               Sample.of(got.times), "ms", better="lower", baseline=baseline, vs=[f"{v}.all" for v in vs],
               chart={"name": "rl-versions", "series": label.replace(", TCP", ""),
                      "x": f"{n} workers, {'TCP' if prefix else 'same host'}"},
               note=f"mean {sum(got.times) / len(got.times):.1f} ms")


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
            # The ways take turns in blocks, so that a machine whose load drifts
            # (a shared one) weighs on each alike.
            got = {key: _Samples() for key, _, _ in _WAYS}
            rounds = max(1, min(_ROUNDS, p.versions_reps // 3))
            for round_ in range(rounds):
                reps = p.versions_reps // rounds + (round_ < p.versions_reps % rounds)
                for key, label, options in _WAYS:
                    _block(p, trainer, workers, state, rng, options, reps, got[key])
                    if options.get("delta") and round_ == rounds - 1:  # what a worker that missed versions reads
                        with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as c:
                            chain = c.peek(trainer.chain_bin)
                        nbytes = tensor_bytes(chain)
                        rec.note(f"RL versions, {label}: a worker that missed versions reads the chain, "
                                 f"{nbytes / 1e6:.1f} MB ({len(chain)} items) = {nbytes / whole:.2f}x the float32 "
                                 "state")
            for key, label, _ in _WAYS:
                _record(rec, n, key, label, prefix, got[key])
        finally:
            rec.release(trainer)


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
    # The trainer's cast and compare run on one intra-op thread: on a shared 2-core
    # machine torch's second OpenMP thread is often descheduled, and each parallel op
    # then waits for it (measured at load 19-31: a bf16 cast of the state 9 ms on one
    # thread, 250 ms on two; docs/design.md).  The full way does no torch op.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rec.note(f"RL versions: the trainer runs torch ops on 1 thread here (torch.set_num_threads; was {threads})")
    server = Server()
    try:
        for zero_copy, prefix, what in ((True, "", "same host (shared memory)"),
                                        (False, "tcp.", "over TCP (as from another host)")):
            rec.say(f"  -- {what}")
            _transport(rec, p, server, state, rng, zero_copy, prefix)
    finally:
        server.stop()
        torch.set_num_threads(threads)
    for prefix, what in (("", ""), ("tcp.", ", over TCP")):
        rec.goal_ratio(f"RL delta version (10% of tensors changed){what}: bytes per worker <= 0.15x full",
                       f"versions.{prefix}delta.worker_mb", f"versions.{prefix}full.worker_mb", "<=", 0.15)
        rec.goal_ratio(f"RL bf16 version{what}: bytes per worker about 0.5x full (<= 0.51x: the step counter "
                       "stays int64)", f"versions.{prefix}bf16.worker_mb", f"versions.{prefix}full.worker_mb",
                       "<=", 0.51)
        rec.goal_ratio(f"RL delta + bf16 version{what}: bytes per worker <= 0.075x full",
                       f"versions.{prefix}delta_bf16.worker_mb", f"versions.{prefix}full.worker_mb", "<=", 0.075)
        if not prefix:  # On one host a full version is mapped from shared memory, not copied: a
            continue    # delta saves memory there, not time (its figures are still reported).
        rec.goal_ratio(f"RL delta version{what}: until {n} workers hold it <= 0.5x full",
                       f"versions.{prefix}delta.all", f"versions.{prefix}full.all", "<=", 0.5)
        rec.goal_ratio(f"RL delta + bf16 version{what}: until {n} workers hold it <= 0.5x full",
                       f"versions.{prefix}delta_bf16.all", f"versions.{prefix}full.all", "<=", 0.5)
