"""``Client.save`` on the server's host: items the server keeps in shared files are
copied file to file by the kernel (``write_item(copies=...)``, done in
``tensorshare/disk/files.py``), not sent over TCP.  Real server processes, real files; the copy itself is also tested
on its own (a source that is too short, a link, a file-size limit mid-copy).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

import tensorshare
from opsproc import OpsServer, http_get
from tensorshare.disk.files import copy_file, splice
from tensorshare.disk.layout import read_item, write_item

tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed (pip install tensordict)")
TensorDict = tensordict.TensorDict

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peek_payload_bytes(server: OpsServer) -> int:
    status, _, body = http_get(server.url("/metrics"))
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith('tensorshare_reply_payload_bytes_total{verb="PEEK"}'):
            return int(float(line.split()[-1]))
    return 0


def _state_dict() -> dict:
    return {f"layer{i}.weight": torch.randn(256, 256 + i) for i in range(6)} | {"step": torch.tensor(7)}


# -- the copy on its own


def test_a_kernel_copy_holds_the_source_bytes(tmp_path):
    src = tmp_path / "src"
    data = os.urandom(3 * MiB + 11)
    src.write_bytes(data + b"trailing bytes the array does not own")
    assert copy_file(str(src), str(tmp_path / "dst"), len(data), fsync=False)
    assert (tmp_path / "dst").read_bytes() == data


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_copy_across_file_systems_is_spliced_whole(tmp_path):
    # tmpfs to tmp_path: copy_file_range refuses (EXDEV) where they differ; the pipe
    # then carries several full loads and an odd tail, from an offset on too.
    data = os.urandom(3 * MiB + 11)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as src:
        src.write(data + b"more")
        src.flush()
        assert copy_file(src.name, str(tmp_path / "dst"), len(data), fsync=False)
        assert (tmp_path / "dst").read_bytes() == data
        fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            assert splice(src.fileno(), fd, MiB + 5, len(data)) == len(data)
        finally:
            os.close(fd)
        assert (tmp_path / "part").read_bytes()[MiB + 5:] == data[MiB + 5:]


def test_a_source_too_short_or_a_link_is_refused_and_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    with pytest.raises(OSError):
        copy_file(str(src), str(tmp_path / "dst"), 1000, fsync=False)
    assert not (tmp_path / "dst").exists()
    os.symlink(src, tmp_path / "link")
    with pytest.raises(OSError):
        copy_file(str(tmp_path / "link"), str(tmp_path / "dst"), 100, fsync=False)
    assert not (tmp_path / "dst").exists()


def test_write_item_copies_arrays_from_another_item(tmp_path):
    from tensorshare.wire.codec import encode

    value = {"a": torch.randn(1000), "empty": torch.zeros(0), "b": torch.arange(77)}
    enc = encode(value)
    first = write_item(str(tmp_path / "first"), enc.description, enc.buffers, enc.nbytes)
    copies = {i: file for i, (_o, n, file) in enumerate(first.files) if n}
    second = write_item(str(tmp_path / "second"), enc.description, [bytes(enc.nbytes)], enc.nbytes, copies=copies)
    back = tensorshare.load_memmap(tmp_path / "second")
    assert all(torch.equal(back[k], value[k]) for k in value)  # the bytes came from the copies, not the zeros
    assert read_item(second.path).description == enc.description


def test_write_item_asks_for_segments_only_when_it_writes_from_them(tmp_path):
    from tensorshare.wire.codec import encode

    value = {"a": torch.randn(1000), "b": torch.arange(77)}
    enc = encode(value)
    asked = []

    def segments():
        asked.append(1)
        return enc.buffers

    first = write_item(str(tmp_path / "first"), enc.description, segments, enc.nbytes)
    assert asked == [1]  # no copies: written from the segments, asked for once
    copies = {i: file for i, (_o, _n, file) in enumerate(first.files)}
    write_item(str(tmp_path / "second"), enc.description, segments, enc.nbytes, copies=copies, threads=2)
    assert asked == [1]  # every array copied by the kernel: the segments were never made
    back = tensorshare.load_memmap(tmp_path / "second")
    assert all(torch.equal(back[k], value[k]) for k in value)


# -- Client.save against a real server


@pytest.fixture
def server():
    proc = OpsServer()
    yield proc
    proc.stop()


@pytest.mark.process
def test_save_on_the_same_host_copies_files_and_loads_back(server, tmp_path):
    sd = _state_dict()
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as client:
        client.put("ckpt/sd", sd)  # through shared memory: the server keeps it in a shared file
        client.append("ckpt/mixed", sd)
        client.append("ckpt/mixed", {"small": torch.ones(3)})  # small: in the server's memory, over TCP
        before = _peek_payload_bytes(server)
        assert client.save("ckpt/sd", tmp_path / "root") == 1
        assert _peek_payload_bytes(server) - before == 0  # no payload byte went over TCP
        assert client.save("ckpt/mixed", tmp_path / "mixed") == 2
        assert 0 < _peek_payload_bytes(server) - before < 1024  # only the small item's
        assert client.save("ckpt/sd", tmp_path / "root", overwrite=True) == 1
        assert torch.equal(client.peek("ckpt/sd")[0]["layer3.weight"], sd["layer3.weight"])  # the bin keeps it
    [back] = tensorshare.load_memmap(tmp_path / "root")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    td = TensorDict.load_memmap(tmp_path / "root")
    assert torch.equal(td["00000000", "layer5.weight"], sd["layer5.weight"])
    first, second = tensorshare.load_memmap(tmp_path / "mixed")
    assert all(torch.equal(first[k], sd[k]) for k in sd) and torch.equal(second["small"], torch.ones(3))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary left


@pytest.mark.process
def test_save_over_tcp_writes_the_same_root(server, tmp_path):
    sd = _state_dict()
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as client:
        client.put("ckpt/tcp", sd)
    with tensorshare.Client("127.0.0.1", server.port, timeout=30, zero_copy=False) as client:
        before = _peek_payload_bytes(server)
        assert client.save("ckpt/tcp", tmp_path / "root") == 1
        assert _peek_payload_bytes(server) - before >= sum(t.nbytes for t in sd.values())
    [back] = tensorshare.load_memmap(tmp_path / "root")
    assert all(torch.equal(back[k], sd[k]) for k in sd)


_SAVE_UNDER_LIMIT = """
import resource, signal, sys
import tensorshare
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
with tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=30) as client:
    try:
        client.save("ckpt/big", sys.argv[2])
    except OSError as exc:
        print("failed:", exc.errno)
    else:
        print("saved")
"""


@pytest.mark.process
def test_a_copy_that_fails_midway_leaves_no_root_and_loses_nothing(server, tmp_path):
    value = {"w": torch.randn(4 * MiB // 4)}  # 4 MiB: past the 1 MiB file size limit of the saver
    with tensorshare.Client("127.0.0.1", server.port, timeout=30) as client:
        client.put("ckpt/big", value)
        out = subprocess.run([sys.executable, "-c", _SAVE_UNDER_LIMIT, str(server.port), str(tmp_path / "root")],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.stdout.strip() == "failed: 27", out.stdout + out.stderr  # EFBIG
        assert os.listdir(tmp_path) == []  # neither the root nor a temporary directory
        assert torch.equal(client.peek("ckpt/big")[0]["w"], value["w"])  # the server still holds it
        assert client.save("ckpt/big", tmp_path / "root") == 1  # and a save without the limit works
    [back] = tensorshare.load_memmap(tmp_path / "root")
    assert torch.equal(back["w"], value["w"])
