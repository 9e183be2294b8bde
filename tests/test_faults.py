"""Faults: clients SIGKILLed in the middle of large puts and gets, and a listener
that stops reading while a gigabyte is published to its bin."""

from __future__ import annotations

import pytest
import gc
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

import tensorshare
from serverproc import ServerProcess
from tensorshare.wire.codec import encode
from wiretools import RawConnection, StrictTransport, raw_frame, wait_for

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "fault_procs.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class RoundTrips(threading.Thread):
    """A client doing checked put/peek round trips while the faults happen."""

    def __init__(self, port: int, name: str):
        super().__init__(daemon=True)
        self.port, self.name = port, name
        self.stop = threading.Event()
        self.ops = 0
        self.worst = 0.0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            with tensorshare.Client("127.0.0.1", self.port, timeout=30) as client:
                while not self.stop.is_set():
                    start = time.perf_counter()
                    value = torch.randn(1000)
                    client.put(self.name, value)
                    [back] = client.peek(self.name)
                    assert torch.equal(back, value)
                    self.worst = max(self.worst, time.perf_counter() - start)
                    self.ops += 1
        except BaseException as exc:
            self.errors.append(exc)


def kill_mid_transfer(server: ServerProcess, rng: random.Random, round_: int, n_put: int,
                      n_get: int) -> tuple[int, int]:
    """Start ``n_put`` clients putting 64 MiB and ``n_get`` getting 32 MiB, SIGKILL them
    all mid-transfer, and check what the server kept.  Returns (kills, server RSS
    with the transfers in flight)."""
    new_values = [torch.full((16 * MiB,), 100 + j, dtype=torch.int32) for j in range(n_put)]  # 64 MiB
    old_values = [torch.full((MiB // 4,), -1 - j, dtype=torch.int32) for j in range(n_put)]
    get_values = [torch.arange(8 * MiB, dtype=torch.int32) + i + round_ for i in range(n_get)]  # 32 MiB
    procs: list[subprocess.Popen] = []
    port = server.port
    try:
        with tensorshare.Client("127.0.0.1", port, timeout=60) as client:
            for j in range(n_put):
                client.put(f"f/put{j}", old_values[j])
            for i in range(n_get):
                client.put(f"f/get{i}", get_values[i])
            seen = []
            for i in range(n_get):
                client.listen(f"f/get{i}", seen.append)
            for j in range(n_put):
                description = encode(new_values[j]).description.hex()
                if j % 2:  # stops part-way through its frame, deterministically
                    procs.append(spawn("put", port, f"f/put{j}", description, 64 * MiB, 100 + j,
                                       rng.uniform(0.05, 0.95)))
                else:  # puts again and again: killed wherever it is
                    procs.append(spawn("putloop", port, f"f/put{j}", description, 64 * MiB, 100 + j))
            for i in range(n_get):
                procs.append(spawn("get", port, f"f/get{i}", rng.randint(1, 16) * MiB))
            for proc in procs:
                assert proc.stdout.readline().strip() == "mid", proc.stderr.read()
            rss_in_flight = server.rss()
            order = list(procs)
            rng.shuffle(order)
            for proc in order:
                time.sleep(rng.uniform(0, 0.05))
                proc.send_signal(signal.SIGKILL)
            for proc in procs:
                proc.wait(10)

            # Every interrupted GET was restored: one RESTORE per bin, the item intact.
            assert wait_for(lambda: sum(n.op == "RESTORE" for n in seen) == n_get, timeout=20), seen
            for i in range(n_get):
                [item] = client.peek(f"f/get{i}")
                assert torch.equal(item, get_values[i])
            # A killed PUT left the old value or the whole new one, never a part.
            for j in range(n_put):
                [item] = client.peek(f"f/put{j}")
                assert torch.equal(item, old_values[j]) or torch.equal(item, new_values[j]), j
            for name in client.list():
                if name.startswith("f/"):
                    client.delete(name)
        return len(procs), rss_in_flight
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            proc.stderr.close()


@pytest.mark.process
def test_clients_killed_mid_put_and_mid_get(tmp_path):
    """20 clients SIGKILLed in the middle of 64 MiB puts and 32 MiB gets, in two rounds:
    the server keeps serving, no partial item becomes visible, every interrupted GET's
    item goes back into its bin, and once the bins are deleted the server's memory is
    back near where it started: nothing the dead clients sent is kept.

    glibc keeps freed large blocks for reuse (its mmap threshold grows with use), so
    RSS alone would show the high-water mark; the server runs with the threshold
    pinned so that RSS shows what is alive (docs/reliability.md).  The receive pool
    keeps freed chunks for reuse too, for --recv-pool-idle seconds (here 0.5)."""
    rng = random.Random(3)
    server = ServerProcess("--recv-pool-idle", "0.5", log_path=tmp_path / "server.log")
    steady = RoundTrips(server.port, "steady")
    try:
        rss_empty = server.rss()
        steady.start()
        kills, rss_in_flight, rss_after = 0, [], []
        for round_ in range(2):
            killed, in_flight = kill_mid_transfer(server, rng, round_, n_put=5, n_get=5)
            kills += killed
            rss_in_flight.append(in_flight)
            wait_for(lambda: server.rss() - rss_empty < 32 * MiB, timeout=5)  # the pool lets go of its chunks
            rss_after.append(server.rss())
        steady.stop.set()
        steady.join(30)
        assert not steady.errors, steady.errors
        assert steady.ops > 0
        assert server.proc.poll() is None
        log = server.log()
        assert "Traceback" not in log and "Unhandled" not in log, log[-3000:]
        print(f"\nfaults: {kills} clients killed mid-transfer; server RSS {rss_empty / MiB:.0f} MiB empty, "
              f"{'/'.join(f'{r / MiB:.0f}' for r in rss_in_flight)} MiB with the transfers in flight, "
              f"{'/'.join(f'{r / MiB:.0f}' for r in rss_after)} MiB after each round (bins deleted); "
              f"steady client {steady.ops} round trips, worst {steady.worst * 1e3:.0f} ms")
        assert kills == 20
        assert max(rss_after) - rss_empty < 32 * MiB
    finally:
        steady.stop.set()
        server.stop()


@pytest.mark.process
def test_a_listener_that_stops_reading_while_a_gigabyte_is_published(tmp_path):
    """16 x 64 MiB puts to a bin whose listener also asks for every version (PEEK)
    but reads nothing: without flow control each queued reply would pin its 64 MiB
    version (1 GiB in all).  Memory stays bounded, the listener is disconnected with
    a logged reason, and a reader beside it sees every version on time."""
    server = ServerProcess("--outbound-stall-timeout", "2", log_path=tmp_path / "server.log")
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=60) as publisher, \
                tensorshare.Client("127.0.0.1", server.port, timeout=60) as reader:
            publisher.put("pub", torch.zeros(16 * MiB, dtype=torch.int32))  # warm the server's buffers once
            reader.peek("pub")
            rss_start = server.rss()
            stuck = RawConnection(server.port, rcvbuf=4096)
            stuck.send(raw_frame(1, "LISTEN", "pub"))
            rss_peak = 0
            for version in range(16):
                value = torch.full((16 * MiB,), version, dtype=torch.int32)
                publisher.put("pub", value, tag=version)
                try:
                    stuck.send(raw_frame(2 + version, "PEEK", "pub"))
                except (ConnectionResetError, BrokenPipeError):
                    pass  # already dropped as stalled
                [back] = reader.peek("pub")
                assert torch.equal(back, value)
                rss_peak = max(rss_peak, server.rss())
            assert wait_for(lambda: "took no byte" in server.log(), timeout=20)
            assert stuck.closed_by_peer(timeout=10)
            assert reader.ping() < 5
            rss_end = server.rss()
        log = server.log()
        assert log.count("took no byte") == 1 and "Traceback" not in log
        print(f"\nslow listener: 1 GiB published; server RSS {rss_start / MiB:.0f} MiB at start, peak "
              f"{rss_peak / MiB:.0f} MiB, {rss_end / MiB:.0f} MiB after the listener was dropped; "
              f"log: {log.strip().splitlines()[-1]}")
        # One version stored, one arriving, one pinned by the stuck reply, and buffers.
        assert rss_peak - rss_start < 320 * MiB
    finally:
        server.stop()


def test_a_connection_lost_mid_put_frees_its_partial_payload_at_once():
    """Regression (found by the test above): the session and its frame decoder referred
    to each other, so the bytes of a PUT cut off mid-payload (up to --max-frame) stayed
    in memory until the cyclic garbage collector happened to run; and the writer's
    flow-control callbacks tie it to its protocol the same way."""
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure

    from tensorshare.wire.frames import SegmentSink, frame_head
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.protocol.recvpool import PooledSink
    from tensorshare_server.net.service import TensorShareFactory
    from tensorshare_server.root import build_state

    def sinks() -> int:  # the payload's sink: a SegmentSink, or its pooled kind
        return sum(type(o) in (SegmentSink, PooledSink) for o in gc.get_objects())

    factory = TensorShareFactory(build_state(ServerConfig()))
    proto = factory.buildProtocol(None)
    proto.makeConnection(StrictTransport())
    enc = encode(torch.zeros(1 << 20, dtype=torch.uint8))
    head = frame_head({"op": "PUT", "id": 1, "bin": "half", "value": enc.description}, enc.nbytes)
    gc.collect()
    gc.disable()
    try:
        before = sinks()
        proto.dataReceived(head + bytes(1 << 19))
        assert sinks() == before + 1
        alive = weakref.ref(proto)
        proto.connectionLost(Failure(ConnectionDone()))
        del proto
        assert sinks() == before and alive() is None
    finally:
        gc.enable()
    assert factory.state.store.listing() == {}
