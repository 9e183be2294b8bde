"""Same-host zero-copy: references to the server's shared memory instead of bytes.

Real server processes on loopback (tests/serverproc.py) with their shared-memory area
in /dev/shm, unless a test needs another; each server's area is found by its pid.
"""

from __future__ import annotations

import gc
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess, small_tmpfs
from tensorshare.protocol import messages as protocol
from tensorshare.disk.areas import TOKEN_FILE, AreaError, inside, new_token, verify_area, write_token
from tensorshare.errors import ZeroCopyUnavailableError
from tensorshare.disk.layout import RECORD
from tensorshare.wire.codec import encode
from test_disk import VALUES, _equal
from wiretools import wait_for
from test_server import wait_for

MiB = 1 << 20
SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this host")



def _shared_fields(enc, name: str) -> dict:
    """Header fields of a PUT/APPEND whose value was written to shared memory as ``name``."""
    return {"value": enc.description, "shm": name, "size": enc.nbytes}

def _area(srv: ServerProcess, root: str = SHM) -> str | None:
    """The shared-memory area of a server process, if it has one."""
    found = glob.glob(os.path.join(root, f"tensorshare-{srv.pid}-*"))
    return found[0] if found else None


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def _size(path: str) -> int:
    """The size of a file the server may be removing meanwhile (0 once gone)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _backing_file(array) -> str | None:
    """The file the memory of a tensor or array maps ('' for anonymous memory)."""
    address = array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def _arrays(value) -> list:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _mapped_from(value, root: str) -> bool:
    """True if every non-empty array of ``value`` maps a file under ``root``."""
    arrays = [a for a in _arrays(value) if a.nbytes]
    return bool(arrays) and all((_backing_file(a) or "").startswith(root + os.sep) for a in arrays)


@pytest.fixture(scope="module")
def every_item():
    """A server that passes every item by reference, however small."""
    srv = ServerProcess("--zero-copy-min", "0")
    yield srv
    srv.stop()


def _client(srv: ServerProcess, **options) -> tensorshare.Client:
    return tensorshare.Client("127.0.0.1", srv.port, timeout=30, **options)


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_value_reads_back_by_reference_as_over_tcp(every_item, name):
    value = VALUES[name]
    area = _area(every_item)
    with _client(every_item) as zc, _client(every_item, zero_copy=False) as tcp:
        assert zc.same_host and not tcp.same_host
        zc.put(f"v-{name}", value)  # through shared memory
        tcp.append(f"v-{name}", value)  # over TCP
        by_ref, by_tcp = zc.peek(f"v-{name}"), tcp.peek(f"v-{name}")
        assert _equal(by_ref, [value, value]) and _equal(by_tcp, [value, value])
        if [a for a in _arrays(value) if a.nbytes]:
            assert _mapped_from(by_ref[0], area)
            assert not _mapped_from(by_tcp[0], area)
        assert _equal(zc.get(f"v-{name}"), [value, value])
        assert zc.peek(f"v-{name}") == []


def test_a_reader_cannot_change_what_is_stored(every_item):
    original = torch.arange(MiB, dtype=torch.float32)
    with _client(every_item) as writer, _client(every_item) as other, _client(every_item, zero_copy=False) as tcp:
        writer.put("ro", {"w": original.clone(), "b": np.arange(10)})
        [mine] = writer.peek("ro")
        [theirs] = other.peek("ro")
        assert _mapped_from(mine, _area(every_item))
        mine["w"] += 1  # in place: copy-on-write pages of this process only
        mine["w"][0] = -5
        mine["b"][:] = 0
        assert torch.equal(theirs["w"], original) and np.array_equal(theirs["b"], np.arange(10))
        for reader in (writer, other, tcp):
            [again] = reader.peek("ro")
            assert torch.equal(again["w"], original) and np.array_equal(again["b"], np.arange(10))
        item_dir = next(d for d in glob.glob(os.path.join(_area(every_item), "items", "*")))
        for file in _files(item_dir):
            if file.endswith(".memmap"):
                assert os.stat(file).st_mode & 0o777 == 0o400  # stored files are read-only


def test_replaced_and_deleted_items_stay_intact_for_their_readers(every_item):
    items = os.path.join(_area(every_item), "items")
    before = set(os.listdir(items))
    with _client(every_item) as c, _client(every_item) as writer:
        writer.put("life", torch.full((2 * MiB,), 1.0))
        [held] = c.peek("life")
        taken = c.get("life")  # GET by reference: the items leave the bin
        writer.put("life", torch.full((2 * MiB,), 2.0))  # replaced
        [second] = c.peek("life")
        writer.delete("life")  # deleted
        c.list()  # releases the references: the server may delete the files now
        writer.list()
        assert wait_for(lambda: not set(os.listdir(items)) - before)  # nothing of theirs left stored...
        gc.collect()
        assert torch.equal(held, torch.full((2 * MiB,), 1.0))  # ...and every reader still has its data
        assert torch.equal(taken[0], torch.full((2 * MiB,), 1.0))
        assert torch.equal(second, torch.full((2 * MiB,), 2.0))
        assert "(deleted)" in _backing_file(held)


def test_put_is_adopted_without_a_copy(every_item):
    area = _area(every_item)
    with _client(every_item) as c:
        areas = c.router.home.areas
        enc = encode({"w": torch.ones(MiB)})
        name = areas.write(enc)
        inode = os.stat(os.path.join(areas.incoming, name, "w.memmap")).st_ino
        assert c._call(protocol.PUT, {"bin": "adopted", **_shared_fields(enc, name)}, zero_copy=False) == 1
        assert not os.listdir(areas.incoming)  # renamed away...
        stored = {os.stat(f).st_ino: f for f in _files(os.path.join(area, "items")) if f.endswith("w.memmap")}
        assert inode in stored  # ...into the items: the same file, not a copy
        assert _equal(c.peek("adopted"), [{"w": torch.ones(MiB)}])


def _tamper(kind: str, item: str) -> object:
    """Spoil an incoming item directory in one way; returns what must stay alive meanwhile."""
    array = os.path.join(item, "w.memmap")
    if kind == "symlink":
        os.unlink(array)
        os.symlink("/etc/hostname", array)
    elif kind == "hard_link":
        os.link(array, os.path.join(os.path.dirname(item), "elsewhere"))
    elif kind == "truncated":
        os.truncate(array, 10)
    elif kind == "extra_file":
        with open(os.path.join(item, "notes.txt"), "w") as f:
            f.write("x")
    elif kind == "fifo":
        os.mkfifo(os.path.join(item, "pipe"))
    elif kind == "bad_record":
        with open(os.path.join(item, RECORD), "wb") as f:
            f.write(b"\xc1 not msgpack")
    elif kind == "open_for_writing":
        return open(array, "r+b")
    return None


@pytest.mark.parametrize("kind", ["symlink", "hard_link", "truncated", "extra_file", "fifo", "bad_record",
                                  "open_for_writing", "other_value", "bad_name", "missing"])
def test_spoilt_incoming_items_are_refused_and_nothing_is_stored(every_item, kind):
    with _client(every_item) as c:
        areas = c.router.home.areas
        enc = encode({"w": torch.ones(1000)})
        name = areas.write(enc)
        keep = _tamper(kind, os.path.join(areas.incoming, name))
        fields = _shared_fields(enc, name)
        if kind == "other_value":
            fields = _shared_fields(encode({"w": torch.zeros(1000, dtype=torch.int32)}), name)
        elif kind == "bad_name":
            fields["shm"] = f"../{name}"
        elif kind == "missing":
            fields["shm"] = "nothing-here"
        with pytest.raises(ZeroCopyUnavailableError):
            c._call(protocol.APPEND, {"bin": f"spoilt-{kind}", **fields}, zero_copy=False)
        if keep is not None:
            keep.close()
        assert f"spoilt-{kind}" not in c.list()
        assert open("/etc/hostname").read()  # nothing followed the symlink
        c.append(f"spoilt-{kind}", {"w": torch.ones(1000)})  # and the connection goes on
        assert _equal(c.peek(f"spoilt-{kind}"), [{"w": torch.ones(1000)}])


@pytest.mark.process
def test_tcp_only_connections_refuse_shared_puts():
    srv = ServerProcess("--no-zero-copy")
    try:
        assert _area(srv) is None
        with _client(srv) as c:
            assert not c.same_host and c.router.home.engine.greeting.get("shm") is None
            with pytest.raises(ZeroCopyUnavailableError):
                c._call(protocol.PUT, {"bin": "x", **_shared_fields(encode(torch.ones(3)), "abc")}, zero_copy=False)
            c.put("x", torch.ones(MiB))
            [back] = c.peek("x")
            assert torch.equal(back, torch.ones(MiB)) and (_backing_file(back) or "").find("tensorshare-") < 0
    finally:
        srv.stop()


# ------------------------------------------------------------------ lifetimes and cleanup


_WRITE_AND_WAIT = r"""
import sys, time, torch, tensorshare
from tensorshare.wire.codec import encode
c = tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=30)
areas = c.router.home.areas
name = areas.write(encode(torch.ones(1 << 20)))  # written, never sent: killed first
print(areas.incoming, name, flush=True)
time.sleep(60)
"""


def test_a_client_killed_before_its_put_leaves_nothing(every_item):
    writer = subprocess.Popen([sys.executable, "-c", _WRITE_AND_WAIT, str(every_item.port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        incoming, name = writer.stdout.readline().split()
        assert os.path.isdir(os.path.join(incoming, name))
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        assert wait_for(lambda: not os.path.exists(incoming))  # the connection's directory went with it
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.process
def test_areas_go_with_their_server_even_after_kill_9():
    first = ServerProcess()
    try:
        area = _area(first)
        with _client(first) as c:
            c.put("a", torch.ones(MiB))
    finally:
        first.kill()  # SIGKILL: no cleanup...
    assert os.path.isdir(area)
    second = ServerProcess()  # ...so the next server removes it
    try:
        assert not os.path.exists(area)
        mine = _area(second)
        with _client(second) as c:
            c.put("b", torch.ones(MiB))
            assert c.same_host
    finally:
        second.stop()
    assert not os.path.exists(mine)  # a clean stop removes its own


def test_pins_are_let_go_when_the_client_goes(every_item):
    area = _area(every_item)
    items = os.path.join(area, "items")
    with _client(every_item) as writer:
        before = set(os.listdir(items))
        writer.put("pinned", torch.ones(MiB))  # over TCP: nobody maps the bin yet
        reader = _client(every_item)
        [held] = reader.peek("pinned")  # copied into shared memory for it, and pinned until released
        [mine] = set(os.listdir(items)) - before
        writer.delete("pinned")
        time.sleep(0.2)
        assert mine in os.listdir(items)  # still pinned by the reader
        reader.close()  # never released: the connection's end lets them go
        assert wait_for(lambda: mine not in os.listdir(items))
        assert torch.equal(held, torch.ones(MiB))


# ------------------------------------------------------------------ fallbacks


def test_zero_copy_false_uses_tcp_only(every_item):
    area = _area(every_item)
    with _client(every_item, zero_copy=False) as c:
        assert not c.same_host
        c.put("plain", torch.ones(MiB + 16))
        [back] = c.peek("plain")
        assert torch.equal(back, torch.ones(MiB + 16)) and not _mapped_from(back, area)
        items = [f for f in _files(os.path.join(area, "items"))]
        assert not [f for f in items if os.stat(f).st_size == 4 * (MiB + 16)]  # not written to shared memory


@pytest.mark.process
def test_a_token_that_does_not_match_means_tcp(tmp_path):
    srv = ServerProcess("--shm-dir", str(tmp_path))  # an area of its own, to tamper with
    try:
        area = _area(srv, str(tmp_path))
        with _client(srv) as c:
            assert c.same_host
        write_token(area, new_token())  # as if the directory belonged to another server or host
        with _client(srv) as c:
            assert not c.same_host
            c.put("x", torch.ones(MiB))
            [back] = c.peek("x")
            assert torch.equal(back, torch.ones(MiB)) and not _mapped_from(back, area)
        os.chmod(area, 0o777)  # an area others could write to is not trusted either
        with _client(srv) as c:
            assert not c.same_host
    finally:
        srv.stop()


@pytest.mark.process
def test_an_unusable_shm_dir_means_tcp(tmp_path):
    srv = ServerProcess("--shm-dir", str(tmp_path / "missing"))
    try:
        with _client(srv) as c:
            assert not c.same_host
            c.put("x", torch.ones(MiB))
            assert torch.equal(c.peek("x")[0], torch.ones(MiB))
    finally:
        srv.stop()


_FULL_WRITER = r"""
import resource, signal, sys, torch, tensorshare
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file may pass 1 MiB: as if shm were full
c = tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=30)
assert c.same_host
value = {"w": torch.arange(1 << 20, dtype=torch.float32)}
c.put("full", value)
[back] = c.peek("full")
assert torch.equal(back["w"], value["w"])
import os; assert not os.listdir(c.router.home.areas.incoming)
print("ok")
"""


def test_a_full_shm_means_tcp_for_that_value(every_item):
    out = subprocess.run([sys.executable, "-c", _FULL_WRITER, str(every_item.port)], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.process
def test_tmpfs_shm_dir_full(tmp_path):
    with small_tmpfs(tmp_path / "small", "2m") as mount:
        srv = ServerProcess("--shm-dir", str(mount))
        try:
            with _client(srv) as c:
                assert c.same_host
                values = [torch.full((MiB // 4,), float(i)) for i in range(4)]  # 4 x 1 MiB into 2 MiB
                for v in values:
                    c.append("many", v)
                assert _equal(c.peek("many"), values)
        finally:
            srv.stop()


# ------------------------------------------------------------------ memory budget


@pytest.mark.process
def test_items_in_shared_memory_count_against_the_memory_limit(tmp_path):
    srv = ServerProcess("--memory-limit", "8MiB", "--spill-dir", str(tmp_path / "spill"))
    try:
        area = _area(srv)
        with _client(srv) as c:
            values = [torch.full((MiB,), float(i)) for i in range(8)]  # 8 x 4 MiB, limit 8 MiB
            for i, v in enumerate(values):
                c.put(f"m{i}", v)

            def in_shm() -> int:
                return sum(_size(f) for f in _files(os.path.join(area, "items")) if f.endswith(".memmap"))

            c.list()  # releases nothing, but lets the spills finish
            assert wait_for(lambda: in_shm() <= 8 * MiB)
            spilled = [f for f in _files(str(tmp_path / "spill")) if f.endswith(".memmap")]
            assert len(spilled) >= 6
            def by_reference(name: str, value) -> bool:
                [back] = c.peek(name)
                assert torch.equal(back, value)
                return _mapped_from(back, str(tmp_path / "spill")) or _mapped_from(back, area)

            for i, v in enumerate(values):  # from shared memory or from the spill directory, by reference
                # (an item whose spill a disk thread is still writing is answered from memory)
                assert wait_for(lambda: by_reference(f"m{i}", v))
    finally:
        srv.stop()


# ------------------------------------------------------------------ other paths


def test_items_put_over_tcp_move_to_shared_memory_when_peeked(every_item):
    area = _area(every_item)
    with _client(every_item, zero_copy=False) as tcp, _client(every_item) as zc:
        tcp.put("promoted", torch.ones(MiB))
        [first] = zc.peek("promoted")  # copied to shared memory for this first reader, who maps it
        assert _mapped_from(first, area) and torch.equal(first, torch.ones(MiB))
        assert torch.equal(zc.peek("promoted")[0], torch.ones(MiB))


def test_puts_go_over_tcp_until_same_host_readers_map_the_bin(every_item):
    """An ordinary value goes over TCP (faster than writing new shared-memory pages);
    once readers on the host map the bin, the server says so and the next values
    come through shared memory, where they map them at once."""
    area = _area(every_item)
    with _client(every_item) as writer, _client(every_item) as reader:
        areas = writer.router.home.areas
        writer.put("routed", torch.ones(MiB))
        assert "routed" not in areas.mapped and not os.listdir(areas.incoming)
        assert _mapped_from(reader.peek("routed")[0], area)
        writer.put("routed", torch.full((MiB,), 2.0))  # over TCP still; the reply says readers map it
        assert "routed" in areas.mapped
        written = []
        write = areas.write
        areas.write = lambda *args: written.append(write(*args)) or written[-1]
        writer.put("routed", torch.full((MiB,), 3.0))
        assert written and written[0] is not None  # through shared memory
        [back] = reader.peek("routed")
        assert _mapped_from(back, area) and torch.equal(back, torch.full((MiB,), 3.0))
        writer.delete("routed")


@pytest.mark.process
def test_data_dir_items_are_mapped_from_the_data_dir(tmp_path):
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        assert _area(srv) is not None  # (for table rows: tests/test_tables_shm_inserts.py)
        with _client(srv) as c:
            areas = c.router.home.areas
            assert c.same_host and not areas.takes_values  # durable items are written to disk from the payload
            c.put("d", {"w": torch.arange(MiB, dtype=torch.float32)})  # over TCP, to disk
            assert not os.listdir(areas.incoming)
            [back] = c.peek("d")
            assert _mapped_from(back, data) and torch.equal(back["w"], torch.arange(MiB, dtype=torch.float32))
            [taken] = c.get("d")  # a GET takes durable items' bytes over TCP (a DELETE could remove the files)
            assert not _mapped_from(taken, data) and torch.equal(taken["w"], back["w"])
    finally:
        srv.stop()


def test_callback_api_and_non_blocking_calls_use_shared_memory(every_item):
    area = _area(every_item)
    ts = tensorshare.TensorShare("127.0.0.1", every_item.port)
    try:
        got, done = [], threading.Event()
        ts.put("cb", {"w": torch.ones(MiB)}, callback=got.append)
        ts.peek("cb", callback=lambda r: (got.append(r), done.set()))
        assert done.wait(30)
        assert got[0] == {"status": "OK"}
        assert got[1]["status"] == "OK" and _mapped_from(got[1]["data"]["w"], area)
        assert not os.listdir(ts.client.router.home.areas.incoming)
    finally:
        ts.stop()


def test_rl_workers_get_parameters_without_a_copy(every_item):
    area = _area(every_item)
    params = {f"layer{i}.weight": torch.randn(256, 256) for i in range(4)}
    trainer = tensorshare.RLTrainer("127.0.0.1", every_item.port, experiment="zc-rl")
    worker = tensorshare.RLWorker("127.0.0.1", every_item.port, experiment="zc-rl")
    try:
        version = trainer.publish_parameters(params)
        got = worker.await_new_parameters(timeout=30)
        assert worker.version == version and _equal(got, params)
        assert _mapped_from(got, area)  # the worker's tensors are the server's pages
        worker.add_data({"obs": torch.ones(64, 1024)})
        [rollout] = trainer.get_data(timeout=30)
        assert torch.equal(rollout["obs"], torch.ones(64, 1024))
    finally:
        worker.stop()
        trainer.stop()


# ------------------------------------------------------------------ the trust checks, directly


def test_verify_area_rules(tmp_path):
    token = new_token()
    area = tmp_path / "area"
    area.mkdir(mode=0o700)
    write_token(str(area), token)
    assert verify_area(str(area), token) is None
    assert verify_area(str(area), new_token())  # another token
    assert verify_area(str(area) + "/", token)  # not normalised
    assert verify_area("relative/path", token)
    assert verify_area(str(tmp_path / "nowhere"), token)
    link = tmp_path / "link"
    link.symlink_to(area)
    assert verify_area(str(link), token)  # a symlinked area
    (area / TOKEN_FILE).unlink()
    (area / TOKEN_FILE).symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text(token)
    assert verify_area(str(area), token)  # a symlinked token file
    assert verify_area(123, token) and verify_area(str(area), None)


@pytest.mark.parametrize("relative", ["../x", "/etc", "a/../../b", "", "a//b", "./a", "a\x00b", 5, None])
def test_paths_from_the_peer_cannot_leave_their_area(relative):
    with pytest.raises(AreaError):
        inside("/dev/shm/area", relative)


def test_shared_memory_is_offered_to_same_host_peers_only(tmp_path):
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.protocol.session import ServerSession
    from tensorshare_server.root import build_state
    from wiretools import CollectingOutbox

    state = build_state(ServerConfig(shm_dir=str(tmp_path)))
    try:
        for same_host in (False, True):
            outbox = CollectingOutbox()
            session = ServerSession(state, outbox, same_host=same_host)
            session.connection_made()
            [greeting] = outbox.headers
            assert ("shm" in greeting) == same_host
            session.connection_lost()
    finally:
        state.storage.close()
    assert not os.listdir(tmp_path)


# ------------------------------------------------------------------ handing tensors over: Client.shared


def test_a_shared_value_is_handed_over_without_a_copy_then_copy_on_write(every_item):
    area = _area(every_item)
    with _client(every_item) as c, _client(every_item) as reader:
        value = c.shared({"obs": torch.empty(MiB, device="meta"), "act": np.arange(1000), "step": 3,
                          "small": torch.arange(10)})
        assert torch.equal(value["obs"], torch.zeros(MiB)) and value["step"] == 3
        value["obs"].fill_(7.0)  # computed in place, in shared memory
        drafts = {os.stat(os.path.join(c.router.home.areas.incoming, f)).st_ino: f
                  for f in os.listdir(c.router.home.areas.incoming)}
        assert len(drafts) == 3
        c.put("handed", value)
        assert not os.listdir(c.router.home.areas.incoming)  # every draft moved into the item
        stored = {os.stat(f).st_ino for f in _files(os.path.join(area, "items")) if f.endswith(".memmap")}
        assert set(drafts) <= stored  # the very files: nothing was copied
        value["obs"][0] = -1.0  # copy-on-write now: the server's item does not change
        value["act"][:] = 0
        [back] = reader.peek("handed")
        assert torch.equal(back["obs"], torch.full((MiB,), 7.0)) and np.array_equal(back["act"], np.arange(1000))
        assert value["obs"][0] == -1.0 and value["obs"][1] == 7.0
        c.put("again", value)  # no longer a draft: copied like any tensor
        [again] = reader.peek("again")
        assert again["obs"][0] == -1.0 and torch.equal(back["obs"], torch.full((MiB,), 7.0))


def test_unused_drafts_go_with_their_tensors(every_item):
    with _client(every_item) as c:
        value = c.shared([torch.ones(1000), torch.ones(10)])
        assert len(os.listdir(c.router.home.areas.incoming)) == 2
        del value
        gc.collect()
        assert not os.listdir(c.router.home.areas.incoming)


def test_shared_without_zero_copy_is_the_value(every_item):
    with _client(every_item, zero_copy=False) as c:
        t = torch.ones(3)
        value = c.shared({"t": t, "m": torch.empty(2, 2, dtype=torch.int16, device="meta")})
        assert value["t"] is t and torch.equal(value["m"], torch.zeros(2, 2, dtype=torch.int16))


def test_session_refers_only_to_same_host_peers_and_pins_until_released(tmp_path):
    """The sans-IO session: references for a same-host peer that asks, bytes otherwise;
    referenced files stay until the reply is released."""
    from tensorshare._client.connection import NO_VALUE
    from tensorshare_server.config import ServerConfig
    from wiretools import CollectingOutbox, request_parts
    from tensorshare_server.protocol.session import ServerSession
    from tensorshare_server.root import build_state

    state = build_state(ServerConfig(shm_dir=str(tmp_path), zero_copy_min=0))

    def session(same_host: bool):
        out = CollectingOutbox()
        s = ServerSession(state, out, same_host=same_host)
        s.connection_made()
        return s, out

    def request(s, out, rid, op, value=None, **extra):
        parts = request_parts(rid, op, "b", NO_VALUE if value is None else value, extra=extra)
        s.data_received(b"".join(bytes(p) for p in parts))
        return out.frames[-1].header

    try:
        local, local_out = session(True)
        remote, remote_out = session(False)
        assert "shm" in local_out.frames[0].header and "shm" not in remote_out.frames[0].header
        request(local, local_out, 1, "PUT", torch.ones(1000))  # over TCP: in memory
        assert "refs" not in request(remote, remote_out, 2, "PEEK", ref=[0])  # a remote peer gets bytes
        assert "refs" in request(local, local_out, 3, "PEEK", ref=[0])  # copied to shared memory for it
        assert request(local, local_out, 7, "PUT", torch.ones(1000))["mapped"] is True  # readers map the bin
        reply = request(local, local_out, 4, "PEEK", ref=[0])
        [[area, path]] = reply["refs"]
        item_dir = inside(state.storage.areas[area].root, path)
        assert area == 0 and os.path.isdir(item_dir) and local_out.frames[-1].payload_len == 0
        request(local, local_out, 5, "DELETE")
        gc.collect()
        assert os.path.isdir(item_dir)  # deleted, but pinned by reply 4
        request(local, local_out, 6, "LIST", release=[4])
        gc.collect()
        assert not os.path.exists(item_dir)  # released: gone
        local.connection_lost()
        remote.connection_lost()
    finally:
        state.storage.close()
    assert not os.listdir(tmp_path)


_LEASE_RACE = """
import fcntl, os, subprocess, sys, time
from tensorshare.disk import areas

path = sys.argv[1]
real = fcntl.fcntl


def racing(fd, cmd, arg=0):  # a client opens its file for writing while the server's lease is held
    out = real(fd, cmd, arg)
    if cmd == fcntl.F_SETLEASE and arg == fcntl.F_RDLCK:
        opener = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'r+b').close()", path])
        deadline = time.monotonic() + 10
        while real(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK and time.monotonic() < deadline:
            time.sleep(0.01)  # until the opener's open is breaking the lease
    return out


areas.fcntl.fcntl = racing
print(areas.not_open_for_writing(path))
"""


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETLEASE"), reason="no file leases here")
def test_a_writer_breaking_the_adoption_check_s_lease_neither_kills_the_server_nor_passes_it(tmp_path):
    """The check that no process still writes an adopted file takes a read lease for a
    moment; a client opening the file for writing in that moment breaks it, and the
    kernel signals the lease's holder (SIGIO by default, which ends a process): the
    holder lives on and the file counts as open for writing."""
    path = tmp_path / "value.bin"
    path.write_bytes(b"\0" * 64)
    done = subprocess.run([sys.executable, "-c", _LEASE_RACE, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"the checking process ended with {done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.strip() == "False"


def test_a_get_by_reference_for_a_peer_already_gone_takes_nothing(tmp_path):
    """The sans-IO session: when the items had to be written into shared memory for the
    reference and the peer closed meanwhile (``peer_gone``), the GET takes nothing."""
    from tensorshare._client.connection import NO_VALUE
    from tensorshare_server.config import ServerConfig
    from wiretools import CollectingOutbox, request_parts
    from tensorshare_server.protocol.session import ServerSession
    from tensorshare_server.root import build_state

    state = build_state(ServerConfig(shm_dir=str(tmp_path), zero_copy_min=0))
    out = CollectingOutbox()
    s = ServerSession(state, out, same_host=True)
    s.connection_made()

    def request(rid, op, value=None, **extra):
        parts = request_parts(rid, op, "b", NO_VALUE if value is None else value, extra=extra)
        s.data_received(b"".join(bytes(p) for p in parts))
        return out.frames[-1].header

    try:
        request(1, "PUT", torch.ones(1000))  # over TCP: in memory, so a reference means writing it out
        out.peer_closed = True
        assert request(2, "GET", ref=[0])["code"] == 421
        assert state.storage.count("b") == 1  # still there for the next consumer
        out.peer_closed = False
        assert "refs" in request(3, "GET", ref=[0]) and state.storage.count("b") == 0
        s.connection_lost()
    finally:
        state.storage.close()


def test_a_same_host_get_that_times_out_while_its_items_are_shared_loses_none(server):
    """A GET by reference of items the server holds in memory writes them into shared
    memory first (64 MiB: tens of ms); a client whose timeout ends meanwhile closes,
    and the items stay in the bin (they were lost: the small reply counted as delivered)."""
    with tensorshare.Client("127.0.0.1", server.port, zero_copy=False) as tcp:
        for i in range(4):
            tcp.append("q", torch.full((4 << 20,), float(i)))  # over TCP: in the server's memory
        with tensorshare.Client("127.0.0.1", server.port) as local:  # (zero-copy: the same host)
            with pytest.raises(tensorshare.errors.TimeoutError):
                local.get("q", timeout=0.002)
        assert wait_for(lambda: tcp.list().get("q") == 4, 10), tcp.list()
        items = tcp.get("q")
    assert [float(t[0]) for t in items] == [0.0, 1.0, 2.0, 3.0] and all(t.shape == (4 << 20,) for t in items)
