"""Puts by device reference through the real clients and a real server process, with the stand-in device.

The stand-in (``devicesim``) opens a reference only in another process, as CUDA
does: readers by reference run in a process of their own (``device_procs.py``),
and a reader in the publisher's process copies from the publisher's snapshot
itself.  The connection-level cases are here too: a read of an item right after
its put on the same connection, a ping and further puts while its bytes upload.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorshare
import tensorshare.device as device_engines
from devicesim import DeferredStreams, DeviceTensor, module_to_device, to_device
from serverproc import ServerProcess
from tensorshare._client.uploads import Uploader
from tensorshare.device.engine import Engine
from tensorshare.errors import ServerLocalError

HERE = Path(__file__).resolve().parent


@pytest.fixture
def engine(monkeypatch):
    eng = Engine(DeferredStreams(), bucket=256 << 10, inline_max=0)
    monkeypatch.setitem(device_engines._ENGINES, "cpu", eng)
    yield eng
    assert not eng.streams.violations


@pytest.fixture(scope="module")
def same_host():
    srv = ServerProcess("--zero-copy-min", "0")
    yield srv
    srv.stop()


class Other:
    """A process of its own on the server's host, with the stand-in device (``device_procs.py``)."""

    def __init__(self, port: int):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "device_procs.py"), str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise AssertionError(f"the other process ended: {self.proc.stderr.read()[-3000:]}")
        return json.loads(answer)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate("exit\n", timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def other(same_host):
    proc = Other(same_host.port)
    yield proc
    proc.close()


def state(seed: int, n: int = 24) -> dict:
    from device_procs import state as made

    return made(seed, n)


def sums(value: dict) -> dict:
    return {k: float(v.double().sum()) for k, v in value.items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reader_in_another_process_copies_device_to_device_and_everyone_else_gets_the_bytes(same_host, engine,
                                                                                             other):
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as publisher, \
            tensorshare.Client("127.0.0.1", same_host.port, timeout=30, zero_copy=False) as tcp_reader:
        values = state(1)
        assert publisher.put("ipc-a", to_device(values), by_reference=True) == 1
        assert publisher.values.exports.held() == 1
        read = other.ask("peek ipc-a")
        assert read["sums"] == sums(values) and read["device"] and read["opened"] == 1
        # its IPC clean-up waited for the engine's stream, not for the caller's work
        assert read["unmapped"] and read["caller"] not in read["unmapped"]
        [over_tcp] = tcp_reader.peek("ipc-a")  # the bytes, uploaded on a connection of their own
        assert equal(over_tcp, values)


def test_a_reader_in_the_publishers_own_process_copies_from_the_snapshot(same_host, engine, monkeypatch):
    """CUDA opens no IPC handle in the process that exported it: an evaluator or a
    worker beside the trainer copies from the snapshot itself, device to device,
    and never waits for the bytes (here they never come)."""
    monkeypatch.setattr(Uploader, "add", lambda self, bin, ident, snapshot: None)  # its bytes never leave
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as publisher, \
            tensorshare.Client("127.0.0.1", same_host.port, timeout=5, device="cpu") as reader:
        values = state(2)
        publisher.put("ipc-own", to_device(values), by_reference=True)
        [back] = reader.peek("ipc-own")
        assert equal(back, values) and all(type(t) is DeviceTensor for t in back.values())
        assert engine.streams.opened == 0  # no IPC handle was opened
        model = to_device({k: torch.zeros_like(v) for k, v in values.items()})
        [into] = reader.peek("ipc-own", into=model)  # straight into a model's own tensors
        assert all(into[k] is model[k] for k in model) and equal(model, values)


def test_the_snapshots_of_a_lost_connection_go_after_a_while_with_no_more_puts(monkeypatch):
    """They were dropped only by the next put by reference: a trainer that went on
    with plain puts (or stopped) kept a whole parameter snapshot in device memory."""
    from tensorshare._client import exports

    monkeypatch.setattr(exports, "RETIRE_S", 0.05)
    held = exports.Exports()
    try:
        held.keep(1, object())
        held.lost()
        assert held.retired() == 1 and held.held() == 0
        deadline = time.monotonic() + 5
        while held.retired():
            assert time.monotonic() < deadline, "the snapshots of the lost connection were kept"
            time.sleep(0.02)
    finally:
        held.close()


def test_an_ephemeral_put_by_reference_ends_with_its_connection(same_host, engine):
    """``ephemeral`` was dropped on the way to a put by reference: the presence marker
    outlived its publisher, and its listeners never heard it leave."""
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=10) as watcher:
        publisher = tensorshare.Client("127.0.0.1", same_host.port, timeout=10)
        publisher.put("ipc-here", to_device(state(4)), by_reference=True, ephemeral=True)
        assert "ipc-here" in watcher.list()
        publisher.close()
        deadline = time.monotonic() + 10
        while "ipc-here" in watcher.list():
            assert time.monotonic() < deadline, "the ephemeral bin outlived its connection"
            time.sleep(0.02)


def test_a_read_right_after_a_put_by_reference_on_the_same_connection(same_host, engine):
    """The publisher reads its item at once: the read waits in the server for the
    bytes, which must not be queued behind it on that connection (nor behind
    anything else there)."""
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=10) as c, \
            tensorshare.Client("127.0.0.1", same_host.port, timeout=10) as mapper, \
            tensorshare.Client("127.0.0.1", same_host.port, timeout=10, zero_copy=False) as elsewhere:
        c.put("ipc-same", to_device(state(3)), by_reference=True)
        assert c.values.exports.idle(10)
        mapper.peek("ipc-same")  # a same-host reader maps the bin: the bytes go through shared memory from now on
        c.put("ipc-same", to_device(state(3)), by_reference=True)  # (its reply says so)
        assert c.values.exports.idle(10)
        values = state(4)
        got: list = []
        with engine.streams.hold("tensorshare-upload"):  # the bytes are slow to come down from the device
            c.put("ipc-same", to_device(values), by_reference=True)
            readers = [threading.Thread(target=lambda client=client: got.append(_outcome(client.peek, "ipc-same")))
                       for client in (c, elsewhere)]
            for thread in readers:
                thread.start()
            time.sleep(0.3)  # both reads wait in the server for the bytes
        for thread in readers:
            thread.join(30)
        assert len(got) == 2 and all(not isinstance(x, Exception) and equal(x[0], values) for x in got), got


def test_a_ping_and_further_puts_do_not_wait_for_the_bytes_of_a_put_by_reference(same_host, engine):
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=5) as c:
        with engine.streams.hold("tensorshare-upload"):  # the upload of the bytes takes as long as it is held
            c.put("ipc-ping", to_device(state(4)), by_reference=True)
            assert c.ping() >= 0  # answered on the publisher's connection while the bytes still upload
            assert c.put("ipc-ping", to_device(state(5)), by_reference=True) == 1
        assert c.values.exports.idle(30)
        with tensorshare.Client("127.0.0.1", same_host.port, timeout=10, zero_copy=False) as reader:
            assert equal(reader.peek("ipc-ping")[0], state(5))  # the newest item's bytes came


def test_publishes_back_to_back_do_not_wait_for_uploads_nor_for_queued_device_work(same_host, engine, other):
    """RLTrainer.publish_parameters(wait=False) of a state in device memory, on the
    server's host: each returns with its snapshot's copies queued, behind the
    trainer's work and while earlier versions upload; a worker in another process
    reads the last version by reference."""
    from tensorshare import RLTrainer

    sim = engine.streams
    model = module_to_device(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)))
    training = sim.stream("training")
    with RLTrainer("127.0.0.1", same_host.port, experiment="ipc-rl") as trainer:
        done = []

        def publish() -> None:
            with sim.using(training):
                for step in range(1, 4):
                    sim.later(training, lambda step=step: [p.detach().fill_(float(step)) for p in model.parameters()])
                    waits = sim.waits_here()
                    version = trainer.publish_parameters(model.state_dict(), wait=False)
                    done.append((version, sim.waits_here() - waits))

        with sim.hold("tensorshare-upload"):
            thread = threading.Thread(target=publish)
            thread.start()
            thread.join(20)
            assert len(done) == 3, done  # none waited for an upload
            assert all(waits == 0 for _version, waits in done), done  # nor for the training work queued
        sim.flush(training)
        trainer.flush(30)
        read = other.ask(f"peek {trainer.params_bin}")
        expected = sums({f"parameters.{k}": v for k, v in model.state_dict().items()})
        assert read["sums"] == expected and read["device"] and read["opened"] >= 1
        assert {v / max(p.numel(), 1) for v, p in zip(expected.values(), model.state_dict().values())} == {3.0}


def test_the_bytes_of_a_gone_publisher_stay_readable_and_its_unsent_items_are_refused(same_host, engine, other):
    from tensorshare.errors import ServerLocalError

    assert other.ask("publish ipc-gone 6") == {"n": 1}  # by reference, from another process; its bytes sent
    other.close()  # the publisher leaves: its references go with it
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30, device="cpu") as reader:
        [back] = reader.peek("ipc-gone")
        assert sums(back) == sums(state(6)) and engine.streams.opened == 0  # from the bytes


def test_a_reference_to_changed_memory_fails_its_digest_and_is_read_from_its_bytes(same_host, engine, other):
    from tensorshare.device import ipc

    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as publisher:
        values = state(7)
        publisher.put("ipc-e", to_device(values), by_reference=True)
        assert publisher.values.exports.idle(10)
        for flat in list(ipc._exported.values()):
            flat[100:108] += 1  # the block was reused for something else
        read = other.ask("peek ipc-e")
        assert read["sums"] == sums(values) and read["opened"] == 1  # opened, refused, read from the bytes


def test_a_publisher_that_closes_before_uploading_leaves_an_error_not_garbage(same_host, engine, monkeypatch):
    monkeypatch.setattr(Uploader, "add", lambda self, bin, ident, snapshot: None)  # its bytes never leave
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30, device="cpu") as reader, \
            tensorshare.Client("127.0.0.1", same_host.port, timeout=30, zero_copy=False) as tcp:
        with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as publisher:
            publisher.put("ipc-f", to_device(state(8)), by_reference=True)
            got = []
            waiting = threading.Thread(target=lambda: got.append(_outcome(tcp.peek, "ipc-f")))
            waiting.start()
        waiting.join(30)
        assert len(got) == 1 and isinstance(got[0], ServerLocalError)
        assert isinstance(_outcome(reader.peek, "ipc-f"), ServerLocalError)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def test_where_references_cannot_be_taken_the_bytes_are(same_host, engine):
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30, zero_copy=False) as c:  # as from another host
        values = state(9)
        assert c.put("ipc-g", to_device(values), by_reference=True) == 1
        assert c.values.exports is None and equal(c.peek("ipc-g")[0], values)
    engine.streams.share_ok = False  # memory torch cannot share (an expandable segment...)
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as c:
        values = state(10)
        assert c.put("ipc-h", to_device(values), by_reference=True) == 1
        assert not c._exported().held() and equal(c.peek("ipc-h")[0], values)
