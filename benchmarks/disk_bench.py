"""Section 6: the disk tier.

* peek of a spilled item (sent by the kernel from its files, and copied through
  the server with ``--no-sendfile``) beside peek of the same item held in memory,
  three servers in the same run, over TCP (a same-host client would map the
  spilled files: section 7);
* ``Client.save`` + ``load_memmap`` and local ``save_memmap`` of a state dict beside
  ``torch.save`` + ``torch.load`` to the same directory, and writing its bytes to
  one file (the floor); ``load_memmap`` of the state dict at two sizes (lazy
  mapping: the time should not grow with the size);
* the start-up time of a server on a data directory at two data sizes;
* the server's RSS while it holds 4x its ``--memory-limit``, beside an idle server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from tensorshare import Client
from tensorshare.memmap import load_memmap, save_memmap

from .procs import Server
from .profiles import MiB, Profile
from .record import Recorder
from .stats import Sample, gbps, mib, time_runs


def _spilled_peek(rec: Recorder, p: Profile) -> None:
    nbytes = p.disk_peek_bytes
    value = torch.ones(nbytes // 4)
    rate = gbps(nbytes)
    holder: list = []
    for key, label, args in (("disk.peek_memory", "in memory", ()),
                             ("disk.peek_spilled", "spilled (--memory-limit 1MiB)", ("--memory-limit", "1MiB")),
                             ("disk.peek_spilled_copy", "spilled, copied through the server (--no-sendfile)",
                              ("--memory-limit", "1MiB", "--no-sendfile"))):
        with Server(*args) as server, \
                Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as client:
            client.put("bench-disk", value)
            client.put("bench-push", torch.ones(MiB // 2))  # pushes the first one out under the limit
            time.sleep(0.5)
            runs = time_runs(lambda: holder.append(client.peek("bench-disk")), p.disk_reps, p.warmup,
                             setup=holder.clear)
            if not torch.equal(holder[-1][0], value):
                rec.note(f"peek of the {label} item did not return what was put")
            holder.clear()
            rec.figure(key, f"Client.peek {mib(nbytes)}, item {label}", Sample.of(runs).map(rate), "GB/s",
                       vs=["disk.peek_memory"] if key != "disk.peek_memory" else (),
                       baseline=key == "disk.peek_memory")


def _state_dict(n: int, side: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.randn(side, side) for i in range(n)}


def _checkpoints(rec: Recorder, p: Profile, root: str) -> None:
    n, side = p.statedict_tensors, p.disk_sd_side
    sd = _state_dict(n, side)
    nbytes = n * side * side * 4
    what = f"state dict {n}x{side}x{side} ({mib(nbytes)})"
    reps, warm = p.disk_reps, p.warmup
    target = os.path.join(root, "ckpt")

    def clean() -> None:
        shutil.rmtree(target, ignore_errors=True)
        if os.path.exists(target + ".pt"):
            os.unlink(target + ".pt")

    def raw_write() -> None:
        with open(target + ".pt", "wb") as f:
            for t in sd.values():
                f.write(memoryview(t.numpy()))

    rec.figure("disk.raw_write", f"writing the {what}'s bytes to one new file", Sample.of(
        time_runs(raw_write, reps, warm, setup=clean)).map(lambda s: s * 1e3), "ms", better="lower",
        baseline=True, note="the floor for any save to this disk")
    rec.figure("disk.torch_save", f"torch.save of a {what} to a file", Sample.of(
        time_runs(lambda: torch.save(sd, target + ".pt"), reps, warm, setup=clean)).map(lambda s: s * 1e3), "ms", better="lower",
        baseline=True)
    torch.save(sd, target + ".pt")
    rec.figure("disk.torch_load", "torch.load of it", Sample.of(
        time_runs(lambda: torch.load(target + ".pt"), reps, warm)).map(lambda s: s * 1e3), "ms",
        better="lower", baseline=True)
    rec.figure("disk.save_memmap", f"tensorshare.save_memmap of the {what}", Sample.of(
        time_runs(lambda: save_memmap(sd, target), reps, warm, setup=clean)).map(lambda s: s * 1e3), "ms",
        better="lower", vs=["disk.torch_save", "disk.raw_write"])
    with Server() as server, Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
        client.put("bench-ckpt", sd)
        rec.figure("disk.client_save", f"Client.save of a bin holding the {what} (peek + write)", Sample.of(
            time_runs(lambda: client.save("bench-ckpt", target), reps, warm, setup=clean)).map(lambda s: s * 1e3),
            "ms", better="lower", vs=["disk.torch_save", "disk.raw_write"])
    clean()
    save_memmap(sd, target)
    back = load_memmap(target)
    if not all(torch.equal(back[k], sd[k]) for k in sd):
        rec.note("load_memmap did not give back the state dict")
    rec.figure("disk.load_memmap", f"tensorshare.load_memmap of the {what}", Sample.of(
        time_runs(lambda: load_memmap(target), reps, warm)).map(lambda s: s * 1e3), "ms", better="lower",
        vs=["disk.torch_load"])
    clean()
    save_memmap(_state_dict(n, side * 2), target)
    rec.figure("disk.load_memmap_4x", f"tensorshare.load_memmap of a 4x larger state dict "
               f"({mib(nbytes * 4)})", Sample.of(time_runs(lambda: load_memmap(target), reps, warm))
               .map(lambda s: s * 1e3), "ms", better="lower", vs=["disk.load_memmap"])
    clean()


def _restart(rec: Recorder, p: Profile, root: str) -> None:
    """Start-up time of a server on a data directory, at two data sizes."""
    for key, total in (("disk.start_small", p.disk_limit_bytes), ("disk.start_large", 4 * p.disk_limit_bytes)):
        data = os.path.join(root, key)
        with Server("--data-dir", data) as server, \
                Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
            for i in range(32):
                client.append(f"bench-start-{i % 8}", torch.ones(total // 32 // 4))
        runs = []
        for _ in range(p.disk_reps):
            start = time.perf_counter()
            with Server("--data-dir", data) as server, Client("127.0.0.1", server.port) as client:
                client.list()
            runs.append((time.perf_counter() - start) * 1e3)
        rec.figure(key, f"server start on a data directory of 32 items, {mib(total)}, until it answers",
                   Sample.of(runs), "ms", better="lower", vs=["disk.start_small"] if key == "disk.start_large" else ())
        shutil.rmtree(data, ignore_errors=True)


def _rss_at_4x(rec: Recorder, p: Profile) -> None:
    limit = p.disk_limit_bytes
    item = limit // 8
    with Server() as idle:
        time.sleep(0.3)
        rec.figure("disk.rss_idle", "idle server RSS", Sample.of([idle.rss() / MiB]), "MiB", better="lower",
                   baseline=True)
    with Server("--memory-limit", str(limit)) as server, \
            Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
        value = torch.ones(item // 4)
        peak = 0
        for i in range(32):  # 4x the limit
            client.append(f"bench-rss-{i % 8}", value)
            peak = max(peak, server.rss())
        time.sleep(0.3)
        rss = server.rss()
    rec.figure("disk.rss_4x", f"server RSS holding {mib(32 * item)} with --memory-limit {mib(limit)}",
               Sample.of([rss / MiB]), "MiB", better="lower", vs=["disk.rss_idle"],
               note=f"peak while storing: {peak / MiB:.0f} MiB")
    rec.goal_value("server RSS holding 4x its memory limit <= limit + idle RSS + 64 MiB",
                   "disk.rss_4x", "<=", limit / MiB + rec.get("disk.rss_idle")["median"] + 64)


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("6. Disk tier")
    root = tempfile.mkdtemp(prefix="tensorshare-bench-disk-")
    try:
        _spilled_peek(rec, p)
        _checkpoints(rec, p, root)
        _rss_at_4x(rec, p)
        _restart(rec, p, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rec.goal_ratio("tensorshare.save_memmap >= 3x faster than torch.save", "disk.torch_save", "disk.save_memmap",
                   ">=", 3)
    rec.goal_ratio("Client.save (through the server) >= 3x faster than torch.save", "disk.torch_save",
                   "disk.client_save", ">=", 3)
    rec.goal_ratio("load_memmap time independent of size (4x the bytes <= 1.5x the time)",
                   "disk.load_memmap_4x", "disk.load_memmap", "<=", 1.5)
    rec.goal_ratio("server start-up independent of data size (4x the bytes <= 1.5x the time)",
                   "disk.start_large", "disk.start_small", "<=", 1.5)
    rec.goal_ratio("load_memmap >= 3x faster than torch.load", "disk.torch_load", "disk.load_memmap", ">=", 3)
    rec.goal_ratio("peek of a spilled item >= 0.5x peek from memory", "disk.peek_spilled", "disk.peek_memory",
                   ">=", 0.5)
