"""Files prepared in shared memory for the next put of the same shapes
(``tensorshare/_client/zerocopy.py``: ``SharedAreas.prepare_bytes``), against a real
server process: they are used, what is stored is right, unused ones go, and the
server removes them with the connection."""

from __future__ import annotations

import os

import torch

import tensorshare
from wiretools import wait_for

MiB = 1 << 20


def _spares(areas) -> list[str]:
    return sorted(name for name in os.listdir(areas.incoming) if name.startswith("spare-"))


def _ready(areas) -> list[str]:
    """The prepared files a put may take: made whole and handed over (a file is on
    disk, being allocated, a moment before it is ready)."""
    with areas._spare_lock:
        if areas._preparing:
            return []
        return sorted(os.path.basename(path) for paths in areas._spares.values() for path in paths)


def _state(version: float, sizes=(MiB, 2 * MiB, 3)) -> dict:
    return {f"w{i}": torch.full((n,), version) for i, n in enumerate(sizes)}


def test_a_repeated_shape_is_written_into_prepared_files(fresh_server):
    with tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30) as client:
        assert client.same_host
        areas = client.router.home.areas
        client.put("params", _state(0.0))  # over TCP: nobody maps the bin yet...
        client.peek("params")  # ...a reader on this host does now: the next values come through shared memory
        client.put("params", _state(0.5))
        assert "params" in areas.mapped
        client.put("params", _state(1.0))
        assert _spares(areas) == []  # one value says nothing about the next
        client.put("params", _state(2.0))
        assert wait_for(lambda: len(_ready(areas)) == 2, timeout=10)  # the two arrays of 1 MiB and more
        assert _spares(areas) == _ready(areas)
        prepared = {os.stat(os.path.join(areas.incoming, name)).st_ino for name in _ready(areas)}
        client.put("params", _state(3.0))
        [back] = client.peek("params")
        assert all(torch.equal(back[k], v) for k, v in _state(3.0).items())
        area = os.path.dirname(os.path.dirname(areas.incoming))
        stored = set()
        for folder, _dirs, files in os.walk(os.path.join(area, "items")):
            stored |= {os.stat(os.path.join(folder, f)).st_ino for f in files if f.endswith(".memmap")}
        assert prepared <= stored  # the prepared files became the stored item's
        assert wait_for(lambda: len(_ready(areas)) == 2, timeout=10)  # and the next ones are ready (the
        # preparing thread done too: a put while it runs prepares nothing for its own shapes)
        client.put("other", _state(3.5, sizes=(5 * MiB,)))
        client.peek("other")
        for version in (3.75, 4.0, 5.0):
            client.put("other", _state(version, sizes=(5 * MiB,)))
        assert wait_for(lambda: [os.path.getsize(os.path.join(areas.incoming, n)) for n in _spares(areas)]
                        == [20 * MiB], timeout=10)  # those of the old shapes went
        assert torch.equal(client.peek("params")[0]["w1"], torch.full((2 * MiB,), 3.0))
        incoming = areas.incoming
    assert wait_for(lambda: not os.path.exists(incoming), timeout=10)  # gone with the connection


def test_preparing_can_be_turned_off(fresh_server, monkeypatch):
    from tensorshare._client.zerocopy import SharedAreas

    monkeypatch.setattr(SharedAreas, "prepare_bytes", 0)
    with tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30) as client:
        areas = client.router.home.areas
        for version in range(3):
            client.put("params", _state(float(version)))
        assert _spares(areas) == []
        assert torch.equal(client.peek("params")[0]["w0"], torch.full((MiB,), 2.0))


def _incoming_bytes(areas) -> tuple[int, int]:
    """``(bytes of prepared files, bytes of directories kept for table rows)`` in the
    incoming directory."""
    spares = kept = 0
    for entry in os.scandir(areas.incoming):
        if entry.name.startswith("spare-"):
            spares += entry.stat().st_size
        elif entry.is_dir() and not entry.name.startswith("."):
            kept += sum(f.stat().st_size for f in os.scandir(entry.path) if f.name.endswith(".memmap"))
    return spares, kept


def _settled(areas) -> bool:
    with areas._spare_lock:
        return not areas._preparing


def test_prepared_files_and_kept_table_rows_share_one_budget(fresh_server, monkeypatch):
    from tensorshare._client.zerocopy import SharedAreas

    monkeypatch.setattr(SharedAreas, "prepare_bytes", 6 * MiB)
    rows = {"x": torch.ones(16384, 64)}  # 4 MiB of rows, through shared memory
    with tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30) as client:
        areas = client.router.home.areas
        client.create_table("t", 4 * 16384, {"x": ((64,), torch.float32)}, remover="fifo")
        client.insert("t", rows, shared=True)
        assert _incoming_bytes(areas) == (0, 4 * MiB)  # kept for the next batch
        client.put("params", _state(0.0, sizes=(768 * 1024,)))  # 3 MiB, through shared memory once read
        client.peek("params")
        for version in (1.0, 2.0, 3.0):
            client.put("params", _state(version, sizes=(768 * 1024,)))
            assert wait_for(lambda: _settled(areas), timeout=10)
            assert sum(_incoming_bytes(areas)) <= 6 * MiB  # no 3 MiB prepared beside the 4 MiB kept
        assert torch.equal(client.peek("params")[0]["w0"], torch.full((768 * 1024,), 3.0))
    with tensorshare.Client("127.0.0.1", fresh_server.port, timeout=30) as client:  # the other way round
        areas = client.router.home.areas
        client.put("params", _state(0.0, sizes=(768 * 1024,)))
        client.peek("params")
        for version in (1.0, 2.0):
            client.put("params", _state(version, sizes=(768 * 1024,)))
        assert wait_for(lambda: _settled(areas) and _incoming_bytes(areas) == (3 * MiB, 0), timeout=10)
        client.insert("t", rows, shared=True)
        assert _incoming_bytes(areas) == (3 * MiB, 0)  # the rows' directory was not kept past the budget
        assert client.table_info("t")["size"] == 2 * 16384
