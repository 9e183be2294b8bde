"""The protocol, both ends paired in memory (tests/pairing.py): every declared verb
round-trips through the real client protocol and the real server session, and the
edge cases of PROTOCOL.md §4.2 get their reply codes, whole or split byte by byte."""

from __future__ import annotations

import msgpack
import pytest
import torch

from pairing import Outbox, Pair, decode, headers
from tensorshare.errors import NoSuchBinError, ProtocolError, RemoteError, UsageError
from tensorshare.protocol.messages import (
    APPEND, AUTH, COMMANDS, DELETE, GET, LIST, LISTEN, NOOP, PEEK, PUT, UNLISTEN, Key,
)
from tensorshare.wire.frames import MAGIC, PREFIX, VERSION, frame_head
from tensorshare_server.config import ServerConfig
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import build_state
from wiretools import raw_frame


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


# ------------------------------------------------------------------ the schema, end to end


def test_the_bin_verbs_round_trip_with_their_results(pair):
    """The bin verbs' results as the clients see them (every declared verb round-trips
    in test_verbs.py)."""
    b = {Key.BIN: "rt"}
    assert pair.call(PUT, {**b, Key.TAG: 7}, torch.arange(3)).result == 1
    assert pair.call(APPEND, b, {"x": 1.5}).result == 2
    assert [v.tolist() if isinstance(v, torch.Tensor) else v for v in pair.call(PEEK, b).result] == [[0, 1, 2],
                                                                                                     {"x": 1.5}]
    assert pair.call(LIST).result == {"rt": 2}
    snapshot = pair.call(LISTEN, b).header
    assert (snapshot[Key.EXISTS], snapshot[Key.N], snapshot[Key.TAG]) == (True, 2, None)
    assert pair.call(UNLISTEN, b).result is None
    taken = pair.call(GET, b)
    assert len(taken.values) == 2 and taken.header[Key.SEQ] > snapshot[Key.SEQ]
    assert pair.call(NOOP).result is None
    assert pair.call(DELETE, b).header[Key.N] == 0
    with pytest.raises(NoSuchBinError):
        pair.call(PEEK, b)


@pytest.mark.parametrize("split", [1, 5, 63])
def test_requests_split_anywhere_are_the_same_requests(pair, split):
    assert pair.call(PUT, {Key.BIN: "s"}, torch.ones(100), split=split).result == 1
    assert torch.equal(pair.call(PEEK, {Key.BIN: "s"}, split=split).values[0], torch.ones(100))


def test_pipelined_requests_in_one_read_are_answered_in_order(pair):
    data = b"".join(raw_frame(rid, "APPEND", "p", rid) for rid in range(1, 21)) + raw_frame(21, "PEEK", "p")
    pair.send(data)
    replies = headers(pair.receive())
    assert [h["id"] for h in replies] == list(range(1, 22))
    assert [h["n"] for h in replies[:-1]] == list(range(1, 21))


def test_the_clients_refuse_what_the_server_would_refuse_before_sending():
    for fields in ({Key.BIN: ""}, {Key.BIN: "a\nb"}, {Key.BIN: 5}, {Key.BIN: "x" * 300},
                   {Key.BIN: "t", Key.TAG: 1 << 63}, {Key.BIN: "t", Key.TAG: "v1"}):
        with pytest.raises(UsageError):
            PUT.check_arguments(fields)
    PUT.check_arguments({Key.BIN: "ok/..", Key.TAG: -(1 << 63)})


# ------------------------------------------------------------------ PROTOCOL.md §4.2, in order


def test_unknown_verb_gets_502_and_the_connection_goes_on(pair):
    pair.send(frame_head({"op": "FROB", "id": 5}, 0))
    [reply] = headers(pair.receive())
    assert reply["code"] == 502 and reply["id"] == 5 and "FROB" in reply["msg"]
    assert pair.call(NOOP).result is None and not pair.outbox.closed


def test_a_verb_that_is_not_a_string_gets_502_even_with_a_payload(pair):
    for rid, op in ((1, ["PUT"]), (2, {"a": 1}), (3, 7), (4, None)):
        pair.send(frame_head({"op": op, "id": rid}, 0))
        [reply] = headers(pair.receive())
        assert reply["code"] == 502 and reply["id"] == rid
    pair.send(frame_head({"op": ["PUT"], "id": 5}, 64) + bytes(64))
    assert headers(pair.receive())[0]["code"] == 502
    assert not pair.outbox.closed


@pytest.mark.parametrize("rid", [0, -1, "7", 1.0, True, None, [1]])
def test_a_bad_request_id_gets_501_with_id_0(pair, rid):
    pair.send(frame_head({"op": "NOOP", "id": rid}, 0))
    [reply] = headers(pair.receive())
    assert (reply["code"], reply["id"]) == (501, 0)


def test_a_payload_on_a_verb_without_one_gets_501_and_is_skipped(pair):
    pair.send(frame_head({"op": "GET", "id": 10, "bin": "x"}, 8) + bytes(8) + raw_frame(11, "NOOP"))
    assert [(h["code"], h["id"]) for h in headers(pair.receive())] == [(501, 10), (200, 11)]


@pytest.mark.parametrize("name", ["", "a\x00b", "tab\there", "\x7f", "x" * 257, 3, None, b"bytes"])
def test_a_bad_bin_name_gets_553(pair, name):
    pair.send(frame_head({"op": "PEEK", "id": 3, "bin": name}, 0))
    [reply] = headers(pair.receive())
    assert (reply["code"], reply["id"]) == (553, 3)
    assert pair.call(NOOP).result is None  # and the connection goes on


def test_a_bad_value_description_is_refused_and_nothing_stored(pair):
    pair.send(frame_head({"op": "PUT", "id": 9, "bin": "torn", "value": b"\x93\x01\x02\x03"}, 64) + bytes(64))
    [reply] = headers(pair.receive())
    assert reply["code"] == 501 and "bad value" in reply["msg"]
    pair.send(frame_head({"op": "PUT", "id": 10, "bin": "torn"}, 0))
    assert headers(pair.receive())[0] == {"code": 501, "id": 10, "msg": "missing value description"}
    assert pair.call(LIST).result == {}


def test_a_tag_that_is_not_a_64_bit_integer_gets_501(pair):
    blob = msgpack.packb({"v": None, "t": [], "n": 0})
    for tag in ("v1", 1 << 63, True, 1.5):
        pair.send(frame_head({"op": "PUT", "id": 1, "bin": "g", "tag": tag, "value": blob}, 0))
        [reply] = headers(pair.receive())
        assert reply["code"] == 501 and "tag" in reply["msg"]


def test_requests_before_a_bad_frame_are_answered_then_500_and_close(pair):
    pair.send(raw_frame(11, "NOOP") + raw_frame(12, "NOOP") + b"garbage" * 4 + raw_frame(13, "NOOP"))
    assert [(h["code"], h["id"]) for h in headers(pair.receive())] == [(200, 11), (200, 12), (500, 0)]
    assert pair.outbox.closed


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20), b"TSHR\x02" + bytes(15),
                                  PREFIX.pack(MAGIC, VERSION, 0, 0, 8, 0) + b"\xc1" * 8,  # not msgpack
                                  PREFIX.pack(MAGIC, VERSION, 0, 0, 3, 0) + msgpack.packb([1, 2])])  # not a map
def test_malformed_frames_get_500_then_close(junk):
    p = Pair()
    try:
        p.send(junk, split=1)
        replies = headers(p.receive())
        assert replies and replies[-1]["code"] == 500 and p.outbox.closed
        p.send(raw_frame(1, "NOOP"))  # nothing more is read
        assert p.receive() == []
    finally:
        p.close()


def test_auth_when_none_is_due_gets_503_and_the_connection_goes_on(pair):
    with pytest.raises(RemoteError) as info:
        pair.call(AUTH, {Key.MECH: "hmac-sha256", Key.NONCE: bytes(32), Key.PROOF: bytes(32)})
    assert info.value.code == 503
    assert pair.call(NOOP).result is None


def test_a_token_pair_authenticates_and_an_unauthenticated_peer_gets_nothing():
    p = Pair(token="a-long-enough-token")
    try:
        assert p.client.ready and p.session.authenticated
        assert p.call(PUT, {Key.BIN: "a"}, 1).result == 1
    finally:
        p.close()
    state = build_state(ServerConfig(token="a-long-enough-token"))
    outbox = Outbox()
    stranger = ServerSession(state, outbox, "stranger")
    stranger.connection_made()
    stranger.data_received(raw_frame(1, "LIST"))
    greeting, refusal = decode(bytes(outbox.data))
    assert greeting["auth"] == "hmac-sha256" and "bins" not in refusal
    assert (refusal["code"], refusal["id"]) == (530, 1) and outbox.closed
    stranger.connection_lost()
    state.storage.close()


# ------------------------------------------------------------------ what the client accepts


@pytest.mark.parametrize("reply", [
    {"code": 250, "id": 1},  # no n, no seq
    {"code": 250, "id": 1, "n": "1", "seq": 1},
    {"code": 212, "id": 1, "bins": [1, 2]},
    {"code": 212, "id": 1, "bins": {"a": "many"}},
    {"code": 226, "id": 1, "seq": 1, "items": [b""], "sizes": [64]},  # sizes beyond the payload
    {"code": 200, "id": 1, "exists": 1, "n": 0, "seq": 0, "tag": None},
    {"code": 299, "id": 1},  # a success code the command does not have
])
def test_a_reply_that_breaks_the_schema_is_a_protocol_error(reply):
    from tensorshare._client.connection import read_reply
    from tensorshare.wire.frames import FrameDecoder

    command = {250: PUT, 212: LIST, 226: PEEK, 200: LISTEN, 299: NOOP}[reply["code"]]
    [frame] = FrameDecoder().feed(frame_head(reply, 0))
    with pytest.raises(ProtocolError):
        read_reply(command, frame)


def test_an_error_reply_raises_the_class_of_its_code():
    from tensorshare._client.connection import read_reply
    from tensorshare.errors import StorageFullError, TransientError
    from tensorshare.wire.frames import FrameDecoder

    for code, cls in ((452, StorageFullError), (550, NoSuchBinError), (499, TransientError)):
        [frame] = FrameDecoder().feed(frame_head({"code": code, "id": 1, "msg": "no"}, 0))
        with pytest.raises(cls) as info:
            read_reply(PEEK, frame)
        assert info.value.code == code and info.value.message == "no"


@pytest.mark.parametrize("sizes, refs, payload_len", [
    ([4, 4], None, 9),  # more payload than items
    ([4, -4], None, 0),  # a negative size
    ([True, 3], None, 4),  # a bool is no size
    ([4.0], None, 4),
    ([4, 4], [None, ["a", "p"]], 8),  # a referred item's bytes are not in the payload
])
def test_an_item_table_whose_sizes_do_not_tile_the_payload_is_refused(sizes, refs, payload_len):
    from tensorshare.protocol.items import item_table

    header = {"items": [b"d"] * len(sizes), "sizes": sizes}
    if refs is not None:
        header["refs"] = refs
    with pytest.raises(ProtocolError):
        item_table(header, payload_len)
    assert item_table({"items": [b"d", b"e"], "sizes": [4, 0]}, 4) == [(b"d", 4, None), (b"e", 0, None)]
    assert item_table({"items": [b"d", b"e"], "sizes": [4, 4], "refs": [None, ["a", "p"]]}, 4)[1] == (b"e", 4, ["a", "p"])
