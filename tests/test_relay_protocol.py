"""What relays add, in memory: item tags in GET/PEEK replies (PROTOCOL.md §11), the
store's one-change mirror of a bin, and the relay's options."""

from __future__ import annotations

import pytest
import torch

from pairing import Pair
from tensorshare.errors import UsageError
from tensorshare.protocol.messages import APPEND, GET, LIST, PEEK, PUT, Key
from tensorshare_server.bins.store import BinStore, Item
from tensorshare_server.config import ServerConfig
from tensorshare_server.relay import split_address


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
