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
          torch.float32, torch.float64, torch.complex64, torch.complex128]


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
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def every_dtype(n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n)
    out = {}
    for dtype in DTYPES:
        if dtype.is_floating_point or dtype.is_complex:
            out[str(dtype)] = torch.randn(n, device="cuda", generator=g).to(dtype)
        else:
            out[str(dtype)] = torch.randint(0, 100, (n,), device="cuda", generator=g).to(dtype)
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


def test_ipc_readers_never_see_a_torn_or_later_version(srv):
    publisher = _spawn("publish", srv.port, "ipc-versions", 40)
    reader = _spawn("read", srv.port, "ipc-versions", 8)
    try:
        out, _ = reader.communicate(timeout=120)
    finally:
        publisher.kill()
        publisher.wait(30)
    assert "read" in out and "errors []" in out, out  # every read whole (version_of raised otherwise)


def test_a_publisher_killed_while_readers_hold_references(srv):
    publisher = _spawn("publish", srv.port, "ipc-killed", 3)
    reader = _spawn("read", srv.port, "ipc-killed", 6)
    try:
        for _ in range(3):
            assert publisher.stdout.readline().startswith("put")
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


def test_same_host_worker_gets_versions_by_reference_and_loads_them_into_its_model(srv):
    from tensorshare import RLTrainer, RLWorker

    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    source = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    with RLTrainer("127.0.0.1", srv.port, experiment="gpu-rl") as trainer, \
            RLWorker("127.0.0.1", srv.port, experiment="gpu-rl", device="cuda") as worker:
        for step in range(3):
            with torch.no_grad():
                for p in source.parameters():
                    p.add_(1.0)
            started = time.perf_counter()
            version = trainer.publish_parameters(source.state_dict(), wait=False)
            blocked = time.perf_counter() - started
            assert blocked < 0.5, blocked
            params = worker.await_new_parameters(timeout=30)
            assert params is not None and worker.version == version
            assert worker.load_into(model) == version
            assert equal(model.state_dict(), source.state_dict())
        trainer.flush(30)


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
