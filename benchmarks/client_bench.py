"""Section 2: large values through the blocking ``Client`` against a server process.

put, peek and get of tensors of each profile size and of a state dict, in GB/s,
beside raw loopback one way (into a warm buffer, a fresh ``torch.empty`` as the
client's receive buffer is, and a fresh ``np.empty``, which numpy backs with huge
pages), Redis SET/GET of the same bytes, TCPStore set/get (up to its 8 MiB cap)
and torch.save + a raw socket + torch.load (the original tensorshare's way).
Goals compare the 256 MiB figures with raw one-way (warm and fresh torch.empty)
and with Redis.  The client uses the TCP path (``zero_copy=False``), the one a
client on another host gets; section 7 measures the same-host path.
"""

from __future__ import annotations

import torch

from tensorshare import Client

from .baselines import RawLoopback, TorchSaveSocket
from .procs import Server
from .profiles import MiB, Profile
from .record import Recorder
from .stats import Sample, gbps, mib, time_runs


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)


def _state_dict(p: Profile) -> dict[str, torch.Tensor]:
    h, w = p.statedict_shape
    return {f"layer{i}.weight": torch.randn(h, w) for i in range(p.statedict_tensors)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return isinstance(b, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _client_ops(rec: Recorder, client: Client, key: str, title: str, value, nbytes: int, reps: int, warm: int,
                base: dict[str, list[str]], x) -> None:
    """put, peek, get of ``value`` in GB/s; ``base`` maps op -> baseline keys."""
    rate = gbps(nbytes)
    chart = lambda series: {"name": "large", "series": series, "x": x} if x is not None else None  # noqa: E731
    bin_name = f"bench-{key}"
    holder: list = []

    rec.figure(f"{key}.put", f"Client.put {title}", Sample.of(time_runs(lambda: client.put(bin_name, value), reps, warm))
               .map(rate), "GB/s", vs=base["put"], nbytes=nbytes, chart=chart("Client.put"))
    items = client.peek(bin_name)
    if len(items) != 1 or not _same(value, items[0]):
        rec.note(f"Client.peek {title} did not return what was put")
    del items
    rec.figure(f"{key}.peek", f"Client.peek {title}",
               Sample.of(time_runs(lambda: holder.append(client.peek(bin_name)), reps, warm, setup=holder.clear))
               .map(rate), "GB/s", vs=base["peek"], nbytes=nbytes, chart=chart("Client.peek"))

    def refill():
        holder.clear()
        client.put(bin_name, value)

    rec.figure(f"{key}.get", f"Client.get {title}",
               Sample.of(time_runs(lambda: holder.append(client.get(bin_name)), reps, warm, setup=refill))
               .map(rate), "GB/s", vs=base["get"], nbytes=nbytes, chart=chart("Client.get"),
               note="each get follows an untimed put of the value")
    holder.clear()
    client.delete(bin_name)


def _raw_baselines(rec: Recorder, raw: RawLoopback, key: str, title: str, nbytes: int, reps: int, warm: int,
                   x) -> None:
    """Raw loopback one way into a warm buffer, a fresh torch.empty and a fresh np.empty."""
    rate = gbps(nbytes)
    for suffix, buffer, what in (("raw_warm", "warm", "warm buffer"), ("raw_fresh", "torch", "fresh buffer"),
                                 ("raw_fresh_np", "numpy", "fresh np.empty buffer")):
        chart = {"name": "large", "series": f"raw one-way ({what})", "x": x} if x is not None else None
        rec.figure(f"{key}.{suffix}", f"raw loopback one-way {title}, {what}",
                   Sample.of(raw.one_way(nbytes, reps, warm, buffer)).map(rate), "GB/s", baseline=True,
                   nbytes=nbytes, chart=chart,
                   note="torch.empty, as the client's receive buffer" if buffer == "torch" else None)


def _one_size(rec: Recorder, p: Profile, peers, client: Client, raw: RawLoopback, original: TorchSaveSocket,
              nbytes: int) -> None:
    reps = p.large_reps_big if nbytes >= 256 * MiB else p.large_reps_small if nbytes <= 4 * MiB else p.large_reps
    warm = p.warmup
    title = mib(nbytes)
    key = f"large.{nbytes}"
    rate = gbps(nbytes)
    x = nbytes / MiB
    chart = lambda series: {"name": "large", "series": series, "x": x}  # noqa: E731
    value = _tensor(nbytes)

    _raw_baselines(rec, raw, key, title, nbytes, reps, warm, x)
    data = None
    redis = peers.redis(rec, f"Redis SET/GET {title}")
    if redis is not None:
        data = value.numpy().tobytes()
        sets, gets = redis.set_get_seconds(data, reps, warm)
        rec.figure(f"{key}.redis_set", f"Redis SET {title}", Sample.of(sets).map(rate), "GB/s", baseline=True,
                   nbytes=nbytes, chart=chart("Redis SET"))
        rec.figure(f"{key}.redis_get", f"Redis GET {title}", Sample.of(gets).map(rate), "GB/s", baseline=True,
                   nbytes=nbytes, chart=chart("Redis GET"))
    store = peers.tcpstore(rec, f"TCPStore set/get {title}")
    if store is not None:
        if nbytes > store.MAX_VALUE:
            rec.skip(f"TCPStore set/get {title}", f"over TCPStore's {mib(store.MAX_VALUE)} payload cap")
        else:
            data = data if data is not None else value.numpy().tobytes()
            sets, gets = store.set_get_seconds(data, reps, warm)
            rec.figure(f"{key}.tcpstore_set", f"TCPStore set {title}", Sample.of(sets).map(rate), "GB/s",
                       baseline=True, nbytes=nbytes, note="set does not wait for a reply")
            rec.figure(f"{key}.tcpstore_get", f"TCPStore get {title}", Sample.of(gets).map(rate), "GB/s",
                       baseline=True, nbytes=nbytes)
    del data
    rec.figure(f"{key}.torchsave", f"torch.save + raw socket + torch.load {title}",
               Sample.of(original.send_seconds(value, reps, warm)).map(rate), "GB/s", baseline=True,
               nbytes=nbytes, chart=chart("torch.save + socket"))
    common = [f"{key}.raw_warm", f"{key}.raw_fresh"]
    base = {"put": common + [f"{key}.redis_set", f"{key}.tcpstore_set", f"{key}.torchsave"],
            "peek": common + [f"{key}.redis_get", f"{key}.tcpstore_get", f"{key}.torchsave"],
            "get": common + [f"{key}.redis_get", f"{key}.tcpstore_get", f"{key}.torchsave"]}
    _client_ops(rec, client, key, title, value, nbytes, reps, warm, base, x)


def _state_dict_run(rec: Recorder, p: Profile, peers, client: Client, raw: RawLoopback,
                    original: TorchSaveSocket) -> None:
    sd = _state_dict(p)
    nbytes = sum(t.nbytes for t in sd.values())
    h, w = p.statedict_shape
    title = f"state dict {p.statedict_tensors}x{h}x{w} ({mib(nbytes)})"
    key, reps, warm, rate = "large.sd", p.large_reps, p.warmup, gbps(nbytes)

    _raw_baselines(rec, raw, key, mib(nbytes), nbytes, reps, warm, None)
    redis = peers.redis(rec, f"Redis pipelined SET/GET of {title}")
    if redis is not None:
        values = {f"bench:sd:{k}": t.numpy().tobytes() for k, t in sd.items()}
        sets, gets = redis.mset_mget_seconds(values, reps, warm)
        del values
        rec.figure(f"{key}.redis_set", f"Redis pipelined SETs of {title}", Sample.of(sets).map(rate), "GB/s",
                   baseline=True, nbytes=nbytes)
        rec.figure(f"{key}.redis_get", f"Redis pipelined GETs of {title}", Sample.of(gets).map(rate), "GB/s",
                   baseline=True, nbytes=nbytes)
    rec.figure(f"{key}.torchsave", f"torch.save + raw socket + torch.load {title}",
               Sample.of(original.send_seconds(sd, reps, warm)).map(rate), "GB/s", baseline=True, nbytes=nbytes)
    common = [f"{key}.raw_warm", f"{key}.raw_fresh"]
    base = {"put": common + [f"{key}.redis_set", f"{key}.torchsave"],
            "peek": common + [f"{key}.redis_get", f"{key}.torchsave"],
            "get": common + [f"{key}.redis_get", f"{key}.torchsave"]}
    _client_ops(rec, client, key, title, sd, nbytes, reps, warm, base, None)


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("2. Large values through Client")
    sizes = p.large_sizes
    sd_bytes = p.statedict_tensors * p.statedict_shape[0] * p.statedict_shape[1] * 4
    server = raw = original = client = None
    try:
        server = Server()
        rec.say(f"  server pid {server.pid} on port {server.port}")
        client = Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False)
        raw = RawLoopback(max(max(sizes), sd_bytes))
        original = TorchSaveSocket()
        for nbytes in sizes:
            rec.say(f"  -- {mib(nbytes)}")
            _one_size(rec, p, peers, client, raw, original, nbytes)
        rec.say("  -- state dict")
        _state_dict_run(rec, p, peers, client, raw, original)
    finally:
        rec.release(client, raw, original, server)
    goal_size = 256 * MiB if 256 * MiB in sizes else max(sizes)
    title, key = mib(goal_size), f"large.{goal_size}"
    for op in ("put", "peek", "get"):
        rec.goal_ratio(f"Client.{op} {title} >= 0.6x raw one-way loopback (warm buffer)", f"{key}.{op}",
                       f"{key}.raw_warm", ">=", 0.6)
        rec.goal_ratio(f"Client.{op} {title} >= 0.6x raw one-way loopback (fresh buffer)", f"{key}.{op}",
                       f"{key}.raw_fresh", ">=", 0.6)
    # (No put goal against Redis SET: Redis receives at about its own parsing speed, while
    # our put already runs at the link, so the ratio measured Redis, not a gap of ours.)
    rec.goal_ratio(f"Client.peek {title} >= 5x Redis GET", f"{key}.peek", f"{key}.redis_get", ">=", 5)
    rec.goal_ratio(f"Client.get {title} >= 5x Redis GET", f"{key}.get", f"{key}.redis_get", ">=", 5)
