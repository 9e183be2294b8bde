"""Outbound flow control: the byte account, coalesced notifications, backpressure on
requests and the stall rule; sans-IO pieces with a strict fake transport, then the
real server over loopback."""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess
from wiretools import CollectingOutbox, RawConnection, StrictTransport, raw_frame, request_parts, wait_for
from tensorshare.protocol import messages as protocol
from tensorshare._client.connection import NO_VALUE
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import FrameDecoder, frame_head
from tensorshare_server.config import ServerConfig
from tensorshare_server.net.flow import FRAME_COST, SHARED_PART, OutboundBudget, StallWatch
from tensorshare_server.net.writer import FrameWriter
from tensorshare_server.protocol.notify import ListenerRegistry, Notifier, notification_frame
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import ServerState
from tensorshare_server.bins.jobs import InlineJobs
from tensorshare_server.bins.storage import Storage
from tensorshare_server.bins.store import BinStore, Change, Item


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_writer(limit: int, buffer_size: int = 1024, clock=None):
    transport = StrictTransport(buffer_size)
    events = []
    budget = OutboundBudget(limit)
    writer = FrameWriter(transport, budget, lambda: events.append("congested"), lambda: events.append("drained"))
    writer.notifier = Notifier(writer)  # the session's coalescing rule, over this writer
    transport.registerProducer(writer, True)
    return writer, transport, events


def reply(rid: int, size: int = 0) -> list:
    head = frame_head({"code": protocol.ITEMS if size else protocol.OK, "id": rid}, size)
    return [head, bytes(size)] if size else [head]


def note(name: str, seq: int, n: int) -> bytes:
    return notification_frame(Change(name, n, seq, "APPEND"))


# ----------------------------------------------------------------- the account


def test_large_parts_count_once_however_often_they_are_queued():
    budget = OutboundBudget(1 << 30)
    chunk = bytes(SHARED_PART)
    heads = [frame_head({"code": 226, "id": i}, len(chunk)) for i in range(100)]
    for head in heads:
        budget.charge([head, chunk])
    assert budget.queued == len(chunk) + sum(map(len, heads)) + 100 * FRAME_COST
    for head in heads[:99]:
        budget.discharge([head, chunk])
        budget.frame_done()
    assert budget.queued == len(chunk) + len(heads[99]) + FRAME_COST
    budget.discharge([heads[99], chunk])
    budget.frame_done()
    assert budget.queued == 0


def test_congestion_starts_over_the_limit_and_ends_at_half():
    budget = OutboundBudget(1000 + 2 * FRAME_COST)
    assert not budget.charge([bytes(1000)])
    assert budget.charge([bytes(1)]) and budget.congested
    assert not budget.discharge([bytes(1)])  # 1000 left: still over half
    assert not budget.discharge([bytes(499)])
    assert budget.queued == 501 + 2 * FRAME_COST and budget.congested
    assert not budget.frame_done()
    assert budget.frame_done() and not budget.congested


def test_output_is_stalled_only_while_pending_and_without_progress():
    watch = StallWatch()
    assert watch.observe(10.0, False, None) == 0.0
    assert watch.observe(11.0, True, (0, 5)) == 0.0
    assert watch.observe(14.0, True, (0, 5)) == 3.0  # nothing moved
    assert watch.observe(15.0, True, (0, 4)) == 0.0  # the socket took a byte: progress
    assert watch.observe(16.5, True, (0, 4)) == 1.5
    assert watch.observe(17.0, False, None) == 0.0  # nothing pending: never stalled
    assert watch.observe(30.0, True, (9, 0)) == 0.0


# ------------------------------------------------------------------ the writer


def test_writer_hands_only_bytes_and_keeps_frames_whole_in_order():
    writer, transport, events = make_writer(limit=1 << 20, buffer_size=100)
    writer.send(reply(1, 4096))
    writer.notifier.notify("a", note("a", 1, 1))
    writer.send(reply(2))
    while transport.paused:
        transport.drain()
    transport.drain()
    assert [(h["code"], h["id"]) for h in transport.frames()] == [(226, 1), (151, 0), (200, 2)]
    assert writer.budget.queued == 0 and events == []


def test_a_long_pipelined_batch_starts_leaving_before_it_is_all_handled():
    """While a read is handled replies are held back to leave together, but not
    indefinitely: the client can start on the first ones while the server works on
    the rest (a pipeline, not a ping-pong of whole batches)."""
    writer, transport, _ = make_writer(limit=1 << 20, buffer_size=1 << 20)
    writer.hold()
    writer.send(reply(1))
    transport.drain()
    assert transport.frames() == []  # held
    for rid in range(2, 101):
        writer.send(reply(rid))
    transport.drain()
    early = len(transport.frames())
    assert 0 < early < 100
    writer.release()
    transport.drain()
    assert [h["id"] for h in transport.frames()] == list(range(1, 101))


def test_notifications_are_coalesced_only_while_congested():
    writer, transport, events = make_writer(limit=2000, buffer_size=10)
    writer.send(reply(1))  # fills the transport: the writer is paused from here on
    assert transport.paused
    for seq in range(1, 4):  # not congested yet: every notification is kept
        writer.notifier.notify("a", note("a", seq, seq))
    writer.send(reply(2, 2048))  # over the limit: congested
    assert writer.congested and events == ["congested"]
    for seq in range(4, 50):
        writer.notifier.notify("a", note("a", seq, seq))
        writer.notifier.notify("b", note("b", 1000 + seq, seq))
    writer.send(reply(3))  # a reply is never dropped
    writer.notifier.notify("a", note("a", 99, 99))
    assert writer.notifier.coalesced == 47 + 45  # a: 3 (queued before) to 49; b: 1004 to 1048
    while transport.paused:
        transport.drain()
    transport.drain()
    frames = transport.frames()
    assert [(h["code"], h["id"], h.get("seq")) for h in frames] == [
        (200, 1, None), (151, 0, 1), (151, 0, 2), (226, 2, None),
        (151, 0, 1049), (200, 3, None), (151, 0, 99)]
    assert (frames[-1]["bin"], frames[-1]["n"]) == ("a", 99) and (frames[-3]["bin"], frames[-3]["n"]) == ("b", 49)
    assert events == ["congested", "drained"] and writer.budget.queued == 0


def test_coalescing_keeps_the_queue_bounded_for_a_reader_that_never_reads():
    writer, transport, events = make_writer(limit=1000, buffer_size=10)
    writer.send(reply(1, 2048))
    assert writer.congested
    for seq in range(10_000):
        writer.notifier.notify(f"bin{seq % 3}", note(f"bin{seq % 3}", seq, seq))
    assert len(writer._queue) < 100
    assert writer.budget.queued < 1000 + 2048 + 4 * (FRAME_COST + 100)  # the reply and one note per bin


def test_a_coalesced_notification_that_ends_the_congestion_says_so():
    """Else a session whose requests wait for the drain would wait for ever."""
    writer, transport, events = make_writer(limit=2000, buffer_size=10)
    writer.send(reply(1))
    assert transport.paused
    writer.send(reply(2, 448))
    notes = {f"b{i}": note(f"b{i}", i, 1) for i in range(4)}  # 62 bytes each, with FRAME_COST over half the limit
    cost = sum(len(frame) + FRAME_COST for frame in notes.values())
    assert cost > 1000 >= cost - len(notes["b0"]) - FRAME_COST
    for name, frame in notes.items():
        writer.notifier.notify(name, frame)
    assert writer.congested and events == ["congested"]
    while writer.budget.queued > cost:
        transport.drain()  # the replies leave, part by part; the notifications wait behind the pause
    assert writer.congested and writer.budget.queued == cost
    writer.notifier.notify("b0", note("b0", 99, 2))  # drops the waiting b0 notification: under half now
    assert events == ["congested", "drained"] and not writer.congested


def test_abandoned_replies_run_their_hooks_and_notifications_do_not_count():
    writer, transport, events = make_writer(limit=1000, buffer_size=10)
    abandoned = []
    writer.send(reply(1), lambda: abandoned.append(1))  # handed to the transport whole
    writer.send(reply(2, 4096), lambda: abandoned.append(2))
    writer.notifier.notify("a", note("a", 1, 1))
    writer.connection_lost()
    assert abandoned == [2]
    writer.send(reply(3), lambda: abandoned.append(3))
    writer.notifier.notify("a", note("a", 2, 2))
    assert abandoned == [2, 3]


# ----------------------------------------------------------------- the session


def make_session():
    config = ServerConfig()
    listeners = ListenerRegistry()
    state = ServerState(config, Storage(BinStore(), InlineJobs(), sink=listeners), listeners)
    outbox = CollectingOutbox()
    session = ServerSession(state, outbox)
    session.connection_made()
    outbox.frames.clear()  # the greeting
    return session, outbox, state


def wire(rid, op, name=None, value=NO_VALUE) -> bytes:
    return b"".join(bytes(p) for p in request_parts(rid, op, name, value))


def test_a_congested_session_holds_requests_back_and_resumes_in_order():
    session, outbox, state = make_session()
    session.data_received(wire(1, "NOOP"))
    outbox.congested = True
    session.data_received(wire(2, "APPEND", "b", 1) + wire(3, "NOOP"))
    session.data_received(wire(4, "APPEND", "b", 2))
    assert [h["id"] for h in outbox.headers] == [1] and session.backlogged
    assert state.store.listing() == {}
    outbox.congested = False
    session.resume()
    assert [h["id"] for h in outbox.headers] == [1, 2, 3, 4] and not session.backlogged
    assert state.store.listing() == {"b": 2}


def test_a_framing_error_is_reported_after_the_requests_held_back():
    session, outbox, state = make_session()
    outbox.congested = True
    session.data_received(wire(1, "NOOP") + wire(2, "NOOP") + b"junk" * 10)
    assert outbox.headers == [] and not outbox.closed
    session.data_received(wire(3, "NOOP"))  # after the bad bytes: never read
    outbox.congested = False
    session.resume()
    assert [(h["code"], h["id"]) for h in outbox.headers] == [(200, 1), (200, 2), (500, 0)]
    assert outbox.closed


def test_requests_held_back_by_a_lost_connection_keep_their_lasting_effect():
    session, outbox, state = make_session()
    enc = encode(0)
    state.store.put("g", Item(enc.description, (), 0))
    outbox.congested = True
    session.data_received(wire(1, "APPEND", "a", 1) + wire(2, "GET", "g") + wire(3, "DELETE", "g")
                          + wire(4, "PEEK", "a") + wire(5, "PUT", "p", 2))
    session.connection_lost()
    assert state.store.listing() == {"a": 1, "p": 1}  # APPEND, DELETE and PUT ran; GET and PEEK did not


def test_table_changes_held_back_by_a_lost_connection_are_carried_out_and_reads_are_not():
    session, outbox, state = make_session()
    spec = {"capacity": 4, "columns": {"x": {"shape": [2], "dtype": "float32"}}, "sampler": "prioritized"}
    outbox.congested = True  # every request is held back
    held = (b"".join(bytes(p) for p in request_parts(2, "TCREATE", "t", extra={"spec": spec}))
            + b"".join(bytes(p) for p in request_parts(3, "TINSERT", "t", {"x": torch.ones(3, 2)}))
            + b"".join(bytes(p) for p in request_parts(4, "TWRITE", "t", {"x": torch.full((1, 2), 7.0)},
                                                       extra={"indices": np.array([3], "<i8").tobytes()}))
            + b"".join(bytes(p) for p in request_parts(5, "TSAMPLE", "t", extra={"n": 2}))
            + b"".join(bytes(p) for p in request_parts(6, "TPRIORITY", "t", extra={
                "keys": np.array([0], "<i8").tobytes(), "priorities": np.array([5.0], "<f8").tobytes()}))
            + b"".join(bytes(p) for p in request_parts(7, "TLIMITS", "t", extra={"limits": {"min_size_to_sample": 3}})))
    session.data_received(held)
    assert not outbox.headers and session.backlogged
    session.connection_lost()
    table = state.storage.table("t").table
    info = table.info()
    assert table.size == 4 and table.inserts == 4 and table.samples == 0  # created, inserted, written; not sampled
    assert info["rate_limiter"]["min_size_to_sample"] == 3
    assert table.slots()["priorities"].tolist() == [5.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------ the real server, loopback


class PausableProxy:
    """A loopback TCP proxy whose server-to-client direction can be stopped: the
    server then sees a client that does not read (the proxy's small receive buffer
    fills), while the client itself is a real, unmodified one."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarding = threading.Event()
        self.forwarding.set()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def pause(self) -> None:
        self.forwarding.clear()

    def resume(self) -> None:
        self.forwarding.set()

    def close(self) -> None:
        self.forwarding.set()
        self.listener.close()
        for sock in self.sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket()
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            upstream.connect(("127.0.0.1", self.server_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.forwarding), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, gate: threading.Event | None) -> None:
        try:
            while True:
                if gate is not None:
                    gate.wait()
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _last_told(seen: list, name: str, n: int, client) -> str:
    """What a listener was told of bin ``name`` (for a failed wait: which notification is
    missing, and what the server holds)."""
    told = [(x.seq, x.n_items, x.tag) for x in seen if x.bin == name]
    return (f"{len(told)} notifications of {name[:20]}..., the last (seq, n, tag): {told[-3:]}; "
            f"the server's: {client.list().get(name)!r} items; {n} changes each")


def pipelined(client, requests) -> list:
    """Send ``(op, bin, value, tag)`` requests without waiting; wait for every reply."""
    done, results = threading.Semaphore(0), []

    def reply(result, error):
        results.append(error or result)
        done.release()

    for op, name, value, tag in requests:
        client.submit(op, name, value, callback=reply, tag=tag)
    for _ in requests:
        assert done.acquire(timeout=60)
    return results


def kernel_send_buffer_max() -> int:
    """The most a TCP socket's send buffer can grow to here (Linux), else a guess."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20


@pytest.mark.process
def test_clients_and_rl_wrappers_tolerate_coalesced_notifications(tmp_path):
    """Three real clients behind a stopped proxy fall behind by 2 x 12,000 changes; the
    server coalesces their notifications, and they still end in the right state."""
    from tensorshare import RLTrainer, RLWorker

    server = ServerProcess("--max-outbound", "64KiB", log_path=tmp_path / "server.log")
    proxy = PausableProxy(server.port)
    experiment = "x" * 200  # long bin names: big notifications, so that fewer fill the kernel's buffers
    # Enough changes to fill the server's socket send buffer (its kernel limit) twice over.
    n = max(12_000, 2 * kernel_send_buffer_max() // (2 * 320))
    try:
        # (zero_copy=False: over TCP through the proxy, not the server's same-host Unix socket)
        with RLTrainer("127.0.0.1", proxy.port, experiment=experiment, filter_version=False,
                       zero_copy=False) as trainer, \
                RLWorker("127.0.0.1", proxy.port, experiment=experiment, zero_copy=False) as worker, \
                tensorshare.Client("127.0.0.1", proxy.port, zero_copy=False) as listener, \
                tensorshare.Client("127.0.0.1", server.port) as writer:
            seen = []
            listener.listen(trainer.data_bin, seen.append)
            listener.listen(trainer.params_bin, seen.append)
            proxy.pause()
            requests = []
            for i in range(n):
                requests.append((protocol.APPEND, trainer.data_bin, {"version": 0, "data": i}, None))
                requests.append((protocol.PUT, trainer.params_bin,
                                 {"version": i, "parameters": {"w": torch.full((2,), float(i))}}, i))
            results = pipelined(writer, requests)
            assert not [r for r in results if isinstance(r, BaseException)]
            proxy.resume()

            # The listener: fewer notifications than changes, seq still only grows,
            # and the last ones tell the final state.
            assert wait_for(lambda: any(x.bin == trainer.data_bin and x.n_items == n for x in seen), 30), \
                _last_told(seen, trainer.data_bin, n, writer)
            assert wait_for(lambda: any(x.bin == trainer.params_bin and x.tag == n - 1 for x in seen), 30), \
                _last_told(seen, trainer.params_bin, n, writer)
            for name in (trainer.data_bin, trainer.params_bin):
                seqs = [x.seq for x in seen if x.bin == name]
                assert all(a < b for a, b in zip(seqs, seqs[1:]))
            assert len(seen) < 2 * n  # coalesced: this test is void without it
            print(f"\ncoalescing: {2 * n} changes while 3 clients read nothing; the listener got "
                  f"{len(seen)} notifications")

            # The worker learns the newest version; the trainer collects every rollout.
            while worker.version < n - 1:
                assert worker.await_new_parameters(timeout=30) is not None
            assert torch.equal(worker.get_parameters()["w"], torch.full((2,), float(n - 1)))
            got = []
            deadline = time.monotonic() + 30
            while len(got) < n and time.monotonic() < deadline:
                got += trainer.get_data(timeout=5)
            assert sorted(got) == list(range(n))
    finally:
        proxy.close()
        server.stop()


def _nonblocking_send(sock: socket.socket, data: memoryview, offset: int, stall: float) -> int:
    """Send from ``offset`` until done or the socket takes nothing for ``stall`` seconds."""
    import select

    while offset < len(data):
        if not select.select([], [sock], [], stall)[1]:
            break
        try:
            offset += sock.send(data[offset:offset + (1 << 20)])
        except BlockingIOError:
            pass
    return offset


@pytest.mark.process
def test_a_writer_that_does_not_read_its_replies_is_slowed_by_tcp_not_by_server_memory(tmp_path):
    """PUT 1 MiB, PEEK it, APPEND a counter, 150 times over, reading nothing: without
    flow control the server would read it all and pin 150 MiB of PEEK replies."""
    server = ServerProcess("--max-outbound", "4MiB", log_path=tmp_path / "server.log")
    pairs, size = 150, 1 << 20
    try:
        with tensorshare.Client("127.0.0.1", server.port) as observer:
            observer.put("bp-warm", torch.zeros(size, dtype=torch.uint8))  # the server's buffers, warmed once
            observer.delete("bp-warm")
            baseline = server.rss()
            enc = encode(torch.zeros(size, dtype=torch.uint8))
            payload = bytes(size)
            frames = []
            for i in range(pairs):
                frames += [frame_head({"op": "PUT", "id": 3 * i + 1, "bin": "bp", "value": enc.description}, size),
                           payload, raw_frame(3 * i + 2, "PEEK", "bp"), raw_frame(3 * i + 3, "APPEND", "bp-count", 0)]
            data = memoryview(b"".join(frames))
            raw = RawConnection(server.port, rcvbuf=4096)
            raw.sock.setblocking(False)
            sent = _nonblocking_send(raw.sock, data, 0, stall=1.0)
            assert sent < len(data) // 2  # the server stopped reading
            executed = observer.list()["bp-count"]
            time.sleep(0.5)
            assert observer.list()["bp-count"] == executed < pairs // 4
            grown = server.rss() - baseline
            assert grown < 48 << 20
            print(f"\nbackpressure: the server stopped reading after {sent / 2**20:.0f} of {len(data) / 2**20:.0f} "
                  f"MiB, having run {executed} of {pairs} PUT/PEEK/APPEND triples; its RSS grew {grown / 2**20:.0f} MiB")
            assert observer.ping() < 5  # everyone else is served meanwhile

            # Now read: the server resumes, every request runs, every reply arrives in order.
            replies = []

            def read_all():
                decoder = FrameDecoder()
                raw.sock.setblocking(True)
                raw.sock.settimeout(30)
                while len(replies) < 3 * pairs:
                    chunk = raw.sock.recv(1 << 20)
                    if not chunk:
                        break
                    replies.extend((f.header["code"], f.header["id"]) for f in decoder.feed(chunk))

            reader = threading.Thread(target=read_all)
            reader.start()
            while sent < len(data):
                sent = _nonblocking_send(raw.sock, data, sent, stall=30)
            reader.join(60)
            expected = [(code, 3 * i + k) for i in range(pairs) for k, code in enumerate((250, 226, 250), 1)]
            assert replies == expected
            assert observer.list()["bp-count"] == pairs
            raw.close()
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="a slow reader's progress is seen in the kernel's send queue (SIOCOUTQ) on Linux only")
def test_a_reader_that_reads_nothing_is_disconnected_and_a_slow_one_is_not(tmp_path):
    server = ServerProcess("--max-outbound", "1MiB", "--outbound-stall-timeout", "1",
                           log_path=tmp_path / "server.log")
    try:
        # Over TCP, so that the item is held as the received chunks (a shared-memory
        # item would go out as one 4 MiB span, handed to the transport at once).
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as client:
            item = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
            client.put("st", item)
            stuck = RawConnection(server.port, rcvbuf=4096)
            slow = RawConnection(server.port)
            stuck.send(raw_frame(1, "PEEK", "st"))
            slow.send(raw_frame(1, "PEEK", "st"))
            received = 0
            start = time.monotonic()
            while received < item.nbytes:  # 16 KiB every 10 ms at most: 2.5 s or more in all
                time.sleep(0.01)
                received += len(slow.sock.recv(16384))
            assert time.monotonic() - start > 2  # slower than the stall timeout, yet never stalled
            assert client.ping() < 5
            assert wait_for(lambda: "took no byte" in server.log(), timeout=10)
            assert stuck.closed_by_peer(timeout=5)
            slow.send(raw_frame(2, "NOOP"))
            while True:  # the rest of the PEEK reply, then the NOOP's
                frame = slow.read_frame()
                if frame.header["id"] == 2:
                    break
            assert frame.header["code"] == 200
            log = server.log()
            assert log.count("took no byte") == 1 and "Traceback" not in log
            assert client.peek("st")[0].equal(item)
    finally:
        server.stop()


@pytest.mark.process
def test_flow_control_options_on_the_command_line():
    import subprocess

    from tensorshare_server.cli import parse_args

    config, _ = parse_args(["--max-outbound", "8MiB", "--outbound-stall-timeout", "2.5"])
    assert (config.max_outbound, config.outbound_stall_timeout) == (8 << 20, 2.5)
    assert (ServerConfig().max_outbound, ServerConfig().outbound_stall_timeout) == (64 << 20, 60.0)
    for bad in (["--max-outbound", "0"], ["--outbound-stall-timeout", "0"], ["--outbound-stall-timeout", "nan"]):
        out = subprocess.run([sys.executable, "-m", "tensorshare_server", *bad], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "error" in out.stderr, (bad, out.stderr)
