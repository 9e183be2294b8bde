"""Cut-through relays: a relay passes a copy on to the relays following it while it still receives it.

A chain head -> gate -> r1 -> r2 on loopback, real processes; the gate
(:mod:`gateproxy`) holds the head's bytes to r1 at a known point, so r1 has only
part of a copy.  Then r2 must already be receiving that copy (cut-through: seen in
both relays' /status.json, ordered by the gate, not by timing), readers of either
relay must still get the last whole version, and when r1 dies mid-copy (kill -9)
r2 must drop its part and, once r1 is back, take the copy whole.
"""

from __future__ import annotations

import json

import pytest
import torch

import tensorshare
from tensorshare.protocol.messages import PEEK, Key
from gateproxy import GateProxy
from opsproc import OpsServer, http_get
from serverproc import ServerProcess
from test_relay import wait_until

pytestmark = pytest.mark.process

FLOATS = 1 << 20  # per tensor: a version is 2 tensors, 8 MiB


def state(version: int) -> dict:
    return {"a": torch.full((FLOATS,), float(version)), "b": torch.full((FLOATS,), float(version))}


def version_of(values: list) -> int:
    """The version a peeked state dict holds; AssertionError if it is torn."""
    [value] = values
    first = float(value["a"][0])
    assert bool((value["a"] == first).all()) and bool((value["b"] == first).all()), "a torn version"
    return int(first)


def relay_state(server: OpsServer) -> dict:
    status, _, body = http_get(server.url("/status.json"))
    assert status == 200
    return json.loads(body)["relay"]


def arriving(server: OpsServer) -> list | None:
    """``[bytes in, bytes]`` of the copy of "params" the relay is receiving now, or None."""
    return relay_state(server).get("arriving", {}).get("params")


@pytest.fixture
def chain():
    head = ServerProcess()
    gate = GateProxy(head.port)
    r1 = OpsServer("--follow", f"127.0.0.1:{gate.port}", "--follow-timeout", "10")
    r2 = OpsServer("--follow", f"127.0.0.1:{r1.port}", "--follow-timeout", "10")
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as up, \
                tensorshare.Client("127.0.0.1", r2.port, timeout=15) as reader:
            up.put("params", state(1), tag=1)
            assert version_of(reader.peek("params")) == 1  # r2 and r1 mirror it now
            yield gate, r1, r2, up, reader
    finally:
        gate.release()
        r2.stop()
        r1.stop()
        gate.close()
        head.stop()


def held_mid_copy(gate: GateProxy, up, r2: OpsServer) -> list:
    """Put version 2 with the gate holding r1's upstream after 1 MiB; wait until r2
    receives part of it; return r2's ``[bytes in, bytes]``."""
    gate.hold_after(1 << 20)
    up.put("params", state(2), tag=2)
    wait_until(lambda: gate.held, what="the gate holding the copy")
    return wait_until(lambda: (lambda a: a if a and a[0] > 0 else None)(arriving(r2)),
                      what="r2 receiving the copy")


def test_a_copy_is_passed_on_while_it_arrives(chain):
    gate, r1, r2, up, reader = chain
    got2 = held_mid_copy(gate, up, r2)
    got1 = arriving(r1)
    # r1 cannot hold it whole (the rest waits at the gate), yet r2 has part of it
    assert got1 is not None and got1[0] < got1[1] == got2[1] == 2 * 4 * FLOATS
    assert got2[0] <= got1[0]
    for port in (r1.port, r2.port):  # readers meanwhile: the last whole version
        with tensorshare.Client("127.0.0.1", port, timeout=15) as other:
            assert version_of(other.peek("params")) == 1
    assert version_of(reader.peek("params")) == 1
    gate.release()
    wait_until(lambda: version_of(reader.peek("params")) == 2, what="version 2 at r2")
    tags = reader._call(PEEK, {Key.BIN: "params", Key.TAGS: True}, then=lambda reply: reply.header[Key.TAGS])
    assert tags == [2]
    assert arriving(r1) is None and arriving(r2) is None


def test_a_copy_lost_mid_way_upstream_is_never_seen(chain):
    gate, r1, r2, up, reader = chain
    seen = []
    with tensorshare.Client("127.0.0.1", r2.port, timeout=15) as listener:
        listener.listen("params", lambda note: seen.append((note.op, note.tag)))
        held_mid_copy(gate, up, r2)
        r1.kill()  # r2's upstream dies mid-copy
        wait_until(lambda: not relay_state(r2)["connected"], what="r2 noticing")
        assert arriving(r2) is None  # its part of the copy is dropped
        assert version_of(reader.peek("params")) == 1  # and readers still get version 1 whole
        gate.release()
        r1.start()  # back on its port: r2 reconnects and takes the copy whole
        wait_until(lambda: version_of(reader.peek("params")) == 2, what="version 2 at r2 after the restart")
        wait_until(lambda: seen and seen[-1][1] == 2, what="r2's listeners hearing of version 2")
    assert all(tag in (1, 2) for _op, tag in seen)


def test_a_copy_same_host_readers_map_is_in_shared_memory_before_they_hear_of_it(chain):
    gate, r1, r2, up, reader = chain

    def tiers() -> dict:
        status, _, body = http_get(r2.url("/status.json"))
        return next(row["tiers"] for row in json.loads(body)["bins"] if row["name"] == "params")

    assert reader.same_host
    reader.peek("params")  # a same-host read of version 1: copied to shared memory after it
    wait_until(lambda: "shm" in tiers(), what="version 1 in r2's shared memory")
    heard = []
    reader.listen("params", lambda note: heard.append((note.tag, tiers()["shm"] if "shm" in tiers() else 0)))
    up.put("params", state(2), tag=2)
    wait_until(lambda: any(tag == 2 for tag, _ in heard), what="version 2 at r2")
    assert [shm for tag, shm in heard if tag == 2][0] == 2 * 4 * FLOATS  # there when its listeners heard of it
    assert version_of(reader.peek("params")) == 2


def test_a_relay_passes_a_copy_on_to_each_relay_following_it(chain):
    gate, r1, r2, up, reader = chain
    sibling = OpsServer("--follow", f"127.0.0.1:{r1.port}", "--follow-timeout", "10")
    try:
        with tensorshare.Client("127.0.0.1", sibling.port, timeout=15) as other:
            assert version_of(other.peek("params")) == 1
            held_mid_copy(gate, up, r2)
            got = wait_until(lambda: (lambda a: a if a and a[0] > 0 else None)(arriving(sibling)),
                             what="the second follower receiving the copy")
            assert got[0] <= arriving(r1)[0] < got[1]  # both streams while r1 has part of it
            gate.release()
            for client in (reader, other):
                wait_until(lambda c=client: version_of(c.peek("params")) == 2, what="version 2 at both followers")
    finally:
        sibling.stop()
