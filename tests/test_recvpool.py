"""The receive pool: large payloads read into reused memory (server/recvpool.py)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import tensorshare
from serverproc import ServerProcess
from tensorshare.connection import decode_items
from tensorshare.wire.frames import FrameDecoder, frame_head
from tensorshare_server import EmbeddedServer, ServerConfig
from tensorshare_server.recvpool import CHUNK, ChunkPool, PooledSink
from wiretools import RawConnection, raw_frame

MiB = 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ ChunkPool


def test_a_chunk_is_handed_out_again_only_once_nothing_refers_to_it():
    pool = ChunkPool(4 * CHUNK)
    first = pool.take()
    view = memoryview(first).toreadonly()[10:20]  # what a stored item or a reply holds
    del first
    assert pool.free_bytes == 0
    second = pool.take()
    assert second is not view.obj and pool.made == 2 and pool.reused == 0
    del view
    assert pool.free_bytes == CHUNK
    third = pool.take()
    assert pool.reused == 1 and pool.made == 2 and pool.free_bytes == 0
    del second, third
    assert pool.free_bytes == 2 * CHUNK


def test_the_pool_tracks_at_most_its_bound():
    pool = ChunkPool(3 * CHUNK + CHUNK // 2)
    held = [pool.take() for _ in range(5)]
    assert pool.made == 5 and pool.tracked_bytes == 3 * CHUNK  # two were plain memory
    del held
    again = [pool.take() for _ in range(5)]
    assert pool.reused == 3 and pool.made == 7
    assert len({id(c) for c in again}) == 5
    assert ChunkPool(CHUNK - 1).tracked_bytes == 0


def test_a_take_finds_free_chunks_beyond_a_run_of_busy_ones():
    pool = ChunkPool(1000 * 64, chunk=64)
    held = [pool.take() for _ in range(300)]
    del held[200:]  # the last hundred are free, far from where the search starts
    before = pool.made
    again = [pool.take() for _ in range(100)]
    assert pool.made - before <= 5 and pool.reused >= 95  # a few misses while it moves on
    del again


def test_trim_releases_chunks_only_after_they_have_been_free_for_idle_seconds():
    clock = FakeClock()
    pool = ChunkPool(8 * CHUNK, idle=10.0, clock=clock)
    kept = pool.take()  # stays in use throughout
    freed = pool.take()
    del freed
    assert pool.trim() == 0  # seen free now
    clock.now += 9.9
    assert pool.trim() == 0
    clock.now += 0.1
    assert pool.trim() == CHUNK and pool.tracked_bytes == CHUNK
    clock.now += 1000
    assert pool.trim() == 0 and pool.tracked_bytes == CHUNK  # in use: never released
    # A chunk held for long and freed now gets its whole idle time from now.
    del kept
    assert pool.trim() == 0
    clock.now += 5
    assert pool.trim() == 0
    taken = pool.take()  # taken again before its time was up: no longer counted as free
    clock.now += 20
    assert pool.trim() == 0 and pool.reused == 1
    del taken


# ---------------------------------------------------------------- PooledSink


def _decode(payload: bytes, pool: ChunkPool, rng: random.Random):
    """Run one PUT frame through a decoder with a PooledSink, mixing lent reads of
    random sizes with bytes fed the usual way, as the server's reads can."""
    wire = frame_head({"op": "PUT", "id": 1}, len(payload)) + payload
    decoder = FrameDecoder(lambda header, n: PooledSink(n, pool))
    frames, pos = [], 0
    while pos < len(wire):
        buf = decoder.lent_buffer()
        if buf is not None and rng.random() < 0.8:
            n = rng.randint(1, len(buf))
            buf[:n] = wire[pos : pos + n]
            del buf
            frames += decoder.buffer_updated(n)
        else:
            n = rng.randint(1, 3 * pool.chunk)
            frames += decoder.feed(wire[pos : pos + n])
        pos += n
    assert len(frames) == 1 and frames[0].payload_len == len(payload)
    return frames[0].payload


def test_a_pooled_sink_keeps_every_payload_whole_and_in_order():
    rng = random.Random(7)
    pool = ChunkPool(64 * 64, chunk=64)
    for case in range(300):
        payload = rng.randbytes(rng.randint(0, 5 * 64 + 63))
        segments = _decode(payload, pool, rng)
        assert b"".join(segments) == payload, case
        for s in segments:
            if isinstance(s, memoryview):  # pool chunks: whole, read-only
                assert s.readonly and s.nbytes == 64
    assert pool.reused > 100  # the segments of earlier cases were dropped: their chunks came back


def test_a_pooled_sink_does_not_lend_for_less_than_a_chunk():
    pool = ChunkPool(16 * 64, chunk=64)
    sink = PooledSink(100, pool)
    first = sink.get_buffer()
    assert first is not None and len(first) == 64
    sink.buffer_updated(64)
    assert sink.get_buffer() is None  # 36 bytes left: they come the usual way
    sink.write(b"x" * 36)
    assert [bytes(s) for s in sink.finish()] == [bytes(64), b"x" * 36]


# ------------------------------------------------------- a real server


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


def test_items_received_into_the_pool_spill_and_are_served_from_disk_over_tcp():
    with EmbeddedServer(port=0, memory_limit=16 * MiB) as server, \
            tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as c:
        values = [torch.full((2 * MiB,), float(i)) for i in range(6)]  # 8 MiB each: past the limit soon
        for i, value in enumerate(values):
            c.put(f"b{i}", value)
        deadline = time.monotonic() + 10
        while server.state.store.resident_bytes > 16 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.store.resident_bytes <= 16 * MiB
        for i, value in enumerate(values):  # spilled ones go out as spans of their files
            assert torch.equal(c.peek(f"b{i}")[0], value)
        assert server.state.recv_pool.tracked_bytes <= 4 * MiB  # a quarter of the memory limit


def test_recv_pool_option_on_the_command_line():
    from tensorshare_server.app import parse_args

    assert parse_args(["--recv-pool", "256MiB"])[0].recv_pool == 256 * MiB
    assert parse_args(["--recv-pool", "0"])[0].recv_pool_bytes == 0
    assert parse_args(["--recv-pool-idle", "2.5"])[0].recv_pool_idle == 2.5
    for bad in ({"recv_pool": -1}, {"recv_pool_idle": 0}, {"recv_pool_idle": float("inf")}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
