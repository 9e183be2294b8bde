"""What relays add, in memory: item tags in GET/PEEK replies (PROTOCOL.md §11), the
store's one-change mirror of a bin, a request answered from upstream called off when
its client goes, and the relay's options."""

from __future__ import annotations

import pytest
import torch
from twisted.internet.task import Clock

from pairing import Outbox, Pair
from tensorshare._client.connection import request_frame
from tensorshare.errors import UsageError
from tensorshare.protocol.messages import APPEND, GET, LIST, NOOP, PEEK, PUT, Key
from tensorshare.wire.frames import FrameDecoder
from tensorshare_server.bins.store import BinStore, Item
from tensorshare_server.config import ServerConfig
from tensorshare_server.protocol.outcome import later
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.relay import split_address
from tensorshare_server.root import build_state


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_peek_and_get_list_every_items_tag_when_asked(pair):
    b = {Key.BIN: "t"}
    pair.call(APPEND, {**b, Key.TAG: 5}, torch.ones(2))
    pair.call(APPEND, b, torch.ones(3))  # untagged
    pair.call(APPEND, {**b, Key.TAG: -(1 << 63)}, torch.ones(4))
    assert Key.TAGS not in pair.call(PEEK, b).header  # not asked: not sent
    assert pair.call(PEEK, {**b, Key.TAGS: True}).header[Key.TAGS] == [5, None, -(1 << 63)]
    reply = pair.call(GET, {**b, Key.TAGS: True, Key.MAX: 2})
    assert reply.header[Key.TAGS] == [5, None] and len(reply.result) == 2


def test_a_server_that_relays_nothing_has_no_relay_state(pair):
    pair.call(PUT, {Key.BIN: "x"}, 1)
    reply = pair.call(LIST)
    assert reply.result == {"x": 1} and Key.RELAY not in reply.header


def test_mirror_replaces_a_bins_items_in_one_change_with_a_growing_seq():
    store = BinStore()
    first = store.append("b", Item(b"d", (b"12345678",), 8, tag=1))
    change = store.mirror("b", [Item(b"d", (b"a" * 8,), 8, tag=3), Item(b"d", (b"b" * 8,), 8, tag=4)], "PUT")
    assert change.seq > first.seq and change.n_items == 2 and change.tag == 4 and change.op == "PUT"
    assert [item.tag for item in store.peek("b")] == [3, 4] and store.nbytes == 16
    empty = store.mirror("b", [], "GET")
    assert empty.n_items == 0 and empty.seq > change.seq and store.nbytes == 0
    created = store.mirror("new", [Item(b"d", (), 0)], "APPEND")
    assert store.listing() == {"b": 0, "new": 1} and created.seq > empty.seq


class Reads:
    """A session's reading side that records why it is paused."""

    def __init__(self):
        self.paused = set()

    def pause(self, reason: str) -> None:
        self.paused.add(reason)

    def resume(self, reason: str) -> None:
        self.paused.discard(reason)


@pytest.mark.parametrize("can_cancel", [True, False])
def test_a_request_answered_from_elsewhere_is_called_off_when_its_connection_closes(can_cancel):
    """As a relay answers a GET that waits upstream: a request that can be called off
    keeps its connection read while it waits (so that a close is seen at once), and is
    called off when it closes; one that cannot holds reading until it is answered."""
    started, cancelled = [], []

    def held(session, request):
        return later(started.append, lambda *result: NOOP.reply(request.id),
                     (lambda: cancelled.append(request.id)) if can_cancel else None)

    state = build_state(ServerConfig(), clock=Clock())
    state.handlers[GET] = held
    outbox, reads = Outbox(), Reads()
    session = ServerSession(state, outbox, "pair", reads=reads)
    session.connection_made()
    session.data_received(b"".join(bytes(p) for p in request_frame(7, GET, {Key.BIN: "q", Key.WAIT: 30.0})))
    assert len(started) == 1 and [f.header[Key.CODE] for f in FrameDecoder().feed(bytes(outbox.data))] == [220]
    assert reads.paused == (set() if can_cancel else {"answering"})
    session.connection_lost()
    assert cancelled == ([7] if can_cancel else [])
    started[0]()  # (what it waited for ends after all: nobody is answered, nothing fails)
    assert len(FrameDecoder().feed(bytes(outbox.data))) == 1  # the greeting alone
    state.storage.close()


@pytest.mark.parametrize("text, expected", [("h:80", ("h", 80)), ("10.0.0.1:8000", ("10.0.0.1", 8000)),
                                            ("[::1]:9", ("::1", 9))])
def test_follow_addresses(text, expected):
    assert split_address(text) == expected


@pytest.mark.parametrize("text", ["h", ":80", "h:0", "h:65536", "h:x"])
def test_bad_follow_addresses_are_refused(text):
    with pytest.raises(UsageError):
        split_address(text)


def test_a_relay_keeps_no_data_directory(tmp_path):
    from tensorshare_server.app import listen

    with pytest.raises(UsageError, match="no data directory"):
        listen(ServerConfig(port=0, follow="127.0.0.1:1", data_dir=str(tmp_path)))
