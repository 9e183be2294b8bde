"""A same-host writer's rows taken from its files as they are (server/bins/keptrows.py).

In process, with real files: a directory checked once and kept open, checked again
when it changed; its bytes mapped for a table in files, which writes them with
``pwritev`` only, so that a file its writer cuts short is a refused insert (451),
never a fault that ends the server; copied out for a table that copies with loads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from server.bins.keptrows import KeptRows
from server.bins.tables import MemmapBacking, RowsNotWrittenError, Table
from server.bins.tables.columns import MappedRows
from server.bins.tables.values import columns_in

COLUMNS = {"x": ((), "int64"), "y": ((3,), "float32")}


def _write_item(directory, first: int, n: int) -> list[tuple[int, str]]:
    """Array files of ``n`` rows, as a writer writes them: ``[(length, path)]``."""
    os.makedirs(directory, exist_ok=True)
    x = np.arange(first, first + n, dtype=np.int64)
    y = x.astype(np.float32).repeat(3).reshape(n, 3)
    files = []
    for name, array in (("x", x), ("y", y)):
        path = os.path.join(directory, f"{name}.memmap")
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.write(array.tobytes())
        files.append((array.nbytes, path))
    return files


class _Value:
    """The parsed description :func:`columns_in` reads: column x is array 0, y array 1."""

    class _Ref:
        def __init__(self, index):
            self.index = index

    class _Spec:
        def __init__(self, dtype, shape):
            self.dtype, self.shape = dtype, shape

    def __init__(self, n: int):
        self.tree = {"x": self._Ref(0), "y": self._Ref(1)}
        self.arrays = [self._Spec("int64", (n,)), self._Spec("float32", (n, 3))]


def _taker(files):
    checks = []

    def check():
        checks.append(1)
        return files

    return check, checks


def test_a_directory_is_checked_once_then_kept_and_checked_again_when_it_changed(tmp_path):
    kept = KeptRows()
    files = _write_item(tmp_path / "a", 0, 8)
    check, checks = _taker(files)
    for first in (0, 100, 200):  # the writer writes its next rows into the same files
        _write_item(tmp_path / "a", first, 8)
        x, y = kept.arrays("a", b"desc", 128, check, mapped=False)
        assert not isinstance(x, MappedRows)
        assert x.view(np.int64).tolist() == list(range(first, first + 8))
        assert y.view(np.float32).reshape(8, 3)[:, 0].tolist() == list(range(first, first + 8))
    assert len(checks) == 1
    kept.arrays("a", b"other", 128, check, mapped=False)  # another value: checked again
    assert len(checks) == 2
    os.truncate(files[0][1], 8)  # cut short: checked again (and refused by the check, in the server)
    with pytest.raises(ValueError):
        kept.arrays("a", b"other", 128, check, mapped=False)
    assert len(checks) == 3
    _write_item(tmp_path / "a", 0, 8)
    kept.arrays("a", b"other", 128, check, mapped=True)
    os.unlink(files[0][1])  # the directory removed (the writer wrote another): checked again
    _write_item(tmp_path / "a", 0, 8)
    kept.arrays("a", b"other", 128, check, mapped=True)
    assert len(checks) == 5
    kept.close()


def test_at_most_so_many_directories_and_bytes_are_kept(tmp_path):
    kept = KeptRows(max_items=2, max_bytes=1000)
    taken = {}
    for name in "abc":
        check, checks = _taker(_write_item(tmp_path / name, 0, 8))  # 128 bytes each
        taken[name] = checks
        kept.arrays(name, b"d", 128, check, mapped=True)
    kept.arrays("c", b"d", 128, lambda: pytest.fail("c is kept"), mapped=True)
    kept.arrays("a", b"d", 128, lambda: taken["a"].append(1) or _write_item(tmp_path / "a", 0, 8), mapped=True)
    assert len(taken["a"]) == 2  # let go for c, the least recently used
    big = _write_item(tmp_path / "big", 0, 100)  # 1,600 bytes: used once, not kept
    check, checks = _taker(big)
    for _ in range(2):
        x, _y = kept.arrays("big", b"d", 1600, check, mapped=True)
        assert x.view(np.int64).tolist() == list(range(100))
    assert len(checks) == 2
    kept.close()


def _file_table(tmp_path, capacity=16):
    return Table(capacity, COLUMNS, sampler="prioritized", remover="fifo", rng=0,
                 backing=MemmapBacking(str(tmp_path / "table")))


def test_mapped_rows_reach_a_table_in_files_and_a_file_cut_short_is_refused_not_a_fault(tmp_path):
    t = _file_table(tmp_path)
    assert t.takes_mapped_rows
    kept = KeptRows()
    files = _write_item(tmp_path / "w", 0, 10)
    check, _ = _taker(files)
    for first in (0, 10):  # the second batch wraps the ring: two runs of slots
        _write_item(tmp_path / "w", first, 10)
        rows = columns_in(_Value(10), kept.arrays("w", b"d", 200, check, mapped=True))
        assert all(isinstance(column.data, MappedRows) for column in rows.values())
        t.insert(rows)
    held = t.read(t.occupied()).values["x"].to_numpy()
    assert sorted(held.tolist()) == list(range(4, 20))
    rows = columns_in(_Value(10), kept.arrays("w", b"d", 200, check, mapped=True))
    os.truncate(files[0][1], 0)  # the writer cuts its file short after the server took it
    with pytest.raises(RowsNotWrittenError):  # pwritev meets EFAULT: an error, never a SIGBUS
        t.insert(rows)
    assert t.size == 6  # the rows it was to replace left (as for any write the files refuse), none came in
    assert sorted(t.read(t.occupied()).values["x"].to_numpy().tolist()) == list(range(14, 20))
    kept.close()


def test_mapped_rows_into_scattered_slots_are_written_a_run_at_a_time_never_loaded(tmp_path):
    t = _file_table(tmp_path, capacity=200)
    t.insert({"x": np.zeros(200, np.int64), "y": np.zeros((200, 3), np.float32)})
    scattered = np.arange(0, 200, 2)  # 100 runs of one slot: more than MAX_RUNS writes are worth
    kept = KeptRows()
    files = _write_item(tmp_path / "s", 300, 100)
    rows = columns_in(_Value(100), kept.arrays("s", b"d", 2000, lambda: files, mapped=True))
    t.write(scattered, rows)
    assert t.read(scattered).values["x"].to_numpy().tolist() == list(range(300, 400))
    os.truncate(files[1][1], 0)  # cut short: refused, and the process lives on
    with pytest.raises(RowsNotWrittenError):
        t.write(scattered + 1, rows)
    kept.close()


def test_a_table_in_memory_or_durable_does_not_take_mapped_rows(tmp_path):
    assert not Table(4, COLUMNS).takes_mapped_rows  # copies rows with loads
    durable = Table(4, COLUMNS, backing=MemmapBacking(str(tmp_path / "d"), keep=True))
    assert not durable.takes_mapped_rows  # its journal copies a change's rows first
