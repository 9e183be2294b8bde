"""The GPU data path on a real GPU (marked ``cuda``; skipped where CUDA is not available).

What the CPU cannot check: CUDA streams and events, pinned memory, CUDA IPC between
processes.  The engine's logic is tested on the CPU in ``test_device.py``,
``test_device_paths.py`` and ``test_device_ipc.py``; ``scripts/gpu_check.sh`` runs
these on a GPU machine (``pytest -m cuda``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device (torch.cuda.is_available() is false)")]

HERE = Path(__file__).resolve().parent
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
          *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))]


@pytest.fixture(scope="module")
def srv():
    proc = ServerProcess("--zero-copy-min", "0")
    yield proc
    proc.stop()


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):  # bitwise (float8 has no == on the CPU)
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)


def every_dtype(n: int) -> dict:
    """``n`` values of each dtype, random bit patterns (NaNs included: compared bitwise;
    no dtype needs a cast kernel: float8 and complex32 have few)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    out = {}
    for dtype in DTYPES:
        if dtype == torch.bool:
            out[str(dtype)] = torch.randint(0, 2, (n,), device="cuda", generator=g).bool()
        else:
            width = torch.empty((), dtype=dtype).element_size()
            out[str(dtype)] = torch.randint(0, 256, (n * width,), dtype=torch.uint8, device="cuda",
                                            generator=g).view(dtype)
    return out


@pytest.mark.parametrize("zero_copy", [False, True], ids=["tcp", "same-host"])
@pytest.mark.parametrize("n", [16, 1 << 20], ids=["small", "large"])
def test_every_dtype_round_trips(srv, zero_copy, n):
    value = every_dtype(n)
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=zero_copy, device="cuda") as c:
        c.put(f"dtypes-{zero_copy}-{n}", value)
        [back] = c.peek(f"dtypes-{zero_copy}-{n}")
    assert equal(back, value) and all(t.is_cuda for t in back.values())


@pytest.mark.parametrize("zero_copy", [False, True], ids=["tcp", "same-host"])
def test_views_and_mixed_dicts(srv, zero_copy):
    big = torch.arange(3 << 20, dtype=torch.float32, device="cuda")
    value = {"offset": big[12345:2_000_000], "strided": big.view(3072, 1024)[:, ::3], "t": big.view(1024, 3072).t(),
             "conj": torch.randn(1000, dtype=torch.complex64, device="cuda").conj(),
             "scalar": torch.tensor(2.5, device="cuda"), "cpu": torch.arange(1000), "np": np.arange(10),
             "nested": [torch.ones(5, device="cuda"), {"x": torch.zeros(3, 3, device="cuda")}], "s": "text"}
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=zero_copy) as c:
        c.put(f"views-{zero_copy}", value)
        [host] = c.peek(f"views-{zero_copy}")
        [dev] = c.peek(f"views-{zero_copy}", device="cuda")
    expected = {k: (v.resolve_conj().cpu() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
    expected["nested"] = [value["nested"][0].cpu(), {"x": value["nested"][1]["x"].cpu()}]
    assert equal(host, expected)
    assert equal(dev, {k: v for k, v in expected.items()})


def test_a_tensor_written_on_another_stream_just_before_put_is_sent_with_its_new_values(srv):
    t = torch.zeros(64 << 20, device="cuda")
    stream = torch.cuda.Stream()
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=False) as c:
        for round_ in range(3):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(50_000_000)  # a long kernel first: the fill below ends well after put starts
                t.fill_(float(round_ + 1))
                c.put("fresh", t)  # on that stream, right after the kernels were queued
            back = c.peek("fresh")[0]
            assert torch.all(back == round_ + 1), f"round {round_}: {back.unique()[:4].tolist()}"


def test_a_reply_is_handed_to_the_readers_stream(srv):
    value = torch.randn(32 << 20, device="cuda")
    stream = torch.cuda.Stream()
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=False) as c:
        c.put("handed", value)
        with torch.cuda.stream(stream):
            [back] = c.peek("handed", device="cuda")
            total = back.double().sum()  # on the reader's stream: after the copies
        torch.cuda.synchronize()
    assert torch.isclose(total, value.double().sum())


def test_peek_into_a_models_own_parameters(srv):
    model = torch.nn.Linear(4096, 4096).cuda()
    source = torch.nn.Linear(4096, 4096).cuda()
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=False) as c:
        c.put("into", source.state_dict())
        targets = model.state_dict()
        [back] = c.peek("into", device="cuda", into=targets)
    assert all(back[k] is targets[k] for k in targets)
    assert equal(model.state_dict(), source.state_dict())


def test_sample_on_the_device(srv):
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=False) as c:
        c.create_table("gpu-table", 256, {"obs": ((4096,), torch.float32)})
        obs = torch.randn(256, 4096)
        c.insert("gpu-table", {"obs": obs})
        sample = c.sample("gpu-table", 128, device="cuda")
    assert sample.value["obs"].is_cuda and torch.equal(sample.value["obs"].cpu(), obs[sample.indices])


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "gpu_procs.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _line(proc: subprocess.Popen, start: str) -> str:
    """The next line ``proc`` prints that starts with ``start`` (others, warnings say, are passed over)."""
    passed = []
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"no line starting {start!r}: {''.join(passed)[-2000:]}")
        if line.startswith(start):
            return line
        passed.append(line)


def test_ipc_readers_never_see_a_torn_version_and_freed_snapshots_leave_the_gpu(srv):
    from gpu_procs import VERSION_BYTES

    reader = _spawn("read", srv.port, "ipc-versions", 12)
    publisher = None
    try:
        _line(reader, "reading")  # up before the first version: it reads many of them
        publisher = _spawn("publish", srv.port, "ipc-versions", 40)
        out, _ = reader.communicate(timeout=120)
        time.sleep(1.5)  # the publisher hears which references are free (it asks twice a second)
    finally:
        reader.kill()
        if publisher is not None:
            publisher.kill()
    published, _ = publisher.communicate(timeout=30)
    assert "read" in out and "errors []" in out, out  # every read whole (version_of raised otherwise)
    found = re.search(r"read (\d+) versions \[([\d, ]*)\]", out)
    assert found and len(found.group(2).split(",")) > 2, out  # it read several versions (by reference: same host)
    held, mem = map(int, re.findall(r"held (\d+) mem (\d+)", published)[-1])
    # torch frees what the client lets go of (its IPC count was not driven below zero by the readers)
    assert held <= 2 and mem <= (held + 1) * VERSION_BYTES, published[-500:]


def test_a_publisher_killed_while_readers_hold_references(srv):
    publisher = _spawn("publish", srv.port, "ipc-killed", 3)
    reader = _spawn("read", srv.port, "ipc-killed", 6)
    try:
        for _ in range(3):
            _line(publisher, "put")
        time.sleep(1.0)  # readers copy meanwhile
        publisher.kill()  # its device memory goes with it
        publisher.wait(30)
        out, _ = reader.communicate(timeout=120)
    finally:
        publisher.kill()
    # every read was one whole version (from the reference or, after, the bytes) or a clear error
    found = re.search(r"read (\d+) versions \[([\d, ]*)\] errors \[(.*)\]", out)
    assert found and "Traceback" not in out, out
    versions = {int(v) for v in found.group(2).split(",") if v.strip()}
    assert versions <= {0, 1, 2} and (2 in versions or "ServerLocalError" in found.group(3)), out
    assert set(re.findall(r"'(\w+)'", found.group(3))) <= {"ServerLocalError"}, out


def test_a_same_host_worker_loads_versions_by_reference_into_its_model(srv):
    from gpu_procs import model_for

    from tensorshare import RLTrainer

    worker = _spawn("work", srv.port, "gpu-rl", 3)  # another process: CUDA IPC opens no memory of its own
    source = model_for()
    try:
        _line(worker, "ready")
        with RLTrainer("127.0.0.1", srv.port, experiment="gpu-rl") as trainer:
            for step in range(1, 4):
                with torch.no_grad():
                    for p in source.parameters():
                        p.fill_(float(step))  # queued just before the publish: it must be in the version
                started = time.perf_counter()
                version = trainer.publish_parameters(source.state_dict(), wait=False)
                blocked = time.perf_counter() - started
                assert blocked < 0.5, blocked
                line = _line(worker, "loaded")
                assert line.startswith(f"loaded {version} values [{float(step)}]"), line
            trainer.flush(30)
        worker.wait(30)
    finally:
        worker.kill()
    assert int(line.rsplit(" ", 1)[1]) >= 1, line  # read device to device, not only from the bytes


def test_a_cast_version_sent_in_the_background_is_the_state_at_the_call(srv):
    from tensorshare import RLTrainer, RLWorker

    # bf16 tensors cast to bf16 and an int counter stay the caller's own: the sender
    # thread must not read them after training changed them
    state = {f"w{i}": torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16) for i in range(8)}
    state["steps"] = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")
    with RLTrainer("127.0.0.1", srv.port, experiment="gpu-cast", zero_copy=False) as trainer, \
            RLWorker("127.0.0.1", srv.port, experiment="gpu-cast", device="cuda", zero_copy=False) as worker:
        for step in range(3):
            version = trainer.publish_parameters(state, dtype=torch.bfloat16, wait=False)
            for t in state.values():  # training goes on at once
                t.add_(1)
            trainer.flush(30)
            params = worker.await_new_parameters(timeout=30)
            assert worker.version == version
            assert all(torch.all(params[k] == step + (0 if k == "steps" else 1)) for k in state), step


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_replies_go_to_the_callers_current_device(srv):
    value = torch.randn(1 << 20, device="cuda:1")
    with tensorshare.Client("127.0.0.1", srv.port, zero_copy=False) as c:
        c.listen("two-gpus-heard", lambda note: None)  # a reading thread: the reply may arrive there
        c.put("two-gpus", value)
        with torch.cuda.device(1):
            [back] = c.peek("two-gpus", device="cuda")
            into = torch.zeros_like(value)
            [placed] = c.peek("two-gpus", device="cuda", into=into)
    assert back.device == torch.device("cuda", 1) and torch.equal(back, value)
    assert placed is into and torch.equal(into, value)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_delta_compares_of_a_state_on_two_gpus():
    from tensorshare.rl.versions import differing

    a, b = torch.ones(10, device="cuda:0"), torch.ones(10, device="cuda:1")
    assert differing([(a, a.clone()), (b, b + 1), (b, b.clone())]) == [False, True, False]


@pytest.mark.parametrize("delta", [False, True])
def test_bf16_and_delta_versions_on_the_gpu(srv, delta):
    from tensorshare import RLTrainer, RLWorker

    state = {f"w{i}": torch.randn(1 << 18, device="cuda") for i in range(16)}
    with RLTrainer("127.0.0.1", srv.port, experiment=f"gpu-bf16-{delta}") as trainer, \
            RLWorker("127.0.0.1", srv.port, experiment=f"gpu-bf16-{delta}", device="cuda") as worker:
        for step in range(4):
            state[f"w{step}"].add_(1.0)
            version = trainer.publish_parameters(state, dtype=torch.bfloat16, delta=delta)
            params = worker.await_new_parameters(timeout=30)
            assert worker.version == version
            assert all(params[k].is_cuda and torch.equal(params[k], state[k].to(torch.bfloat16)) for k in state)
        if delta:
            assert trainer.last_publish.kind == "delta" and trainer.last_publish.changed == 1


def test_each_thread_transfers_on_a_stream_of_its_own():
    import threading

    from tensorshare.device.cuda import streams

    sides = []
    threads = [threading.Thread(target=lambda: sides.append(streams().side(0))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({s.cuda_stream for s in sides}) == 3 and streams().side(0) is streams().side(0)
