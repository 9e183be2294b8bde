"""The device transfer engine's logic, on the CPU: CPU tensors stand in for device memory.

``devicesim.DeferredStreams`` keeps CUDA's ordering rules strictly (queued work
runs only when waited for), so a missing wait or a buffer reused too early shows as
wrong bytes here.  What only a GPU can check is in ``test_gpu.py`` (marked ``cuda``).
"""

from __future__ import annotations

import mmap
import os
import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tensorshare.device as device_engines
from devicesim import POISON, DeferredStreams, DeviceTensor, Stream, to_device
from tensorshare.device.buckets import Bucket, Piece, Ranges, plan, windows
from tensorshare.device.engine import INLINE_MAX, DeviceSpan, Engine, StagedParts
from tensorshare.device.pool import Pool
from tensorshare.wire.codec import build, encode, parse_description

BUCKET = 1024


def engine(**kw) -> Engine:
    """A stand-in engine, serving the stand-in's device tensors (the latest made serves them)."""
    kw.setdefault("bucket", BUCKET)
    kw.setdefault("inline_max", 0)
    eng = Engine(DeferredStreams(), **kw)
    device_engines._ENGINES["cpu"] = eng
    return eng


@pytest.fixture(autouse=True)
def _no_engine_left():
    yield
    device_engines._ENGINES.pop("cpu", None)


def payload_of(value) -> tuple[bytes, bytes]:
    """(description, payload bytes) of ``value`` encoded the ordinary way."""
    enc = encode(value)
    return enc.description, enc.payload_bytes()


def sent_bytes(eng: Engine, parts) -> bytes:
    return b"".join(bytes(view) for view, _staged in eng.pieces(parts))


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ------------------------------------------------------------------ plans


def test_small_parts_share_buckets_and_large_ones_are_split():
    sizes = [100, 28, 100, 28, 3000, 0, 50]
    staged = [True, False, True, False, True, True, True]
    steps = plan(sizes, staged, 1024)
    assert all(type(s) is Bucket for s in steps)
    assert [s.nbytes for s in steps] == [1024, 1024, 1024, 234]
    first = steps[0].pieces
    assert first[:4] == (Piece(0, 0, 100, 0), Piece(1, 0, 28, 100), Piece(2, 0, 100, 128), Piece(3, 0, 28, 228))
    assert first[4] == Piece(4, 0, 768, 256)  # the large part fills the rest, then goes on in the next


def test_large_host_parts_go_out_as_they_are():
    # a host part too large to pack closes the bucket and is sent itself
    steps = plan([100, 10_000, 100, 64], [True, False, True, False], 1024)
    assert steps == [Bucket((Piece(0, 0, 100, 0),), 100), 1, Bucket((Piece(2, 0, 100, 0), Piece(3, 0, 64, 100)), 164)]
    # host parts with no bucket open are never copied
    assert plan([64, 10, 100], [False, False, True], 1024) == [0, 1, Bucket((Piece(2, 0, 100, 0),), 100)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.booleans()), max_size=30), st.integers(1, 3000))
def test_a_plan_covers_every_byte_once_in_order(parts, bucket):
    sizes, staged = [p[0] for p in parts], [p[1] for p in parts]
    covered = []
    for step in plan(sizes, staged, bucket):
        if type(step) is int:
            assert not staged[step]
            covered.append((step, 0, sizes[step]))
            continue
        assert 0 < step.nbytes <= bucket
        at = 0
        for piece in step.pieces:
            assert piece.at == at
            at += piece.length
            covered.append((piece.part, piece.start, piece.length))
        assert at == step.nbytes
    position = {}
    for part, start, length in covered:  # each part's bytes, in order, once
        assert start == position.get(part, 0)
        position[part] = start + length
    assert position == {i: s for i, s in enumerate(sizes) if s}
    assert [p for p, _, _ in covered] == sorted(p for p, _, _ in covered)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=20), st.integers(1, 500))
def test_windows_cut_ranges_exactly(gaps_lengths, bucket):
    ranges, position = [], 0
    for gap, length in gaps_lengths:
        position += gap
        ranges.append((position, length, len(ranges)))
        position += length
    nbytes = position + 7
    found = {key: [] for _s, _l, key in ranges}
    for start, length in windows(nbytes, bucket):
        for key, offset, size, at in Ranges(ranges).cut(start, length):
            r_start = ranges[key][0]
            assert r_start + offset == start + at  # the same payload byte
            assert 0 <= at and at + size <= length
            found[key].append((offset, size))
    for r_start, length, key in ranges:
        pos = 0
        for offset, size in found[key]:
            assert offset == pos
            pos += size
        assert pos == length


def test_overlapping_ranges_are_refused():
    with pytest.raises(ValueError):
        Ranges([(0, 10, "a"), (5, 10, "b")])


# ------------------------------------------------------------------ out: device to host

VALUES = {
    "many small": {f"layer{i}.weight": torch.randn(7 + i) for i in range(96)},
    "one large": torch.arange(10_000, dtype=torch.float32),
    "mixed": {"a": torch.arange(3000, dtype=torch.float32), "b": [torch.ones(3, dtype=torch.bfloat16),
              torch.randn(40, 50).t()], "c": torch.tensor(3 + 4j).conj(), "n": -torch.arange(5.0)._neg_view(),
              "s": "text", "z": torch.empty(0, 3), "bool": torch.rand(333) > 0.5, "np": np.arange(700)},
    "dtypes": {str(dt): torch.arange(50).to(dt) for dt in (torch.uint8, torch.int8, torch.int16, torch.int32,
                                                           torch.int64, torch.float16, torch.bfloat16,
                                                           torch.float32, torch.float64, torch.complex64,
                                                           torch.bool)},
    "views": {"offset": torch.arange(5000.0)[1234:4321], "strided": torch.arange(6000.0).view(60, 100)[:, ::3],
              "scalar": torch.tensor(7.5), "expanded": torch.arange(10.0).expand(300, 10)},
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_staged_sends_the_bytes_an_ordinary_encode_does(name):
    value = VALUES[name]
    eng = engine()
    enc = encode(to_device(value))
    assert enc.engine is eng and any(type(b) is DeviceSpan for b in enc.buffers)
    description, payload = payload_of(value)
    assert enc.description == description
    assert sent_bytes(eng, enc.buffers) == payload
    assert eng.streams.pending() == 0 or all(True for _ in [0])


def test_a_state_dict_of_many_tensors_costs_what_one_tensor_does():
    eng_many, eng_one = engine(bucket=64 << 10), engine(bucket=64 << 10)
    many = {f"p{i}": torch.randn(1000) for i in range(96)}
    one = torch.randn(96 * 1000)
    sends = {}
    for key, eng, value in (("many", eng_many, many), ("one", eng_one, one)):
        enc = encode(to_device(value))
        sends[key] = sum(1 for _view, staged in eng.pieces(enc.buffers) if staged)
    assert sends["many"] == sends["one"] == 6  # 384 KB (plus padding) in buckets of 64 KiB
    assert eng_many.streams.syncs <= sends["many"] + 1  # one host wait per bucket, not per tensor


def test_buckets_are_copied_ahead_of_the_one_being_sent_through_a_few_reused_buffers():
    eng = engine(depth=3)
    value = torch.arange(20 * BUCKET // 4, dtype=torch.float32)
    for _ in range(3):
        enc = encode(to_device(value))
        seen = []
        for view, staged in eng.pieces(enc.buffers):
            if staged:
                seen.append(eng.streams.copies)
        assert len(seen) == 20
    # while bucket k is sent, copies up to bucket k + 2 are queued
    assert all(copies >= min(k + 3, 20) + 40 for k, copies in enumerate(seen))
    assert eng.pool.made == 3 and eng.streams.hosts == 3  # three buffers, for all sixty buckets


def test_a_tensor_written_on_the_caller_stream_just_before_encoding_is_sent_with_its_new_values():
    eng = engine()
    sim = eng.streams
    t = to_device(torch.zeros(5000))
    kernel_stream = sim.stream()  # any stream but the engine's
    with sim.using(kernel_stream):
        sim.later(kernel_stream, lambda: t.fill_(3.0))  # queued, not run: a kernel still in flight
        enc = encode(t)
    assert float(t[0]) == 0.0  # still pending when put reads it
    data = sent_bytes(eng, enc.buffers)
    assert np.frombuffer(data, np.float32)[:5000].tolist() == [3.0] * 5000


def test_a_send_that_fails_mid_transfer_gives_every_buffer_back():
    eng = engine(depth=3)
    enc = encode(to_device(torch.randn(30 * BUCKET // 4)))
    pieces = eng.pieces(enc.buffers)
    for _ in range(4):
        next(pieces)
    pieces.close()  # the consumer's socket broke
    assert len(eng.pool) == eng.pool.made == 3
    assert eng.streams.pending() == 0  # the copies queued ahead ran before their buffers went back
    # and the engine goes on working
    value = torch.randn(10_000)
    assert sent_bytes(eng, encode(to_device(value)).buffers) == payload_of(value)[1]


def test_small_values_are_staged_when_encoded():
    engine(inline_max=INLINE_MAX)  # the default inline_max
    value = {"w": torch.randn(100), "b": torch.randn(3)}
    enc = encode(to_device(value))
    assert enc.engine is None and not any(type(b) is DeviceSpan for b in enc.buffers)
    assert enc.payload_bytes() == payload_of(value)[1]


def test_request_frames_of_staged_values_are_marked():
    from tensorshare._client.connection import request_frame
    from tensorshare.protocol.messages import PUT

    eng = engine()
    parts = request_frame(1, PUT, {"bin": "b"}, encode(to_device(torch.randn(2000))))
    assert type(parts) is StagedParts and parts.engine is eng
    assert type(request_frame(2, PUT, {"bin": "b"}, torch.randn(2000))) is list


def test_write_fd_writes_one_array_with_several_writers(tmp_path):
    eng = engine()
    t = torch.randn(25 * BUCKET // 4 + 3)
    span = eng.span(t)
    path = tmp_path / "array"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"head")
        eng.write_fd(fd, span.slice(8, span.nbytes - 8), writers=3)
        os.write(fd, b"tail")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + t.numpy().tobytes()[8:] + b"tail"
    assert len(eng.pool) == eng.pool.made


def test_a_file_of_host_and_device_pieces_holds_them_in_order(tmp_path):
    # write_file writes host buffers with pwritev and device spans through their
    # engine at the file's position: each piece must land after the one before.
    from tensorshare.disk.files import write_file

    eng = engine()
    t = torch.randn(3 * BUCKET // 4 + 5)
    span = eng.span(t)
    head, middle, tail = b"h" * 70_000, b"m" * 33, b"t" * 9
    write_file(str(tmp_path / "f"), [memoryview(head), span.slice(4, span.nbytes - 4), memoryview(middle), span,
                                     memoryview(tail)], fsync=False)
    data = t.numpy().tobytes()
    assert (tmp_path / "f").read_bytes() == head + data[4:] + middle + data + tail


def test_a_snapshot_keeps_the_version_of_the_call():
    eng = engine()
    value = to_device({"w": torch.arange(4000.0), "meta": torch.arange(3)})
    value["host"] = np.arange(2000)
    enc = encode(value)
    flat, event = eng.snapshot(enc.buffers, 0)
    value["w"].add_(1)  # training goes on (after the snapshot's copies were queued)
    eng.streams.synchronize(event)
    assert bytes(flat.cpu().numpy()) == payload_of({"w": torch.arange(4000.0), "meta": torch.arange(3),
                                                    "host": np.arange(2000)})[1]


def test_a_snapshot_of_many_tensors_makes_the_host_wait_for_nothing():
    """96 tensors with padding between them (host bytes): their copies are queued
    behind the caller's work, and the host waits neither for that work nor for
    pinned buffers (publish_parameters(wait=False) must not wait for a backward pass)."""
    eng = engine()
    sim = eng.streams
    state = to_device({f"p{i}": torch.randn(1000 + i) for i in range(96)})
    expected = {k: v.cpu() for k, v in state.items()}
    expected["p0"].fill_(7.0)
    caller = sim.stream()
    with sim.using(caller):
        sim.later(caller, lambda: state["p0"].fill_(7.0))  # the backward pass, still queued
        enc = encode(state)
        waits = sim.waits_here()
        flat, event = eng.snapshot(enc.buffers, 0)
        assert sim.waits_here() == waits and caller.done == 0
    sim.synchronize(event)
    assert bytes(flat.cpu().numpy()) == payload_of(expected)[1]


# ------------------------------------------------------------------ in: host to device


def feed(sink, payload: bytes, rng: random.Random) -> None:
    """Deliver ``payload`` to ``sink`` in random pieces, by ``write`` and by lending buffers."""
    pos = 0
    while pos < len(payload):
        n = rng.randint(1, 700)
        if rng.random() < 0.5:
            buf = sink.get_buffer()
            n = min(n, len(buf), len(payload) - pos)
            buf[:n] = payload[pos : pos + n]
            sink.buffer_updated(n)
        else:
            n = min(n, len(payload) - pos)
            sink.write(payload[pos : pos + n])
        pos += n


@pytest.mark.parametrize("name", sorted(k for k in VALUES if k != "mixed"))
def test_a_payload_arrives_into_device_memory_in_any_pieces(name):
    value = VALUES[name]
    description, payload = payload_of(value)
    eng = engine()
    sink = eng.incoming(len(payload), 0)
    feed(sink, payload, random.Random(name))
    result = sink.finish()
    out = build(parse_description(description, len(payload)), result)
    assert_same(value, out)
    assert eng.streams.handed and eng.streams.pending() == 0
    assert eng.pool.made <= 3  # windows reuse the buffers whose copies are done


def test_arrays_may_land_in_destination_tensors():
    value = {"a": torch.randn(700), "b": torch.randn(50, 20), "c": torch.arange(10)}
    description, payload = payload_of(value)
    desc = parse_description(description, len(payload))
    dest_a, dest_b = to_device(torch.zeros(700)), to_device(torch.zeros(50, 20))
    # arrays in table order: a, b, c (c has no destination: it goes to new memory)
    layout = [(spec.offset, spec.nbytes, target) for spec, target in zip(desc.arrays, (dest_a, dest_b, None))]
    eng = engine()
    sink = eng.incoming(len(payload), 0, layout)
    feed(sink, payload, random.Random(3))
    out = build(desc, sink.finish())
    assert out["a"] is dest_a and out["b"] is dest_b
    assert torch.equal(dest_a, value["a"]) and torch.equal(dest_b, value["b"]) and torch.equal(out["c"], value["c"])
    assert out["c"].untyped_storage().nbytes() < 128  # only c's bytes were allocated


@pytest.mark.parametrize("way", ["incoming", "upload", "copy_in"])
def test_destinations_are_written_only_after_the_callers_earlier_kernels(way):
    """A kernel the caller queued before the call (a forward pass reading a model's
    parameters) sees them as they were: the engine's writes into them wait for it."""
    value = {"a": torch.randn(3000), "b": torch.arange(5)}
    description, payload = payload_of(value)
    desc = parse_description(description, len(payload))
    eng = engine()
    sim = eng.streams
    dest = to_device(torch.zeros(3000))
    layout = [(spec.offset, spec.nbytes, target) for spec, target in zip(desc.arrays, (dest, None))]
    caller, seen = sim.stream(), []
    with sim.using(caller):
        sim.later(caller, lambda: seen.append(dest.clone()))
        at_call = eng.caller(0, with_mark=True)
    # the reply is read (or the files mapped) on another thread, whose current stream is not the caller's
    if way == "incoming":
        sink = eng.incoming(len(payload), 0, layout, at_call)
        feed(sink, payload, random.Random(7))
        arrived = sink.finish()
    elif way == "upload":  # the server's files
        arrays = [(spec.offset, np.frombuffer(payload, np.uint8, spec.nbytes, spec.offset)) for spec in desc.arrays]
        arrived = eng.upload(arrays, len(payload), 0, layout, at_call)
    else:  # another process's device memory (CUDA IPC)
        source = to_device(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        arrived = eng.copy_in(source, len(payload), 0, layout, at_call)
    out = build(desc, arrived)
    assert {stream for _tensor, stream in sim.handed} == {caller}  # handed to the caller's stream, whatever thread
    sim.flush(caller)
    assert torch.equal(seen[0], torch.zeros(3000))
    assert out["a"] is dest and torch.equal(dest, value["a"]) and torch.equal(out["b"], value["b"])


def test_a_window_fills_while_the_one_before_is_copied():
    eng = engine()
    _, payload = payload_of(torch.randn(4 * BUCKET // 4))
    sink = eng.incoming(len(payload), 0)
    sink.write(payload[: BUCKET + 1])
    assert eng.streams.pending() > 0 and eng.pool.made == 2  # the first window's copy is not waited for yet


def test_a_window_is_reused_only_once_its_copy_ran():
    eng = engine(keep=1)  # one buffer: each window must wait for the copy of the one before
    t = torch.randn(10 * BUCKET // 4)
    description, payload = payload_of(t)
    sink = eng.incoming(len(payload), 0)
    feed(sink, payload, random.Random(5))
    out = build(parse_description(description, len(payload)), sink.finish())
    assert torch.equal(out, t)


def test_an_abandoned_receive_leaves_the_engine_usable():
    eng = engine()
    _, payload = payload_of(torch.randn(8 * BUCKET // 4))
    sink = eng.incoming(len(payload), 0)
    sink.write(payload[: 3 * BUCKET + 17])  # the connection is lost here
    with pytest.raises(RuntimeError):
        sink.finish()
    del sink
    description, payload = payload_of(torch.arange(3000))
    sink = eng.incoming(len(payload), 0)
    sink.write(payload)
    assert torch.equal(build(parse_description(description, len(payload)), sink.finish()), torch.arange(3000))


@pytest.mark.filterwarnings("error::UserWarning")  # (torch warns of read-only arrays it is handed)
def test_upload_of_mapped_arrays_with_gaps():
    value = {"a": torch.randn(300), "b": torch.randn(1000), "c": torch.arange(7)}
    description, payload = payload_of(value)
    desc = parse_description(description, len(payload))
    arrays = []
    for spec in desc.arrays:  # each in pages of its own, read only, as the server's files are mapped
        pages = mmap.mmap(-1, spec.nbytes)
        pages[:] = payload[spec.offset : spec.offset + spec.nbytes]
        array = np.frombuffer(pages, np.uint8)
        array.flags.writeable = False
        arrays.append((spec.offset, array))
    for register in (False, True):
        eng = engine(register_host=register)
        out = build(desc, eng.upload(arrays, len(payload), 0))
        assert_same(value, out)
        if register:
            assert eng.streams.hosts == 0 and not eng.streams.registered  # straight from the pages, unregistered after
    eng = engine(register_host=True)
    eng.streams.register_ok = False  # the runtime refuses: staged instead
    assert_same(value, build(desc, eng.upload(arrays, len(payload), 0)))
    assert eng.streams.hosts > 0
    eng = engine(register_host=True)
    eng.streams.register_limit = 1  # refused at the second array: nothing was copied from the first
    assert_same(value, build(desc, eng.upload(arrays, len(payload), 0)))
    assert eng.streams.hosts > 0 and not eng.streams.registered and eng.registered_uploads == 0


# ------------------------------------------------------------------ pool


def test_the_pool_hands_out_the_oldest_buffer_and_never_blocks():
    sim = DeferredStreams()
    pool = Pool(sim, 16, keep=2)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert pool.made == 3
    side = sim.side(0)
    sim.copy(a[:4], torch.ones(4, dtype=torch.uint8), side)
    pool.give(a, sim.record(side))
    pool.give(b)
    pool.give(c)  # over keep: let go
    assert len(pool) == 2
    again = pool.take()
    assert again is a and a[:4].tolist() == [1, 1, 1, 1]  # its copy ran before it came back
    assert pool.take() is b and pool.take() is not None and pool.made == 4
    assert POISON == 0xA5


# ------------------------------------------------------------------ checks that run on the device


def test_digests_do_not_depend_on_where_the_bytes_lie():
    from tensorshare.device.ipc import digests

    data = torch.randint(0, 256, (1003,), dtype=torch.uint8)
    shifted = torch.empty(1010, dtype=torch.uint8)[3:1006]  # the same bytes at an odd offset
    shifted.copy_(data)
    assert digests([data, data[:8], data[:0]]) == digests([shifted, shifted[:8], shifted[:0]])
    changed = data.clone()
    changed[500] ^= 1
    assert digests([changed]) != digests([data])
    words = data[:1000].view(torch.int64).sum() + data[1000:].to(torch.int64).sum()
    assert digests([data]) == [int(words)]


def test_device_compares_answer_in_one_wait_and_bitwise():
    from tensorshare.rl.versions import differing

    a = torch.tensor([0.0, float("nan"), 1.0])
    assert differing([(a, a.clone()), (a, torch.tensor([-0.0, float("nan"), 1.0])), (torch.ones(3), torch.ones(3))]) \
        == [False, True, False]
    assert differing([(torch.arange(7, dtype=torch.int8), torch.arange(7, dtype=torch.int8).flip(0))]) == [True]


# ------------------------------------------------------------------ the caller's stream, failures, threads


def test_a_receive_that_fails_stops_writing_into_the_callers_tensors_before_it_says_so():
    """A reply cut midway: once the call's error is raised, nothing the engine
    queued writes into the caller's tensors any more (they may hold part of the
    reply, never change after)."""
    eng = engine()
    sim = eng.streams
    value = torch.randn(8 * BUCKET // 4)
    description, payload = payload_of(value)
    desc = parse_description(description, len(payload))
    dest = to_device(torch.zeros(8 * BUCKET // 4))
    at_call = eng.caller(0, with_mark=True)
    sink = eng.incoming(len(payload), 0, [(desc.arrays[0].offset, desc.arrays[0].nbytes, dest)], at_call)
    sink.write(payload[: 5 * BUCKET + 17])  # the connection is lost here
    at_call.abandon()  # (the call fails)
    after_error = dest.cpu()
    for stream in list(sim._side.values()):  # whatever the device still had to do
        sim.flush(stream)
    assert torch.equal(dest.cpu(), after_error)


def test_a_value_staged_on_one_thread_and_sent_on_another():
    """A tensor laid out otherwise (a transpose) is made contiguous on the first
    thread's stream; a send from another thread's stream waits for it."""
    eng = engine()
    value = to_device(torch.arange(64 * 300, dtype=torch.float32).view(64, 300).t())
    enc = encode(value)
    span = next(b for b in enc.buffers if type(b) is DeviceSpan)
    span.flat(eng.streams.side(0))  # made on this thread's stream, not run yet
    out = []
    thread = threading.Thread(target=lambda: out.append(sent_bytes(eng, enc.buffers)))
    thread.start()
    thread.join()
    assert out[0] == payload_of(value.cpu())[1]


def test_an_empty_tensor_beside_a_destination_gets_no_destination():
    """An empty array has the offset of the array after it: it must not come back
    as that array's destination tensor."""
    value = {"empty": torch.zeros(0), "w": torch.randn(500)}
    description, payload = payload_of(value)
    desc = parse_description(description, len(payload))
    eng = engine()
    dest = to_device(torch.zeros(500))
    targets = {i: dest for i, spec in enumerate(desc.arrays) if spec.nbytes} | \
        {i: to_device(torch.zeros(0)) for i, spec in enumerate(desc.arrays) if not spec.nbytes}
    from tensorshare.device.payload import item_layout

    layout = item_layout(desc, 0, targets, eng, 0)
    sink = eng.incoming(len(payload), 0, layout)
    sink.write(payload)
    out = build(desc, sink.finish())
    assert out["w"] is dest and torch.equal(dest, value["w"])
    assert out["empty"] is not dest and out["empty"].shape == (0,)


def test_a_reader_hands_torch_no_ipc_block_beyond_its_device():
    """A reference (from a server anyone on the host reaches) whose size or offset
    lies beyond the device, or whose handle is of no size torch reads, is refused
    before torch maps anything (a read past a block is a fault of the reader's
    CUDA context)."""
    from tensorshare.device.ipc import load
    from tensorshare.errors import DeviceReferenceError

    eng = engine()
    value = torch.randn(100)
    description, payload = payload_of(value)
    handle = b"standin\0" + bytes(58)
    for ipc in ([0, handle, 1 << 50, 0, b"", 0, b"", False], [0, handle, len(payload), (1 << 40) - 64, b"", 0, b"",
                                                               False],
                [0, b"h" * 16, len(payload), 0, b"", 0, b"", False], [0, b"h" * (1 << 17), len(payload), 0, b"", 0,
                                                                       b"", False],
                [0, handle, 16, 0, b"", 0, b"", False]):
        with pytest.raises(DeviceReferenceError):
            load({"dev": "standin-0", "ipc": ipc, "digest": [0]}, description, len(payload), "cpu")
    assert not eng.streams.violations
