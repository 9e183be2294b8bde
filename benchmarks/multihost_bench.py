"""Section 10: beyond one machine -- hosts as network namespaces on shaped 1 Gbit/s links.

Every host is a network namespace with its own address and its own link to a
switch (:mod:`benchmarks.netns`), shaped to ``mh_rate`` in both directions, so a
server's NIC is a real bottleneck.  Needs root; skipped with the reason otherwise.

* **Link-rate bound**, in this run: one raw TCP transfer of the state dict's bytes
  from host 0 to host 1 (``socket.sendall`` to a receiver that acknowledges the
  last byte).
* **Fan-out** of a state dict (``mh_fan_bytes``, 16 tensors) published in host 0
  until all ``mh_workers`` workers (one per host, each a process that listens and
  peeks every new version) hold it, measured from just before the ``put`` to the
  last worker's peek returning (one machine: one clock).  Four shapes: the
  **star** (every worker reads the head server over its link, TCP), **flat
  relays** (one relay per worker host following the head; workers read their
  host's relay through same-host zero-copy), a **relay tree** (relays follow
  relays, two children each, so the head sends two copies and each relay at most
  two) and a **relay chain** (relay h follows relay h - 1: every link carries one
  copy, and each relay passes a copy on while it arrives, so the last host holds it
  about one link's transfer time after the put).
* **Rollout ingestion** from ``mh_workers`` hosts appending ``mh_roll_bytes``
  rollouts into 1, 2 and 4 shards (``ShardedClient``, one server per shard host,
  each producer appending to its own bin and taking it back every 16 items).
* **Table inserts** of 1 MiB batches (64-byte transitions) from ``mh_workers`` hosts
  into one prioritized table of ``mh_table_rows`` rows on host 0, beside the link's
  own rate: where the server's link, not the CPU its writers share with it on one
  machine (section scale), bounds them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

from .profiles import Profile
from .record import Recorder
from .stats import Sample, mib

TENSORS = 16
CHAIN_PORT = 18100  # the chain's relays listen here, each in its own host, so all start side by side
MIB_BATCH = 1 << 20  # a writer host's table insert (of the scale section's 64-byte rows)


# ------------------------------------------------------------------ the processes in the hosts


def _state(version: int, nbytes: int):
    import torch

    return {f"layer{i}": torch.full((nbytes // TENSORS // 4,), float(version)) for i in range(TENSORS)}


def _publish(nbytes: int) -> None:
    """Host 0's publisher: a ``HOST PORT`` line on stdin says where to publish from
    then on; a ``VERSION`` line puts that version and prints ``VERSION TIME``."""
    import tensorshare

    client = None
    try:
        for line in sys.stdin:
            words = line.split()
            if len(words) == 2:
                if client is not None:
                    client.close()
                client = tensorshare.Client(words[0], int(words[1]), timeout=300)
                continue
            version = int(words[0])
            state = _state(version, nbytes)
            start = time.time()
            client.put("params", state, tag=version)
            print(f"{version} {start}", flush=True)
    finally:
        if client is not None:
            client.close()


def _hold() -> None:
    """A worker host's reader: for each ``HOST PORT ZERO_COPY`` line on stdin, connect
    there, listen to the parameters and print ``VERSION TIME`` for every version held
    (until the next line)."""
    import queue

    import tensorshare

    client = None
    tags: queue.Queue = queue.Queue()
    commands: queue.Queue = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line)
        commands.put("")  # stdin closed: stop

    threading.Thread(target=read_commands, daemon=True).start()
    held = -1
    while True:
        try:
            command = commands.get(timeout=0.001 if client is not None else None)
        except queue.Empty:
            command = None
        if command is not None:
            if client is not None:
                client.close()
            if not command.strip():
                return
            host, port, zero_copy = command.split()
            tags = queue.Queue()
            client = tensorshare.Client(host, int(port), timeout=300, zero_copy=bool(int(zero_copy)))
            client.listen("params", lambda note, q=tags: q.put(note.tag))
            held = -1
            print("ready", flush=True)
            continue
        try:
            tag = tags.get(timeout=0.05)
        except queue.Empty:
            continue
        if tag is None or tag <= held:
            continue
        [state] = client.peek("params")
        version = int(state["layer0"][0])
        if float(state[f"layer{TENSORS - 1}"][-1]) != version:
            print(f"torn {version}", flush=True)
        done = time.time()
        held = version
        del state
        print(f"{version} {done}", flush=True)


def _raw_recv(host: str, nbytes: int) -> None:
    with socket.socket() as listener:
        listener.bind((host, 0))
        listener.listen(1)
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                buffer, got = bytearray(1 << 20), 0
                while got < nbytes:
                    n = conn.recv_into(buffer)
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")


def _raw_send(host: str, port: int, nbytes: int, reps: int) -> None:
    data = bytes(nbytes)
    times = []
    for _ in range(reps):
        with socket.create_connection((host, port)) as conn:
            start = time.perf_counter()
            conn.sendall(data)
            conn.recv(1)
            times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)


def _produce(run_s: float, item_bytes: int, servers: list[str]) -> None:
    import os

    import torch

    import tensorshare

    rollout = {"obs": torch.ones(item_bytes // 4)}
    name = f"rollouts-{os.getpid()}"
    with tensorshare.ShardedClient(servers, timeout=120, zero_copy=False) as client:
        client.ping()
        print("ready", flush=True)
        sys.stdin.readline()  # go
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < run_s:
            client.append(name, rollout)
            count += 1
            if count % 16 == 0:
                client.get(name)
        elapsed = time.perf_counter() - start
        client.delete(name)
    print(json.dumps({"bytes": count * item_bytes, "items": count, "seconds": elapsed}), flush=True)


def _table_insert(run_s: float, batch_bytes: int, capacity: int, server: str) -> None:
    """A writer host's table inserts: batches of ``batch_bytes`` into one table of
    ``capacity`` rows on ``server`` (made by whichever writer comes first, the same
    settings for all), for ``run_s`` seconds from the ``go`` line."""
    import tensorshare

    from .scale_bench import ROW, columns, rows

    batch = batch_bytes // ROW
    data, ends = rows(0, batch)
    host, port = server.rsplit(":", 1)
    with tensorshare.Client(host, int(port), timeout=120, zero_copy=False) as client:
        client.create_table("mh-table", capacity, columns(), sampler="prioritized", priority_exponent=0.6)
        print("ready", flush=True)
        sys.stdin.readline()  # go
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < run_s:
            client.insert("mh-table", data, ends=ends)
            count += 1
        elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": count * batch * ROW, "items": count, "seconds": elapsed}), flush=True)


def worker_main(argv: list[str]) -> None:
    role, *args = argv
    if role == "publish":
        _publish(int(args[0]))
    elif role == "hold":
        _hold()
    elif role == "raw_recv":
        _raw_recv(args[0], int(args[1]))
    elif role == "raw_send":
        _raw_send(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif role == "ingest":
        _produce(float(args[0]), int(args[1]), args[2:])
    elif role == "tinsert":
        _table_insert(float(args[0]), int(args[1]), int(args[2]), args[3])
    else:
        raise SystemExit(f"unknown role {role!r}")


# ------------------------------------------------------------------ the measurements


def _spawn(net, host: int, *args) -> subprocess.Popen:
    return net.python(host, ["-m", "benchmarks.multihost_bench", *map(str, args)], stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """The next stdout line of ``proc`` within ``timeout`` seconds."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0]:
        raise RuntimeError(f"no answer from a worker within {timeout:g}s")
    return box[0].strip()


def _bound(rec: Recorder, net, p: Profile) -> Sample:
    nbytes = p.mh_fan_bytes
    recv = _spawn(net, 1, "raw_recv", net.addresses[1], nbytes)
    port = int(_line(recv, 60))
    send = _spawn(net, 0, "raw_send", net.addresses[1], port, nbytes, p.mh_reps + 1)
    times = json.loads(_line(send, 60 + 10 * (p.mh_reps + 1) * nbytes / 1e8))[1:]
    sample = Sample.of(t * 1e3 for t in times)
    rec.figure("mh.link", f"one link: raw TCP {mib(nbytes)} host 0 -> host 1 at {p.mh_rate}", sample, "ms",
               better="lower", baseline=True,
               note=f"{nbytes / (sample.median / 1e3) / 1e6:.0f} MB/s; netem delay {'on' if net.delayed else 'off'}")
    rec.figure("mh.link_rate", f"one link's rate: raw TCP {mib(nbytes)} host 0 -> host 1 at {p.mh_rate}",
               Sample.of(nbytes / t / 1e6 for t in times), "MB/s", baseline=True)
    return sample


def _fan(rec: Recorder, net, p: Profile, holders: list, publisher, shape: str, label: str) -> None:
    from .netns import start_server, start_servers

    n, nbytes = p.mh_workers, p.mh_fan_bytes
    head, port = start_server(net, 0)
    servers: list = [head]
    if shape == "star":
        targets = [(net.addresses[0], port, 0)] * n
    else:
        relay_ports: dict[int, int] = {}
        follow = ("--follow-timeout", "300")
        # flat: every relay follows the head; tree: relays 1 and 2 follow the head, relay h
        # follows relay h // 2 (two children each); each level starts side by side
        levels = [list(range(1, n + 1))] if shape == "flat" else []
        if shape == "tree":
            level, h = [1, 2], 3
            while level:
                levels.append([x for x in level if x <= n])
                level = [c for x in level for c in (2 * x, 2 * x + 1) if c <= n and c >= 3]
        for level in levels:
            specs = [(h, ("--follow", f"{net.addresses[0]}:{port}" if h <= 2 or shape == "flat"
                          else f"{net.addresses[h // 2]}:{relay_ports[h // 2]}", *follow)) for h in level]
            for h, (proc, relay_port) in zip(level, start_servers(net, specs)):
                relay_ports[h] = relay_port
                servers.append(proc)
        if shape == "chain":  # relay h follows relay h - 1 (relay 1 the head)
            specs = [(h, ("--follow", f"{net.addresses[0]}:{port}" if h == 1
                          else f"{net.addresses[h - 1]}:{CHAIN_PORT}", *follow)) for h in range(1, n + 1)]
            for h, (proc, relay_port) in zip(range(1, n + 1), start_servers(net, specs, port=CHAIN_PORT)):
                relay_ports[h] = relay_port
                servers.append(proc)
        targets = [(net.addresses[h], relay_ports[h], 1) for h in range(1, n + 1)]
    for w, target in zip(holders, targets):
        w.stdin.write(" ".join(map(str, target)) + "\n")
        w.stdin.flush()
    for w in holders:
        if _line(w, 120) != "ready":
            raise RuntimeError("a worker did not start")
    publisher.stdin.write(f"{net.addresses[0]} {port}\n")  # publishes to this run's head from now on
    publisher.stdin.flush()
    limit = 60 + 30 * n * nbytes / 1e8
    alls, firsts, torn = [], [], 0
    for version in range(p.mh_reps + p.warmup):
        publisher.stdin.write(f"{version}\n")
        publisher.stdin.flush()
        start = float(_line(publisher, limit).split()[1])
        last, first = 0.0, float("inf")
        for w in holders:
            while True:
                line = _line(w, limit).split()
                if line[0] == "torn":
                    torn += 1
                    continue
                if int(line[0]) == version:
                    last = max(last, float(line[1]))
                    first = min(first, float(line[1]))
                    break
        if version >= p.warmup:
            alls.append((last - start) * 1e3)
            firsts.append((first - start) * 1e3)
    if torn:
        rec.note(f"fan-out ({label}): {torn} torn state dict(s) seen")
    rec.figure(f"mh.fan.{shape}", f"{label}: {mib(nbytes)} until all {n} worker hosts hold it", Sample.of(alls),
               "ms", better="lower", vs=["mh.link"] + (["mh.fan.star"] if shape != "star" else []),
               note=f"from just before put to the last worker's peek; the first worker: "
                    f"{Sample.of(firsts).median:,.0f} ms")
    for proc in servers:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ingest(rec: Recorder, net, p: Profile, shards: int) -> None:
    from .netns import start_servers

    n = p.mh_workers
    # shard servers on hosts 0..shards-1, producers on the hosts after them
    servers = [f"{net.addresses[h]}:{port}" for h, (_, port) in enumerate(start_servers(net, [(h, ()) for h in range(shards)]))]
    producers = [_spawn(net, shards + i, "ingest", p.mh_roll_run_s, p.mh_roll_bytes, *servers) for i in range(n)]
    total, count = _produced(producers, p.mh_roll_run_s)
    rec.figure(f"mh.ingest.{shards}", f"rollout ingestion from {n} hosts into {shards} shard(s), "
                                      f"{mib(p.mh_roll_bytes)} rollouts", Sample.of([total]), "MB/s",
               vs=["mh.ingest.1"] if shards > 1 else [],
               note=f"{count} appends in {p.mh_roll_run_s:g}s")
    net.stop_processes()


def _table_inserts(rec: Recorder, net, p: Profile) -> None:
    """Inserts of 1 MiB batches from ``mh_workers`` hosts into one table on host 0:
    with the server's link the bound (not, as on one machine, the CPU its writers
    share with it), beside that link's own rate."""
    from .netns import start_server
    from .scale_bench import ROW

    n = p.mh_workers
    _, port = start_server(net, 0)
    server = f"{net.addresses[0]}:{port}"
    writers = [_spawn(net, 1 + i, "tinsert", p.mh_roll_run_s, MIB_BATCH, p.mh_table_rows, server) for i in range(n)]
    total, count = _produced(writers, p.mh_roll_run_s)
    rec.figure("mh.tinsert", f"table inserts of {mib(MIB_BATCH)} batches ({MIB_BATCH // ROW} rows) from {n} "
               f"hosts into one table of {p.mh_table_rows:,} rows on host 0", Sample.of([total]), "MB/s",
               vs=["mh.link_rate"], note=f"{count} inserts in {p.mh_roll_run_s:g}s")
    net.stop_processes()


def _produced(producers: list, run_s: float) -> tuple[float, int]:
    """Start ``producers`` together once each is ready; their MB/s together, and their count of requests."""
    for w in producers:
        if _line(w, 120) != "ready":
            raise RuntimeError("a producer did not start")
    for w in producers:
        w.stdin.write("go\n")
        w.stdin.flush()
    results = [json.loads(_line(w, run_s + 120)) for w in producers]
    return sum(r["bytes"] for r in results) / max(r["seconds"] for r in results) / 1e6, sum(r["items"] for r in results)


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("10. Beyond one machine (network namespaces, shaped links)")
    from .netns import Network, unavailable

    why = unavailable()
    if why:
        rec.skip("multi-host section", why)
        return
    n = p.mh_workers
    with Network(n + 1, rate=p.mh_rate) as net:
        rec.say(f"  {n + 1} hosts ({net.tag}), every link {p.mh_rate}"
                f"{', netem delay ' + net.delay if net.delayed else ' (no netem in this kernel: no added delay)'}")
        _bound(rec, net, p)
        net.stop_processes()
        # one reader per worker host and one publisher in host 0, kept for every shape
        holders = [_spawn(net, h, "hold") for h in range(1, n + 1)]
        publisher = _spawn(net, 0, "publish", p.mh_fan_bytes)
        _fan(rec, net, p, holders, publisher, "star", "star (every worker reads the head, TCP)")
        _fan(rec, net, p, holders, publisher, "flat", "flat relays (one per host, all following the head)")
        _fan(rec, net, p, holders, publisher, "tree", "relay tree (two children per node)")
        _fan(rec, net, p, holders, publisher, "chain", "relay chain (each relay follows the one before, cut-through)")
    for k, shards in enumerate(p.mh_roll_shards, 1):
        with Network(n + shards, rate=p.mh_rate) as net:
            _ingest(rec, net, p, shards)
            if k == len(p.mh_roll_shards):  # (its n + 1 hosts or more: no network of its own to build)
                _table_inserts(rec, net, p)
    rec.goal_ratio(f"relays: all {n} worker hosts hold {mib(p.mh_fan_bytes)} within 2.5x one link's transfer",
                   "mh.fan.chain", "mh.link", "<=", 2.5)
    rec.goal_ratio("flat relays no slower than the star (1.2x slack for noise)", "mh.fan.flat", "mh.fan.star",
                   "<=", 1.2)
    rec.goal_ratio(f"table inserts from {n} hosts >= 0.8x the server's link rate (where the link, not the CPU, "
                   "bounds them)", "mh.tinsert", "mh.link_rate", ">=", 0.8)
    if 4 in p.mh_roll_shards:
        rec.goal_ratio("rollout ingestion into 4 shards >= 2x one shard", "mh.ingest.4", "mh.ingest.1", ">=", 2)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
