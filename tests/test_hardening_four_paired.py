"""Issue #42, the fourth hardening round, where the code alone decides: the table
engine on real files, both ends of the protocol paired in memory (tests/pairing.py),
the clients against a real server process where a connection must really break.

Each test failed on the code the issue was filed against (docs/reliability.md,
"Fourth round"); the cases a process, a signal or a file decides end to end are in
``tests/test_hardening_four.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tensorshare_server.bins import tables
from tensorshare_server.bins.tables import Table
from tensorshare_server.bins.tables.slots import Slots

# ============================================================ 1. a durable table's write cut short

COLUMNS = {"v": ((), "int64"), "obs": ((64,), "uint8")}


def _durable(directory: str, reopen: bool = False) -> Table:
    return Table(8, COLUMNS, remover="fifo", backing=tables.MemmapBacking(directory, keep=True, reopen=reopen))


def _batch(version: int, n: int = 8) -> dict:
    return {"v": np.full(n, version, np.int64), "obs": np.full((n, 64), version, np.uint8)}


def _versions(table: Table) -> list[int]:
    rows = table.read(np.arange(table.capacity))
    v, obs = rows.values["v"].to_numpy(), rows.values["obs"].to_numpy()
    assert (obs == v[:, None].astype(np.uint8)).all(), "a torn row"
    return v.tolist()


class Killed(BaseException):
    """The server process dies here: what its files hold is what a restart finds."""


def _die_at_keys(monkeypatch) -> None:
    """The next change dies once its rows' bytes are in the columns, before their keys."""
    def fill(self, *args, **kwargs):
        raise Killed
    monkeypatch.setattr(Slots, "fill", fill)


@pytest.mark.parametrize("change", ["write", "insert that evicts"])
def test_1_a_change_that_replaces_rows_and_dies_midway_is_finished_by_the_restart(tmp_path, monkeypatch, change):
    """The old rows' keys went (-1 in ``_slots/key.bin``) before the new rows' bytes
    were copied over theirs: a kill in between left the slots empty.  The change is
    recorded whole first, and the restart finishes it."""
    directory = str(tmp_path / "t")
    table = _durable(directory)
    old_keys = table.insert(_batch(1)).keys
    with monkeypatch.context() as m:
        _die_at_keys(m)
        with pytest.raises(Killed):
            if change == "write":
                table.write(np.arange(8), _batch(2))
            else:
                table.insert(_batch(2))
    again = _durable(directory, reopen=True)
    assert again.size == 8 and _versions(again) == [2] * 8
    assert (again.occupied() == np.arange(8)).all() and (again.read(np.arange(8)).keys > old_keys.max()).all()
    with open(os.path.join(directory, "_slots", "journal.bin"), "rb") as f:
        assert f.read(32) == bytes(32)  # done: its header cleared
    assert again.insert(_batch(3, 1)).keys[0] > again.read([7]).keys[0]  # keys go on growing


def test_1_a_write_with_sample_counts_that_dies_midway_is_finished_with_its_counts(tmp_path, monkeypatch):
    """A write that gives its rows' sample counts (a checkpoint's rows) is recorded with
    them: the restart that finishes it gives the rows their counts, not 0."""
    directory = str(tmp_path / "t")
    table = _durable(directory)
    table.insert(_batch(1))
    counts = np.array([0, 1, 2, 3, 4, 5, 6, 1 << 40])
    with monkeypatch.context() as m:
        _die_at_keys(m)
        with pytest.raises(Killed):
            table.write(np.arange(8), _batch(2), times_sampled=counts)
    with open(os.path.join(directory, "_slots", "journal.bin"), "rb") as f:
        assert f.read(4) == b"TSJ3"
    again = _durable(directory, reopen=True)
    assert again.size == 8 and _versions(again) == [2] * 8
    assert again.slots()["times_sampled"].tolist() == [0, 1, 2, 3, 4, 5, 6, np.iinfo(np.uint32).max]


def test_1_a_change_that_died_while_it_was_being_recorded_leaves_the_old_rows(tmp_path, monkeypatch):
    """Killed before the record's header was written: the table's files were not touched."""
    directory = str(tmp_path / "t")
    table = _durable(directory)
    table.write(np.arange(8), _batch(1))

    def header_never_written(fd, parts, offset):
        real(fd, parts, offset)  # the body is written whole; the kill comes before the header
        raise Killed

    from tensorshare_server.bins.tables import journal
    real = journal.write_all
    monkeypatch.setattr(journal, "write_all", header_never_written)
    with pytest.raises(Killed):
        table.write(np.arange(8), _batch(2))
    assert os.path.getsize(os.path.join(directory, "_slots", "journal.bin")) > 8 * 64  # the body, headless
    monkeypatch.undo()
    again = _durable(directory, reopen=True)
    assert again.size == 8 and _versions(again) == [1] * 8


def test_1_a_durable_write_that_finds_no_room_for_its_record_changes_nothing(tmp_path):
    """452 before the table is touched (here: the record's file cannot be made)."""
    from tensorshare.errors import StorageFullError

    directory = str(tmp_path / "t")
    table = _durable(directory)
    table.write(np.arange(8), _batch(1))
    os.mkdir(os.path.join(directory, "_slots", "journal.bin"))  # a directory where the record goes: EISDIR
    with pytest.raises(StorageFullError):
        table.write(np.arange(8), _batch(2))
    assert table.size == 8 and _versions(table) == [1] * 8


# ============================================================ 3. a multi-worker server's status port


def test_3_the_parents_status_port_closes_a_silent_connection_and_counts_its_connections():
    """The parent of a ``--workers`` server served its status port with none of round
    three's limits: a half-sent request stayed open for good.  Its site is now the
    one-process server's (30 s of silence, 32 connections, no body)."""
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import MemoryReactorClock, StringTransport

    from tensorshare_server.config import ServerConfig
    from tensorshare_server.ops.web import IDLE_TIMEOUT, MAX_CONNECTIONS
    from tensorshare_server.workers.ops import start_ops
    from tensorshare_server.workers.supervisor import Supervisor

    reactor = MemoryReactorClock()
    start_ops(Supervisor(ServerConfig(workers=2, metrics_port=0), reactor), reactor)
    site = reactor.tcpServers[0][1]
    peer = IPv4Address("TCP", "127.0.0.1", 40000)
    transports = []
    for _ in range(MAX_CONNECTIONS + 1):
        protocol = site.buildProtocol(peer)
        if protocol is None:  # past the limit: closed as it comes
            break
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")  # never finished
        transports.append(transport)
    assert len(transports) == MAX_CONNECTIONS
    reactor.advance(IDLE_TIMEOUT - 1)
    assert not any(t.disconnecting for t in transports)
    reactor.advance(2)
    assert all(t.disconnecting for t in transports)


# ============================================================ 6. a read of bytes still in a publisher's GPU


def test_6_a_read_that_gives_wait_waits_for_missing_bytes_that_long_at_most():
    """A read of an item put by device reference whose bytes never come was held 60 s
    whatever it asked; a relay's fetch held so stopped its whole upstream connection.
    A read's ``wait`` now bounds that wait too (0: refused at once, 451)."""
    import torch

    from pairing import Pair, headers
    from tensorshare._client.connection import NO_VALUE
    from tensorshare.errors import ServerLocalError
    from tensorshare.protocol.messages import PEEK, PUT, Key
    from tensorshare.wire.codec import encode
    from test_device_ipc import reference

    pair = Pair(same_host=True)
    try:
        value = encode(torch.arange(4.0))
        pair.call(PUT, {Key.BIN: "ref", Key.VALUE: value.description, Key.SIZE: value.nbytes,
                        Key.CUDA: dict(reference(7), digest=[1])}, NO_VALUE)
        with pytest.raises(ServerLocalError, match="within 0s"):
            pair.call(PEEK, {Key.BIN: "ref", Key.WAIT: 0})
        assert pair.call(PUT, {Key.BIN: "other"}, 1).header[Key.N] == 1  # the connection goes on
        rid = pair.send_request(PEEK, {Key.BIN: "ref", Key.WAIT: 2.0})
        pair.clock.advance(1.5)
        assert not [h for h in headers(pair.receive()) if h.get("id") == rid]  # still held
        pair.clock.advance(1.0)
        [reply] = [h for h in headers(pair.receive()) if h.get("id") == rid]
        assert reply["code"] == 451
    finally:
        pair.close()


# ============================================================ 8. a huge sample of a one-item table


def test_8_a_sample_of_many_copies_of_one_item_is_bounded_before_anything_is_drawn(tmp_path):
    """A table of items' sample was bounded by its header alone: 2,000,000 copies of a
    one-item table's item under a 16 MiB limit took +222 MiB and stalled another
    client's NOOP 1.7 s.  Its payload is bounded by max_outbound (552) and what
    building it takes counts in the memory budget (452), before anything is drawn."""
    import torch

    from pairing import Pair
    from tensorshare.errors import StorageFullError, TooLargeError
    from tensorshare.protocol.messages import TCREATE, TINSERT, TSAMPLE, Key, TableKey

    pair = Pair(memory_limit=1 << 20, max_outbound=1 << 20, spill_dir=str(tmp_path), zero_copy=False)
    try:
        for name, item in (("tensor", torch.arange(8)), ("small", {"a": 1})):
            pair.call(TCREATE, {Key.BIN: name, TableKey.SPEC: {"capacity": 1}})
            pair.call(TINSERT, {Key.BIN: name}, item)
        with pytest.raises(TooLargeError, match="max_outbound"):  # 20,000 x 64 bytes of payload
            pair.call(TSAMPLE, {Key.BIN: "tensor", Key.N: 20_000})
        with pytest.raises(StorageFullError, match="memory budget"):  # no payload, 20,000 rows of header
            pair.call(TSAMPLE, {Key.BIN: "small", Key.N: 20_000})
        tables = pair.state.storage.tables
        assert tables.get("tensor").table.samples == tables.get("small").table.samples == 0  # nothing drawn
        assert len(pair.call(TSAMPLE, {Key.BIN: "small", Key.N: 2000}).values) == 2000  # a header of 100 KiB
        assert pair.state.store.in_flight_bytes == 0  # its header counted until written (here: at once)
    finally:
        pair.close()


# ============================================================ 11. a table checkpoint's files are its own


@pytest.mark.parametrize("link", ["x.memmap", "_slots/key.bin", "_slots", "table.json"])
def test_11_a_checkpoint_file_that_is_a_symbolic_link_is_refused_not_followed(tmp_path, link):
    """A checkpoint whose column file was a symbolic link uploaded the file it points
    to (any file of the loading user whose size is known): its files must be its own."""
    import shutil

    from tensorshare.disk.layout import LayoutError
    from tensorshare.disk.tables import CheckpointWriter, read_checkpoint

    spec = {"capacity": 4, "columns": {"x": {"shape": [8], "dtype": "uint8"}}}
    writer = CheckpointWriter(tmp_path / "ckpt", "t", spec, 2)
    writer.column(writer.columns[0])[:] = 7
    for what in ("index", "key", "priority", "times_sampled"):
        writer.state(what)[:] = [0, 1]  # (two rows at distinct slots: a checkpoint a server takes)
    writer.finish()
    assert read_checkpoint(tmp_path / "ckpt").columns["x"][1].tolist() == [[7] * 8] * 2
    secret = tmp_path / "secret"
    target = tmp_path / "ckpt" / link
    if target.is_dir():
        shutil.copytree(target, secret)
        shutil.rmtree(target)
    else:
        secret.write_bytes(target.read_bytes())  # a file the loading user may read, of the size expected
        target.unlink()
    os.symlink(secret, target)
    with pytest.raises(LayoutError, match="symbolic link|not a table checkpoint|not a directory"):
        read_checkpoint(tmp_path / "ckpt")



@pytest.mark.parametrize("change", ["shape 3", "dtype list", "name with NUL", "a setting not a table's",
                                    "table.json a FIFO"])
def test_11_a_malformed_checkpoint_is_a_layout_error_never_a_traceback_or_a_hang(tmp_path, change):
    import json

    from tensorshare.disk.layout import LayoutError
    from tensorshare.disk.tables import CheckpointWriter, read_checkpoint

    spec = {"capacity": 4, "columns": {"x": {"shape": [2], "dtype": "uint8"}}}
    writer = CheckpointWriter(tmp_path / "ckpt", "t", spec, 1)
    writer.column(writer.columns[0])[:] = 7
    for what in ("index", "key", "priority", "times_sampled"):
        writer.state(what)[:] = 1
    writer.finish()
    assert read_checkpoint(tmp_path / "ckpt").rows == 1  # whole, as written
    record = tmp_path / "ckpt" / "table.json"
    saved = json.loads(record.read_text())
    column = saved["spec"]["columns"]["x"]
    if change == "table.json a FIFO":
        record.unlink()
        os.mkfifo(record)  # (its open blocked until a writer came)
    else:
        if change == "shape 3":
            column["shape"] = 3
        elif change == "dtype list":
            column["dtype"] = ["uint8"]
        elif change == "name with NUL":
            saved["spec"]["columns"] = {"x\0y": column}
        else:
            saved["spec"]["replace"] = True
        record.write_text(json.dumps(saved))
    with pytest.raises(LayoutError):
        read_checkpoint(tmp_path / "ckpt")


# ============================================================ 14. a declared size past max_frame


@pytest.mark.parametrize("route", ["shm", "cuda"])
def test_14_a_declared_size_past_max_frame_is_552_on_every_route_that_declares_one(route):
    """PROTOCOL.md §10.4 said 501 for a shared-memory ``size`` past ``max_frame``, §7 and
    the server 552; a PUT by device reference got 501.  Both are 552 now, as over TCP,
    and a size that is not an int >= 0 is 501."""
    import torch

    from pairing import Pair
    from tensorshare._client.connection import NO_VALUE
    from tensorshare.errors import BadRequestError, TooLargeError
    from tensorshare.protocol.messages import PUT, Key
    from tensorshare.wire.codec import encode
    from test_device_ipc import reference

    pair = Pair(max_frame=1024, same_host=True)
    try:
        fields = {Key.BIN: "b", Key.VALUE: encode(torch.zeros(512)).description}
        fields.update({Key.SHM: "x"} if route == "shm" else {Key.CUDA: reference(7)})
        with pytest.raises(TooLargeError, match="max-frame"):
            pair.call(PUT, {**fields, Key.SIZE: 2048}, NO_VALUE)
        with pytest.raises(BadRequestError, match="size"):
            pair.call(PUT, {**fields, Key.SIZE: -1}, NO_VALUE)
    finally:
        pair.close()
