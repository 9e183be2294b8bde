"""The disk tier: the item layout, spilling under a memory budget, the durable data directory,
Client.save / load_memmap.  Real files throughout; server tests use a real server process."""

from __future__ import annotations

import gc
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

import tensorshare
from serverproc import ServerProcess, small_tmpfs
from tensorshare.disk.areas import TOKEN_FILE
from tensorshare.errors import StorageFullError
from tensorshare.disk.layout import RECORD, LayoutError, read_item, write_item
from tensorshare.memmap import load_memmap, save_memmap
from tensorshare.wire.codec import encode
from tensorshare_server.bins.spill import SpillArea
from tensorshare_server.bins.jobs import InlineJobs
from tensorshare_server.bins.storage import Storage
from tensorshare_server.bins.store import BinStore, Item

MiB = 1 << 20


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


# ------------------------------------------------------------------ the layout

VALUES = {
    "state_dict": {f"layer{i}.weight": torch.randn(8, 4) for i in range(5)} | {"step": 7, "name": "run"},
    "nested": {"obs": {"pixels": torch.randint(0, 255, (2, 3, 4), dtype=torch.uint8),
                       "vec": torch.arange(6.0).reshape(2, 3)}, "done": torch.tensor([True, False])},
    "every_dtype": {str(dt).split(".")[1]: torch.ones(3, dtype=dt) for dt in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
        torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn)},
    "bare_tensor": torch.randn(5, 5),
    "empty_and_scalar": {"empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)},
    "lists_tuples_bytes": [torch.ones(2), (torch.zeros(1), b"raw", 1 << 80), None, 1.5],
    "numpy": {"a": np.arange(10, dtype=np.int32), "b": np.ones((2, 2))},
    "unsafe_keys": {"../escape": torch.ones(1), "/abs": torch.ones(2), ".hidden": torch.ones(3),
                    "x.memmap": torch.ones(4), "meta.json": torch.ones(5), "a/b": {"c": torch.ones(6)},
                    "": torch.ones(7), "ok": torch.ones(8)},
    "no_arrays": {"just": ["scalars", 1, 2.0, None]},
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_layout_round_trip(tmp_path, name):
    value = VALUES[name]
    path = tmp_path / "item"
    save_memmap(value, path)
    assert _equal(load_memmap(path), value)
    for file in _files_under(str(path)):  # no key became a path outside the item
        assert os.path.realpath(file).startswith(str(path) + os.sep)
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".tmp-")]


def test_layout_is_tensordicts(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    value = VALUES["nested"] | {"step": 3, "tag": "x"}
    save_memmap(value, tmp_path / "td")
    td = tensordict.TensorDict.load_memmap(tmp_path / "td")
    assert torch.equal(td["obs", "pixels"], value["obs"]["pixels"])
    assert torch.equal(td["obs", "vec"], value["obs"]["vec"])
    assert torch.equal(td["done"], value["done"])
    assert td["step"] == 3 and td["tag"] == "x"


def test_layout_files_are_raw_arrays(tmp_path):
    value = {"w": torch.arange(12, dtype=torch.int16).reshape(3, 4), "sub": {"b": torch.ones(2)}}
    save_memmap(value, tmp_path / "i")
    raw = np.fromfile(tmp_path / "i" / "w.memmap", dtype=np.int16)
    assert raw.tolist() == list(range(12))
    assert (tmp_path / "i" / "sub" / "b.memmap").stat().st_size == 8


def test_arrays_written_from_many_segments_hold_their_exact_bytes(tmp_path):
    # A payload in more pieces than one pwritev takes (512), split inside arrays, around
    # an empty one; the large array's file is preallocated (64 KiB and more) and must
    # come out at exactly its size.
    value = {"big": torch.randn(200_000), "empty": torch.zeros(0), "small": torch.arange(33, dtype=torch.int8)}
    enc = encode(value)
    payload = enc.payload_bytes()
    cuts = sorted(random.Random(5).sample(range(1, len(payload)), 1500))
    segments = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)])]
    write_item(str(tmp_path / "i"), enc.description, segments, enc.nbytes)
    back = load_memmap(tmp_path / "i")
    assert all(torch.equal(back[k], value[k]) for k in value)
    assert (tmp_path / "i" / "big.memmap").stat().st_size == 800_000
    assert (tmp_path / "i" / "big.memmap").read_bytes() == value["big"].numpy().tobytes()


def test_loaded_tensors_are_copy_on_write_unless_writable(tmp_path):
    save_memmap({"w": torch.zeros(4)}, tmp_path / "i")
    cow = load_memmap(tmp_path / "i")
    cow["w"] += 1
    assert torch.equal(load_memmap(tmp_path / "i")["w"], torch.zeros(4))
    shared = load_memmap(tmp_path / "i", writable=True)
    shared["w"] += 2
    del shared
    gc.collect()
    assert torch.equal(load_memmap(tmp_path / "i")["w"], torch.full((4,), 2.0))


def _saved(tmp_path):
    path = tmp_path / "item"
    save_memmap({"a": torch.ones(100), "b": torch.zeros(10)}, path)
    return path


@pytest.mark.parametrize("damage", ["missing_file", "truncated_file", "garbage_record", "escaping_entry",
                                    "wrong_format", "no_record"])
def test_corrupt_items_raise_layout_error(tmp_path, damage):
    path = _saved(tmp_path)
    record = path / RECORD
    if damage == "missing_file":
        (path / "a.memmap").unlink()
    elif damage == "truncated_file":
        os.truncate(path / "a.memmap", 10)
    elif damage == "garbage_record":
        record.write_bytes(b"\xc1 not msgpack")
    elif damage in ("escaping_entry", "wrong_format"):
        doc = msgpack.unpackb(record.read_bytes())
        if damage == "escaping_entry":
            doc["files"][0] = "../../etc/passwd"
        else:
            doc["format"] = 99
        record.write_bytes(msgpack.packb(doc, use_bin_type=True))
    else:
        record.unlink()
    with pytest.raises(LayoutError):
        read_item(str(path))


def test_failed_write_leaves_nothing(tmp_path):
    enc = encode({"a": torch.ones(10)})
    with pytest.raises(ValueError):  # segments shorter than the payload
        write_item(str(tmp_path / "x"), enc.description, [b"\0" * 8], enc.nbytes)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------- the storage, driven inline


def _item(value, tag=None) -> tuple:
    """A value as the storage takes it: ``(description, payload segments, payload bytes, tag)``."""
    enc = encode(value)
    return enc.description, (enc.payload_bytes(),), enc.nbytes, tag


def _payload(item: Item) -> bytes:
    return b"".join(p if type(p) is bytes else p.tobytes() for p in item.parts())


DESCRIPTIONS = 4096  # room in a test's budget for the items' descriptions, which count too


def _storage(tmp_path, limit):
    """Storage with a budget of ``limit`` payload bytes (and the descriptions')."""
    return Storage(BinStore(memory_limit=limit + DESCRIPTIONS), InlineJobs(), spill=SpillArea(str(tmp_path / "spill")))


def _add(storage, name, value, replace=False) -> Item:
    """Store ``value`` (:func:`_item`) in bin ``name``: the item the storage made of it."""
    out = []
    storage.add(name, *value, replace, lambda change, error: out.append((change, error)))
    (change, error), = out
    assert error is None
    return storage.store.items_of(name)[-1]


def test_spill_keeps_memory_under_the_limit_lru_first(tmp_path):
    storage = _storage(tmp_path, 3 * MiB)
    values = [_item(torch.full((MiB // 4,), float(i))) for i in range(8)]  # 1 MiB each
    payloads = [b"".join(value[1]) for value in values]
    items = []
    for i, value in enumerate(values):
        items.append(_add(storage, f"b{i}", value))
        if i == 2:
            storage.store.peek("b0")  # b0 recently used: b1 goes first
        if i == 3:
            assert items[0].resident and not items[1].resident
        assert storage.store.resident_bytes <= 3 * MiB
    assert [item.resident for item in items] == [False] * 5 + [True] * 3
    for item, payload in zip(items, payloads):  # every byte identical, from memory or from files
        assert _payload(item) == payload


def test_files_of_items_that_leave_are_deleted(tmp_path):
    storage = _storage(tmp_path, MiB)
    for i in range(4):
        _add(storage, "bin", _item(torch.ones(MiB // 4)))
    spill_root = storage.spill.items
    assert len(os.listdir(spill_root)) >= 3  # the .lock file and spilled items
    items, _ = storage.store.get("bin")
    assert not any(i.resident for i in items[:2])
    del items
    gc.collect()
    assert os.listdir(spill_root) == [".lock"]
    _add(storage, "other", _item(torch.ones(MiB // 4)))
    _add(storage, "other", _item(torch.ones(MiB // 4)))
    _add(storage, "other", _item(torch.ones(MiB // 2)), replace=True)  # spills, then replaces
    gc.collect()
    assert len(os.listdir(spill_root)) <= 2
    storage.close()
    assert not os.path.exists(spill_root)


def test_failed_spill_refuses_growth_not_stored_items(tmp_path):
    storage = _storage(tmp_path, MiB)
    kept = _add(storage, "a", _item(torch.ones(MiB // 4)))
    os.rename(storage.spill.items, storage.spill.items + "-gone")
    open(storage.spill.items, "w").close()  # a file where the directory was: every spill write fails
    _add(storage, "b", _item(torch.ones(MiB // 4)))  # over budget: the spill fails, the item stays
    assert storage.spill_failed
    with pytest.raises(StorageFullError):
        storage.add("c", *_item(torch.ones(MiB // 4)), False, lambda *a: None)
    assert [_payload(i) for i in storage.store.peek("a")] == [_payload(kept)]
    assert storage.store.listing() == {"a": 1, "b": 1}


# ------------------------------------------------ the server process


RSS_OVERHEAD = 160 * MiB  # interpreter, Twisted, and payloads being received or spilled


@pytest.mark.process
def test_memory_limit_bounds_rss_and_every_byte_reads_back():
    srv = ServerProcess("--memory-limit", "64MiB")
    try:
        base = srv.rss()
        peak = 0
        with tensorshare.Client("127.0.0.1", srv.port, timeout=60) as c:
            for i in range(64):  # 512 MiB in 8 MiB items over 16 bins
                c.append(f"bin{i % 16}", torch.full((2 * MiB,), float(i)))
                peak = max(peak, srv.rss())
            listing = c.list()
            assert listing == {f"bin{b}": 4 for b in range(16)}
            for b in range(16):
                items = c.peek(f"bin{b}")
                assert [t[0].item() for t in items] == [float(b + 16 * k) for k in range(4)]
                assert all(torch.equal(t, torch.full((2 * MiB,), t[0].item())) for t in items)
                peak = max(peak, srv.rss())
            taken = c.get("bin3")
            assert [t[0].item() for t in taken] == [3.0, 19.0, 35.0, 51.0]
        print(f"server RSS: {base / MiB:.0f} MiB at start, peak {peak / MiB:.0f} MiB holding 512 MiB "
              f"with a 64 MiB limit")
        assert peak < 64 * MiB + RSS_OVERHEAD
    finally:
        srv.stop()


@pytest.mark.process
def test_data_dir_restart_serves_the_same_bins(tmp_path):
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            c.put("params", {"w": torch.arange(10.0), "version": 3}, tag=3)
            for i in range(5):
                c.append("rollouts", torch.full((100,), float(i)), tag=i)
            c.append("taken", torch.ones(3))
            c.get("taken")
            c.append("gone", torch.ones(3))
            c.delete("gone")
            c.append("replaced", torch.ones(1))
            c.put("replaced", torch.zeros(2))
            c.append("replaced", torch.ones(3))
        srv.stop()
        start = time.monotonic()
        srv.start()
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list() == {"params": 1, "rollouts": 5, "taken": 0, "replaced": 2}
            assert _equal(c.peek("params"), [{"w": torch.arange(10.0), "version": 3}])
            assert [t[0].item() for t in c.get("rollouts")] == [0, 1, 2, 3, 4]
            assert _equal(c.peek("replaced"), [torch.zeros(2), torch.ones(3)])
            snapshot = c.listen("params", lambda note: None).snapshot
            assert snapshot.tag == 3
        print(f"restart took {time.monotonic() - start:.2f} s")
        srv.kill()  # the get above is on disk too
        srv.start()
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list()["rollouts"] == 0
    finally:
        srv.stop()
    leftovers = [f for f in _files_under(data) if ".tmp-" in f]
    assert not leftovers


_APPENDER = r"""
import sys, torch, tensorshare
port = int(sys.argv[1])
c = tensorshare.Client("127.0.0.1", port, timeout=10, reconnect=False)
i = 0
try:
    while True:
        c.append("stream", {"i": torch.tensor(i), "data": torch.full((int(sys.argv[2]),), float(i))}, tag=i)
        print(i, flush=True)  # acknowledged
        i += 1
except tensorshare.TensorShareError:
    pass
"""


@pytest.mark.process
@pytest.mark.parametrize("round_", range(3))
def test_kill_9_loses_no_acknowledged_item(tmp_path, round_):
    data = str(tmp_path / "data")
    srv = ServerProcess("--data-dir", data)
    rng = random.Random(round_)
    size = [16, 64 << 10, 1 << 20][round_]  # float32 elements per item
    writer = subprocess.Popen([sys.executable, "-c", _APPENDER, str(srv.port), str(size)],
                              stdout=subprocess.PIPE, text=True)
    try:
        acked = []
        deadline = time.monotonic() + 30
        target = rng.randint(20, 60)
        while len(acked) < target and time.monotonic() < deadline:
            line = writer.stdout.readline()
            if not line:
                break
            acked.append(int(line))
        time.sleep(rng.random() * 0.05)
        srv.kill()  # SIGKILL, mid-stream
        writer.wait(timeout=30)
        rest = writer.stdout.read()  # the same buffered reader as readline(), not the bare pipe
        acked += [int(x) for x in rest.split()]
        assert len(acked) >= 10
        srv.start()
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            items = c.peek("stream") if "stream" in c.list() else []
        numbers = [int(item["i"]) for item in items]
        # every acknowledged item, in order, whole; at most the one in flight beyond
        assert numbers[: len(acked)] == acked and len(numbers) <= len(acked) + 1
        for item in items:
            assert torch.equal(item["data"], torch.full((size,), float(item["i"])))
    finally:
        writer.kill()
        writer.wait()
        srv.stop()


@pytest.mark.process
def test_corrupt_and_foreign_entries_are_skipped(tmp_path):
    data = tmp_path / "data"
    srv = ServerProcess("--data-dir", str(data))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            for i in range(3):
                c.append("a", torch.full((10,), float(i)))
            c.put("b", torch.ones(4))
        srv.stop()
        bins = data / "bins"
        a_dir = next(d for d in bins.iterdir() if (d / "bin.json").read_text().find('"a"') >= 0)
        second = sorted(a_dir.iterdir())[1]
        next(second.glob(RECORD)).write_bytes(b"garbage")  # a corrupt item
        (bins / "not-a-bin").mkdir()  # foreign entries
        (bins / "stray-file").write_text("hello")
        (a_dir / "12345").mkdir()
        srv.start()
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            assert c.list() == {"a": 2, "b": 1}
            assert [t[0].item() for t in c.peek("a")] == [0.0, 2.0]
            c.append("a", torch.ones(1))  # and it keeps serving
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        err = srv.proc.stderr.read()
        assert "skipped" in err and "not-a-bin" in err
    finally:
        srv.stop()


def _file_size_limit(nbytes: int):
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past it fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.mark.process
@pytest.mark.parametrize("mode", ["data-dir", "spill"])
def test_disk_full_gives_a_clear_reply_and_loses_nothing(tmp_path, mode):
    args = ["--data-dir", str(tmp_path / "d")] if mode == "data-dir" else \
        ["--memory-limit", "4MiB", "--spill-dir", str(tmp_path / "s")]
    srv = ServerProcess(*args, preexec_fn=_file_size_limit(2 * MiB))  # no file may pass 2 MiB
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            small = [torch.full((1000,), float(i)) for i in range(3)]
            for t in small:
                c.append("kept", t)
            refused = 0
            for i in range(6):  # 4 MiB items: cannot be written, so the memory budget fills
                try:
                    c.append("big", torch.ones(MiB))
                except StorageFullError as exc:
                    assert "disk" in str(exc) or "spill" in str(exc)
                    refused += 1
            assert refused >= 1
            assert _equal(c.peek("kept"), small)  # nothing stored was lost
            if mode == "spill":  # memory is full of what could not be spilled: make room
                c.delete("big")
            c.append("kept", torch.ones(3))  # and small writes work
            assert c.list()["kept"] == 4
    finally:
        srv.stop()


@pytest.mark.process
def test_tmpfs_disk_full(tmp_path):
    """A full disk refuses with 452 and keeps what it had; a new bin whose first item
    was refused is not left behind in the data directory (a restart listed it)."""
    with small_tmpfs(tmp_path / "small", "6m") as mount:
        srv = ServerProcess("--data-dir", str(mount / "d"))
        try:
            with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
                c.append("a", torch.ones(1000))
                with pytest.raises(StorageFullError, match="disk full"):
                    for _ in range(10):
                        c.append("a", torch.ones(MiB))  # 4 MiB each into 6 MiB
                n = c.list()["a"]
                assert 1 <= n <= 2
                with pytest.raises(StorageFullError, match="disk full"):
                    c.put("ghost", torch.ones(MiB))
                assert "ghost" not in c.list()
                c.delete("a")  # frees the space; writing works again
                c.append("a", torch.ones(MiB))
            srv.stop()
            srv = ServerProcess("--data-dir", str(mount / "d"))
            with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
                assert c.list() == {"a": 1}
        finally:
            srv.stop()


@pytest.mark.process
def test_client_save_and_load_memmap(tmp_path):
    srv = ServerProcess()
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            values = [VALUES["state_dict"], VALUES["lists_tuples_bytes"], torch.arange(5)]
            for v in values:
                c.append("ckpt", v)
            assert c.save("ckpt", tmp_path / "ckpt") == 3
            assert c.list()["ckpt"] == 3  # the bin keeps its items
            assert _equal(load_memmap(tmp_path / "ckpt"), values)
            with pytest.raises(FileExistsError):
                c.save("ckpt", tmp_path / "ckpt")
            c.put("ckpt", torch.ones(2))
            c.save("ckpt", tmp_path / "ckpt", overwrite=True)
            assert _equal(load_memmap(tmp_path / "ckpt"), [torch.ones(2)])
            with pytest.raises(tensorshare.NoSuchBinError):
                c.save("missing", tmp_path / "x")
            assert not (tmp_path / "x").exists()
    finally:
        srv.stop()


@pytest.mark.process
def test_spill_dir_is_cleaned_up(tmp_path):
    spill = tmp_path / "spill"
    srv = ServerProcess("--memory-limit", "1MiB", "--spill-dir", str(spill))
    try:
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            for i in range(4):
                c.append("x", torch.ones(MiB // 2))
            assert c.list() == {"x": 4}
        srv.kill()  # a crash leaves its spill files...
        assert _files_under(str(spill))
        # ...which the next server removes (on a port of its own: the old one may have been
        # taken meanwhile by another test's server, which picked it as a free one)
        srv = ServerProcess("--memory-limit", "1MiB", "--spill-dir", str(spill))
        assert [f for f in _files_under(str(spill)) if not f.endswith((".lock", TOKEN_FILE))] == []
    finally:
        srv.stop()  # and a clean stop removes its own
    assert _files_under(str(spill)) == []


# Four writers (threads of one process: one torch import), each on a connection of
# its own, append until the stop file exists and each has more than 10 acknowledged
# items (at most 60 s): a fixed run time left too few acknowledgements when the
# restarts took most of it.  Each line says the writer, then "ok" or "failed", then i.
_LOAD_WRITERS = r"""
import os, sys, threading, time, torch, tensorshare
port, writers, stop, size = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lock = threading.Lock()

def say(*words):
    with lock:
        print(*words, flush=True)

def write(w):
    c = tensorshare.connect("127.0.0.1", port, retry_for=30, timeout=10, max_backoff=0.2)
    end = time.monotonic() + 60
    i = acked = 0
    while time.monotonic() < end and not (acked > 10 and os.path.exists(stop)):
        try:
            c.append(f"load-{w}", {"w": w, "i": i, "data": torch.full((size,), float(i))})
            say(w, "ok", i)
            acked += 1
        except tensorshare.TensorShareError as exc:  # the server restarts: try again with the next item
            say(w, "failed", i)
            time.sleep(0.05)
        i += 1
    c.close()

threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.process
def test_restart_under_load_loses_no_acknowledged_item(tmp_path):
    """Writers keep appending while the server is killed (-9) and stopped (SIGTERM) and
    restarted on its data directory; they reconnect by themselves."""
    from wiretools import wait_for

    srv = ServerProcess("--data-dir", str(tmp_path / "data"), "--memory-limit", "32MiB")
    stop = tmp_path / "stop"
    n = 4
    writers = subprocess.Popen([sys.executable, "-c", _LOAD_WRITERS, str(srv.port), str(n), str(stop), str(64 << 10)],
                               stdout=subprocess.PIPE, text=True)
    lines: list[list[str]] = [[] for _ in range(n)]
    reader = threading.Thread(target=lambda: [lines[int(line.split()[0])].append(line) for line in writers.stdout],
                              daemon=True)
    reader.start()

    def acked_by_each() -> list[int]:
        return [sum(line.split()[1] == "ok" for line in list(out)) for out in lines]

    def each_acks_more(than: list[int], more: int = 3) -> bool:
        return all(now >= before + more for now, before in zip(acked_by_each(), than))

    try:
        assert wait_for(lambda: each_acks_more([0] * n), 60), lines  # every writer is appending
        srv.kill()
        before = acked_by_each()
        srv.start()
        assert wait_for(lambda: each_acks_more(before), 60), lines  # and appends to the restarted server
        srv.stop()
        before = acked_by_each()
        srv.start()
        assert wait_for(lambda: each_acks_more(before), 60), lines  # and again after a clean stop
        stop.touch()
        writers.wait(timeout=90)
        reader.join(10)
        with tensorshare.Client("127.0.0.1", srv.port, timeout=30) as c:
            for w, out in enumerate(lines):
                acked = [int(x.split()[2]) for x in out if x.split()[1] == "ok"]
                failed = {int(x.split()[2]) for x in out if x.split()[1] == "failed"}
                assert len(acked) > 10, (w, len(acked), len(failed))
                items = c.peek(f"load-{w}")
                present = [item["i"] for item in items]
                assert present == sorted(set(present))  # in order, no duplicates
                assert set(acked) <= set(present) <= set(acked) | failed
                for item in items:
                    assert item["w"] == w and torch.equal(item["data"], torch.full((64 << 10,), float(item["i"])))
        assert writers.returncode == 0
        assert srv.rss() < 32 * MiB + RSS_OVERHEAD
    finally:
        writers.kill()
        writers.wait()
        srv.stop()
