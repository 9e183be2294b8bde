"""The per-request fast paths give what the general paths give.

* Whole small frames are parsed where they arrive (``frames.whole_frames``): the
  same frames as the general decoder, and a session answers the same bytes to a
  stream fed whole, one byte at a time, or with trailing data.
* The limits still apply on the fast path: an oversized header, an unknown verb,
  no authentication yet, a bin limit, a memory budget that is full.
* A verb's compiled request parser and a message's prepared reply head agree with
  the declarations' general checks and ``frame_head``.
* A small GET/PEEK reply, made as one ``bytes``, is the general path's reply, and
  its limits and a GET's accounting and hooks are the same.
* A reply skips the writer's queue and budget only while the writer is idle, and
  never overtakes a frame queued before it.
"""

from __future__ import annotations

import socket

import msgpack
import pytest
import torch
from twisted.internet import protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor

from pairing import HeldJobs, Outbox, Pair
from tensorshare._client.connection import NO_VALUE, read_reply, request_frame
from tensorshare.errors import ProtocolError, RemoteError
from tensorshare.protocol.messages import (
    APPEND, BAD_ARGS, BAD_FRAME, COMMANDS, DELETE, GET, LISTEN, NOOP, NOT_AUTHENTICATED, PEEK, PUT, TOO_LARGE,
    UNKNOWN_VERB,
)
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import (
    FREE_CONTAINERS, SMALL_FRAME, FrameDecoder, FrameLimits, SegmentSink, discard_sink, frame_head, unpack_header,
    whole_frames,
)
from tensorshare_server.config import ServerConfig
from tensorshare_server.net import twisted_internals
from tensorshare_server.net.flow import OutboundBudget
from tensorshare_server.net.writer import FrameWriter
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import build_state


def _request(rid: int, command, fields: dict | None = None, value=NO_VALUE) -> bytes:
    return b"".join(bytes(p) for p in request_frame(rid, command, fields, value))


def _stream() -> bytes:
    """A client's mixed requests, as it would send them."""
    value = torch.arange(64, dtype=torch.float32)
    return b"".join([
        _request(1, PUT, {"bin": "a"}, value), _request(2, APPEND, {"bin": "a", "tag": 7}, value),
        _request(3, PEEK, {"bin": "a"}), _request(4, LISTEN, {"bin": "a"}), _request(5, GET, {"bin": "a"}),
        _request(6, NOOP), _request(7, GET, {"bin": "missing"}), _request(8, DELETE, {"bin": "a"}),
        frame_head({"op": "FROB", "id": 9}, 0), frame_head({"op": "PUT", "id": 10, "bin": "\x01"}, 0),
        _request(11, PUT, {"bin": "b"}, torch.ones(3)),
    ])


def _answers(data: bytes, split: int | None = None, **config) -> bytes:
    """The bytes a fresh session answers ``data`` with (after its greeting)."""
    pair = Pair(**config)
    pair.outbox.data.clear()
    pair.send(data, split=split)
    return bytes(pair.outbox.data)


# -------------------------------------------------------------- whole_frames


def _decoded(data: bytes) -> list[tuple[dict, bytes, int]]:
    frames = FrameDecoder(lambda header, n: SegmentSink(n)).feed(data)
    return [(f.header, b"".join(f.payload), f.payload_len) for f in frames]


def test_whole_frames_are_the_decoders_frames():
    data = _stream()
    found, end = whole_frames(data)
    assert end == len(data)
    assert found == _decoded(data)


def test_whole_frames_stop_where_a_frame_is_not_whole_and_the_decoder_goes_on():
    data = _stream()
    for cut in (1, 19, 20, 25, len(data) - 1):  # the last frame cut short: within its prefix, header, payload
        head, tail = data[:-cut], data[-cut:]
        found, end = whole_frames(head)
        decoder = FrameDecoder(lambda header, n: SegmentSink(n))
        rest = decoder.feed(head[end:]) + decoder.feed(tail)
        decoded = _decoded(data)
        assert found == _decoded(head) and len(found) == (len(decoded) - 1 if cut < 30 else 0)
        assert [(f.header, b"".join(f.payload), f.payload_len) for f in rest] == decoded[len(found):]


def test_whole_frames_of_small_frames_only_up_to_the_threshold():
    def frame_of(total: int) -> bytes:
        head = frame_head({"op": "PUT", "id": 1, "bin": "b", "value": b"v"}, 0)
        return frame_head({"op": "PUT", "id": 1, "bin": "b", "value": b"v"}, total - len(head)) + \
            b"x" * (total - len(head))
    at, over = frame_of(SMALL_FRAME), frame_of(SMALL_FRAME + 1)
    assert len(at) == SMALL_FRAME and len(over) == SMALL_FRAME + 1
    assert whole_frames(at)[1] == len(at) and whole_frames(at)[0] == _decoded(at)
    assert whole_frames(over) == ([], 0)  # the decoder's: a large payload may go into the receive pool
    assert whole_frames(at + over)[1] == len(at)


def test_whole_frames_leave_what_is_wrong_to_the_decoder():
    good = frame_head({"op": "NOOP", "id": 1}, 0)
    bad_header = frame_head({"op": "NOOP", "id": 2}, 0)[:20] + b"\xc1" * (len(good) - 20)  # not msgpack
    keyed_by_bytes = msgpack.packb({b"op": b"NOOP", b"id": 3})  # a header whose keys are not str
    bytes_key = good[:8] + len(keyed_by_bytes).to_bytes(4, "little") + bytes(8) + keyed_by_bytes
    long_header = frame_head({"op": "NOOP", "id": 4, "pad": "x" * FREE_CONTAINERS}, 0)
    for wrong in (bad_header, bytes_key, long_header, b"HTTP/1.1 200 OK\r\n" + good):
        found, end = whole_frames(good + wrong + good)
        assert found == _decoded(good) and end == len(good)


@pytest.mark.parametrize("declared", [b"\xdd", b"\xdf", b"\xdb", b"\xc6"], ids=["array", "map", "str", "bin"])
def test_a_small_header_declaring_more_than_it_holds_is_refused_before_anything_is_made(declared):
    """A length of 10**9 in a header of a dozen bytes: refused by its own size (the
    decoder bounds every declared length by the header's bytes), never allocated."""
    header = b"\x82\xa2op\xa4NOOP\xa2id" + declared + (10**9).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="malformed header"):
        unpack_header(header)
    frame = frame_head({"op": "NOOP", "id": 1}, 0)[:8] + len(header).to_bytes(4, "little") + bytes(8) + header
    assert whole_frames(frame) == ([], 0)  # the decoder's, which refuses it with its reason
    with pytest.raises(ProtocolError, match="malformed header"):
        FrameDecoder(discard_sink).feed(frame)


# ------------------------------------------------- a session, whole or split


def test_a_session_answers_the_same_bytes_whole_byte_by_byte_and_with_trailing_data():
    data = _stream()
    whole = _answers(data)
    assert whole == _answers(data, split=1)
    assert whole == _answers(data, split=7)
    replies = {f.header["id"]: f.header["code"] for f in FrameDecoder(discard_sink).feed(whole) if f.header["id"]}
    assert replies == {1: 250, 2: 250, 3: 226, 4: 200, 5: 226, 6: 200, 7: 550, 8: 250, 9: 502, 10: 553, 11: 250}
    pair = Pair()  # a request whose last bytes come in the next read, after a whole one
    pair.outbox.data.clear()
    pair.send(data[:-5])
    pair.send(data[-5:])
    assert bytes(pair.outbox.data) == whole


def _reads() -> bytes:
    value = torch.arange(16, dtype=torch.float32)
    return b"".join([
        _request(1, PUT, {"bin": "a", "tag": 3}, value), _request(2, APPEND, {"bin": "a"}, torch.ones(2, 3)),
        _request(3, PEEK, {"bin": "a"}), _request(4, PEEK, {"bin": "a", "since": 2}),
        _request(5, PEEK, {"bin": "a", "since": 1}), _request(6, PEEK, {"bin": "a", "tags": True}),
        _request(7, PEEK, {"bin": "a", "ref": [0]}), _request(8, GET, {"bin": "a", "max": 1, "ref": [0]}),
        _request(9, GET, {"bin": "a"}), _request(10, GET, {"bin": "a"}), _request(11, PEEK, {"bin": "none"}),
        _request(12, PUT, {"bin": "b"}, torch.ones(1024)), _request(13, PEEK, {"bin": "b"}),
        _request(14, GET, {"bin": "b"}),
    ])


@pytest.mark.parametrize("same_host", [False, True])
def test_small_get_and_peek_replies_are_the_general_paths(monkeypatch, same_host):
    from tensorshare_server.protocol import handlers

    config = {"same_host": True, "zero_copy_min": 1024} if same_host else {}
    fast = _answers(_reads(), **config)
    monkeypatch.setattr(handlers, "_SMALL_REPLY", 0)  # (every reply takes the general path)
    assert fast == _answers(_reads(), **config)
    codes = [f.header["code"] for f in FrameDecoder(discard_sink).feed(fast) if f.header["id"]]
    assert codes == [250, 250, 226, 226, 226, 226, 226, 226, 226, 226, 550, 250, 226, 226]


def test_a_small_get_or_peek_is_held_to_the_reply_header_limit_and_a_get_to_its_accounting():
    pair = Pair(max_reply_header=80)
    for _ in range(3):
        pair.call(APPEND, {"bin": "a"}, torch.ones(2, 2, 2))  # 31 bytes of description each
    for command in (PEEK, GET):
        with pytest.raises(RemoteError, match="take 93 bytes, over the 80 one reply may carry"):
            pair.call(command, {"bin": "a"})
    assert len(pair.call(GET, {"bin": "a", "max": 2}).values) == 2  # (what a GET was refused kept every item)
    store, held = pair.state.store, []
    nbytes = store.items_of("a")[0].nbytes
    pair.outbox.send = lambda parts, on_abandon=None, on_written=None: held.append((on_abandon, on_written))
    pair.send_request(GET, {"bin": "a"})
    assert store.in_flight_bytes == nbytes and store.count("a") == 0  # counted until written
    held.pop()[0]()  # the connection died first: the item goes back
    assert store.in_flight_bytes == 0 and store.count("a") == 1
    pair.send_request(GET, {"bin": "a"})
    held.pop()[1]()  # written
    assert store.in_flight_bytes == 0 and store.count("a") == 0


def test_limits_hold_on_the_fast_path():
    too_many = _request(1, PUT, {"bin": "one"}, torch.ones(2)) + _request(2, PUT, {"bin": "two"}, torch.ones(2))
    for split in (None, 1):
        frames = FrameDecoder(discard_sink).feed(_answers(too_many, split, max_bins=1))
        assert [f.header["code"] for f in frames] == [250, TOO_LARGE]
    oversized = frame_head({"op": "NOOP", "id": 1, "pad": "x" * 2000}, 0)
    for split in (None, 1):
        pair = Pair(max_header=1000)
        pair.outbox.data.clear()
        pair.send(_request(1, NOOP) + oversized + _request(2, NOOP), split=split)
        assert [f.header["code"] for f in pair.receive()] == [200, BAD_FRAME]  # then it closes
        assert pair.outbox.closed
    unknown = FrameDecoder(discard_sink).feed(_answers(frame_head({"op": "FROB", "id": 3}, 0)))
    assert [(f.header["code"], f.header["id"]) for f in unknown] == [(UNKNOWN_VERB, 3)]
    payload_on_noop = frame_head({"op": "NOOP", "id": 4}, 3) + b"abc"
    assert [f.header["code"] for f in FrameDecoder(discard_sink).feed(_answers(payload_on_noop))] == [BAD_ARGS]


def test_requests_before_authentication_take_the_general_path_and_are_refused():
    state = build_state(ServerConfig(token="secret"), clock=Clock())
    outbox = Outbox()
    session = ServerSession(state, outbox, "fast")
    session.connection_made()
    outbox.data.clear()
    session.data_received(_request(1, NOOP) + _request(2, PUT, {"bin": "b"}, torch.ones(2)))
    frames = FrameDecoder(discard_sink).feed(bytes(outbox.data))
    assert [f.header["code"] for f in frames] == [NOT_AUTHENTICATED] and outbox.closed
    assert not state.storage.store.exists("b")


class _Reads:
    def __init__(self):
        self.paused: set[str] = set()

    def pause(self, reason: str) -> None:
        self.paused.add(reason)

    def resume(self, reason: str) -> None:
        self.paused.discard(reason)


def test_a_full_memory_budget_stops_reading_payloads_on_the_fast_path_too(tmp_path):
    jobs = HeldJobs()  # the spill writes wait: memory stays over the budget meanwhile
    state = build_state(ServerConfig(memory_limit=4096, spill_dir=str(tmp_path)), jobs=jobs, clock=Clock())
    reads = _Reads()
    outbox = Outbox()
    session = ServerSession(state, outbox, "fast", reads)
    session.connection_made()
    big = torch.ones(2048)  # 8 KiB: over the budget, so it is spilled (a held disk job)
    session.data_received(_request(1, PUT, {"bin": "a"}, big))
    assert jobs.queued and not state.storage.room()
    session.data_received(_request(2, PUT, {"bin": "b"}, big))
    assert reads.paused == {"memory"}  # as the general decoder does: no more payloads until there is room
    jobs.release()
    assert state.storage.room() and not reads.paused
    codes = [f.header["code"] for f in FrameDecoder(discard_sink).feed(bytes(outbox.data))]
    assert codes == [220, 250, 250]


# ------------------------------------------------- compiled checks, templates


def test_compiled_parsers_agree_with_the_declared_checks():
    for command in COMMANDS.values():
        right = {field.key: _right(field.kind.name) for field in command.fields}
        request = command.parse_request({"op": command.verb, "id": 5, **right}, 5, None, 0)
        assert [getattr(request, key) for key in command.keys] == [right[key] for key in command.keys]
        assert command.parse_right({"op": command.verb, "id": 5, **right}, 5, None, 0) is not None
        if not command.payload:  # a payload where none is declared: 501 from either way in
            assert command.parse_right({"op": command.verb, "id": 5, **right}, 5, [b"x"], 1) is None
            with pytest.raises(Exception, match="takes no payload"):
                command.parse_request({"op": command.verb, "id": 5, **right}, 5, [b"x"], 1)
        for field in command.fields:  # each field wrong in turn: the compiled parser says no, the checks say why
            if field.kind.name == "anything":
                continue
            wrong = {**right, field.key: _wrong(field.kind.name)}
            assert command.parse_right(wrong, 5, None, 0) is None, (command, field.key)
            with pytest.raises(Exception) as raised:
                command.parse_request(wrong, 5, None, 0)
            assert getattr(raised.value, "code", None) == field.code


_RIGHT = {"an integer": 3, "a boolean": True, "a string": "s", "bytes": b"b", "a list of integers": [1, 2],
          "a list": [1, "x"], "a map of strings to integers": {"a": 1}, "a map": {"k": []}, "anything": 1,
          "a tag": -5, "a bin name": "bin/1", "a list of tags": [1, None], "an integer of at least 1": 1,
          "bytes of at most 64": b"x" * 64}


def _right(kind: str):
    return _RIGHT.get(kind, 1.5)  # (seconds)


def _wrong(kind: str):
    return {"a bin name": "bad\x00name", "a tag": 1 << 63, "bytes of at most 64": b"x" * 65,
            "an integer of at least 1": 0}.get(kind, object())


def test_a_prepared_reply_head_is_the_frame_of_the_declared_reply():
    for rid, n, seq in ((1, 0, 1), (12345, 3, 1 << 40), ((1 << 64) - 1, 1 << 32, 7), (-1, 2, 3)):
        made = PUT.success.head(rid, n, seq)
        (frame,) = FrameDecoder(discard_sink).feed(made)
        assert frame.header == PUT.reply(rid, n=n, seq=seq) and frame.payload_len == 0
        assert PUT.success.check(frame.header) is frame.header
    (frame,) = FrameDecoder(discard_sink).feed(NOOP.success.head(9))
    assert frame.header == NOOP.reply(9)
    assert GET.success.head is None and LISTEN.success.head is None  # replies with other required fields


def test_a_prepared_reply_head_reads_back_its_own_frames_only():
    head = PUT.success.head
    assert head.keys == ("id", "n", "seq")
    for rid, n, seq in ((1, 0, 1), (12345, 3, 1 << 40), ((1 << 64) - 1, 1 << 32, 7)):
        made = head(rid, n, seq)
        assert head.read(made) == (rid, n, seq) and head.read(memoryview(made)) == (rid, n, seq)
        (frame,) = FrameDecoder(discard_sink).feed(made)  # what a decoder makes of the same bytes
        assert frame.header == {"code": PUT.success.code, **dict(zip(head.keys, head.read(made)))}
        assert head.read(made + b"\x00") is None and head.read(made[:-1]) is None
        for i in range(len(made)):  # any one byte changed: read as the decoder reads it, or not at all
            changed = bytearray(made)
            changed[i] ^= 0x01
            values = head.read(bytes(changed))
            if values is not None:
                (frame,) = FrameDecoder(discard_sink).feed(bytes(changed))
                assert frame.header == {"code": PUT.success.code, **dict(zip(head.keys, values))}
    assert head.read(head(-1, 2, 3)) is None  # made the slow way (not a uint64): decoded as usual
    assert head.read(frame_head(PUT.reply(5, n=1, seq=2), 0)) is None  # the shortest encoding: not the template's
    assert NOOP.success.head.read(NOOP.success.head(9)) == (9,) and NOOP.success.head.read(head(9, 1, 1)) is None


def test_a_one_item_reply_head_is_the_frame_of_the_declared_reply_and_reads_back_only_its_own():
    lone = PEEK.success.lone
    assert GET.success.lone is lone and PUT.success.lone is None  # (a put's reply has no items)
    limits = FrameDecoder().limits
    blob = encode(torch.ones(4, 4)).description
    for rid, seq, item, nbytes in ((1, 1, blob, 64), (12345, 1 << 40, b"", 0), ((1 << 64) - 1, 7, b"x" * 300, 5)):
        frame_bytes = lone(rid, seq, item, nbytes) + b"p" * nbytes
        (frame,) = FrameDecoder(discard_sink).feed(frame_bytes)  # what a decoder makes of the same bytes
        declared = PEEK.reply(rid, seq=seq, items=[item], sizes=[nbytes])
        assert frame.header == declared and frame.payload_len == nbytes
        assert PEEK.success.check(frame.header) is frame.header
        ((header, payload, _),), end = whole_frames(frame_bytes)
        assert header == declared and end == len(frame_bytes)
        start = len(frame_bytes) - nbytes
        assert lone.read(frame_bytes, limits) == (rid, seq, item, nbytes, start)
        assert lone.read(memoryview(frame_bytes), limits) == (rid, seq, item, nbytes, start)
        assert lone.read(frame_bytes + b"\x00", limits) is None  # not exactly one frame: decoded as usual
        assert lone.read(frame_bytes[:-1], limits) is None
        for i in range(len(frame_bytes) - nbytes):  # any one byte changed: read as the decoder reads it, or not at all
            changed = bytearray(frame_bytes)
            changed[i] ^= 0x01
            got = lone.read(bytes(changed), limits)
            if got is not None:
                (frame,) = FrameDecoder(discard_sink).feed(bytes(changed))
                rid_, seq_, item_, nbytes_, _ = got
                assert frame.header == PEEK.reply(rid_, seq=seq_, items=[item_], sizes=[nbytes_])
    made = lone(-1, 2, blob, 64)  # not a uint64: made the slow way, decoded as usual
    (frame,) = FrameDecoder(discard_sink).feed(made + bytes(64))
    assert frame.header == PEEK.reply(-1, seq=2, items=[blob], sizes=[64]) and lone.read(made + bytes(64), limits) is None
    general = frame_head(PEEK.reply(5, seq=2, items=[blob], sizes=[64]), 64) + bytes(64)  # the shortest encoding
    assert lone.read(general, limits) is None
    two = frame_head(PEEK.reply(5, seq=2, items=[blob, blob], sizes=[32, 32]), 64) + bytes(64)  # two items
    assert lone.read(two, limits) is None
    long_blob = lone(5, 2, b"x" * FREE_CONTAINERS, 1) + b"p"  # a header over whole_frames' limit: the decoder's
    assert lone.read(long_blob, limits) is None and whole_frames(long_blob) == ([], 0)
    small = FrameDecoder(limits=FrameLimits(max_payload=8)).limits  # a payload over the receiver's limit
    assert lone.read(lone(5, 2, blob, 64) + bytes(64), small) is None


def test_a_small_read_of_one_item_is_answered_from_the_template_and_of_two_as_a_map():
    pair, limits = Pair(), FrameDecoder().limits
    pair.call(PUT, {"bin": "b"}, torch.arange(3.0))
    for command in (PEEK, GET):
        rid = pair.send_request(command, {"bin": "b"})
        data = bytes(pair.outbox.data)
        assert command.success.lone.read(data, limits)[0] == rid  # the template's exact bytes
        (reply,) = pair.receive()
        assert read_reply(command, reply).values[0].tolist() == [0.0, 1.0, 2.0]
    pair.call(PUT, {"bin": "b"}, torch.arange(3.0))
    pair.call(APPEND, {"bin": "b"}, torch.arange(2.0))
    for command in (PEEK, GET):
        pair.send_request(command, {"bin": "b"})
        data = bytes(pair.outbox.data)
        assert command.success.lone.read(data, limits) is None
        (reply,) = pair.receive()
        assert len(reply.header["sizes"]) == 2
        assert [v.tolist() for v in read_reply(command, reply).values] == [[0.0, 1.0, 2.0], [0.0, 1.0]]


# ------------------------------------------------------ the writer's fast path


@pytest.fixture
def wired():
    """A writer on a real TCP-like transport whose reactor never runs."""
    a, b = socket.socketpair()
    transport = twisted_internals.ReceivingServer(a, protocol.Protocol(), ("127.0.0.1", 1), None, 0, MemoryReactor())
    budget = OutboundBudget(1 << 30)
    yield transport, FrameWriter(transport, budget), budget, b
    transport.stopReading()
    transport.stopWriting()
    a.close()
    b.close()


def test_a_reply_to_an_idle_writer_is_sent_at_once_without_accounting(wired):
    transport, out, budget, peer = wired
    written = []
    out.send_reply([b"reply-1"], on_written=lambda: written.append(1))
    assert peer.recv(100) == b"reply-1" and written == [1] and budget.queued == 0 and not out.pending
    out.hold()  # while a read is handled: together at its end
    out.send_reply([b"a"])
    out.send_reply([b"b", b"c"])
    assert out.pending and budget.queued == 0
    out.release()
    assert peer.recv(100) == b"abc" and not out.pending


def test_a_slow_readers_reply_takes_the_queue_and_is_accounted(wired):
    transport, out, budget, peer = wired
    out.pauseProducing()  # what Twisted does when its buffer is full: the reader is slow
    out.send_reply([b"late"])
    assert out.pending and budget.queued > len(b"late")
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(100)
    out.resumeProducing()
    peer.setblocking(True)
    assert peer.recv(100) == b"late" and budget.queued == 0


def test_a_held_reply_keeps_its_place_before_a_queued_frame_and_is_abandoned_with_the_connection(wired):
    transport, out, budget, peer = wired
    out.hold()
    out.send_reply([b"first "])
    ticket = out.send([b"second"])  # a notification (it may be withdrawn): queued, after the reply
    assert ticket is not None
    out.release()
    assert peer.recv(100) == b"first second"
    abandoned = []
    out.hold()
    out.send_reply([b"never"], on_abandon=lambda: abandoned.append(1))
    out.connection_lost()
    assert abandoned == [1]
    large = b"x" * (64 << 10)  # not a small reply: the queue, whatever the writer's state
    out2 = FrameWriter(transport, OutboundBudget(1 << 30))
    out2.hold()
    out2.send_reply([large])
    assert out2.budget.queued >= len(large)
