"""The profiles (smoke, quick, full): sizes, repetitions and time limits of each measurement."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    sections: tuple[str, ...]          # which sections run, in order
    time_limit_s: int                  # the whole run is stopped after this
    warmup: int                        # untimed runs before the timed ones
    # 1. wire codec
    wire_tensor_bytes: int
    wire_reps: int
    statedict_tensors: int             # the state dict: N tensors of 256x256 float32
    statedict_shape: tuple[int, int]
    # 2. large values through Client
    large_sizes: tuple[int, ...]
    large_reps: int                    # timed runs per size (sizes >= 256 MiB use large_reps_big)
    large_reps_big: int
    large_reps_small: int              # sizes <= 4 MiB: many more runs (each takes milliseconds)
    client_timeout_s: float
    # 3. small ops
    small_ops: int                     # ops per timed run
    small_runs: int
    pipelined_ops: int                 # appends per timed run
    pipelined_runs: int
    async_window: int                  # Deferreds in flight in the AsyncClient run
    # 4. scaling
    scale_clients: tuple[int, ...]
    scale_value_bytes: int
    scale_run_s: float
    scale_runs: int
    fanout_listeners: tuple[int, ...]
    fanout_value_bytes: int
    fanout_reps: int
    rss_total_bytes: int
    rss_bins: int
    rss_runs: int
    # 5. RL (RLTrainer / RLWorker)
    rl_workers: int                    # RLWorker processes (and Redis processes for the baseline)
    rl_fan_tensors: int                # the published state dict: N float32 tensors of M elements
    rl_fan_tensor_elems: int
    rl_fan_reps: int                   # timed publishes (a new version each)
    rl_roll_cols: tuple[int, ...]      # rollout sizes: obs float32 [32, COLS] + reward float32 [32]
    rl_roll_run_s: float               # seconds the workers append per run
    rl_roll_runs: int
    rl_worker_lifetime_s: float        # the RL worker processes exit by themselves after this
    # 6. disk tier
    disk_peek_bytes: int = 256 * MiB   # the item peeked from memory and from its spilled files
    disk_reps: int = 5
    disk_sd_side: int = 512            # the checkpoint: statedict_tensors tensors of side x side float32
    disk_limit_bytes: int = 64 * MiB   # --memory-limit of the RSS run (which stores 4x this)
    # 7. same-host zero-copy
    zc_bytes: int = 256 * MiB          # the tensor put, peeked and taken by reference and over TCP
    zc_reps: int = 3
    zc_fan_bytes: int = 256 * MiB      # the state dict (16 tensors) fanned out to zc_fan_workers RLWorkers
    zc_fan_workers: int = 8
    # 8. actor-learner runs (CartPole, 4 actors, three transports)
    al_warmup_s: float = 2.0           # seconds of each run not counted (processes start, caches warm)
    al_run_s: float = 5.0              # seconds counted per run
    al_runs: int = 1                   # runs per transport and configuration
    # 10. beyond one machine (network namespaces with shaped links; needs root)
    mh_workers: int = 8                # worker hosts
    mh_rate: str = "1gbit"             # every link, both directions (tc tbf)
    mh_fan_bytes: int = 16 * MiB       # the state dict fanned out (16 tensors)
    mh_reps: int = 3
    mh_roll_shards: tuple[int, ...] = (1, 2, 4)
    mh_roll_bytes: int = 256 << 10     # one rollout
    mh_roll_run_s: float = 2.0
    mh_table_rows: int = 1 << 20       # the table the hosts' writers insert into
    # 11. tables (a replay buffer in the server)
    tables_rows: int = 100_000         # transitions of 28 KB (obs 4x84x84 uint8) the sampled table holds
    tables_reps: int = 20              # timed samples of 256
    tables_redis_keys: int = 20_000    # keys of the Redis baseline (the same bytes per key)
    tables_prio_rows: int = 1_000_000  # rows of the prioritized table (sample + update of 256)
    tables_actors: int = 8             # actor processes inserting batches of 32
    tables_actor_capacity: int = 10_000
    tables_run_s: float = 2.0
    tables_runs: int = 3
    pool_lead_s: float = 2.0           # a pool of actor processes gets its work this long before the clock starts
    # 16. scale: tables of 10^7-10^8 rows, larger than RAM, sequences (issue #41)
    big_rows: int = 10_000_000         # rows of 64 B in the large table (the goals are stated at 10^8: full)
    big_side_rows: int = 10_000_000    # rows of the side-by-side run with TorchRL in process
    big_ram_table_bytes: int = 2 << 30  # the table larger than RAM (0: twice the machine's memory, if the disk has it)
    big_reps: int = 30
    big_writers: int = 8
    big_run_s: float = 2.0
    big_dir: str = ""                  # where the scratch directory goes ("": the system's temporary directory)
    # 4. scaling over --workers (issue #32): the most clients of scale_clients against each count
    scale_workers: tuple[int, ...] = (1, 2, 4)
    # 9. metrics on vs off: fresh pairs of servers (where the OS places a process can slow one
    # by 10-15% for its life: runs over several pairs are pooled)
    ops_rounds: int = 3
    # 13. a busy host: CPU-bound processes on every core while small ops and a large put run
    busy_hogs: int = 4                 # CPU-bound processes (the goals are stated for 4 on 2 cores)
    busy_small_ops: int = 1000         # put+peek round trips per timed run
    busy_runs: int = 5
    busy_put_bytes: int = 256 * MiB
    busy_put_reps: int = 5
    # 14. the floor: a small request's CPU beside a minimal server of the same framing, and Redis
    floor_clients: int = 8             # client processes of mixed put/append/get
    floor_value_bytes: int = 1 << 10
    floor_ops: int = 1500              # ops per client per run (CPU per request is counted around them)
    floor_runs: int = 3
    # 12. RL parameter versions (bf16 casts, deltas)
    versions_workers: int = 4          # RLWorker processes holding each version
    versions_tensors: int = 40         # the state dict: N float32 tensors of M elements (and a step counter)
    versions_tensor_elems: int = 1 << 18
    versions_change: float = 0.1       # the share of the tensors that change per version
    versions_reps: int = 12            # timed versions per way of publishing
    # 15. the GPU data path (skipped without CUDA)
    gpu_bytes: int = 1024 * MiB        # the CUDA tensor and the bf16 state dict
    gpu_tensors: int = 96              # tensors of the state dict
    gpu_reps: int = 3


QUICK = Profile(
    name="quick", sections=("wire", "large", "small", "scaling", "rl", "disk", "zerocopy", "actors", "ops", "multihost", "tables", "scale", "versions", "busy", "floor", "gpu"), time_limit_s=1800, warmup=1,
    wire_tensor_bytes=64 * MiB, wire_reps=3, statedict_tensors=100, statedict_shape=(256, 256),
    large_sizes=(1 * MiB, 16 * MiB, 256 * MiB), large_reps=9, large_reps_big=3, large_reps_small=30,
    client_timeout_s=120,
    small_ops=500, small_runs=10, pipelined_ops=20_000, pipelined_runs=3, async_window=512,
    scale_clients=(1, 2, 4, 8), scale_value_bytes=64 << 10, scale_run_s=1.5, scale_runs=3,
    fanout_listeners=(1, 2, 4), fanout_value_bytes=1 * MiB, fanout_reps=5,
    rss_total_bytes=256 * MiB, rss_bins=16, rss_runs=3,
    rl_workers=8, rl_fan_tensors=16, rl_fan_tensor_elems=1 << 20, rl_fan_reps=5,
    rl_roll_cols=(64, 8192), rl_roll_run_s=0.75, rl_roll_runs=3, rl_worker_lifetime_s=300,
    tables_rows=20_000, tables_reps=15, tables_redis_keys=10_000, tables_run_s=1.0, tables_runs=2,
)

FULL = Profile(
    name="full", sections=("wire", "large", "small", "scaling", "rl", "disk", "zerocopy", "actors", "ops", "multihost", "tables", "scale", "versions", "busy", "floor", "gpu"), time_limit_s=5400, warmup=1,
    wire_tensor_bytes=256 * MiB, wire_reps=5, statedict_tensors=100, statedict_shape=(256, 256),
    large_sizes=(1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB), large_reps=7, large_reps_big=5,
    large_reps_small=50,
    client_timeout_s=300,
    small_ops=2500, small_runs=14, pipelined_ops=100_000, pipelined_runs=5, async_window=1024,
    scale_clients=(1, 2, 4, 8, 16), scale_value_bytes=64 << 10, scale_run_s=3.0, scale_runs=5,
    fanout_listeners=(1, 2, 4, 8, 16), fanout_value_bytes=1 * MiB, fanout_reps=9,
    rss_total_bytes=1024 * MiB, rss_bins=16, rss_runs=3,
    rl_workers=8, rl_fan_tensors=16, rl_fan_tensor_elems=1 << 20, rl_fan_reps=9,
    rl_roll_cols=(64, 1024, 8192), rl_roll_run_s=3.0, rl_roll_runs=5, rl_worker_lifetime_s=900,
    disk_peek_bytes=1024 * MiB, disk_reps=7, disk_sd_side=512, disk_limit_bytes=256 * MiB,
    zc_bytes=1024 * MiB, zc_reps=5, al_run_s=10.0, al_runs=3, scale_workers=(1, 2, 4, 8, 16),
    busy_small_ops=2500, busy_runs=9, busy_put_reps=7, floor_ops=4000, floor_runs=5,
    mh_fan_bytes=64 * MiB, mh_reps=5, mh_roll_run_s=4.0,
    big_rows=100_000_000, big_ram_table_bytes=0, big_reps=50, big_run_s=4.0,
)

SMOKE = Profile(
    name="smoke", sections=("wire", "large", "small", "scaling", "rl", "disk", "zerocopy", "ops", "multihost", "tables", "scale", "versions", "busy", "floor", "gpu"), time_limit_s=480, warmup=1,
    wire_tensor_bytes=1 * MiB, wire_reps=1, statedict_tensors=4, statedict_shape=(16, 16),
    large_sizes=(64 << 10,), large_reps=1, large_reps_big=1, large_reps_small=1, client_timeout_s=30,
    small_ops=20, small_runs=1, pipelined_ops=200, pipelined_runs=1, async_window=16,
    scale_clients=(1,), scale_value_bytes=4 << 10, scale_run_s=0.3, scale_runs=1,
    fanout_listeners=(1,), fanout_value_bytes=4 << 10, fanout_reps=1,
    rss_total_bytes=4 * MiB, rss_bins=2, rss_runs=1,
    rl_workers=2, rl_fan_tensors=4, rl_fan_tensor_elems=1 << 16, rl_fan_reps=1,
    rl_roll_cols=(64,), rl_roll_run_s=0.3, rl_roll_runs=1, rl_worker_lifetime_s=120,
    disk_peek_bytes=4 * MiB, disk_reps=1, disk_sd_side=16, disk_limit_bytes=8 * MiB,
    zc_bytes=4 * MiB, zc_reps=1, zc_fan_bytes=4 * MiB, zc_fan_workers=1,
    mh_workers=2, mh_fan_bytes=1 * MiB, mh_reps=1, mh_roll_shards=(2,), mh_roll_bytes=64 << 10, mh_roll_run_s=0.5,
    mh_table_rows=1 << 15,
    tables_rows=512, tables_reps=1, tables_redis_keys=512, tables_prio_rows=10_000, tables_actors=2,
    tables_actor_capacity=256, tables_run_s=0.3, tables_runs=1, pool_lead_s=0.5, ops_rounds=1,
    versions_workers=1, versions_tensors=10, versions_tensor_elems=1 << 12, versions_reps=2,
    scale_workers=(2,), busy_hogs=2, busy_small_ops=20, busy_runs=1, busy_put_bytes=4 * MiB, busy_put_reps=1,
    floor_clients=1, floor_ops=30, floor_runs=1,
    gpu_bytes=64 * MiB, gpu_tensors=8, gpu_reps=1,
    big_rows=20_000, big_side_rows=20_000, big_ram_table_bytes=8 * MiB, big_reps=2, big_writers=2, big_run_s=0.3,
)

# Issue #32's many-core run (scripts/gpu_check.sh runs it on a 16-core machine): 14 client
# processes of mixed 1 KiB put/append/get against --workers 1, 2, 4, 8 beside Redis's 14,
# and the busy-host section with two CPU-bound processes per core (as 4 on 2 cores).
CORES = replace(QUICK, name="cores", sections=("scaling", "busy"), scale_clients=(1, 14), scale_value_bytes=1 << 10,
                scale_workers=(1, 2, 4, 8), busy_hogs=2 * (os.cpu_count() or 2))

PROFILES = {p.name: p for p in (SMOKE, QUICK, FULL, CORES)}
