"""Values put by device reference (CUDA IPC on one host, PROTOCOL.md §13), on the CPU.

The server's side is tested paired in memory (``pairing.Pair``) with references
of the protocol's form.  The clients' side runs with the device engine over
``devicesim.DeferredStreams``, whose "shared" blocks are CPU tensors in a registry
of this process: a reference opens to the publisher's very tensor (as a CUDA
mapping would), a publisher that "dies" takes its handles with it, and a block
changed after publishing fails the reader's digest.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tensorshare
import tensorshare.device as device_engines
from devicesim import SHARED, DeferredStreams
from pairing import Pair
from serverproc import ServerProcess
from tensorshare.device.engine import Engine
from tensorshare.errors import BadRequestError, ServerLocalError, ZeroCopyUnavailableError
from tensorshare.protocol.messages import GET, NOOP, PEEK, PUT, Key
from tensorshare.wire.codec import encode

# ------------------------------------------------------------------ the server, paired in memory


TORCH_HANDLE = b"\x02c" + b"h" * 64  # the handle of a block as torch >= 2.5 gives it: version, kind, cudaIpcMemHandle_t


def reference(ident: int = 7, dev: str = "GPU-1") -> dict:
    return {"id": ident, "dev": dev, "ipc": [0, TORCH_HANDLE, 4096, 0, b"/torch_counter", 3, b"e" * 64, True],
            "digest": [1, 2]}


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
        assert frame.header[Key.CUDA] == [reference()] and frame.payload_len == 0
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
        assert frame_of(pair, PEEK, {Key.BIN: "v", Key.CUDA: ["GPU-1"]}).header[Key.CUDA] == [reference()]
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


def test_only_the_publisher_fills_and_a_fill_must_match():
    state = Pair(same_host=True).state
    publisher, other = Pair(same_host=True, state=state), Pair(same_host=True, state=state)
    try:
        _, enc = by_reference(publisher, "v", VALUE, reference(9))
        other.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 9}, enc)  # not its reference: dropped
        assert state.storage.items_of("v")[0].segments is None
        wrong = encode({"w": torch.arange(100.0), "b": torch.zeros(3), "x": 1})
        with pytest.raises(BadRequestError):
            publisher.call(PUT, {Key.BIN: "v", Key.VALUE: wrong.description, Key.FILL: 9}, wrong)
        publisher.call(PUT, {Key.BIN: "v", Key.VALUE: enc.description, Key.FILL: 9}, enc)
        assert state.storage.items_of("v")[0].segments is not None
    finally:
        other.close()
        publisher.close()


# ------------------------------------------------------------------ the clients, with the stand-in


@pytest.fixture
def engine(monkeypatch):
    eng = Engine(DeferredStreams(), bucket=256 << 10, inline_max=0)
    monkeypatch.setitem(device_engines._ENGINES, "cpu", eng)
    yield eng
    SHARED.clear()


@pytest.fixture(scope="module")
def same_host():
    srv = ServerProcess("--zero-copy-min", "0")
    yield srv
    srv.stop()


def state_dict(seed: int, n: int = 24) -> dict:
    torch.manual_seed(seed)
    return {f"p{i}": torch.randn(20_000 + i) for i in range(n)}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def clients(srv):
    return (tensorshare.Client("127.0.0.1", srv.port, timeout=30),
            tensorshare.Client("127.0.0.1", srv.port, timeout=30, device="cpu"),
            tensorshare.Client("127.0.0.1", srv.port, timeout=30, zero_copy=False))


def test_same_host_device_readers_copy_device_to_device_and_everyone_else_gets_the_bytes(same_host, engine):
    publisher, device_reader, tcp_reader = clients(same_host)
    with publisher, device_reader, tcp_reader:
        state = state_dict(1)
        assert publisher.put("ipc-a", encode(state, stage=engine), by_reference=True) == 1
        assert publisher.values.exports.held() == 1
        [back] = device_reader.peek("ipc-a")
        assert equal(back, state) and engine.streams.opened == 1
        assert all(t.data_ptr() != s.data_ptr() for t, s in zip(back.values(), SHARED_BLOCKS()))  # a copy
        [over_tcp] = tcp_reader.peek("ipc-a")  # waits for the upload
        assert equal(over_tcp, state)
        # a reader's destination tensors are filled device to device
        model = {k: torch.empty_like(v) for k, v in state.items()}
        [into] = device_reader.peek("ipc-a", into=model)
        assert all(into[k] is model[k] for k in model) and equal(model, state)


def SHARED_BLOCKS() -> list:
    return [flat for flat in SHARED.values()]


def test_snapshots_are_freed_once_no_reader_holds_them(same_host, engine):
    publisher, reader, _tcp = clients(same_host)
    with publisher, reader, _tcp:
        publisher.put("ipc-b", encode(state_dict(2), stage=engine), by_reference=True)
        reader.peek("ipc-b")  # holds the reference until its next request
        publisher.put("ipc-b", encode(state_dict(3), stage=engine), by_reference=True)
        publisher.values.exports.idle(10)
        assert publisher.values.exports.held() == 2
        reader.ping()  # releases the first
        publisher.ping()
        assert publisher.values.exports.held() == 1


def test_a_reader_never_sees_a_later_version(same_host, engine):
    publisher, reader, _tcp = clients(same_host)
    with publisher, reader, _tcp:
        versions = [state_dict(10 + v, 4) for v in range(6)]
        stop = threading.Event()
        seen = []

        def read() -> None:
            while not stop.is_set():
                items = reader.peek("ipc-c")
                if items:
                    seen.append(items[0])

        for v, state in enumerate(versions):
            state["version"] = torch.tensor(v)
        publisher.put("ipc-c", encode(versions[0], stage=engine), by_reference=True)
        thread = threading.Thread(target=read)
        thread.start()
        try:
            for state in versions[1:]:
                publisher.put("ipc-c", encode(state, stage=engine), by_reference=True)
        finally:
            stop.set()
            thread.join(30)
        assert seen
        for got in seen:
            assert equal(got, versions[int(got["version"])])  # whole, one version's bytes


def test_a_reference_whose_publisher_is_gone_is_read_from_its_bytes(same_host, engine):
    publisher, reader, _tcp = clients(same_host)
    with publisher, reader, _tcp:
        state = state_dict(4)
        publisher.put("ipc-d", encode(state, stage=engine), by_reference=True)
        assert publisher.values.exports.idle(10)  # its bytes are on the server
        SHARED.clear()  # the publisher's process "died": its handles open no more
        opened = engine.streams.opened
        [back] = reader.peek("ipc-d")
        assert equal(back, state) and engine.streams.opened == opened  # from the bytes


def test_a_reference_to_changed_memory_fails_its_digest_and_is_read_from_its_bytes(same_host, engine):
    publisher, reader, _tcp = clients(same_host)
    with publisher, reader, _tcp:
        state = state_dict(5)
        publisher.put("ipc-e", encode(state, stage=engine), by_reference=True)
        assert publisher.values.exports.idle(10)
        for flat in SHARED.values():
            flat[100:108] += 1  # the block was reused for something else
        [back] = reader.peek("ipc-e")
        assert equal(back, state) and engine.streams.opened >= 1


def test_a_publisher_that_closes_before_uploading_leaves_an_error_not_garbage(same_host, engine, monkeypatch):
    from tensorshare._client.exports import Exports

    monkeypatch.setattr(Exports, "upload", lambda self, client, bin, ident, snapshot: None)  # its bytes never leave
    publisher, reader, tcp = clients(same_host)
    with reader, tcp:
        with publisher:
            publisher.put("ipc-f", encode(state_dict(6), stage=engine), by_reference=True)
            got = []
            waiting = threading.Thread(target=lambda: got.append(_outcome(tcp.peek, "ipc-f")))
            waiting.start()
        waiting.join(30)
        assert len(got) == 1 and isinstance(got[0], ServerLocalError)
        assert isinstance(_outcome(reader.peek, "ipc-f"), ServerLocalError)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def test_where_references_cannot_be_taken_the_bytes_are(same_host, engine):
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30, zero_copy=False) as c:  # as from another host
        state = state_dict(7)
        assert c.put("ipc-g", encode(state, stage=engine), by_reference=True) == 1
        assert c.values.exports is None and equal(c.peek("ipc-g")[0], state)
    engine.streams.share_ok = False  # memory torch cannot share (an expandable segment, torch < 2.5)
    with tensorshare.Client("127.0.0.1", same_host.port, timeout=30) as c:
        state = state_dict(8)
        assert c.put("ipc-h", encode(state, stage=engine), by_reference=True) == 1
        assert not c._exported().held() and equal(c.peek("ipc-h")[0], state)
