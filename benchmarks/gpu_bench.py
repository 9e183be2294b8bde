"""Section 13: the GPU data path -- CUDA tensors through TCP, shared memory and CUDA IPC.

Skipped with one line where CUDA is not available.  Every row of issue #30's
table, beside a baseline measured in this run (one tensor of ``gpu_bytes``
float32, and a state dict of ``gpu_tensors`` bf16 tensors of the same bytes):

* TCP ``put`` of a CUDA tensor and ``peek`` into ``device="cuda"`` (until the
  device holds it), against raw loopback TCP one way into a warm buffer;
* same-host ``put`` of a CUDA tensor, against a pinned device-to-host copy;
  same-host ``peek`` into CUDA, staged through pinned buffers and with the mapping
  registered, against a pinned host-to-device copy;
* the state dict against one tensor of the same bytes (TCP put);
* same-host ``put(by_reference=True)`` of the state dict, once the previous
  upload of its bytes is done and back to back (its bytes still uploading), and
  same-host reads of it into CUDA in another process (device to device), against
  the pinned copies;
* ``RLTrainer.publish_parameters`` of the CUDA state until a same-host
  ``RLWorker(device="cuda")`` holds it (by device reference), in another process
  and in the trainer's own, against ``torch.multiprocessing`` passing the same
  dict by CUDA IPC to a process whose CUDA is up; and how long
  ``publish_parameters(wait=False)`` holds the trainer: by reference and staged
  (over TCP), idle and with 50 ms of GPU work queued before the call.
"""

from __future__ import annotations

import time

import torch

from tensorshare import Client, RLTrainer

from .baselines import RawLoopback
from .procs import Server, Worker
from .profiles import Profile
from .record import Recorder
from .rl_bench import fan_runs
from .stats import Sample, gbps, mib, time_runs


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("15. GPU data path")
    if not torch.cuda.is_available():
        rec.skip("section gpu", "no CUDA device (torch.cuda.is_available() is false)")
        return
    rec.say(f"  device: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    nbytes = p.gpu_bytes
    server = Server("--zero-copy-min", "0")
    raw = None
    try:
        raw = RawLoopback(nbytes)
        _links(rec, p, nbytes, raw)
        _tcp(rec, p, server, nbytes)
        _same_host(rec, p, server, nbytes)
        _state_dict(rec, p, server, nbytes)
        _by_reference(rec, p, server, nbytes)
        _publish(rec, p, server, nbytes)
    finally:
        rec.release(raw, server)
    _goals(rec)


def _synced(fn):
    """``fn`` and then a wait for the device: what a transfer costs until its bytes are there."""
    def timed():
        fn()
        torch.cuda.synchronize()
    return timed


def _links(rec: Recorder, p: Profile, nbytes: int, raw: RawLoopback) -> None:
    size, rate = mib(nbytes), gbps(nbytes)
    rec.figure("gpu.raw_tcp", f"raw loopback TCP one way, {size}, warm buffer",
               Sample.of(raw.one_way(nbytes, p.gpu_reps, p.warmup, "warm")).map(rate), "GB/s", baseline=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rec.figure("gpu.d2h", f"pinned device-to-host copy, {size}",
               Sample.of(time_runs(_synced(lambda: pinned.copy_(device, non_blocking=True)), p.gpu_reps, p.warmup))
               .map(rate), "GB/s", baseline=True)
    rec.figure("gpu.h2d", f"pinned host-to-device copy, {size}",
               Sample.of(time_runs(_synced(lambda: device.copy_(pinned, non_blocking=True)), p.gpu_reps, p.warmup))
               .map(rate), "GB/s", baseline=True)


def _put_peek(rec: Recorder, p: Profile, client: Client, key: str, label: str, value, vs_put: str,
              vs_peek: str) -> None:
    nbytes = value.numel() * value.element_size()
    rate, name, holder = gbps(nbytes), f"bench-gpu-{key}", []
    rec.figure(f"gpu.{key}.put", f"{label} put of a CUDA tensor, {mib(nbytes)}",
               Sample.of(time_runs(lambda: client.put(name, value), p.gpu_reps, p.warmup)).map(rate), "GB/s",
               vs=[vs_put])
    rec.figure(f"gpu.{key}.peek", f"{label} peek into device=\"cuda\", {mib(nbytes)}",
               Sample.of(time_runs(_synced(lambda: holder.append(client.peek(name, device="cuda"))), p.gpu_reps,
                                   p.warmup, setup=holder.clear)).map(rate), "GB/s", vs=[vs_peek])
    [back] = client.peek(name, device="cuda")
    if not torch.equal(back, value):
        rec.note(f"{label} peek into CUDA did not return what was put")
    holder.clear()
    client.delete(name)


def _tcp(rec: Recorder, p: Profile, server: Server, nbytes: int) -> None:
    value = torch.randn(nbytes // 4, device="cuda")
    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as client:
        _put_peek(rec, p, client, "tcp", "TCP", value, "gpu.raw_tcp", "gpu.raw_tcp")


def _same_host(rec: Recorder, p: Profile, server: Server, nbytes: int) -> None:
    from tensorshare import device as devices
    from tensorshare.device.cuda import streams
    from tensorshare.device.engine import Engine

    value = torch.randn(nbytes // 4, device="cuda")
    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
        if not client.same_host:
            rec.skip("same-host rows", "the server's shared memory is not offered to this client")
            return
        _put_peek(rec, p, client, "shm", "same-host", value, "gpu.d2h", "gpu.h2d")
        staged = devices.engine_for("cuda")
        registering = devices._ENGINES["cuda"] = Engine(streams(), register_host=True)  # the other way to read
        try:
            name, holder = "bench-gpu-registered", []
            client.put(name, value)
            rec.figure("gpu.shm.peek_registered", f"same-host peek into CUDA, {mib(nbytes)}, mapping registered",
                       Sample.of(time_runs(_synced(lambda: holder.append(client.peek(name, device="cuda"))),
                                           p.gpu_reps, p.warmup, setup=holder.clear)).map(gbps(nbytes)), "GB/s",
                       vs=["gpu.h2d", "gpu.shm.peek"])
            holder.clear()
            client.delete(name)
            if not registering.registered_uploads:
                rec.note("the CUDA runtime refused to register the mapping: the registered row measured staging")
        finally:
            devices._ENGINES["cuda"] = staged


def _state_dict(rec: Recorder, p: Profile, server: Server, nbytes: int) -> None:
    n = p.gpu_tensors
    state = {f"layer{i}.weight": torch.randn(nbytes // 2 // n, device="cuda").to(torch.bfloat16) for i in range(n)}
    one = torch.randn(nbytes // 2 // n * n, device="cuda").to(torch.bfloat16)
    rate = gbps(nbytes)
    with Client("127.0.0.1", server.port, timeout=p.client_timeout_s, zero_copy=False) as client:
        rec.figure("gpu.one.put", f"TCP put of one bf16 CUDA tensor, {mib(nbytes)}",
                   Sample.of(time_runs(lambda: client.put("bench-gpu-one", one), p.gpu_reps, p.warmup)).map(rate),
                   "GB/s", vs=["gpu.raw_tcp"])
        rec.figure("gpu.sd.put", f"TCP put of a {n}-tensor bf16 CUDA state dict, {mib(nbytes)}",
                   Sample.of(time_runs(lambda: client.put("bench-gpu-sd", state), p.gpu_reps, p.warmup)).map(rate),
                   "GB/s", vs=["gpu.one.put", "gpu.raw_tcp"])
        client.delete("bench-gpu-one")
        client.delete("bench-gpu-sd")


def _ipc_child(inbox, acks) -> None:
    """The baseline's reader: CUDA up, then acknowledge each dict received by CUDA IPC."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    acks.put("ready")
    while True:
        state = inbox.get()
        if state is None:
            return
        torch.cuda.synchronize()
        acks.put(time.monotonic())
        del state


def _ipc_baseline(state: dict, reps: int, warmup: int) -> list[float]:
    """Milliseconds until a process with CUDA up holds ``state``, passed by torch.multiprocessing."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(inbox, acks), daemon=True)
    child.start()
    try:
        if acks.get(timeout=120) != "ready":
            raise RuntimeError("the CUDA IPC baseline's reader did not start")
        times = []
        for rep in range(warmup + reps):
            start = time.monotonic()
            inbox.put(state)
            got = acks.get(timeout=120)
            if rep >= warmup:
                times.append((got - start) * 1e3)
        inbox.put(None)
        return times
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def _bf16_state(n: int, nbytes: int) -> dict:
    return {f"layer{i}.weight": torch.zeros(nbytes // 2 // n, device="cuda", dtype=torch.bfloat16) for i in range(n)}


def _by_reference(rec: Recorder, p: Profile, server: Server, nbytes: int) -> None:
    """Puts by device reference of the state dict, and reads of it in another process."""
    n, size, rate = p.gpu_tensors, mib(nbytes), gbps(nbytes)
    state = _bf16_state(n, nbytes)
    name = "bench-gpu-ref"
    reader = Worker("cuda-peek", server.port, 600)
    try:
        with Client("127.0.0.1", server.port, timeout=p.client_timeout_s) as client:
            if not client.same_host:
                rec.skip("by-reference rows", "the server's shared memory is not offered to this client")
                return
            exports = client._exported()

            def idle_put() -> None:
                client.put(name, state, by_reference=True)

            rec.figure("gpu.ref.put", f"same-host put by reference of a {n}-tensor {size} bf16 state, its previous "
                       f"upload done", Sample.of(time_runs(idle_put, p.gpu_reps, p.warmup,
                                                          setup=lambda: exports.idle(120))).map(rate),
                       "GB/s", vs=["gpu.d2h"])
            rec.figure("gpu.ref.put_b2b", f"same-host puts by reference of that state back to back (uploads under way)",
                       Sample.of(time_runs(idle_put, p.gpu_reps, p.warmup)).map(rate), "GB/s", vs=["gpu.ref.put"])
            exports.idle(120)
            reader.expect(120, "ready")
            reader.send(f"peek {name} {p.warmup + p.gpu_reps}")
            times = [float(t) for t in reader.expect(300, "peeked").split()[1:]][p.warmup:]
            rec.figure("gpu.ref.peek", f"same-host peek into CUDA of that state in another process (by reference)",
                       Sample.of(times).map(lambda ms: nbytes / ms / 1e6), "GB/s", vs=["gpu.h2d"])
            client.delete(name)
    finally:
        rec.release(reader)


def _busy_gpu(ms: float) -> None:
    """Queue about ``ms`` milliseconds of work on the current stream (a backward pass still running)."""
    rate = torch.cuda.get_device_properties(0).clock_rate or 1_500_000  # kHz
    torch.cuda._sleep(int(ms * rate))


def _blocked(trainer: RLTrainer, state: dict, p: Profile, busy_ms: float, back_to_back: bool) -> list[float]:
    """Milliseconds ``publish_parameters(wait=False)`` held the trainer, with ``busy_ms``
    of GPU work queued before each; ``back_to_back``: the previous publish still
    sending (else each waits for the one before, untimed)."""
    blocked = []
    for rep in range(p.warmup + p.gpu_reps):
        for t in state.values():
            t.fill_(float(trainer.version + 1))
        if busy_ms:
            _busy_gpu(busy_ms)
        else:
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.publish_parameters(state, wait=False)
        if rep >= p.warmup:
            blocked.append((time.perf_counter() - start) * 1e3)
        if not back_to_back:
            trainer.flush(120)
    trainer.flush(120)
    return blocked


def _publish(rec: Recorder, p: Profile, server: Server, nbytes: int) -> None:
    n = p.gpu_tensors
    state = _bf16_state(n, nbytes)
    size = mib(nbytes)
    rec.figure("gpu.ipc_baseline", f"torch.multiprocessing: a {n}-tensor {size} bf16 dict held by a CUDA process",
               Sample.of(_ipc_baseline(state, p.gpu_reps, p.warmup)), "ms", better="lower", baseline=True)
    worker = Worker("rl", server.port, "gpu", 600, "1", "cuda")
    try:
        worker.expect(120, "ready")
        with RLTrainer("127.0.0.1", server.port, experiment="gpu", connect_timeout=30) as trainer:
            _publish_, _first, last, bad = fan_runs(trainer, [worker], state, p.gpu_reps, p.warmup, 120)
            rec.figure("gpu.publish_held", f"publish_parameters of a {n}-tensor {size} bf16 CUDA state until a "
                       f"same-host RLWorker(device=\"cuda\") holds it",
                       Sample.of(last), "ms", better="lower", vs=["gpu.ipc_baseline"])
            if bad:
                rec.note(f"{bad} state dict(s) a worker received were wrong")
            for key, busy in (("", 0.0), ("_busy", 50.0)):
                rec.figure(f"gpu.publish_blocked{key}", f"the trainer held by publish_parameters(wait=False) of that "
                           f"state, by reference, back to back{', 50 ms of GPU work queued' if busy else ''}",
                           Sample.of(_blocked(trainer, state, p, busy, True)), "ms", better="lower")
        _publish_own_process(rec, p, server, state)
        with RLTrainer("127.0.0.1", server.port, experiment="gpu-staged", connect_timeout=30,
                       zero_copy=False) as trainer:
            for key, busy in (("", 0.0), ("_busy", 50.0)):
                rec.figure(f"gpu.publish_blocked_staged{key}", f"the trainer held by publish_parameters(wait=False) "
                           f"of that state, staged over TCP{', 50 ms of GPU work queued' if busy else ''}",
                           Sample.of(_blocked(trainer, state, p, busy, False)), "ms", better="lower")
    finally:
        rec.release(worker)


def _publish_own_process(rec: Recorder, p: Profile, server: Server, state: dict) -> None:
    """publish_parameters until an RLWorker(device="cuda") in the trainer's own process holds it."""
    from tensorshare import RLWorker

    n, size = len(state), mib(sum(t.nbytes for t in state.values()))
    held = []
    with RLTrainer("127.0.0.1", server.port, experiment="gpu-own", connect_timeout=30) as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="gpu-own", device="cuda") as worker:
        for rep in range(p.warmup + p.gpu_reps):
            for t in state.values():
                t.fill_(float(trainer.version + 1))
            torch.cuda.synchronize()
            start = time.perf_counter()
            version = trainer.publish_parameters(state)
            while worker.version < version:
                worker.await_new_parameters(timeout=120)
            torch.cuda.synchronize()
            if rep >= p.warmup:
                held.append((time.perf_counter() - start) * 1e3)
    rec.figure("gpu.publish_held_own", f"publish_parameters of a {n}-tensor {size} bf16 CUDA state until an "
               f"RLWorker(device=\"cuda\") in the trainer's process holds it",
               Sample.of(held), "ms", better="lower", vs=["gpu.ipc_baseline"])


def _goals(rec: Recorder) -> None:
    rec.goal_ratio("TCP put of a CUDA tensor >= 0.8x loopback TCP", "gpu.tcp.put", "gpu.raw_tcp", ">=", 0.8)
    rec.goal_ratio("TCP peek into CUDA >= 0.8x loopback TCP", "gpu.tcp.peek", "gpu.raw_tcp", ">=", 0.8)
    rec.goal_ratio("same-host put from CUDA >= 0.5x a pinned device-to-host copy", "gpu.shm.put", "gpu.d2h",
                   ">=", 0.5)
    rec.goal_ratio("same-host peek into CUDA >= 0.5x a pinned host-to-device copy", "gpu.shm.peek", "gpu.h2d",
                   ">=", 0.5)
    rec.goal_ratio("the bf16 state dict within 1.2x of one tensor of the same bytes (its rate >= 1/1.2)",
                   "gpu.sd.put", "gpu.one.put", ">=", 1 / 1.2)
    rec.goal_ratio("a published CUDA state held by a same-host CUDA worker within 3x of CUDA IPC",
                   "gpu.publish_held", "gpu.ipc_baseline", "<=", 3.0)
    rec.goal_ratio("a published CUDA state held by a CUDA worker in the trainer's process within 3x of CUDA IPC",
                   "gpu.publish_held_own", "gpu.ipc_baseline", "<=", 3.0)
    rec.goal_ratio("same-host put by reference >= 0.5x a pinned device-to-host copy", "gpu.ref.put", "gpu.d2h",
                   ">=", 0.5)
    rec.goal_ratio("same-host peek by reference in another process >= 0.5x a pinned host-to-device copy",
                   "gpu.ref.peek", "gpu.h2d", ">=", 0.5)
    for key, how in (("", "by reference"), ("_busy", "by reference, 50 ms of GPU work queued"),
                     ("_staged", "staged"), ("_staged_busy", "staged, 50 ms of GPU work queued")):
        rec.goal_value(f"the trainer held <= 20 ms by publish_parameters(wait=False), {how}",
                       f"gpu.publish_blocked{key}", "<=", 20.0)
