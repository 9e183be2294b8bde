"""Reused receive memory: tensorshare/wire/recycle.py, the server's receive pool
(server/protocol/recvpool.py) and the clients' reply arrays."""

from __future__ import annotations

import random
import time

import pytest
import torch

import tensorshare
from serverproc import ServerProcess
from tensorshare._client.connection import decode_items
from tensorshare.wire.frames import FrameDecoder, frame_head
from tensorshare_server import EmbeddedServer, ServerConfig
from tensorshare.wire.recycle import Recycler, size_class
from tensorshare.protocol.schema import Payload
from tensorshare.wire.frames import SegmentSink
from tensorshare_server.protocol.recvpool import (
    CHUNK, POOLED_MIN, PooledSink, chunk_pool, payload_sink,
)
from wiretools import RawConnection, raw_frame

MiB = 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------- Recycler


def test_a_buffer_is_handed_out_again_only_once_nothing_refers_to_it():
    pool = Recycler(4 * CHUNK, bytearray)
    first = pool.take(CHUNK)
    view = memoryview(first).toreadonly()[10:20]  # what a stored item or a reply holds
    del first
    assert pool.free_bytes == 0
    second = pool.take(CHUNK)
    assert second is not view.obj and pool.made == 2 and pool.reused == 0
    del view
    assert pool.free_bytes == CHUNK
    third = pool.take(CHUNK)
    assert pool.reused == 1 and pool.made == 2 and pool.free_bytes == 0
    del second, third
    assert pool.free_bytes == 2 * CHUNK


def test_the_recycler_holds_at_most_its_bound_and_makes_room_for_a_new_size():
    pool = Recycler(3 * CHUNK + CHUNK // 2, bytearray)
    held = [pool.take(CHUNK) for _ in range(5)]
    assert held[3] is None and held[4] is None  # all in use: the caller reads the usual way
    assert pool.made == 3 and pool.held_bytes == 3 * CHUNK
    del held
    again = [pool.take(CHUNK) for _ in range(3)]
    assert pool.reused == 3 and pool.made == 3 and len({id(c) for c in again}) == 3
    del again[1:]
    big = pool.take(2 * CHUNK)  # two free buffers of another size make room
    assert big is not None and len(big) == 2 * CHUNK and pool.held_bytes == 3 * CHUNK
    assert pool.take(3 * CHUNK) is None  # the rest is in use
    pool.clear()
    assert pool.held_bytes == 0 and pool.take(CHUNK) is not None
    assert chunk_pool(CHUNK - 1, 10.0) is None


def test_a_take_that_cannot_fit_keeps_what_is_kept():
    pool = Recycler(8 * CHUNK, bytearray)
    warm = pool.take(CHUNK)
    del warm  # free, of another size than what comes next
    assert pool.take(9 * CHUNK) is None  # over the bound whatever is dropped
    busy = pool.take(6 * CHUNK)
    assert pool.take(3 * CHUNK) is None  # dropping the free 1 MiB would not make room: keep it
    assert pool.held_bytes == 7 * CHUNK and pool.take(CHUNK) is not None and pool.reused == 1
    del busy
    big = pool.take(2 * CHUNK)  # letting the free 1 MiB go (oldest first) is enough
    assert big is not None and pool.held_bytes == 8 * CHUNK and pool.free_bytes == 6 * CHUNK


def test_a_take_at_the_bound_looks_for_room_among_the_oldest_buffers_only():
    pool = Recycler(400 * 64, bytearray)
    held = [pool.take(64) for _ in range(400)]  # at the bound, each held (stored items, say)
    held[300:] = []  # free, but newer than the 256 a take looks at for room
    assert pool.take(128) is None  # read the usual way, without a look at all 400
    held[0] = held[1] = None  # the two oldest come free: room for 128 bytes
    assert len(pool.take(128)) == 128 and pool.held_bytes == 400 * 64


def test_size_classes_waste_at_most_an_eighth():
    for n in [1, MiB - 1, MiB, MiB + 1, 3 * MiB + 12345, 100 * MiB + 1, 256 * MiB, 256 * MiB + 1, 5 << 30]:
        c = size_class(n)
        assert c >= n and c % MiB == 0 and c - n < max(MiB, n / 8), n
    assert size_class(256 * MiB) == 256 * MiB and size_class(MiB + 1) == 2 * MiB
    assert len({size_class(100 * MiB + k * 4096) for k in range(1000)}) <= 2  # a varying size shares


def test_maybe_trim_trims_at_most_every_quarter_of_idle():
    clock = FakeClock()
    pool = Recycler(8 * CHUNK, bytearray, idle=8.0, clock=clock)
    buf = pool.take(CHUNK)
    del buf
    pool.maybe_trim()  # too soon after the start: nothing looked at
    clock.now += 2
    pool.maybe_trim()  # sees it free (t = 2)
    clock.now += 7
    pool.maybe_trim()  # free for 7 s: kept
    assert pool.held_bytes == CHUNK
    clock.now += 1.9
    pool.maybe_trim()  # free for 8.9 s, but only 1.9 s since the last trim: not looked at
    assert pool.held_bytes == CHUNK
    clock.now += 0.1
    pool.maybe_trim()
    assert pool.held_bytes == 0


def test_a_take_finds_free_buffers_beyond_a_run_of_busy_ones():
    pool = Recycler(1000 * 64, bytearray)
    held = [pool.take(64) for _ in range(300)]
    del held[200:]  # the last hundred are free, far from where the search starts
    before = pool.made
    again = [pool.take(64) for _ in range(100)]
    assert pool.made - before <= 5 and pool.reused >= 95  # a few misses while it moves on
    del again


def test_trim_lets_go_of_buffers_only_after_they_have_been_free_for_idle_seconds():
    clock = FakeClock()
    pool = Recycler(8 * CHUNK, bytearray, idle=10.0, clock=clock)
    kept = pool.take(CHUNK)  # stays in use throughout
    freed = pool.take(CHUNK)
    del freed
    assert pool.trim() == 0  # seen free now
    clock.now += 9.9
    assert pool.trim() == 0
    clock.now += 0.1
    assert pool.trim() == CHUNK and pool.held_bytes == CHUNK
    clock.now += 1000
    assert pool.trim() == 0 and pool.held_bytes == CHUNK  # in use: never let go
    # A buffer held for long and freed now gets its whole idle time from now.
    del kept
    assert pool.trim() == 0
    clock.now += 5
    assert pool.trim() == 0
    taken = pool.take(CHUNK)  # taken again before its time was up: no longer counted as free
    clock.now += 20
    assert pool.trim() == 0 and pool.reused == 1
    del taken


# ---------------------------------------------------------------- PooledSink


def _decode(payload: bytes, pool: Recycler, chunk: int, rng: random.Random):
    """Run one PUT frame through a decoder with a PooledSink, mixing lent reads of
    random sizes with bytes fed the usual way, as the server's reads can."""
    wire = frame_head({"op": "PUT", "id": 1}, len(payload)) + payload
    decoder = FrameDecoder(lambda header, n: PooledSink(n, pool, chunk))
    frames, pos = [], 0
    while pos < len(wire):
        buf = decoder.lent_buffer()
        if buf is not None and rng.random() < 0.8:
            n = rng.randint(1, len(buf))
            buf[:n] = wire[pos : pos + n]
            del buf
            frames += decoder.buffer_updated(n)
        else:
            n = rng.randint(1, 3 * chunk)
            frames += decoder.feed(wire[pos : pos + n])
        pos += n
    assert len(frames) == 1 and frames[0].payload_len == len(payload)
    return frames[0].payload


def test_a_pooled_sink_keeps_every_payload_whole_and_in_order():
    rng = random.Random(7)
    pool = Recycler(64 * 64, bytearray)
    for case in range(300):
        payload = rng.randbytes(rng.randint(0, 5 * 64 + 63))
        segments = _decode(payload, pool, 64, rng)
        assert b"".join(segments) == payload, case
        for s in segments:
            if isinstance(s, memoryview):  # pool chunks: whole, read-only
                assert s.readonly and s.nbytes == 64
    assert pool.reused > 100  # the segments of earlier cases were dropped: their chunks came back


def test_a_pooled_sink_does_not_lend_for_less_than_a_chunk_nor_past_the_bound():
    pool = Recycler(16 * 64, bytearray)
    sink = PooledSink(100, pool, 64)
    first = sink.get_buffer()
    assert first is not None and len(first) == 64
    sink.buffer_updated(64)
    assert sink.get_buffer() is None  # 36 bytes left: they come the usual way
    sink.write(b"x" * 36)
    assert [bytes(s) for s in sink.finish()] == [bytes(64), b"x" * 36]
    full = Recycler(64, bytearray)
    held = full.take(64)
    sink = PooledSink(200, full, 64)
    sink.write(b"a" * 10)
    assert sink.get_buffer() is None  # the one chunk is in use
    sink.write(b"b" * 70)
    del held
    lent = sink.get_buffer()
    lent[:] = b"c" * 64
    sink.buffer_updated(64)
    sink.write(b"d" * 56)
    assert b"".join(sink.finish()) == b"a" * 10 + b"b" * 70 + b"c" * 64 + b"d" * 56


def test_a_tables_rows_arrive_in_one_buffer_even_after_bytes_read_with_the_header():
    pool = Recycler(16 * MiB, bytearray)
    payload = random.Random(3).randbytes(POOLED_MIN + 777)
    sink = payload_sink(Payload.ROWS, len(payload), pool)
    sink.write(payload[:1000])  # the read that brought the frame's header
    lent = sink.get_buffer()
    assert len(lent) == len(payload) - 1000  # the rest goes straight into the same buffer
    lent[:] = payload[1000:]
    del lent
    sink.buffer_updated(len(payload) - 1000)
    (whole,) = sink.finish()
    assert whole.readonly and bytes(whole) == payload
    del whole, sink  # the request is done with
    again = payload_sink(Payload.ROWS, len(payload), pool)
    again.write(payload)
    assert [bytes(s) for s in again.finish()] == [payload] and pool.reused == 1  # the same memory, warm


def test_which_payloads_the_pool_receives():
    pool = Recycler(16 * MiB, bytearray)
    assert type(payload_sink(Payload.ROWS, POOLED_MIN - 1, pool)) is SegmentSink  # a read or two
    assert type(payload_sink(Payload.ITEM, POOLED_MIN, pool)) is PooledSink
    assert type(payload_sink(Payload.ROWS, 5 * MiB, None)) is SegmentSink  # no pool (--recv-pool 0)
    # an item's payload: whole chunks, then one buffer of exactly the tail when that is large
    sink = payload_sink(Payload.ITEM, CHUNK + POOLED_MIN, pool)
    sink.write(bytes(CHUNK + POOLED_MIN))
    assert [s.nbytes for s in sink.finish()] == [CHUNK, POOLED_MIN]


# ------------------------------------------------------- a real server


@pytest.mark.process
def test_repeated_puts_are_received_into_reused_memory_and_read_back_exactly():
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        pool = server.state.recv_pool
        size = 3 * MiB + 12345  # whole chunks (the first read, with the header, brings some too) and a tail
        made = []
        for i in range(8):
            value = torch.full((size // 4,), float(i))
            c.put("params", value)
            assert torch.equal(c.peek("params")[0], value)
            made.append(pool.made)
        # Each put is received while the one before is still stored; from the third
        # on, into the chunks of the version before last.
        assert 0 < made[0] < made[1] == made[-1] and pool.reused == 6 * made[0]
        # Values that stay stored keep their memory while others come and go.
        for i in range(12):
            c.append("rollouts", torch.full((MiB + i,), i, dtype=torch.int16))
            c.put("params", torch.full((size // 4,), -float(i)))
        taken = c.get("rollouts")
        assert len(taken) == 12
        assert all(torch.equal(t, torch.full((MiB + i,), i, dtype=torch.int16)) for i, t in enumerate(taken))
        assert torch.equal(c.peek("params")[0], torch.full((size // 4,), -11.0))
        assert ServerConfig(recv_pool=0).recv_pool_bytes == 0
        assert ServerConfig(recv_pool=1 << 30, memory_limit=64 * MiB).recv_pool_bytes == 16 * MiB


@pytest.mark.process
def test_inserts_into_a_table_are_received_into_reused_memory_and_stored_exactly():
    columns = {"obs": ((4, 84, 84), torch.uint8), "reward": ((), torch.float32)}
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        pool = server.state.recv_pool
        c.create_table("replay", 64, columns, remover="fifo")
        sent = []
        for i in range(6):  # 32 rows of 28 KB: 900 KB a batch, one buffer of the pool each time
            rows = {"obs": torch.randint(0, 256, (32, 4, 84, 84), dtype=torch.uint8),
                    "reward": torch.full((32,), float(i))}
            keys = c.insert("replay", rows)
            sent.append((keys % 64, rows))
        assert pool.made == 1 and pool.reused == 5  # the batch before's buffer, free once its rows were copied
        for slots, rows in sent[-2:]:  # the table (64 rows) holds the last two batches
            back = c.read("replay", slots)
            assert torch.equal(back["obs"], rows["obs"]) and torch.equal(back["reward"], rows["reward"])


@pytest.mark.process
def test_a_reply_being_sent_keeps_its_memory_while_the_item_is_replaced_again_and_again():
    """A reader that reads nothing yet holds a PEEK reply of the item's chunks; puts
    of other values must be received into other memory, or the reply would send
    them."""
    server = ServerProcess()
    try:
        with tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
            original = torch.arange(4 * MiB, dtype=torch.int32)  # 16 MiB: 16 pooled chunks
            c.put("p", original)
            reader = RawConnection(server.port, rcvbuf=4096, timeout=30)
            reader.send(raw_frame(1, "PEEK", "p"))
            time.sleep(0.2)  # the reply is queued, mostly unsent
            for i in range(8):
                c.put("p", torch.full((4 * MiB,), -i, dtype=torch.int32))
            assert int(c.peek("p")[0][0]) == -7
            reply = reader.read_frame()
            assert reply.header["code"] == 226
            (value,) = decode_items(reply.header, reply.payload, reply.payload_len)
            assert torch.equal(value, original)
            reader.close()
    finally:
        server.stop()
    assert "Traceback" not in server.stderr


@pytest.mark.process
def test_items_received_into_the_pool_spill_and_are_served_from_disk_over_tcp():
    # 16 MiB of payload, and room for the descriptions, which count too
    with EmbeddedServer(port=0, memory_limit=16 * MiB + 64 * 1024) as server, \
            tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        pool, store = server.state.recv_pool, server.state.store
        assert 4 * MiB <= pool.max_bytes < 5 * MiB  # a quarter of the memory limit: 4 chunks
        values = [torch.full((2 * MiB,), float(i)) for i in range(4)]  # 8 MiB each
        for i in range(3):  # the first fills the pool; the next two are read the usual way
            c.put(f"b{i}", values[i])
        deadline = time.monotonic() + 10
        while store.resident_bytes > 16 * MiB and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.resident_bytes <= 16 * MiB  # b0, least recently used, went to disk
        assert pool.free_bytes == pool.held_bytes == 4 * MiB  # and its chunks came back
        c.put("b3", values[3])
        assert pool.reused == 4
        for i, value in enumerate(values):  # spilled ones go out as spans of their files
            assert torch.equal(c.peek(f"b{i}")[0], value)


@pytest.mark.process
def test_a_reader_gone_mid_reply_leaves_no_chunk_held():
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        pool = server.state.recv_pool
        c.put("p", torch.arange(4 * MiB, dtype=torch.int32))  # 16 MiB
        held = pool.held_bytes
        for _ in range(3):
            reader = RawConnection(server.port, rcvbuf=4096)
            reader.send(raw_frame(1, "PEEK", "p"))
            reader.sock.recv(65536)
            reader.close()  # mid-reply
        c.put("p", torch.zeros(4 * MiB, dtype=torch.int32))  # the first value's chunks: only the replies held them
        deadline = time.monotonic() + 10
        while pool.free_bytes < held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.free_bytes >= held
        assert torch.equal(c.peek("p")[0], torch.zeros(4 * MiB, dtype=torch.int32))


# ------------------------------------------------------- the clients' reply arrays


@pytest.mark.process
def test_a_client_receives_a_reply_into_an_array_only_once_its_values_are_dropped():
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        first = torch.arange(MiB, dtype=torch.float32)  # 4 MiB
        c.put("p", first)
        kept = c.peek("p")[0]  # held: its array must not take the next reply
        c.put("p", torch.full((MiB,), -1.0))
        second = c.peek("p")[0]
        assert torch.equal(kept, first) and torch.equal(second, torch.full((MiB,), -1.0))
        assert kept.data_ptr() != second.data_ptr() and c.values.buffers.reused == 0
        address = second.data_ptr()
        del second
        c.put("p", torch.full((MiB,), 7.0))
        third = c.peek("p")[0]  # the second's array was free
        assert third.data_ptr() == address and c.values.buffers.reused == 1
        assert torch.equal(third, torch.full((MiB,), 7.0)) and torch.equal(kept, first)
        small = c.peek("p")  # a list of tensors holding the reply: still one array
        view = small[0][10:20]
        del small, third
        c.put("p", torch.full((MiB,), 8.0))
        assert torch.equal(c.peek("p")[0], torch.full((MiB,), 8.0))
        assert torch.equal(view, torch.full((10,), 7.0))  # a view keeps its array too
        c.close()
        assert c.values.buffers.held_bytes == 0
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        for n in (MiB, MiB + 64, 3 * MiB + 4096):  # exactly at the threshold, and sizes between classes
            c.put("p", torch.full((n,), 1, dtype=torch.uint8))
            kept = c.peek("p")[0]
            c.put("p", torch.full((n,), 2, dtype=torch.uint8))
            other = c.peek("p")[0]
            assert int(kept.min()) == int(kept.max()) == 1 and int(other.min()) == 2, n
            del other
            c.put("p", torch.full((n - 64,), 3, dtype=torch.uint8))  # same class: takes the other's array
            again = c.peek("p")[0]
            assert int(kept.max()) == 1 and int(again.min()) == int(again.max()) == 3, n
            del kept, again
    with EmbeddedServer(port=0) as server, tensorshare.Client("127.0.0.1", server.port, reuse=0) as c:
        assert c.values.buffers is None
        c.put("p", first)
        assert torch.equal(c.peek("p")[0], first)
    with pytest.raises(ValueError):
        tensorshare.Client("127.0.0.1", 1, reuse=-1)


@pytest.mark.process
def test_the_deferred_client_reuses_reply_arrays_too():
    from twisted.internet import reactor
    from twisted.internet.threads import blockingCallFromThread

    from tensorshare.async_client import AsyncClient
    from tensorshare_server.app import ensure_reactor_thread

    ensure_reactor_thread()
    with EmbeddedServer(port=0) as server:
        client = blockingCallFromThread(reactor, AsyncClient.connect, "127.0.0.1", server.port, zero_copy=False)
        try:
            for i in range(3):
                value = torch.full((MiB,), float(i))
                blockingCallFromThread(reactor, client.put, "p", value)
                items = blockingCallFromThread(reactor, client.peek, "p")
                assert torch.equal(items[0], value)
                del items
            assert client.values.buffers.reused == 2 and client.values.buffers.made == 1
        finally:
            blockingCallFromThread(reactor, client.close)
        assert client.values.buffers.held_bytes == 0


def test_recv_pool_option_on_the_command_line():
    from tensorshare_server.cli import parse_args

    assert parse_args(["--recv-pool", "256MiB"])[0].recv_pool == 256 * MiB
    assert parse_args(["--recv-pool", "0"])[0].recv_pool_bytes == 0
    assert parse_args(["--recv-pool-idle", "2.5"])[0].recv_pool_idle == 2.5
    for bad in ({"recv_pool": -1}, {"recv_pool_idle": 0}, {"recv_pool_idle": float("inf")}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
