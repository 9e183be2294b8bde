"""Ephemeral bins (server/protocol/ephemeral.py): a PUT that lasts as long as its
connection.  The rules through sessions paired in memory, then a client process
killed with SIGKILL against a server process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tensorshare
from pairing import Pair
from serverproc import ServerProcess
from tensorshare.errors import RemoteError
from tensorshare.protocol.messages import APPEND, DELETE, GET, LIST, LISTEN, PEEK, PUT, Key

EPH = {Key.BIN: "w/1", Key.EPHEMERAL: True}


def _notes(pair: Pair) -> list[dict]:
    return [f.header for f in pair.receive() if f.header.get("code") == 151]


def test_an_ephemeral_bin_ends_with_its_connection_and_listeners_are_told():
    trainer = Pair()
    worker = Pair(state=trainer.state)
    trainer.call(LISTEN, {Key.BIN: "w/1"})
    assert worker.call(PUT, {**EPH, Key.TAG: 3}, {"version": 3}).result == 1
    assert [(n["op"], n["tag"]) for n in _notes(trainer)] == [("PUT", 3)]
    assert trainer.call(PEEK, {Key.BIN: "w/1"}).result == [{"version": 3}]
    worker.session.connection_lost()
    assert [n["op"] for n in _notes(trainer)] == ["DELETE"]
    assert "w/1" not in trainer.call(LIST).result
    assert len(trainer.state.ephemeral) == 0


def test_the_latest_putter_owns_it_so_a_rejoined_worker_survives_its_predecessor():
    old = Pair()
    new = Pair(state=old.state)
    old.call(PUT, EPH, torch.tensor([1]))
    new.call(PUT, EPH, torch.tensor([2]))  # the same worker, back on a new connection
    old.session.connection_lost()  # the dead connection is noticed late
    assert [t.item() for t in new.call(PEEK, {Key.BIN: "w/1"}).result] == [2]
    new.session.connection_lost()
    assert "w/1" not in old.state.store.listing()


def test_ephemeral_and_lasting_items_never_mix_in_one_bin():
    pair = Pair()
    pair.call(PUT, EPH, torch.tensor([1]))
    for command in (APPEND, PUT):  # a lasting store into an ephemeral bin
        with pytest.raises(RemoteError, match="is ephemeral") as info:
            pair.call(command, {Key.BIN: "w/1"}, torch.tensor([2]))
        assert info.value.code == 501
    pair.call(PUT, {Key.BIN: "lasting"}, torch.tensor([1]))
    with pytest.raises(RemoteError, match="not ephemeral") as info:
        pair.call(PUT, {Key.BIN: "lasting", Key.EPHEMERAL: True}, torch.tensor([2]))
    assert info.value.code == 501
    assert pair.state.store.listing() == {"w/1": 1, "lasting": 1}  # neither refused store changed anything


def test_a_deleted_ephemeral_bin_is_forgotten_and_the_name_is_free_again():
    pair = Pair()
    pair.call(PUT, EPH, torch.tensor([1]))
    pair.call(DELETE, {Key.BIN: "w/1"})
    pair.call(APPEND, {Key.BIN: "w/1"}, torch.tensor([2]))  # now an ordinary bin
    other = Pair(state=pair.state)
    other.call(GET, {Key.BIN: "w/1"})
    pair.session.connection_lost()  # owns nothing any more: the bin stays
    assert "w/1" in other.state.store.listing()


def test_ephemeral_items_stay_out_of_the_data_directory(tmp_path):
    data = str(tmp_path / "data")
    pair = Pair(data_dir=data)
    pair.call(PUT, EPH, torch.tensor([1]))
    pair.call(PUT, {Key.BIN: "lasting"}, torch.tensor([2]))
    pair.close()  # the server stops with the connection open: a crash, as far as the disk knows
    again = Pair(data_dir=data)
    assert again.state.store.listing() == {"lasting": 1}


def test_an_ephemeral_put_waits_for_no_lasting_put_on_its_way_to_the_disk(tmp_path):
    """A durable PUT being written made no bin yet: an ephemeral PUT of the name was
    taken, the lasting item landed in the ephemeral bin once written, and the bin (the
    lasting item with it, acknowledged) was deleted when the ephemeral client left."""
    from pairing import HeldJobs
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state
    from twisted.internet.task import Clock

    jobs = HeldJobs()
    state = build_state(ServerConfig(data_dir=str(tmp_path / "data")), jobs, clock=Clock())
    jobs.release()
    lasting, ephemeral = Pair(state=state), Pair(state=state)
    sent = lasting.send_request(PUT, {Key.BIN: "w/1"}, torch.tensor([1]))  # its files are being written
    with pytest.raises(RemoteError, match="exists and is not ephemeral"):
        ephemeral.call(PUT, EPH, torch.tensor([2]))
    jobs.release()
    assert [(f.header["code"], f.header.get("id")) for f in lasting.receive()] == [(250, sent)]
    ephemeral.close()
    assert state.storage.listing() == {"w/1": 1}
    appended = lasting.send_request(APPEND, {Key.BIN: "w/1"}, torch.tensor([3]))  # a lasting bin: appends are taken
    jobs.release()
    assert [(f.header["code"], f.header.get("id")) for f in lasting.receive()] == [(250, appended)]


_WORKER = textwrap.dedent("""
    import sys, time, torch, tensorshare
    c = tensorshare.Client("127.0.0.1", int(sys.argv[1]), timeout=10)
    c.put("exp/workers/a", {"pid": 1}, ephemeral=True)
    print("joined", flush=True)
    time.sleep(60)
""")


def test_a_killed_client_leaves_at_once_end_to_end():
    server = ServerProcess()
    try:
        with tensorshare.Client("127.0.0.1", server.port, timeout=10) as trainer:
            left = threading.Event()
            trainer.listen("exp/workers/a", lambda note: note.op == "DELETE" and left.set())
            worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(server.port)], stdout=subprocess.PIPE,
                                      text=True)
            try:
                assert worker.stdout.readline().strip() == "joined"
                assert trainer.peek("exp/workers/a") == [{"pid": 1}]
                worker.kill()
                assert left.wait(10), "the killed worker's bin was not deleted"
                assert "exp/workers/a" not in trainer.list()
            finally:
                worker.kill()
                worker.wait(10)
    finally:
        server.stop()
