"""Values put by device reference (CUDA IPC on one host, PROTOCOL.md §13): the server's side, paired in memory.

References of the protocol's form, stored, handed out, filled and let go by a
real server protocol (``pairing.Pair``); the clients' side, with the stand-in
device and a real server process, is ``test_device_refs.py``.
"""

from __future__ import annotations

import pytest
import torch

from pairing import Pair
from tensorshare.errors import BadRequestError, ServerLocalError, StorageFullError, ZeroCopyUnavailableError
from tensorshare.protocol.messages import DELETE, GET, NOOP, PEEK, PUT, Key
from tensorshare.wire.codec import encode

# ------------------------------------------------------------------ the server, paired in memory


TORCH_HANDLE = b"\x02c" + b"h" * 64  # the handle of a block as torch >= 2.5 gives it: version, kind, cudaIpcMemHandle_t


def reference(ident: int = 7, dev: str = "GPU-1") -> dict:
    return {"id": ident, "dev": dev, "ipc": [0, TORCH_HANDLE, 4096, 0, b"/torch_counter", 3, b"e" * 64, True],
            "digest": [1, 2]}


def readers(ref: dict) -> dict:
    """``ref`` as readers get it: without its id, which only its publisher knows."""
    return {k: v for k, v in ref.items() if k != "id"}


def by_reference(pair: Pair, name: str, value, ref: dict, tag: int | None = None):
    enc = encode(value)
    fields = {Key.BIN: name, Key.VALUE: enc.description, Key.SIZE: enc.nbytes, Key.CUDA: ref}
    if tag is not None:
        fields[Key.TAG] = tag
    return pair.call(PUT, fields), enc


VALUE = {"w": torch.arange(100.0), "b": torch.ones(3)}


def frame_of(pair: Pair, command, fields: dict):
    """The reply frame to one request, undecoded (device references are not opened here)."""
    rid = pair.send_request(command, fields)
    [frame] = [f for f in pair.receive() if f.header.get("id") == rid]
    return frame


def test_an_item_put_by_reference_is_read_by_reference_and_its_bytes_follow():
    pair = Pair(same_host=True)
    other = Pair(same_host=True, state=pair.state)
    try:
        reply, enc = by_reference(pair, "v", VALUE, reference(), tag=5)
        assert reply.header[Key.N] == 1
        # a reader that opens the device gets the reference, no bytes
        frame = frame_of(pair, PEEK, {Key.BIN: "v", Key.CUDA: ["GPU-1"]})
        assert frame.header[Key.CUDA] == [readers(reference())] and frame.payload_len == 0
        assert frame.header[Key.SIZES] == [enc.nbytes]
        # one on another device waits for the bytes (its connection's later requests behind it)
        rid = other.send_request(PEEK, {Key.BIN: "v", Key.CUDA: ["GPU-2"]})
        assert not [f for f in other.receive() if f.header.get("id") == rid]
        filled = pair.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 7}, enc)
        assert filled.header[Key.N] == 1
        pair.clock.advance(0.01)
        [held] = [f for f in other.receive() if f.header.get("id") == rid]
        assert held.header[Key.SIZES] == [enc.nbytes] and held.payload_len == enc.nbytes
        assert Key.CUDA not in held.header
        # later readers of the bytes get them at once; the reference stays for the others
        assert pair.call(PEEK, {Key.BIN: "v"}).frame.payload_len == enc.nbytes
        assert frame_of(pair, PEEK, {Key.BIN: "v", Key.CUDA: ["GPU-1"]}).header[Key.CUDA] == [readers(reference())]
    finally:
        other.close()
        pair.close()


def test_the_publisher_hears_which_references_nothing_holds_any_more():
    pair = Pair(same_host=True)
    reader = Pair(same_host=True, state=pair.state)
    try:
        by_reference(pair, "v", VALUE, reference(1))
        read = frame_of(reader, PEEK, {Key.BIN: "v", Key.CUDA: ["GPU-1"]})  # pinned until released
        reply, _ = by_reference(pair, "v", VALUE, reference(2))  # 1 leaves the bin; the reader holds it
        assert Key.FREED not in reply.header
        reader.call(NOOP, {Key.RELEASE: [read.header[Key.ID]]})
        assert pair.call(NOOP).header[Key.FREED] == [1]
        assert Key.FREED not in pair.call(NOOP).header  # told once
        third, _ = by_reference(pair, "v", VALUE, reference(3))  # nobody read 2: freed by this very put
        assert third.header[Key.FREED] == [2]
    finally:
        reader.close()
        pair.close()


def test_a_publisher_that_leaves_takes_its_references():
    state = Pair(same_host=True).state
    publisher, reader = Pair(same_host=True, state=state), Pair(same_host=True, state=state)
    try:
        _, enc = by_reference(publisher, "filled", VALUE, reference(1))
        publisher.call(PUT, {Key.BIN: "filled", Key.VALUE: enc.description, Key.FILL: 1}, enc)
        by_reference(publisher, "bare", VALUE, reference(2))
        waiting = reader.send_request(PEEK, {Key.BIN: "bare"})
        publisher.close()
        state.waits.clock.advance(0.01)
        [refused] = [f for f in reader.receive() if f.header.get("id") == waiting]
        assert refused.header[Key.CODE] == ServerLocalError.code
        assert frame_of(reader, PEEK, {Key.BIN: "bare", Key.CUDA: ["GPU-1"]}).header[Key.CODE] == ServerLocalError.code
        # the item that had its bytes keeps them, and no reference is handed out any more
        kept = frame_of(reader, PEEK, {Key.BIN: "filled", Key.CUDA: ["GPU-1"]})
        assert Key.CUDA not in kept.header and kept.payload_len == enc.nbytes
    finally:
        reader.close()


def test_a_read_waits_for_the_bytes_only_so_long():
    pair = Pair(same_host=True)
    reader = Pair(same_host=True, state=pair.state)
    try:
        by_reference(pair, "v", VALUE, reference())
        rid = reader.send_request(PEEK, {Key.BIN: "v"})
        pair.clock.advance(61)
        [refused] = [f for f in reader.receive() if f.header.get("id") == rid]
        assert refused.header[Key.CODE] == ServerLocalError.code
    finally:
        reader.close()
        pair.close()


def test_a_take_that_waited_for_items_then_for_their_bytes_is_answered_and_leaves_its_lane():
    """A GET waiting in its lane for items goes on when an item put by reference
    comes, waits in that lane again for the item's bytes, and is answered once they
    are in; nothing of either wait is left behind."""
    pair = Pair(same_host=True)
    reader = Pair(same_host=True, state=pair.state)
    try:
        rid = reader.send_request(GET, {Key.BIN: "v", Key.WAIT: 30})
        _, enc = by_reference(pair, "v", VALUE, reference())
        pair.clock.advance(0)
        assert not [f for f in reader.receive() if f.header.get("id") == rid]  # the item came, its bytes not
        pair.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 7}, enc)
        pair.clock.advance(0)
        [taken] = [f for f in reader.receive() if f.header.get("id") == rid]
        assert taken.header[Key.SIZES] == [enc.nbytes] and taken.payload_len == enc.nbytes
        waits = pair.state.waits
        assert waits.going(("v", GET.lane)) == 0 and not waits.waiting_on("v")
    finally:
        reader.close()
        pair.close()


@pytest.mark.parametrize("bad", [
    "x", {**reference(), "id": 0}, {**reference(), "id": "7"}, {**reference(), "dev": ""},
    {**reference(), "ipc": [0, b"h", 4096]}, {**reference(), "ipc": [0, "h", 4096, 0, b"c", 3, b"e", True]},
    {**reference(), "ipc": [0, b"h" * (64 << 10) + b"h", 4096, 0, b"c", 3, b"e", True]},
    {**reference(), "ipc": [0, b"h", 4096, 0, b"c", 3, b"e" * 65, True]}, {**reference(), "digest": [1.5]},
    {**reference(), "digest": [(1 << 64) - 1]},
])
def test_malformed_references_are_refused_and_nothing_is_stored(bad):
    pair = Pair(same_host=True)
    try:
        with pytest.raises(BadRequestError):
            by_reference(pair, "v", VALUE, bad)
        assert pair.state.storage.state("v")[0] is False
    finally:
        pair.close()


@pytest.mark.parametrize("where", ["another host", "a data directory"])
def test_references_are_taken_only_on_the_servers_host_and_without_a_data_directory(where, tmp_path):
    pair = Pair(same_host=False) if where == "another host" else Pair(same_host=True, data_dir=str(tmp_path))
    try:
        with pytest.raises(ZeroCopyUnavailableError):
            by_reference(pair, "v", VALUE, reference())
        assert pair.state.storage.state("v")[0] is False
    finally:
        pair.close()


def test_the_bytes_come_on_any_same_host_connection_that_names_the_reference_and_must_match():
    """The publisher sends the bytes on a connection of their own (its reads and
    pings never wait behind them): what names the item is its reference's id, which
    readers are not given, and its bin."""
    state = Pair(same_host=True).state
    publisher, uploader = Pair(same_host=True, state=state), Pair(same_host=True, state=state)
    try:
        _, enc = by_reference(publisher, "v", VALUE, reference(9))
        uploader.call(PUT, {Key.BIN: "w", Key.VALUE: enc.description, Key.FILL: 9}, enc)  # another bin: dropped
        assert state.storage.items_of("v")[0].segments is None
        wrong = encode({"w": torch.arange(100.0), "b": torch.zeros(3), "x": 1})
        with pytest.raises(BadRequestError):
            uploader.call(PUT, {Key.BIN: "v", Key.VALUE: wrong.description, Key.FILL: 9}, wrong)
        uploader.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 9}, enc)
        assert state.storage.items_of("v")[0].segments is not None
    finally:
        uploader.close()
        publisher.close()


def test_a_fill_says_when_same_host_readers_map_the_bin():
    """The bytes of the next item go through shared memory once same-host readers
    map the bin: the fill's reply tells the uploading connection so, as a PUT's does."""
    state = Pair(same_host=True).state
    publisher, uploader, reader = (Pair(same_host=True, state=state) for _ in range(3))
    try:
        _, enc = by_reference(publisher, "v", VALUE, reference(3))
        state.mapped.add("v")  # (a same-host reader asked for references into it)
        filled = uploader.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 3}, enc)
        assert filled.header.get(Key.MAPPED) is True
    finally:
        for pair in (reader, uploader, publisher):
            pair.close()


def test_one_reference_id_in_two_bins_leaves_both_items_known():
    """A publisher that uses one id in two bins: when it leaves, both items are
    lost at once (a read is refused, not held 60 s), and each fill finds its own."""
    state = Pair(same_host=True).state
    publisher, reader = Pair(same_host=True, state=state), Pair(same_host=True, state=state)
    try:
        _, enc = by_reference(publisher, "a", VALUE, reference(5))
        by_reference(publisher, "b", VALUE, reference(5))
        publisher.call(PUT, {Key.BIN: "b", Key.VALUE: enc.description, Key.FILL: 5}, enc)
        assert state.storage.items_of("a")[0].segments is None and state.storage.items_of("b")[0].segments is not None
        publisher.close()
        assert frame_of(reader, PEEK, {Key.BIN: "a"}).header[Key.CODE] == ServerLocalError.code
        assert frame_of(reader, PEEK, {Key.BIN: "b"}).payload_len == enc.nbytes
    finally:
        reader.close()


def test_a_reference_has_one_digest_per_array():
    pair = Pair(same_host=True)
    try:
        for digest in ([1], [1, 2, 3], list(range(1 << 12))):
            with pytest.raises(BadRequestError):
                by_reference(pair, "v", VALUE, {**reference(), "digest": digest})
        assert pair.state.storage.state("v")[0] is False
    finally:
        pair.close()


def test_references_count_in_the_memory_limit():
    """What a reference holds in the server (its handles and digests) is memory the
    budget counts: puts of large references under a small limit are refused, not
    stored beyond it."""
    pair = Pair(same_host=True, memory_limit=1 << 20)
    store = pair.state.store
    try:
        before = store.description_bytes
        by_reference(pair, "v0", VALUE, {**reference(1), "ipc": [0, b"h" * (60 << 10), 4096, 0, b"c", 0, b"", False]})
        assert store.description_bytes - before > 60 << 10
        with pytest.raises(StorageFullError):
            for i in range(1, 40):  # 40 references of 60 KiB would hold 2.4 MiB
                by_reference(pair, f"v{i}", VALUE, {**reference(i + 1),
                                                    "ipc": [0, b"h" * (60 << 10), 4096, 0, b"c", 0, b"", False]})
        assert store.description_bytes <= 1 << 20
        held = store.description_bytes
        pair.call(DELETE, {Key.BIN: "v0"})
        assert held - store.description_bytes > 60 << 10  # given back with the item
    finally:
        pair.close()
