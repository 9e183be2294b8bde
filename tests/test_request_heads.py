"""Prepared request heads (tensorshare/wire/heads.py) and the server's known heads (server/protocol/known.py).

* A request made from a prepared head is the request ``request_frame`` makes: the
  same header, read by the general decoder, and the same payload.
* A session answers a stream of prepared requests with the bytes it answers the
  general ones with, whole or split, and serves the repeated ones from the heads
  it learned.
* A known head read again agrees with the general decoder for every one-byte change
  of a request, or declines it; hostile heads (wrong or huge lengths, bad UTF-8
  names, names over the limit, id 0, undeclared fields) are all declined and get
  the general path's answer.
"""

from __future__ import annotations

import itertools
import struct

import pytest
import torch

from pairing import Pair
from tensorshare._client.connection import NO_VALUE, bin_request, request_frame
from tensorshare.errors import UsageError
from tensorshare.protocol.messages import APPEND, GET, PEEK, PUT
from tensorshare.protocol.prepared import ref_fields
from tensorshare.wire.codec import small_lone
from tensorshare.wire.frames import FrameDecoder, SegmentSink, frame_head, unpack_header
from tensorshare.wire.heads import KnownHeads, request_head
from tensorshare_server.protocol.known import KnownRequests

_VALUE = torch.arange(16, dtype=torch.float32)
_NEW_TAGS = itertools.count(1000)  # (a tag no request of a test had before)


def _joined(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _decoded(data: bytes) -> list[tuple[dict, bytes]]:
    frames = FrameDecoder(lambda header, n: SegmentSink(n)).feed(data)
    return [(f.header, b"".join(f.payload)) for f in frames]


def _prepared(rid: int, command, name: str, value=NO_VALUE, ref: tuple | None = None) -> bytes:
    return _joined(bin_request(rid, command, name, NO_VALUE if value is NO_VALUE else small_lone(value), None,
                               ref_fields(ref)))


def _general(rid: int, command, name: str, value=NO_VALUE, ref: tuple | None = None) -> bytes:
    """The same request in the general layout (a map packed anew: a request with any other field)."""
    fields = {"bin": name} if ref is None else {"bin": name, "ref": list(ref)}
    if value is NO_VALUE:
        return frame_head(command.request(rid, fields), 0)
    enc = small_lone(value)
    return _joined([frame_head({**command.request(rid, fields), "value": enc.description}, enc.nbytes), *enc.buffers])


_BIN_REQUESTS = [(PUT, _VALUE, None), (APPEND, torch.ones(3, dtype=torch.int64), None), (PEEK, NO_VALUE, None),
                 (PEEK, NO_VALUE, (0, 2)), (GET, NO_VALUE, (1,))]


@pytest.mark.parametrize("rid", [1, 77, 2**64 - 1])
@pytest.mark.parametrize("command, value, ref", _BIN_REQUESTS)
def test_a_prepared_request_is_the_general_request(rid, command, value, ref):
    prepared, general = _prepared(rid, command, "héads", value, ref), _general(rid, command, "héads", value, ref)
    assert prepared != general  # (the id first, as a uint64)
    assert _decoded(prepared) == _decoded(general)
    assert list(_decoded(prepared)[0][0])[0] == "id"


@pytest.mark.parametrize("command, value, ref", _BIN_REQUESTS)
def test_request_frame_makes_a_bin_request_from_its_prepared_head(command, value, ref):
    """Every client's requests are made by request_frame: one naming a bin alone
    (and the areas a read asks references to) is the prepared request, its value
    encoded or not; one with any other field is not (a tag: below)."""
    fields = {"bin": "héads"} if ref is None else {"bin": "héads", "ref": list(ref)}
    for given in ([] if value is NO_VALUE else [value, small_lone(value)]) or [NO_VALUE]:
        assert _joined(request_frame(9, command, fields, given)) == _prepared(9, command, "héads", value, ref)
    tagged = _joined(request_frame(9, PUT, {"bin": "héads", "tag": next(_NEW_TAGS)}, _VALUE))
    assert list(_decoded(tagged)[0][0])[0] == "op"  # (a tag new here: the general layout)
    few = {"obs": torch.ones(3), "step": 4}  # (a value of several parts: from a head too)
    assert list(_decoded(_joined(request_frame(9, PUT, {"bin": "héads"}, few)))[0][0])[0] == "id"
    many = {f"part-{i}": torch.ones(1) for i in range(64)}  # (a long description: not kept in a head)
    assert list(_decoded(_joined(request_frame(9, PUT, {"bin": "héads"}, many)))[0][0])[0] == "op"


@pytest.mark.parametrize("fields", [{"bin": "tagged-héads", "tag": 2**63 - 1},
                                    {"bin": "tagged-héads", "tag": -3, "below": 256, "wait": 60.0}])
def test_scalar_fields_that_come_again_go_out_from_a_prepared_head(fields):
    """A request's scalar fields (an item's tag; an RL worker's tag, bound and wait)
    are held in a head once the same ones come twice in a row for the same request;
    a tag that changes each time, or one out of range, stays in the general layout
    (the latter refused as before)."""
    fields = {**fields, "bin": f"tagged-héads-{next(_NEW_TAGS)}"}  # (a request no test made before)
    first, again, third = (_joined(request_frame(rid, APPEND, fields, _VALUE)) for rid in (3, 4, 5))
    assert list(_decoded(first)[0][0])[0] == "op" and list(_decoded(again)[0][0])[0] == "id"
    assert _decoded(again)[0] == ({**_decoded(first)[0][0], "id": 4}, _VALUE.numpy().tobytes())
    assert third == again.replace((4).to_bytes(8, "big"), (5).to_bytes(8, "big"), 1)  # (the same head)
    counting = [_joined(request_frame(rid, APPEND, {**fields, "tag": rid}, _VALUE)) for rid in range(9)]
    assert all(list(_decoded(frame)[0][0])[0] == "op" for frame in counting)
    assert _decoded(counting[-1])[0][0] == {**fields, "tag": 8, "op": "APPEND", "id": 8,
                                            "value": small_lone(_VALUE).description}
    for bad in (2**63, True, 1.0):
        with pytest.raises(UsageError, match="tag must be"):
            request_frame(6, APPEND, {"bin": "tagged-héads", "tag": bad}, _VALUE)


def test_a_session_serves_a_tagged_head_as_the_general_request():
    tags, name = [(1, 7), (2, 7), (3, 7), (4, 8), (5, 8), (6, 8)], f"t-{next(_NEW_TAGS)}"
    made = [_joined(request_frame(rid, APPEND, {"bin": name, "tag": tag}, _VALUE)) for rid, tag in tags]
    assert [list(_decoded(frame)[0][0])[0] for frame in made] == ["op", "id", "id", "op", "id", "id"]
    enc = small_lone(_VALUE)
    general = [_joined([frame_head({**APPEND.request(rid, {"bin": name, "tag": tag}), "value": enc.description},
                                   enc.nbytes), *enc.buffers]) for rid, tag in tags]
    answers, known = [], []
    for frames in (made, general):
        pair = Pair()
        pair.outbox.data.clear()
        for frame in frames:  # (a read at a time: a head is looked up where a read starts)
            pair.send(frame)
        pair.send(frame_head(PEEK.request(7, {"bin": name, "tags": True}), 0))
        answers.append(bytes(pair.outbox.data))
        known.append(_known(pair))
    assert answers[0] == answers[1] and known == [2, 0]  # (a head a tag)
    frames = FrameDecoder(lambda h, n: SegmentSink(n)).feed(answers[0])
    assert [f.header["code"] for f in frames] == [250] * 6 + [226] and frames[-1].header["tags"] == [7, 7, 7, 8, 8, 8]


def _stream(make) -> bytes:
    """A loop's requests, each verb on each bin more than once."""
    return b"".join([
        make(1, PUT, "a", _VALUE), make(2, PUT, "a", _VALUE), make(3, APPEND, "a", _VALUE), make(4, PEEK, "a"),
        make(5, PEEK, "a"), make(6, PEEK, "a", ref=(0,)), make(7, PEEK, "a", ref=(0,)), make(8, GET, "a"),
        make(9, PEEK, "a"), make(10, GET, "a"), make(11, PEEK, "missing"), make(12, PEEK, "missing"),
        make(13, PUT, "b", torch.ones(2, 3)), make(14, APPEND, "b", torch.ones(2, 3)), make(15, GET, "b"),
    ])


def _answers(data: bytes, split: int | None = None, **config) -> tuple[bytes, Pair]:
    pair = Pair(**config)
    pair.outbox.data.clear()
    pair.send(data, split=split)
    return bytes(pair.outbox.data), pair


def _known(pair: Pair) -> int:
    return len(pair.session._heads._heads._known)


@pytest.mark.parametrize("split", [None, 1, 7])
def test_a_session_answers_prepared_requests_as_the_general_ones(split):
    general, pair = _answers(_stream(_general), split)
    assert _known(pair) == 0
    prepared, pair = _answers(_stream(_prepared), split)
    assert prepared == general
    assert _known(pair) == (0 if split else 9)  # (only whole ones in a read are learned)
    codes = {f.header["id"]: f.header["code"] for f in FrameDecoder(lambda h, n: SegmentSink(n)).feed(prepared)}
    assert codes == {1: 250, 2: 250, 3: 250, 4: 226, 5: 226, 6: 226, 7: 226, 8: 226, 9: 226, 10: 226, 11: 550,
                     12: 550, 13: 250, 14: 250, 15: 226}


def test_requests_of_a_known_head_are_served_from_it(monkeypatch):
    pair = Pair()
    for rid in range(1, 6):
        pair.send(_prepared(rid, PUT, "a", _VALUE))
    read, look = KnownRequests.read, KnownHeads.read
    served, hits = [], []
    monkeypatch.setattr(KnownRequests, "read", lambda self, data, pos=0: served.append(found := read(self, data, pos))
                        or found)
    monkeypatch.setattr(KnownHeads, "read", lambda self, data, pos=0: hits.append(found := look(self, data, pos))
                        or found)
    pair.outbox.data.clear()
    pair.send(_prepared(6, PEEK, "a") + _prepared(7, PEEK, "a"))
    assert [entry[0].verb for entry, _request, _stop in served[:2]] == ["PEEK", "PEEK"]
    assert [request.id for _entry, request, _stop in served[:2]] == [6, 7]
    assert [hit[1] for hit in hits if hit is not None] == [7]  # the first PEEK learned, the second looked up
    frames = FrameDecoder(lambda h, n: SegmentSink(n)).feed(bytes(pair.outbox.data))
    assert [(f.header["id"], f.header["seq"]) for f in frames] == [(6, 5), (7, 5)]


@pytest.mark.parametrize("split", [1500, 2500])
def test_requests_after_one_split_across_reads_are_still_served_from_known_heads(split, monkeypatch):
    """Pipelined requests whose reads end inside a payload: the decoder ends that
    request, and those after it in the read are served from their known head again
    (before, every later read of the stream went through the decoder)."""
    value = torch.arange(200, dtype=torch.float32)  # (frames of 923 bytes: reads end inside them)
    stream = b"".join(_prepared(rid, APPEND, "s", value) for rid in range(1, 41))
    general = b"".join(_general(rid, APPEND, "s", value) for rid in range(1, 41))
    read, served = KnownRequests.read, []
    monkeypatch.setattr(KnownRequests, "read", lambda self, data, pos=0: served.append(found := read(self, data, pos))
                        or found)
    answered, pair = _answers(stream, split)
    hits = sum(found is not None for found in served)
    assert answered == _answers(general, split)[0]
    assert hits >= 12  # (16 and 25 of the 40; the decoder alone took all but 1 or 2 of them before)
    assert pair.session._decoder.idle
    frames = FrameDecoder(lambda h, n: SegmentSink(n)).feed(answered)
    assert [f.header["id"] for f in frames] == list(range(1, 41)) and {f.header["code"] for f in frames} == {250}


def _general_read(pair: Pair, data: bytes):
    """What the general way makes of the one whole request in ``data``: (verb, id,
    field values, payload length), or None where it refuses it."""
    try:
        frames = FrameDecoder(lambda h, n: SegmentSink(n)).feed(data)
    except Exception:
        return None
    if len(frames) != 1:
        return None
    header = frames[0].header
    entry = pair.session._verbs.get(header.get("op")) if type(header.get("op")) is str else None
    rid = header.get("id")
    if entry is None or type(rid) is not int or not 0 < rid < 2**64 or "release" in header:
        return None
    try:
        request = entry[0].parse_request(header, rid, None, frames[0].payload_len)
    except Exception:
        return None
    return entry[0].verb, rid, tuple(map(_plain, entry[0].fields_of(request))), frames[0].payload_len


def _plain(value):
    return tuple(value) if type(value) is list else value


@pytest.mark.parametrize("make", [lambda rid: _prepared(rid, PUT, "abc", _VALUE),
                                  lambda rid: _prepared(rid, PEEK, "abc", ref=(0,))])
def test_a_known_head_changed_in_any_byte_is_declined_or_read_as_the_general_decoder_reads_it(make):
    pair = Pair()
    known = pair.session._heads
    assert known.read(make(1)) is not None  # learned
    frame = make(2)
    head_size = len(frame) - (64 if len(frame) > 64 else 0)  # (a PUT's payload: 64 bytes)
    agreed = declined = 0
    for i in range(head_size):
        for new in {frame[i] ^ 1, frame[i] ^ 0x80, 0, 0xFF} - {frame[i]}:
            changed = frame[:i] + bytes([new]) + frame[i + 1:]
            found = known.read(changed)
            if found is None:
                declined += 1
                continue
            entry, request, stop = found  # (a changed length may end it early: the rest is another frame)
            assert stop <= len(changed)
            assert _general_read(pair, changed[:stop]) == (entry[0].verb, request.id, tuple(map(_plain, entry[0].fields_of(
                request))), request.payload_len)
            agreed += 1
    assert agreed and declined  # (the id's bytes are read; the rest is declined or learned anew)


def _with_lengths(frame: bytes, header_len: int | None = None, payload_len: int | None = None) -> bytes:
    old_header, old_payload = struct.unpack_from("<IQ", frame, 8)
    return frame[:8] + struct.pack("<IQ", old_header if header_len is None else header_len,
                                   old_payload if payload_len is None else payload_len) + frame[20:]


def _id_first(fields: dict, rid: int = 5, payload: bytes = b"") -> bytes:
    """A frame laid out as a prepared head (the id first), with any fields."""
    return request_head(fields, len(payload))(rid) + payload


_HOSTILE = {
    "id 0": _prepared(0, PEEK, "a"),
    "header too long": _with_lengths(_prepared(3, PEEK, "a"), header_len=40),
    "header too short": _with_lengths(_prepared(3, PEEK, "a"), header_len=14),
    "huge header": _with_lengths(_prepared(3, PEEK, "a"), header_len=2**32 - 1),
    "huge payload": _with_lengths(_prepared(3, PUT, "a", _VALUE), payload_len=2**64 - 1),
    "payload missing": _with_lengths(_prepared(3, PEEK, "a"), payload_len=8),
    "bad utf-8 name": _prepared(3, PEEK, "ab").replace(b"\xa2ab", b"\xa2\xff\xfe"),
    "name over the limit": _id_first({"op": "PEEK", "bin": "n" * 257}),
    "control character": _id_first({"op": "PEEK", "bin": "a\x01"}),
    "unknown verb": _id_first({"op": "FROB", "bin": "a"}),
    "undeclared field": _id_first({"op": "PEEK", "bin": "a", "frob": 1}),
    "release": _id_first({"op": "PEEK", "bin": "a", "release": [1]}),
    "a map value": _id_first({"op": "PEEK", "bin": {"a": 1}}),
    "payload undeclared": _id_first({"op": "PEEK", "bin": "a"}, payload=b"x" * 8),
    "auth": _id_first({"op": "AUTH", "token": b"t"}),
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_hostile_heads_are_declined_and_get_the_general_answer(name):
    frame = _HOSTILE[name]
    pair = Pair()
    known = pair.session._heads
    for _ in range(2):  # (declined, and not learned either)
        assert known.read(frame) is None
    assert _known(pair) == 0
    head = _prepared(1, PEEK, "a")
    answer, _ = _answers(head + frame + head)
    general = _answers(head + _reframed(frame) + head)[0] if name != "bad utf-8 name" else None
    if general is not None:
        assert answer == general
    codes = [f.header["code"] for f in FrameDecoder(lambda h, n: SegmentSink(n)).feed(answer)]
    assert codes[0] == 550 and 400 <= codes[1] < 600  # (no bin "a" yet; then the refusal)


def _reframed(frame: bytes) -> bytes:
    """``frame`` with its header in the general layout where it decodes (else as it is)."""
    try:
        header = unpack_header(frame[20:20 + struct.unpack_from("<I", frame, 8)[0]])
    except Exception:
        return frame
    if struct.unpack_from("<I", frame, 8)[0] + 20 > len(frame):
        return frame
    body = 20 + struct.unpack_from("<I", frame, 8)[0]
    return frame_head({"op": header.pop("op", None), **header}, struct.unpack_from("<Q", frame, 12)[0]) + frame[body:]


def test_a_shorter_bin_name_limit_holds_for_known_heads():
    frame = _prepared(3, PEEK, "a-long-name")
    answer, pair = _answers(frame + frame, max_bin_name=8)
    assert _known(pair) == 0
    assert [f.header["code"] for f in FrameDecoder(lambda h, n: SegmentSink(n)).feed(answer)] == [553, 553]


def test_known_heads_are_bounded():
    heads = KnownHeads(limit=2)
    from tensorshare.wire.frames import DEFAULT_FRAME_LIMITS

    frames = [_prepared(1, PEEK, name) for name in "abc"]
    for i, frame in enumerate(frames):
        assert heads.candidate(frame, 0, DEFAULT_FRAME_LIMITS) is not None
        heads.learn(frame, 0, i)
    assert heads.read(frames[0]) is None and heads.read(frames[1]) is None  # forgotten at the limit
    assert heads.read(_prepared(9, PEEK, "c"))[:2] == (2, 9)


def test_a_relays_forwarded_requests_go_out_from_prepared_heads():
    """A relay forwards a request upstream as it came (frame_of, a RawValue): one
    naming a bin alone is the prepared request, which the upstream serves from the
    head it learned; one with a scalar field too, once the same comes again."""
    from tensorshare.protocol.engine import Call, RawValue, frame_of

    enc = small_lone(_VALUE)
    forwarded = [_joined(frame_of(Call(rid, PUT, {"bin": "a"}), RawValue(enc.description, enc.buffers, enc.nbytes)))
                 for rid in (1, 2)] + [_joined(frame_of(Call(rid, PEEK, {"bin": "a"}))) for rid in (3, 4)]
    assert forwarded == [_prepared(1, PUT, "a", _VALUE), _prepared(2, PUT, "a", _VALUE), _prepared(3, PEEK, "a"),
                         _prepared(4, PEEK, "a")]
    answer, pair = _answers(b"".join(forwarded))
    assert answer == _answers(b"".join(_general(rid, command, "a", *value) for rid, command, value in (
        (1, PUT, [_VALUE]), (2, PUT, [_VALUE]), (3, PEEK, []), (4, PEEK, []))))[0]
    assert _known(pair) == 2
    fields = {"bin": f"a-{next(_NEW_TAGS)}", "tags": True}  # (a request no test made before)
    tagged = [_joined(frame_of(Call(rid, PEEK, fields))) for rid in (5, 6)]
    assert [list(_decoded(frame)[0][0])[0] for frame in tagged] == ["op", "id"]  # (a scalar: once it comes again)
    assert _decoded(tagged[1])[0][0] == {**_decoded(tagged[0])[0][0], "id": 6}
