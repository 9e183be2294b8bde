"""The data directory (server/bins/durable.py) on real files: GET's floor, DELETE
keeping taken items, putting taken items back, and a process killed at each step
of a bin's rewrite restarting into a state that existed."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from server.bins.durable import DataDir
from tensorshare.wire.codec import encode


def _commit(data: DataDir, name: str, value: float, counter, replace: bool = False) -> str:
    enc = encode(torch.full((4,), float(value)))
    stored, _number = data.commit(name, lambda: next(counter), replace, enc.description, enc.buffers, enc.nbytes,
                                  None)
    return stored.path


def _reopen(data: DataDir) -> DataDir:
    """The directory as a restarted server opens it (the first lets go of its lock)."""
    data.close()
    return DataDir(data.root)


def _values(data: DataDir, name: str) -> list[float]:
    """The first element of each live item of bin ``name``, as a fresh start finds
    them (a start removes what is below the floor: call it last)."""
    loaded = _reopen(data).load()
    assert loaded.problems == []
    if name not in loaded.bins:
        return []
    out = []
    for _number, stored in loaded.bins[name].items:
        (_offset, _count, path), = stored.files
        out.append(torch.from_file(path, size=4, dtype=torch.float32)[0].item())
    return out


def test_floor_delete_and_put_back_on_disk(tmp_path):
    data = DataDir(str(tmp_path / "data"))
    counter = itertools.count(1)
    taken = [_commit(data, "b", v, counter) for v in (1, 2)]
    _commit(data, "b", 3, counter)
    data.set_floor("b", 3)  # a GET took items 1 and 2
    kept = data.delete_bin("b", keep=tuple(taken))  # its reply is still being written
    assert sorted(kept) == sorted(taken)
    assert not os.path.exists(data.bin_path("b"))
    _commit(data, "b", 4, counter)  # a new bin of the same name
    restored = data.put_back("b", [kept[p].path for p in taken], lambda: next(counter))
    assert [number for _stored, number in restored.values()] == [5, 6, 7]
    assert _values(data, "b") == [1, 2, 4]  # the undelivered items first, in their order
    assert not [e for e in os.listdir(data.bins_dir) if e.startswith(".")]


def test_put_back_into_the_bin_they_came_from(tmp_path):
    data = DataDir(str(tmp_path / "data"))
    counter = itertools.count(1)
    taken = _commit(data, "b", 1, counter)
    _commit(data, "b", 2, counter)
    data.set_floor("b", 2)
    data.put_back("b", [taken], lambda: next(counter))
    assert _values(data, "b") == [1, 2]


def test_a_start_clears_the_held_area(tmp_path):
    data = DataDir(str(tmp_path / "data"))
    counter = itertools.count(1)
    taken = _commit(data, "b", 1, counter)
    data.set_floor("b", 2)
    data.delete_bin("b", keep=(taken,))
    assert os.listdir(data.held)
    _reopen(data).load()  # the GET that held them is over: its connection died with the server
    assert not os.path.exists(data.held) or os.listdir(data.held) == []


# A process that rewrites a bin (putting back a taken item before the two it holds)
# and dies (os._exit: no clean-up runs) at one step of the rewrite.
_CRASH = textwrap.dedent("""
    import itertools, os, sys
    import server.bins.durable as durable

    root, step = sys.argv[1], sys.argv[2]
    data = durable.DataDir(root)
    real_rename, real_link, real_write = os.rename, durable._link_tree, durable._atomic_write

    def link_tree(source, target):
        real_link(source, target)
        if step == "linking":  # one item linked into the new bin, not the others
            os._exit(17)

    def atomic_write(path, text, fsync):
        real_write(path, text, fsync)
        if step == "complete" and path.endswith(durable._COMPLETE):  # the new bin whole, the old one in place
            os._exit(17)

    def rename(source, target):
        real_rename(source, target)
        if step == "old-bin-gone" and os.path.dirname(target) == data.trash:  # neither bin in place
            os._exit(17)

    durable._link_tree, durable._atomic_write, os.rename = link_tree, atomic_write, rename
    taken = os.path.join(data.held, sorted(os.listdir(data.held))[0])
    data.put_back("b", [taken], itertools.count(100).__next__)
    os._exit(0)
""")


@pytest.mark.parametrize("step, expected", [
    ("linking", [2, 3]),  # the rewrite never finished: the bin as it was
    ("complete", [1, 2, 3]),  # finished, not swapped in: the next start swaps it in
    ("old-bin-gone", [1, 2, 3]),
    ("done", [1, 2, 3]),
])
def test_a_crash_during_put_back_leaves_the_old_bin_or_the_new_one(tmp_path, step, expected):
    data = DataDir(str(tmp_path / "data"))
    counter = itertools.count(1)
    taken = _commit(data, "b", 1, counter)
    _commit(data, "b", 2, counter)
    _commit(data, "b", 3, counter)
    data.set_floor("b", 2)
    data.delete_bin("b", keep=(taken,))  # held/ now has item 1
    data = _reopen(data)
    counter = itertools.count(4)
    _commit(data, "b", 2, counter)
    _commit(data, "b", 3, counter)
    data.close()  # the crashing process is the server now
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _CRASH, data.root, step], cwd=repo, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == (0 if step == "done" else 17), out.stderr[-2000:]
    assert any(e.startswith(".swap-") for e in os.listdir(data.bins_dir)) == (step != "done")
    # What a restart finds (the held area is gone by then: the GET's connection died).
    assert _values(data, "b") == expected
    assert not [e for e in os.listdir(data.bins_dir) if e.startswith(".")]


def test_a_clean_restart_goes_on_past_the_last_sequence_number(tmp_path):
    """GETs and DELETEs take seqs but no item numbers: a restart that went on from the
    items' numbers gave a bin a seq a reader had already seen for another version, and
    its ``peek(since=)`` said nothing was new.  A clean stop notes the counter."""
    from pairing import Pair
    from tensorshare.protocol.messages import GET, PUT, Key

    data = str(tmp_path / "data")
    pair = Pair(data_dir=data)
    pair.call(PUT, {Key.BIN: "params"}, torch.ones(1))
    pair.call(PUT, {Key.BIN: "empty"}, torch.ones(1))
    for _ in range(20):  # (a GET of an empty bin takes a seq too)
        pair.call(GET, {Key.BIN: "empty"})
    last = pair.call(PUT, {Key.BIN: "params"}, torch.ones(1)).header[Key.SEQ]
    pair.close()
    again = Pair(data_dir=data)
    assert again.call(PUT, {Key.BIN: "params"}, torch.ones(1)).header[Key.SEQ] > last
