"""Section 10: tables -- a replay buffer in the server (issue #19).

* sample 256 transitions (``obs`` 4x84x84 uint8 + action + reward: 28,232 bytes
  each, 7.2 MB a sample) from a table of ``tables_rows`` rows over TCP loopback:
  GB/s and samples/s, beside, in this run, the same sample from an in-process
  TorchRL ``ReplayBuffer(LazyTensorStorage)`` (uniform sampler: the local limit;
  where torchrl is not installed, a plain ``torch`` gather of 256 random rows
  stands in, labelled so) and Redis pipelined GETs of 256 random keys holding
  the same bytes.  Goals: at least 1 GB/s, and within 3x of the in-process time.
  Then the same sample by a same-host client through shared memory (the server
  writes the gathered rows into its shared-memory area, the client maps them:
  PROTOCOL.md §10.3), beside the TCP figure of this run.
* inserts/s from ``tables_actors`` actor processes (batches of 32 transitions)
  into a full table (fifo remover), beside the same processes doing Redis RPUSH of
  the same bytes (32 values per RPUSH, the list trimmed to the table's capacity in
  the same round trip).
* a TorchRL ``ReplayBuffer`` over the same table (``tensorshare.torchrl``: TableStorage,
  TableSampler, TableWriter): ``rb.sample()`` of 256 and ``rb.extend()`` of 32 in
  milliseconds, beside the same calls on the in-process ``LazyTensorStorage`` buffer
  of this run.  Goals: sample within 1.0x its time, extend within 1.5x.
* prioritized sample of 256 + priority update of those 256 on a table of
  ``tables_prio_rows`` rows (one int64 column): the round trip over TCP, two NOOP
  round trips (what two calls cost with no work in the server), and their
  difference, the server's time.  Goal: under 2 ms.
"""

from __future__ import annotations

import multiprocessing
import time

import torch

from tensorshare import Client

from .procs import Server
from .profiles import Profile
from .record import Recorder
from .stats import Sample, gbps, time_runs

OBS = (4, 84, 84)
BATCH = 256
ACTOR_BATCH = 32
FILLING_CAPACITY = 1_000_000  # the table of 64 B rows actors insert into while it fills (64 MB of columns)
SMALL_COLUMNS = {"obs": ((14,), torch.float32), "action": ((), torch.int64)}  # 64 B a row


def columns() -> dict:
    return {"obs": (OBS, torch.uint8), "action": ((), torch.int64), "reward": ((), torch.float32)}


def transitions(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randint(0, 256, (n, *OBS), dtype=torch.uint8, generator=g),
            "action": torch.randint(0, 6, (n,), generator=g), "reward": torch.rand(n, generator=g)}


def small_transitions(n: int) -> dict:
    return {"obs": torch.ones(n, 14), "action": torch.arange(n)}


ROW_BYTES = sum(v[0].numel() * v[0].element_size() for v in transitions(1).values())


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("11. Tables (a replay buffer in the server)")
    rec.say(f"  a transition is {ROW_BYTES} bytes; samples of {BATCH}")
    server = Server()
    try:
        # zero_copy=False: these figures are over TCP even on one host (the same-host
        # sample has its own figure, beside the TCP one)
        with Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as client:
            _sample(rec, p, client, peers, server.port)
            _prioritized(rec, p, client)
        _inserts(rec, p, server.port, peers)
    finally:
        server.stop()


def _fill(client: Client, name: str, rows: int, chunk: dict) -> None:
    n = next(iter(chunk.values())).shape[0]
    for first in range(0, rows, n):
        k = min(n, rows - first)
        client.insert(name, {c: v[:k] for c, v in chunk.items()})


def _sample(rec: Recorder, p: Profile, client: Client, peers, port: int) -> None:
    rows, reps, warm = p.tables_rows, p.tables_reps, p.warmup
    nbytes = BATCH * ROW_BYTES
    rate, per_s = gbps(nbytes), (lambda t: BATCH / t)
    chunk = transitions(min(rows, 1000))
    vs: list[str] = []

    # the local limit: the same sample from an in-process buffer
    local_key = _local_sample(rec, rows, reps, warm, chunk, rate)
    if local_key:
        vs.append(local_key)

    redis = peers.redis(rec, "Redis pipelined GETs of 256 keys")
    if redis is not None:
        keys = min(rows, p.tables_redis_keys)
        blob = {i: b"".join(chunk[c][i % chunk["obs"].shape[0]].numpy().tobytes() for c in chunk)
                for i in range(min(keys, chunk["obs"].shape[0]))}
        r = redis.r
        for start in range(0, keys, 500):
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(keys, start + 500)):
                pipe.set(f"bench:t:{i}", blob[i % len(blob)])
            pipe.execute()
        holder: list = []
        g = torch.Generator().manual_seed(1)

        def get256():
            pipe = r.pipeline(transaction=False)
            for i in torch.randint(0, keys, (BATCH,), generator=g).tolist():
                pipe.get(f"bench:t:{i}")
            holder.append(pipe.execute())

        times = time_runs(get256, reps, warm, setup=holder.clear)
        holder.clear()
        for start in range(0, keys, 1000):
            r.delete(*[f"bench:t:{i}" for i in range(start, min(keys, start + 1000))])
        rec.figure("tables.redis_get256", f"Redis pipelined GET of {BATCH} random keys of {ROW_BYTES} B",
                   Sample.of(times).map(rate), "GB/s", baseline=True)
        vs.append("tables.redis_get256")

    client.create_table("bench-replay", rows, columns(), sampler="uniform", remover="fifo")
    _fill(client, "bench-replay", rows, chunk)
    holder = []
    times = time_runs(lambda: holder.append(client.sample("bench-replay", BATCH)), reps, warm, setup=holder.clear)
    drawn = holder[-1]
    if drawn.value["obs"].shape != (BATCH, *OBS):
        rec.note("a table sample came back with the wrong shape")
    holder.clear()
    rec.figure("tables.sample256", f"table sample {BATCH} from {rows} rows over TCP", Sample.of(times).map(rate),
               "GB/s", vs=vs)
    rec.figure("tables.sample256_rate", f"table sample {BATCH} from {rows} rows over TCP, transitions/s",
               Sample.of(times).map(per_s), "samples/s")
    _sample_shm(rec, p, port, rate, [k for k in ("tables.sample256", local_key) if k])
    _torchrl_over_table(rec, p, client, "bench-replay")
    client.delete("bench-replay")
    rec.goal_value("table sample of 256 x 28 KB over TCP >= 1 GB/s", "tables.sample256", ">=", 1.0)
    if local_key:
        rec.goal_ratio("table sample over TCP takes <= 3x the in-process buffer's time", "tables.sample256",
                       local_key, "<=", 3, time_of_rates=True)


def _sample_shm(rec: Recorder, p: Profile, port: int, rate, vs: list[str]) -> None:
    """The same sample by a same-host client: the rows come through shared memory."""
    with Client("127.0.0.1", port, timeout=p.client_timeout_s) as local:
        if not local.same_host:
            rec.note("no shared memory offered to this client: no same-host table sample figure")
            return
        holder: list = []
        times = time_runs(lambda: holder.append(local.sample("bench-replay", BATCH, shared=True)), p.tables_reps,
                          p.warmup,
                          setup=holder.clear)
        if holder[-1].value["obs"].shape != (BATCH, *OBS):
            rec.note("a same-host table sample came back with the wrong shape")
        holder.clear()
    rec.figure("tables.sample256_shm", f"table sample {BATCH} from {p.tables_rows} rows, same host "
               "(shared memory, sample(shared=True))", Sample.of(times).map(rate), "GB/s", vs=vs)


def _local_sample(rec: Recorder, rows: int, reps: int, warm: int, chunk: dict, rate) -> str | None:
    """The in-process baseline: TorchRL's ReplayBuffer if installed, else a torch gather."""
    n = chunk["obs"].shape[0]
    try:
        import logging

        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        logging.getLogger("torchrl").setLevel(logging.WARNING)
    except ImportError as exc:
        rec.note(f"torchrl is not installed ({exc}): the in-process baseline is a plain torch gather of "
                 f"{BATCH} random rows (index_select per column), TorchRL's buffer does the same and more")
        data = {c: torch.cat([v] * -(-rows // n))[:rows] for c, v in chunk.items()}
        holder: list = []

        def gather():
            idx = torch.randint(0, rows, (BATCH,))
            holder.append({c: v.index_select(0, idx) for c, v in data.items()})

        times = time_runs(gather, reps, warm, setup=holder.clear)
        rec.figure("tables.local_gather", f"in-process torch gather of {BATCH} random rows (local limit)",
                   Sample.of(times).map(rate), "GB/s", baseline=True)
        del data
        return "tables.local_gather"
    rb = ReplayBuffer(storage=LazyTensorStorage(rows), batch_size=BATCH)
    td = TensorDict(dict(chunk), batch_size=[n])
    for first in range(0, rows, n):
        k = min(n, rows - first)
        rb.extend(td[:k])
    holder = []
    times = time_runs(lambda: holder.append(rb.sample()), reps, warm, setup=holder.clear)
    holder.clear()
    rec.figure("tables.torchrl_sample256", f"in-process TorchRL ReplayBuffer(LazyTensorStorage) sample {BATCH}",
               Sample.of(times).map(rate), "GB/s", baseline=True)
    rec.figure("tables.torchrl_sample256_ms", f"in-process TorchRL ReplayBuffer(LazyTensorStorage): rb.sample() "
               f"of {BATCH}", Sample.of(times).map(_ms), "ms", better="lower", baseline=True)
    actor = td[:ACTOR_BATCH].clone()
    times = time_runs(lambda: rb.extend(actor), reps * 4, warm)
    rec.figure("tables.torchrl_extend32_ms", f"in-process TorchRL ReplayBuffer(LazyTensorStorage): rb.extend() "
               f"of {ACTOR_BATCH}", Sample.of(times).map(_ms), "ms", better="lower", baseline=True)
    del rb, td
    return "tables.torchrl_sample256"


def _torchrl_over_table(rec: Recorder, p: Profile, client: Client, name: str) -> None:
    """A TorchRL ReplayBuffer over table ``name`` (TableStorage, TableSampler,
    TableWriter) beside the in-process LazyTensorStorage figures of this run:
    ``rb.sample()`` (drawn in the server, one round trip) and ``rb.extend()``."""
    if rec.get("tables.torchrl_sample256_ms") is None:
        return  # no torchrl
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer

    from tensorshare.torchrl import TableSampler, TableStorage, TableWriter

    rb = ReplayBuffer(storage=TableStorage(name, client), sampler=TableSampler(), writer=TableWriter(),
                      batch_size=BATCH)
    holder: list = []
    times = time_runs(lambda: holder.append(rb.sample()), p.tables_reps, p.warmup, setup=holder.clear)
    if holder[-1]["obs"].shape != (BATCH, *OBS):
        rec.note("a TorchRL sample through TableStorage came back with the wrong shape")
    holder.clear()
    rec.figure("tables.trl_table_sample256_ms", f"TorchRL ReplayBuffer(TableStorage, TableSampler): rb.sample() of "
               f"{BATCH} over TCP", Sample.of(times).map(_ms), "ms", better="lower",
               vs=["tables.torchrl_sample256_ms"])
    actor = TensorDict(transitions(ACTOR_BATCH), batch_size=[ACTOR_BATCH])
    times = time_runs(lambda: rb.extend(actor), p.tables_reps * 4, p.warmup)
    rec.figure("tables.trl_table_extend32_ms", f"TorchRL ReplayBuffer(TableStorage, TableWriter): rb.extend() of "
               f"{ACTOR_BATCH} over TCP", Sample.of(times).map(_ms), "ms", better="lower",
               vs=["tables.torchrl_extend32_ms"])
    rb.storage.close()
    rec.goal_ratio("TorchRL rb.sample() through TableStorage within 1.0x the in-process LazyTensorStorage time",
                   "tables.trl_table_sample256_ms", "tables.torchrl_sample256_ms", "<=", 1.0)
    rec.goal_ratio("TorchRL rb.extend() through TableStorage within 1.5x the in-process LazyTensorStorage time",
                   "tables.trl_table_extend32_ms", "tables.torchrl_extend32_ms", "<=", 1.5)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _prioritized(rec: Recorder, p: Profile, client: Client) -> None:
    rows, reps, warm = p.tables_prio_rows, max(p.tables_reps, 5), p.warmup
    client.create_table("bench-prio", rows, {"id": ((), torch.int64)}, sampler="prioritized",
                        priority_exponent=0.6, remover="fifo")
    step = min(rows, 100_000)
    for first in range(0, rows, step):
        k = min(step, rows - first)
        client.insert("bench-prio", {"id": torch.arange(first, first + k)}, priorities=torch.rand(k) + 0.01)
    new = torch.rand(BATCH) + 0.01

    def once():
        s = client.sample("bench-prio", BATCH)
        client.update_priorities("bench-prio", s.keys, new)

    times = time_runs(once, reps, warm)
    pings = time_runs(lambda: (client.ping(), client.ping()), reps, warm)
    client.delete("bench-prio")
    ms = _ms
    rec.figure("tables.noop2", "two NOOP round trips (no work in the server)", Sample.of(pings).map(ms), "ms",
               better="lower", baseline=True)
    rec.figure("tables.prio_rt", f"prioritized sample {BATCH} + update {BATCH} on {rows} rows, round trips",
               Sample.of(times).map(ms), "ms", better="lower", vs=["tables.noop2"])
    base = sorted(pings)[len(pings) // 2]
    rec.figure("tables.prio_server", f"prioritized sample {BATCH} + update {BATCH} on {rows} rows, server time "
               "(round trips minus two NOOPs)", Sample.of([max(t - base, 0.0) for t in times]).map(ms), "ms",
               better="lower")
    rec.goal_value("prioritized sample + update of 256 on the table: server time < 2 ms", "tables.prio_server",
                   "<", 2.0)


# -- inserts from actor processes


def _table_actor(port: int, start: float, run_s: float, table: str = "bench-actors", small: bool = False) -> int:
    chunk = small_transitions(ACTOR_BATCH) if small else transitions(ACTOR_BATCH, seed=int(start * 1000) % 1000)
    done = 0
    with Client("127.0.0.1", port, timeout=60) as client:
        time.sleep(max(0.0, start - time.time()))
        end = start + run_s
        while time.time() < end:
            client.insert(table, chunk)
            done += ACTOR_BATCH
    return done


def _redis_actor(port: int, start: float, run_s: float, capacity: int) -> int:
    import redis

    chunk = transitions(ACTOR_BATCH)
    values = [b"".join(chunk[c][i].numpy().tobytes() for c in chunk) for i in range(ACTOR_BATCH)]
    done = 0
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    time.sleep(max(0.0, start - time.time()))
    end = start + run_s
    while time.time() < end:
        pipe = r.pipeline(transaction=False)
        pipe.rpush("bench:actors", *values)
        pipe.ltrim("bench:actors", -capacity, -1)
        pipe.execute()
        done += ACTOR_BATCH
    r.close()
    return done


def _actors(fn, args: tuple, n: int, run_s: float, lead_s: float) -> float:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "redis", "tensorshare.client", "benchmarks.tables_bench"])
    with ctx.Pool(n) as pool:
        pool.map(abs, range(n))  # the workers are up before the clock starts
        start = time.time() + lead_s  # each connects and makes its batch first
        counts = pool.starmap(fn, [(args[0], start, run_s, *args[1:])] * n)
    return sum(counts) / run_s


def _inserts(rec: Recorder, p: Profile, port: int, peers) -> None:
    n, run_s, runs = p.tables_actors, p.tables_run_s, p.tables_runs
    capacity = p.tables_actor_capacity
    vs = []
    redis = peers.redis(rec, "Redis RPUSH from actor processes")
    if redis is not None:
        rates = [_actors(_redis_actor, (redis.server.port, capacity), n, run_s, p.pool_lead_s) for _ in range(runs)]
        redis.r.delete("bench:actors")
        rec.figure("tables.redis_rpush", f"Redis RPUSH of {ACTOR_BATCH} transitions from {n} processes",
                   Sample.of(rates), "transitions/s", baseline=True)
        vs.append("tables.redis_rpush")
    with Client("127.0.0.1", port, timeout=60) as client:
        client.create_table("bench-actors", capacity, columns(), remover="fifo")
        rates = [_actors(_table_actor, (port,), n, run_s, p.pool_lead_s) for _ in range(runs)]
        size = client.table_info("bench-actors")["size"]
        client.delete("bench-actors")
    if size != capacity:
        rec.note(f"the actors' table held {size} rows, not its capacity {capacity}")
    rec.figure("tables.inserts", f"table inserts of {ACTOR_BATCH} transitions from {n} processes",
               Sample.of(rates), "transitions/s", vs=vs)
    # Rows of 64 B, into a full table and into a large one while it fills (each insert
    # looks for free slots): an RL run's first hours, when its replay table starts empty.
    small = {}
    with Client("127.0.0.1", port, timeout=60) as client:
        for way, rows in (("full", capacity), ("filling", FILLING_CAPACITY)):
            client.create_table("bench-small", rows, SMALL_COLUMNS, remover="fifo")
            small[way] = [_actors(_table_actor, (port, "bench-small", True), n, run_s, p.pool_lead_s)
                          for _ in range(runs)]
            size = client.table_info("bench-small")["size"]
            client.delete("bench-small")
            if way == "filling" and size >= rows:
                rec.note(f"the filling table filled up ({size} rows): not every insert looked for free slots")
    rec.figure("tables.inserts_small", f"table inserts of {ACTOR_BATCH} rows of 64 B from {n} processes into a "
               f"full table of {capacity:,} rows", Sample.of(small["full"]), "rows/s")
    rec.figure("tables.inserts_filling", f"the same into a table of {FILLING_CAPACITY:,} rows while it fills",
               Sample.of(small["filling"]), "rows/s", vs=["tables.inserts_small"])
