"""tensorshare's benchmark suite: every figure beside a baseline measured in the same run.

    python -m benchmarks --profile quick   # a few minutes (``make bench``)
    python -m benchmarks --profile full    # more sizes and clients (``make bench-full``)
    python -m benchmarks --profile smoke   # seconds, tiny sizes; results not written

Modules, one job each:

* :mod:`.profiles`   -- the sizes, repetitions and time limits of each profile
* :mod:`.stats`      -- timing: warm-up, repeated runs, median/min/max, percentiles
* :mod:`.record`     -- collects figures, ratios to baselines, goals, skips; prints progress
* :mod:`.procs`      -- child processes (server, redis-server, workers), always cleaned up
* :mod:`.machine`    -- what the run ran on (cores, memory, versions)
* :mod:`.baselines`  -- the physical and peer baselines (memcpy, raw loopback, Redis, TCPStore, torch.save)
* :mod:`.wire_bench` -- the wire codec (``dumps``/``loads``) against memcpy and torch.save/load
* :mod:`.client_bench` -- large values through ``Client`` against raw loopback, Redis, TCPStore
* :mod:`.small_ops`  -- small-op latency and pipelined appends/s
* :mod:`.scaling`    -- concurrent clients, fan-out to listeners, server RSS per stored GiB
* :mod:`.rl_bench`   -- RLTrainer/RLWorker: parameter fan-out to workers, rollout ingestion
* :mod:`.workers`    -- the code child processes run (``python -m benchmarks.workers KIND ...``)
* :mod:`.runner`     -- runs the sections of a profile and returns the results dict
* :mod:`.report`     -- writes ``results/latest.json``, ``latest.md`` and ``latest-*.png``
* :mod:`.smoke`      -- ``run_smoke()``: the tiny profile, for the test suite
* :mod:`.tables_engine_bench` -- the table engine alone (``python -m benchmarks.tables_engine_bench``):
  prioritized sampling and row gathers beside plain numpy; not part of the profiles
"""
