"""Device tensors through the real clients and a real server, on the CPU.

The device transfer engine runs over ``devicesim.DeferredStreams`` with CPU
tensors standing in for device memory (``devicesim.DeviceTensor``: the codec sends
them through the engine, as CUDA tensors) and replies to calls that ask for the
``cpu`` device arrive through the engine (it is installed for that device type here).
So the clients' staged sends (blocking and Twisted), their receives into device
memory, ``into=`` destinations and the same-host paths (device to the server's
shared memory, its files to the device) all run in CI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorshare
import tensorshare.device as device_engines
from devicesim import DeferredStreams, Stream, module_to_device, to_device
from pairing import async_pair, result_of
from serverproc import ServerProcess
from tensorshare.device.engine import Engine
from tensorshare.wire.codec import encode

BUCKET = 256 << 10


@pytest.fixture
def engine(monkeypatch):
    """The stand-in engine, serving the ``cpu`` device type for this test."""
    eng = Engine(DeferredStreams(), bucket=BUCKET, inline_max=0)
    monkeypatch.setitem(device_engines._ENGINES, "cpu", eng)
    return eng


def state_dict(n: int = 96, size: int = 6000) -> dict:
    torch.manual_seed(n)
    return {f"layer{i}.weight": torch.randn(size + i).to(torch.bfloat16 if i % 3 else torch.float32)
            for i in range(n)}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_tcp_put_and_peek_through_the_engine(server, engine):
    value = {"params": state_dict(), "step": 7, "big": torch.arange(300_000, dtype=torch.float32)}
    sim = engine.streams
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.put("dev-tcp", encode(to_device(value)))
        sent = sim.copies
        assert sent > 96 and engine.pool.made <= engine.depth  # staged, through a few reused buffers
        with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False, device="cpu") as reader:
            [back] = reader.peek("dev-tcp")
        assert same(back, value)
        assert sim.copies > sent and sim.handed  # arrived window by window, handed to the caller
        # a client without a device may ask for one per call
        received = sim.copies
        [again] = c.peek("dev-tcp", device="cpu")
        assert same(again, value) and sim.copies > received
        # and plain reads are untouched
        copies = sim.copies
        assert same(c.peek("dev-tcp"), [value]) and sim.copies == copies


def test_progress_is_reported_for_staged_puts(server, engine):
    seen = []
    value = torch.randn(1_000_000)
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.put("dev-progress", encode(to_device(value)), progress=lambda done, total: seen.append((done, total)))
        assert same(c.peek("dev-progress"), [value])
    total = seen[-1][1]
    assert seen[-1][0] == total > 4_000_000 and len(seen) > 10
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_peek_into_destination_tensors(server, engine):
    value = {"version": 3, "parameters": state_dict(8, 50_000)}
    model = to_device({name: torch.zeros_like(t) for name, t in value["parameters"].items()})
    model["layer0.weight"] = to_device(torch.zeros(3))  # a shape that does not match: that array gets new memory
    caller, seen = Stream("caller"), []
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.put("dev-into", value)
        c.listen("dev-into-heard", lambda note: None)  # a reading thread: the reply may arrive there
        before = engine.streams.devices
        with engine.streams.using(caller):  # a kernel reading the model, queued before the peek
            engine.streams.later(caller, lambda: seen.append(model["layer1.weight"].clone()))
            [back] = c.peek("dev-into", device="cpu", into={"parameters": model})
    engine.streams.flush(caller)
    assert not seen[0].any()  # it read the model as it was: the writes into it waited for it
    params = back["parameters"]
    for name, t in value["parameters"].items():
        assert torch.equal(params[name], t)
        if name != "layer0.weight":
            assert params[name] is model[name]  # received in place
    assert params["layer0.weight"] is not model["layer0.weight"] and torch.equal(model["layer0.weight"], torch.zeros(3))
    assert engine.streams.devices == before + 1  # one buffer, for the one array without a destination


def test_replies_with_numpy_arrays_are_received_as_before(server, engine):
    value = {"t": torch.randn(400_000), "a": np.arange(10)}
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.put("dev-numpy", value)
        copies = engine.streams.copies
        [back] = c.peek("dev-numpy", device="cpu")
    assert torch.equal(back["t"], value["t"]) and np.array_equal(back["a"], value["a"])
    assert engine.streams.copies == copies


def test_the_async_client_sends_and_receives_through_the_engine(engine):
    client, pump, clock, state = async_pair()
    try:
        value = state_dict(40, 20_000)
        assert result_of(client.put("dev-async", encode(to_device(value))), pump) == 1
        copies = engine.streams.copies
        [back] = result_of(client.peek("dev-async", device="cpu"), pump)
        assert same(back, value) and engine.streams.copies > copies
    finally:
        client.close()
        pump.flush()
        state.storage.close()


@pytest.fixture(scope="module")
def same_host():
    srv = ServerProcess("--zero-copy-min", "0")
    yield srv
    srv.stop()


def test_same_host_put_into_shared_memory_and_peek_onto_the_device(same_host, engine):
    value = {"params": state_dict(12, 50_000), "big": torch.arange(500_000, dtype=torch.float32)}
    sim = engine.streams
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as c:
        assert c.same_host
        draft = c.shared(torch.zeros(100_000))  # a draft waiting to be put: puts look for drafts among their arrays
        c.put("dev-shm", encode(to_device(value)))  # device -> pinned buckets -> the server's files
        staged = sim.copies
        assert staged >= 13
        with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as tcp_check:
            assert same(tcp_check.peek("dev-shm"), [value])  # mapped on the host: what was written
        [back] = c.peek("dev-shm", device="cpu")  # the server's files -> pinned buckets -> device
        assert same(back, value) and sim.copies > staged
        model = to_device({name: torch.empty_like(t) for name, t in value["params"].items()})
        [into] = c.peek("dev-shm", device="cpu", into={"params": model})
        assert all(into["params"][name] is model[name] and torch.equal(model[name], t)
                   for name, t in value["params"].items())
        del draft



def _anonymous_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def test_a_same_host_read_onto_the_device_maps_the_files_without_copying_them(same_host, engine, monkeypatch):
    """The server's files are mapped and read in whole to be uploaded: populated at
    once, and read only. (Populating a private writable mapping copies every page into
    anonymous memory first: a second copy of the item on the host.)"""
    size = 32 << 20
    seen = []
    upload = engine.upload

    def measured(arrays, *args, **kwargs):  # the files are mapped, nothing uploaded yet
        seen.append((_anonymous_bytes(), [array.flags.writeable for _o, array in arrays]))
        return upload(arrays, *args, **kwargs)

    monkeypatch.setattr(engine, "upload", measured)
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as c:
        c.put("dev-map", torch.ones(size // 4))
        before = _anonymous_bytes()
        [back] = c.peek("dev-map", device="cpu")
        c.delete("dev-map")
    assert back.shape == (size // 4,) and bool((back == 1).all())
    [(anonymous, writeable)] = seen
    assert anonymous - before < size // 4, f"{(anonymous - before) >> 20} MiB copied before the upload"
    assert writeable == [False]


# ------------------------------------------------------------------ RL and tables


def test_a_device_version_is_snapshotted_and_sent_in_the_background(server, engine):
    from tensorshare.protocol.messages import PUT
    from tensorshare.rl.staging import Sender, snapshot

    state = state_dict(20, 30_000)
    expected = {k: v.clone() for k, v in state.items()}
    results = []
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        sender = Sender(c)
        enc = snapshot(encode(to_device({"version": 1, "parameters": state})))
        for t in state.values():  # training goes on: the snapshot does not see it
            t.add_(1)
        sender.send(PUT, "dev-sender", enc, 1, lambda result, error: results.append((result, error)))
        assert sender.flush(10)
        c.ping()  # its reply follows the PUT's
        assert results == [(1, None)]
        [back] = c.peek("dev-sender")
        sender.close()
    assert back["version"] == 1 and same(back["parameters"], expected)


def test_a_sender_reports_what_it_could_not_send(engine):
    from tensorshare.protocol.messages import PUT
    from tensorshare.rl.staging import Sender, snapshot

    class Gone:
        def submit(self, *args, **kw):
            raise tensorshare.errors.ConnectionLostError("gone")

    errors = []
    sender = Sender(Gone())
    sender.send(PUT, "x", snapshot(encode(to_device(torch.randn(100_000)))), 1,
                lambda result, error: errors.append(error))
    assert sender.flush(10)
    sender.close()
    assert len(errors) == 1 and isinstance(errors[0], tensorshare.errors.ConnectionLostError)


def test_a_worker_loads_a_version_straight_into_its_model(server, engine):
    from tensorshare import RLTrainer, RLWorker

    model = module_to_device(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256)))
    with RLTrainer("127.0.0.1", server.port, experiment="dev-load") as trainer, \
            RLWorker("127.0.0.1", server.port, experiment="dev-load", device="cpu", zero_copy=False) as worker:
        assert worker.load_into(model) == -1  # nothing published yet
        source = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
        version = trainer.publish_parameters(source.state_dict())
        worker._note_version(version)
        allocated = engine.streams.devices
        assert worker.load_into(model) == version
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
        assert engine.streams.devices == allocated  # every array arrived into the model's own tensors
        pointers = {p.data_ptr() for p in model.parameters()}
        assert {t.data_ptr() for t in worker.get_parameters().values()} == pointers
        # a cast version cannot arrive in place: it is copied in
        trainer.publish_parameters(source.state_dict(), dtype=torch.bfloat16)
        worker._note_version(version + 1)
        assert worker.load_into(model) == version + 1
        assert all(torch.equal(a, b.to(torch.bfloat16).to(torch.float32))
                   for a, b in zip(model.state_dict().values(), source.state_dict().values()))


def test_a_table_sample_arrives_on_the_device(server, engine):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.create_table("dev-table", 64, {"obs": ((8192,), torch.float32), "act": ((), torch.int64)})
        obs = torch.randn(64, 8192)
        c.insert("dev-table", {"obs": obs, "act": torch.arange(64)})
        copies = engine.streams.copies
        sample = c.sample("dev-table", 48, device="cpu")  # 1.5 MiB: over DEVICE_MIN
        assert engine.streams.copies > copies and sample.keys.dtype == torch.int64
        rows = sample.indices
        assert torch.equal(sample.value["obs"], obs[rows]) and torch.equal(sample.value["act"], rows)
        read = c.read("dev-table", [3, 5], device="cpu")
        assert torch.equal(read["obs"], obs[[3, 5]])


# ------------------------------------------------------------------ the caller's stream, on every path


@pytest.mark.parametrize("path", ["tcp", "shared memory"])
def test_the_async_client_hands_a_reply_into_tensors_to_the_callers_stream(engine, path):
    """An AsyncClient's reply is read on the reactor thread: the writes into the
    caller's tensors wait for the caller's stream as it was at the call, and the
    result is handed to that stream, not to the reactor thread's; received over
    TCP, or copied from the server's files."""
    options = {"zero_copy": False} if path == "tcp" else {}
    client, pump, clock, state = async_pair(client_options=options, zero_copy_min=0)
    sim = engine.streams
    try:
        value = state_dict(12, 50_000)
        result_of(client.put("dev-async-into", value), pump)
        if path == "shared memory":
            result_of(client.peek("dev-async-into"), pump)  # (a same-host read: the item moves to shared memory)
            assert state.storage.items_of("dev-async-into")[0].files is not None
        model = to_device({k: torch.zeros_like(v) for k, v in value.items()})
        caller, seen = sim.stream(), []
        with sim.using(caller):  # a kernel reading the model, queued before the call
            sim.later(caller, lambda: seen.append(model["layer1.weight"].clone()))
            called = client.peek("dev-async-into", device="cpu", into=model)
        [back] = result_of(called, pump)  # read with another current stream
        assert {stream for _tensor, stream in sim.handed} == {caller}
        sim.flush(caller)
        assert not seen[0].any() and all(back[k] is model[k] for k in model) and same(model, value)
    finally:
        client.close()
        pump.flush()
        state.storage.close()


# ------------------------------------------------------------------ a device that cannot take the reply


@pytest.mark.parametrize("device", ["gpu", "meta", *([] if torch.cuda.is_available() else ["cuda", "cuda:0"])])
def test_a_take_onto_a_device_that_cannot_hold_it_is_refused_before_anything_is_taken(server, device):
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        for i in range(3):
            c.append(f"dev-bad-{device}", torch.full((4,), float(i)))
        with pytest.raises(tensorshare.errors.UsageError):
            c.get(f"dev-bad-{device}", device=device)
        with pytest.raises(tensorshare.errors.UsageError):
            tensorshare.Client("127.0.0.1", server.port, device=device)
        assert [float(t[0]) for t in c.get(f"dev-bad-{device}")] == [0.0, 1.0, 2.0]  # all still there


def test_a_take_whose_items_do_not_fit_on_the_device_loses_none(server, engine):
    value = torch.randn(600_000)  # over DEVICE_MIN: received straight into device memory, were there room
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as c:
        c.append("dev-full", value)
        c.append("dev-full", value + 1)
        engine.streams.memory_full = True
        items = c.get("dev-full", device="cpu")
    assert len(items) == 2 and torch.equal(items[0], value) and torch.equal(items[1], value + 1)
