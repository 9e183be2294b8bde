"""Relay servers (``--follow``) end to end: real upstream and relay processes on loopback.

A relay mirrors its upstream's followed bins whole (tags and order kept, its own
growing ``seq``), forwards writes and acknowledges them only after the upstream
did, survives the upstream's kill -9 and restart without serving a torn or mixed
version, and can follow another relay.  Multi-host runs over shaped links are in
test_multihost.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

import pytest
import torch

import tensorshare
from tensorshare import errors
from tensorshare.errors import TensorShareError
from tensorshare.protocol.messages import DELETE, GET, PEEK, PUT, Key
from tensorshare.wire.codec import Encoded
from tensorshare.wire.frames import FrameDecoder, frame_head
from opsproc import OpsServer, http_get
from serverproc import ServerProcess

pytestmark = pytest.mark.process

WAIT_S = 20.0  # the longest any condition below may take


def wait_until(condition, timeout: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.02)


def relay_of(upstream: ServerProcess, *args: str) -> ServerProcess:
    return ServerProcess("--follow", f"127.0.0.1:{upstream.port}", "--follow-timeout", "10", *args)


def tags_of(client, name: str) -> list:
    return client._call(PEEK, {Key.BIN: name, Key.TAGS: True}, then=lambda reply: reply.header.get(Key.TAGS))


@contextlib.contextmanager
def serving_pair(upstream):
    """``upstream`` (started), a relay of it, and a client of each; all stopped after."""
    relay = relay_of(upstream)
    try:
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15) as up, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            yield upstream, relay, up, rel
    finally:
        relay.stop()
        upstream.stop()


@pytest.fixture
def pair():
    with serving_pair(ServerProcess()) as four:
        yield four


def test_mirror_keeps_items_tags_order_and_notifies(pair):
    _, _, up, rel = pair
    for i in range(5):
        up.append("r", {"x": torch.full((3,), float(i))}, tag=100 + i)
    items = rel.peek("r")
    assert [int(item["x"][0]) for item in items] == [0, 1, 2, 3, 4]
    assert tags_of(rel, "r") == [100, 101, 102, 103, 104]
    notes = []
    handle = rel.listen("r", notes.append)
    assert handle.snapshot.n_items == 5 and handle.snapshot.tag == 104
    up.put("r", torch.ones(2), tag=7)
    up.append("r", torch.zeros(2), tag=8)
    wait_until(lambda: notes and notes[-1].n_items == 2 and notes[-1].tag == 8, what="the relay notified")
    seqs = [handle.snapshot.seq] + [note.seq for note in notes]
    assert seqs == sorted(set(seqs)), seqs  # seq only grows on the relay
    assert tags_of(rel, "r") == [7, 8]
    up.delete("r")
    wait_until(lambda: notes[-1].op == "DELETE", what="the delete mirrored")
    with pytest.raises(errors.NoSuchBinError):
        rel.peek("r")


def test_writes_are_forwarded_and_read_back_at_once(pair):
    _, _, up, rel = pair
    assert rel.put("p", {"w": torch.arange(4.0)}, tag=1) == 1
    assert torch.equal(rel.peek("p")[0]["w"], torch.arange(4.0))  # read your write on the relay
    assert torch.equal(up.peek("p")[0]["w"], torch.arange(4.0))
    rel.put("p", {"w": torch.zeros(4)}, tag=2)
    assert torch.equal(rel.peek("p")[0]["w"], torch.zeros(4)) and tags_of(rel, "p") == [2]
    assert rel.append("q", torch.ones(1)) == 1 and rel.append("q", torch.ones(2)) == 2
    assert [t.numel() for t in rel.get("q")] == [1, 2]  # taken upstream, handed on
    assert up.list()["q"] == 0
    rel.delete("p")
    assert "p" not in up.list()
    with pytest.raises(errors.NoSuchBinError):
        rel.peek("p")
    with pytest.raises(errors.BadRequestError):  # a bad value is refused, and nothing is sent on
        rel._call(PUT, {Key.BIN: "q"}, Encoded(b"junk", [], 0), zero_copy=False)
    assert up.list()["q"] == 0
    status = rel.relay_status()
    assert status["connected"] is True and status["upstream"].endswith(str(pair[0].port))
    assert up.relay_status() is None


def test_table_verbs_through_a_relay_reach_the_head(pair):
    """A table is made, filled, sampled and changed at the head through the relay: every
    table verb is forwarded (its declared treatment), and its answer is the head's."""
    _, _, up, rel = pair
    assert rel.create_table("replay", 16, {"x": ((2,), torch.float32)}, sampler="prioritized") == 0
    assert up.table_info("replay")["capacity"] == 16  # it lives at the head
    keys = rel.insert("replay", {"x": torch.arange(8.0).view(4, 2)})
    assert len(keys) == 4
    assert up.table_info("replay")["size"] == 4 and rel.table_info("replay")["size"] == 4
    assert rel.update_priorities("replay", keys[:1], [0.0]) == 1
    drawn = rel.sample("replay", 3)
    assert len(drawn) == 3 and 0 not in drawn.keys.tolist()  # priority 0: never drawn
    rel.write("replay", [5], {"x": torch.full((1, 2), 9.0)})
    assert torch.equal(up.read("replay", [5])["x"], torch.full((1, 2), 9.0))
    assert torch.equal(rel.read("replay", [0, 5])["x"], up.read("replay", [0, 5])["x"])
    assert rel.set_table_limits("replay", min_size_to_sample=2)["rate_limiter"]["min_size_to_sample"] == 2
    assert up.list()["replay"] == 5 and rel.list()["replay"] == 5
    up.put("plain", 1)
    with pytest.raises(errors.BadNameError):  # the head's refusal, as it came
        rel.insert("plain", {"x": torch.ones(1, 2)})
    rel.delete("replay")
    assert "replay" not in up.list()


def test_large_values_and_same_host_zero_copy_on_the_relay(pair):
    _, _, up, rel = pair
    state = {f"layer{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    up.put("big", state, tag=1)
    [got] = rel.peek("big")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert rel.same_host  # the relay's own shared memory serves its host


def test_unfollowed_bins_live_on_the_relay():
    upstream = ServerProcess()
    relay = relay_of(upstream, "--follow-bins", "params*")
    try:
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15) as up, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            up.put("params", torch.ones(2))
            up.put("other", torch.ones(3))
            rel.put("mine", torch.zeros(1))
            assert "mine" not in up.list()
            assert torch.equal(rel.peek("params")[0], torch.ones(2))
            with pytest.raises(errors.NoSuchBinError):
                rel.peek("other")  # not followed: the relay's own namespace
            listing = rel.list()
            assert listing["params"] == 1 and listing["mine"] == 1 and "other" not in listing
    finally:
        relay.stop()
        upstream.stop()


def test_relay_of_a_relay():
    head = ServerProcess()
    middle = relay_of(head)
    leaf = relay_of(middle)
    try:
        with tensorshare.Client("127.0.0.1", head.port, timeout=15) as h, \
                tensorshare.Client("127.0.0.1", leaf.port, timeout=15) as l:
            h.put("p", torch.arange(3.0), tag=1)
            assert torch.equal(l.peek("p")[0], torch.arange(3.0))
            notes = []
            l.listen("p", notes.append)
            h.put("p", torch.arange(5.0), tag=2)
            wait_until(lambda: notes and notes[-1].tag == 2, what="the change reached the leaf")
            assert torch.equal(l.peek("p")[0], torch.arange(5.0))
            l.append("up", torch.ones(2), tag=9)  # leaf -> middle -> head
            assert h.peek("up")[0].numel() == 2 and tags_of(h, "up") == [9]
    finally:
        leaf.stop()
        middle.stop()
        head.stop()


def test_token_and_tls_on_both_sides(tmp_path):
    pytest.importorskip("cryptography")
    pytest.importorskip("OpenSSL")
    from certs import make_certificates

    certs = make_certificates(tmp_path)
    up_token, relay_token = tmp_path / "up-token", tmp_path / "relay-token"
    up_token.write_text("upstream-token-0123456789abcdef-xyz")
    relay_token.write_text("relay-token-0123456789abcdef-xyz!!")
    upstream = ServerProcess("--token-file", str(up_token), "--tls-cert", certs.cert, "--tls-key", certs.key)
    relay = relay_of(upstream, "--follow-token-file", str(up_token), "--follow-tls-fingerprint", certs.fingerprint,
                     "--token-file", str(relay_token), "--tls-cert", certs.cert, "--tls-key", certs.key)
    try:
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15, token=up_token.read_text(),
                                tls_ca=certs.ca) as up, \
                tensorshare.Client("127.0.0.1", relay.port, timeout=15, token=relay_token.read_text(),
                                   tls_ca=certs.ca) as rel:
            up.put("p", torch.ones(3), tag=4)
            assert torch.equal(rel.peek("p")[0], torch.ones(3))
            rel.put("p", torch.zeros(3), tag=5)
            assert torch.equal(up.peek("p")[0], torch.zeros(3))
        with pytest.raises(errors.AuthenticationError):  # the relay's own token guards it
            tensorshare.Client("127.0.0.1", relay.port, timeout=15, token=up_token.read_text(),
                               tls_ca=certs.ca).list()
    finally:
        relay.stop()
        upstream.stop()
    # A relay given a wrong upstream token says so and refuses reads instead of hanging.
    upstream = ServerProcess("--token-file", str(up_token))
    relay = relay_of(upstream, "--follow-token-file", str(relay_token), "--follow-timeout", "2")
    try:
        with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            with pytest.raises(errors.ServerUnavailableError):
                rel.peek("p")
            assert "refused" in wait_until(lambda: rel.relay_status().get("error"), what="the relay reported")
    finally:
        relay.stop()
        upstream.stop()


def _version_state(v: int) -> dict:
    # 4 x 256 KiB: the relay serves it through shared memory, the upstream over TCP
    return {f"w{i}": torch.full((65536,), float(v)) for i in range(4)}


def test_upstream_kill_and_restart_never_serves_a_torn_or_mixed_version(tmp_path):
    upstream = ServerProcess("--data-dir", str(tmp_path / "data"))
    relay = relay_of(upstream)
    problems, seen, stop = [], [], threading.Event()

    def read() -> None:
        with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            while not stop.is_set():
                try:
                    items = rel.peek("params")
                except TensorShareError:
                    time.sleep(0.01)
                    continue
                if len(items) != 1:
                    problems.append(f"{len(items)} items")
                    continue
                values = {float(t[0]) for t in items[0].values()} | {float(t[-1]) for t in items[0].values()}
                if len(values) != 1:
                    problems.append(f"torn: {sorted(values)}")
                elif seen and values.pop() < seen[-1]:
                    problems.append("went back")
                else:
                    seen.append(float(items[0]["w0"][0]))

    try:
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15) as up:
            up.put("params", _version_state(0), tag=0)
            wait_until(lambda: _peek_tag(relay) == 0, what="first version mirrored")
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            version = 0
            for version in range(1, 16):
                up.put("params", _version_state(version), tag=version)
                time.sleep(0.02)
            wait_until(lambda: _peek_tag(relay) == 15, what="version 15 mirrored")
            upstream.kill()  # kill -9: the relay keeps serving version 15, whole
            with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
                wait_until(lambda: not rel.relay_status()["connected"], what="relay saw the upstream go")
                assert float(rel.peek("params")[0]["w3"][-1]) == 15.0
            upstream.start()  # same port, same data directory
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15) as up:
            for version in range(16, 31):
                up.put("params", _version_state(version), tag=version)
                time.sleep(0.02)
        wait_until(lambda: _peek_tag(relay) == 30, what="the relay caught up after the restart")
        stop.set()
        reader.join(15)
        assert not problems, problems[:5]
        assert seen and seen[-1] == 30.0 and len(seen) > 10
    finally:
        stop.set()
        relay.stop()
        upstream.stop()


def _peek_tag(relay: ServerProcess):
    with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
        try:
            return tags_of(rel, "params")[0]
        except TensorShareError:
            return None


def test_forwarded_writes_are_never_lost_or_duplicated_across_an_upstream_kill(tmp_path):
    upstream = ServerProcess("--data-dir", str(tmp_path / "data"))
    relay = relay_of(upstream)
    acked, uncertain = [], []
    try:
        with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as rel:
            for i in range(120):
                if i == 40:
                    upstream.kill()
                if i == 60:
                    upstream.start()
                    with tensorshare.Client("127.0.0.1", relay.port, timeout=15) as probe:
                        wait_until(lambda: probe.relay_status()["connected"], what="the relay reconnected")
                try:
                    rel.append("rollouts", torch.tensor([i]), tag=i)
                    acked.append(i)
                except TensorShareError:
                    uncertain.append(i)  # not acknowledged: stored at most once, never retried here
        with tensorshare.Client("127.0.0.1", upstream.port, timeout=15) as up:
            stored = [int(t) for t in up.peek("rollouts")]
            assert tags_of(up, "rollouts") == stored
        assert len(stored) == len(set(stored)), "a forwarded write was stored twice"
        assert set(acked) <= set(stored), f"acknowledged writes lost: {sorted(set(acked) - set(stored))}"
        assert stored == sorted(stored)  # in the order they were written
        assert set(stored) <= set(acked) | set(uncertain)
        assert 15 <= len(uncertain) <= 25 and len(acked) >= 95  # the outage was seen, and the rest went through
    finally:
        relay.stop()
        upstream.stop()


def test_rl_workers_through_a_relay(pair):
    """The RL wrappers unchanged: the trainer on the head, a worker on the relay."""
    upstream, relay, _, _ = pair
    trainer = tensorshare.RLTrainer("127.0.0.1", upstream.port, experiment="relayed", timeout=15)
    worker = tensorshare.RLWorker("127.0.0.1", relay.port, experiment="relayed", timeout=15)
    try:
        state = {"w": torch.arange(6.0)}
        assert trainer.publish_parameters(state) == 0
        params = worker.get_parameters() or worker.await_new_parameters(timeout=10)
        assert torch.equal(params["w"], state["w"]) and worker.version == 0
        worker.add_data({"obs": torch.ones(3)})
        worker.flush()
        got = trainer.get_data(timeout=10)
        assert len(got) == 1 and torch.equal(got[0]["obs"], torch.ones(3))
        trainer.publish_parameters({"w": torch.zeros(6)})
        assert torch.equal(worker.await_new_parameters(timeout=10)["w"], torch.zeros(6)) and worker.version == 1
    finally:
        worker.stop()
        trainer.stop()


def test_an_ephemeral_bin_put_through_a_relay_ends_with_its_client(pair):
    _, relay, up, _ = pair
    member = tensorshare.Client("127.0.0.1", relay.port, timeout=15)
    member.put("members/w1", {"host": "h1"}, ephemeral=True)
    assert "members/w1" in up.list()
    with pytest.raises(errors.BadRequestError):  # upstream's rule holds: only ephemeral PUTs replace it
        member.append("members/w1", 1)
    # a DELETE for another owner changes nothing, and says so with the bin's n (§4.6), which
    # the relay (mirroring nothing of it: nobody listens there) takes from the upstream
    other = member._call(DELETE, {Key.BIN: "members/w1", Key.OWNER: b"another-client"},
                         then=lambda reply: reply.header[Key.N])
    assert other == 1 and "members/w1" in up.list()
    member.close()  # the worker goes: the relay deletes its bin upstream
    wait_until(lambda: "members/w1" not in up.list(), what="the ephemeral bin deleted upstream")


def test_reads_that_wait_through_a_relay(pair):
    """A GET that waits is forwarded with its wait (taken upstream once enough
    items are there); a PEEK that waits for a change waits for the mirror's."""
    _, _, up, rel = pair
    appender = threading.Timer(0.2, lambda: [up.append("wq", torch.tensor([i])) for i in range(3)])
    appender.start()
    assert [t.item() for t in rel.get("wq", wait=10, least=3)] == [0, 1, 2]
    appender.join(10)
    assert up.list()["wq"] == 0
    up.put("wp", torch.tensor([1]), tag=1)
    [value], seq = rel.peek("wp", with_seq=True)
    putter = threading.Timer(0.2, lambda: up.put("wp", torch.tensor([2]), tag=2))
    putter.start()
    [value], later = rel.peek("wp", with_seq=True, since=seq, wait=10)
    putter.join(10)  # (its reply may come after the peek's: the client must not close before it)
    assert value.item() == 2 and later != seq


def _upstream_status(upstream: OpsServer) -> dict:
    return json.loads(http_get(upstream.url("/status.json"))[2])


def _gets_upstream(upstream: OpsServer) -> int:
    return _upstream_status(upstream).get("verbs", {}).get("GET", {}).get("requests", 0)


def _get_that_waits(port: int, name: str, wait: float) -> socket.socket:
    """A client of its own on a raw socket, whose GET of ``name`` waits up to ``wait`` seconds."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(frame_head(GET.request(1, {Key.BIN: name, Key.WAIT: wait}), 0))
    return sock


def _reply(sock: socket.socket, rid: int) -> dict:
    """The header of the reply to request ``rid`` on a raw socket (5 s at most)."""
    decoder = FrameDecoder()
    sock.settimeout(5)
    while True:
        data = sock.recv(1 << 16)
        assert data, "connection closed before the reply"
        for frame in decoder.feed(data):
            if frame.header.get(Key.ID) == rid:
                return frame.header


@pytest.fixture
def counted_pair():
    """An upstream whose /status.json counts its requests and connections, and its relay."""
    with serving_pair(OpsServer()) as four:
        four[3].put("warm", 0)  # (the relay is connected upstream)
        yield four


def test_a_get_waiting_through_a_relay_takes_nothing_once_its_client_is_gone(counted_pair):
    """A client's GET that waits upstream is called off there when the client goes
    (PROTOCOL.md §4.5): an item appended later stays for the next client."""
    upstream, relay, up, rel = counted_pair
    opened = _upstream_status(upstream)["connections"]["open"]
    gets = _gets_upstream(upstream)
    sock = _get_that_waits(relay.port, "q", 30)
    wait_until(lambda: _gets_upstream(upstream) > gets, 10, "the GET waiting upstream")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # abruptly (a reset), as a killed client's
    # (until the upstream has seen the relay's connection for that GET go: 10 s at most)
    wait_until(lambda: _upstream_status(upstream)["connections"]["open"] <= opened, 10,
               "the relay's request upstream called off")
    up.append("q", torch.tensor([7]))
    assert [t.item() for t in rel.get("q")] == [7]  # not taken by the gone client's GET


def test_a_get_waiting_through_a_relay_holds_up_no_other_request(counted_pair):
    """Requests upstream answer in order per connection: a GET that waits there goes
    on a connection of its own, not ahead of every other client's request."""
    upstream, relay, up, _ = counted_pair
    gets = _gets_upstream(upstream)
    sock = _get_that_waits(relay.port, "q", 10)
    try:
        wait_until(lambda: _gets_upstream(upstream) > gets, 10, "the GET waiting upstream")
        with tensorshare.Client("127.0.0.1", relay.port, timeout=3) as other:
            other.put("p", torch.tensor([1]))  # (held behind the GET: a timeout after 3 s)
            assert up.list()["p"] == 1
            other.append("q", torch.tensor([2]))
        reply = _reply(sock, 1)  # the GET took the item
        assert reply[Key.CODE] == 226 and len(reply[Key.ITEMS]) == 1, reply
        assert up.list()["q"] == 0
    finally:
        sock.close()
