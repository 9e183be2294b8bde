"""The client engine (tensorshare/protocol/engine.py) and the router (protocol/router.py), in memory.

The engine is paired with a real server session over a real store (tests/pairing.py's
EnginePair): no socket, no reactor, no torch; bytes are fed whole and one at a time.
"""

from __future__ import annotations

import sys
import subprocess

import pytest

from pairing import EnginePair
from tensorshare.errors import (
    ConnectionLostError, NoSuchBinError, NotAuthenticatedError, ProtocolError, WrongServerError,
)
from tensorshare.protocol.engine import DEAD, PROBE, READY, Call, Engine, Notice, RawValue, Restored, next_request_id
from tensorshare.protocol.messages import APPEND, GET, LIST, LISTEN, NOOP, PEEK, PUT, Key
from tensorshare.protocol.placement import WorkerMap
from tensorshare.protocol.router import Router



def raw(data: bytes = b"\x01\x02\x03\x04") -> RawValue:
    """A value as the engine takes it: a 4-byte uint8 array, encoded by the codec (the layer above)."""
    import numpy as np

    from tensorshare.wire.codec import encode

    enc = encode(np.frombuffer(data, np.uint8).copy())
    return RawValue(enc.description, [bytes(b) for b in enc.buffers], enc.nbytes)


class Handle:
    def __init__(self, name: str, every_append: bool = True):
        self.bin, self.every_append, self.stopping = name, every_append, False


@pytest.fixture(params=[None, 1], ids=["whole", "byte-by-byte"])
def pair(request):
    p = EnginePair(split=request.param)
    yield p
    p.session.connection_lost()


def test_the_opening_ends_in_one_ready_event():
    p = EnginePair()
    assert p.engine.ready and p.engine.greeting[Key.CODE] == 220
    assert EnginePair().reconnect() == [READY]


def test_a_token_is_proved_and_a_missing_one_refused():
    p = EnginePair(token="s3cret")
    assert p.engine.ready
    assert p.call(NOOP).error is None
    with pytest.raises(NotAuthenticatedError):
        EnginePair(token=None, state=p.state)


def test_replies_are_checked_by_their_declaration(pair):
    put = pair.call(PUT, {Key.BIN: "b"}, raw())
    assert put.error is None and put.frame.header[Key.N] == 1
    missing = pair.call(PEEK, {Key.BIN: "nope"})
    assert isinstance(missing.error, NoSuchBinError)
    peek = pair.call(PEEK, {Key.BIN: "b"})
    assert peek.error is None and bytes(peek.frame.payload)[:4] == b"\x01\x02\x03\x04"
    assert pair.engine.calls == {}


def test_a_success_code_that_breaks_its_declaration_fails_the_call_not_the_connection():
    engine = Engine()
    engine.connected()
    engine.receive(_frame({"code": 220, "id": 0}), 0.0)
    call = Call(next_request_id(), LIST, None)
    engine.request(call)
    events = engine.receive(_frame({"code": 212, "id": call.rid, "bins": [1]}), 0.0)
    assert events == [call] and isinstance(call.error, ProtocolError)
    assert engine.ready


def test_a_reply_id_that_is_not_an_integer_breaks_the_connection():
    engine = Engine()
    engine.connected()
    engine.receive(_frame({"code": 220, "id": 0}), 0.0)
    with pytest.raises(ProtocolError):
        engine.receive(_frame({"code": 200, "id": "x"}), 0.0)


def test_an_http_server_is_told_from_its_first_bytes():
    engine = Engine(where="h:1")
    engine.connected()
    with pytest.raises(WrongServerError):
        engine.receive(b"HTTP/1.1 400 Bad Request\r\n", 0.0)


def test_a_listen_hears_a_change_made_right_after_its_reply(pair):
    handle = Handle("b")
    listen = _listen(pair.engine, handle)
    pair.send(pair.engine.request(listen))
    pair.call(PUT, {Key.BIN: "b"}, raw())  # the notification follows in the same bytes as the PUT's reply
    assert listen.error is None and "b" in pair.engine.listens
    notices = [e for e in pair.events if isinstance(e, Notice)]
    assert [(n.bin, n.header[Key.OP], n.handles) for n in notices] == [("b", "PUT", (handle,))]


def test_listens_are_restored_on_the_next_connection():
    p = EnginePair()
    handle = Handle("b", every_append=False)
    listen = _listen(p.engine, handle)
    p.send(p.engine.request(listen))
    p.pump()
    p.call(APPEND, {Key.BIN: "b"}, raw())
    assert [e.header[Key.OP] for e in p.events if isinstance(e, Notice)] == ["APPEND"]
    p.events.clear()
    failed = p.lose()
    assert failed == []
    events = p.reconnect()
    assert events[0] is READY
    restored = [e for e in events if isinstance(e, Restored)]
    assert len(restored) == 1 and restored[0].handles == (handle,) and restored[0].header[Key.N] == 1
    p.call(APPEND, {Key.BIN: "b"}, raw())  # first_append_only was restored too: no notice for a second item
    assert not [e for e in p.events if isinstance(e, Notice)]
    p.call(GET, {Key.BIN: "b"})
    assert [e.header[Key.OP] for e in p.events if isinstance(e, Notice)] == ["GET"]


def test_a_handle_adopted_while_connected_is_listened_to_at_once_and_restored_later():
    p = EnginePair()
    p.call(PUT, {Key.BIN: "b"}, raw())
    handle = Handle("b")
    p.engine.adopt(handle)  # (moved from another connection's engine: the engine decides to listen now)
    assert len(p.engine.outbox) == 1
    restored = [e for e in p.pump() if isinstance(e, Restored)]
    assert [(r.bin, r.handles, r.header[Key.N]) for r in restored] == [("b", (handle,), 1)]
    second = Handle("b")
    p.engine.adopt(second)  # its bin is listened to already: nothing to send
    assert p.engine.outbox == [] and p.engine.listens.handles("b") == (handle, second)
    p.call(PUT, {Key.BIN: "b"}, raw())
    assert [e.handles for e in p.events if isinstance(e, Notice)] == [(handle, second)]
    p.lose()
    later = Handle("c")
    p.engine.adopt(later)  # no connection: it waits for the next opening
    assert p.engine.outbox == []
    restored = [e for e in p.reconnect() if isinstance(e, Restored)]
    assert sorted(r.bin for r in restored) == ["b", "c"]


def test_sinks_given_to_the_engine_receive_payloads_on_this_connection_and_the_next():
    from tensorshare.wire.frames import buffer_sink

    seen = []

    def sinks(header, nbytes):
        seen.append(nbytes)
        return buffer_sink(header, nbytes)

    p = EnginePair()
    p.call(PUT, {Key.BIN: "b"}, raw())
    p.engine.use_sinks(sinks)
    assert bytes(p.call(PEEK, {Key.BIN: "b"}).frame.payload)[:4] == b"\x01\x02\x03\x04" and seen and seen[-1]
    p.lose()
    p.reconnect()
    count = len(seen)
    assert p.call(PEEK, {Key.BIN: "b"}).error is None and len(seen) > count


def test_stopping_one_of_two_handles_sends_a_noop_and_the_last_an_unlisten(pair):
    first, second = Handle("b"), Handle("b")
    for handle in (first, second):
        pair.send(pair.engine.request(_listen(pair.engine, handle)))
    pair.pump()
    stop = _stop(pair.engine, first)
    assert stop.command is NOOP
    pair.send(pair.engine.request(stop))
    pair.pump()
    assert pair.engine.listens.handles("b") == (second,)
    stop = _stop(pair.engine, second)
    assert stop.command.verb == "UNLISTEN"
    pair.send(pair.engine.request(stop))
    pair.pump()
    assert "b" not in pair.engine.listens
    assert pair.engine.stop_listening(second) is None


def test_a_lost_connection_fails_every_call_in_flight():
    p = EnginePair()
    calls = [Call(next_request_id(), NOOP, None) for _ in range(3)]
    for call in calls:
        p.engine.request(call)  # never delivered
    failed = p.engine.lost(ConnectionLostError("gone"))
    assert failed == calls and all(isinstance(c.error, ConnectionLostError) for c in calls)
    with pytest.raises(ConnectionLostError):
        p.engine.request(Call(next_request_id(), NOOP, None))


def test_an_abandoned_call_resets_the_connection_only_when_the_server_may_still_deliver():
    p = EnginePair()
    for command, fields, reset in ((PEEK, {Key.BIN: "b"}, False), (NOOP, None, False),
                                   (GET, {Key.BIN: "b"}, True), (PEEK, {Key.BIN: "b", Key.WAIT: 5.0}, True)):
        call = Call(next_request_id(), command, fields)
        p.engine.request(call)
        assert p.engine.abandon(call) is reset
        assert p.engine.abandon(call) is False  # (once)


def test_a_waiting_get_abandoned_leaves_the_next_item_to_the_next_reader():
    p = EnginePair()
    get = Call(next_request_id(), GET, {Key.BIN: "q", Key.WAIT: 30.0})
    p.send(p.engine.request(get))
    p.pump()
    assert p.engine.abandon(get)  # the caller left: the driver resets the connection
    p.lose()
    p.reconnect()
    p.call(APPEND, {Key.BIN: "q"}, raw())
    taken = p.call(GET, {Key.BIN: "q"})
    assert taken.error is None and len(taken.frame.header[Key.SIZES]) == 1


def test_keepalive_probes_a_silent_server_and_gives_up_on_a_dead_one():
    p = EnginePair(keepalive=2.0)
    assert p.engine.tick(1.0) == (None, 2.0)
    action, wake = p.engine.tick(2.5)
    assert action == PROBE and len(p.engine.outbox) == 1
    p.now = 2.6
    p.pump()  # the probe is answered: its reply is dropped
    assert p.engine.tick(3.0)[0] is None
    assert p.engine.tick(20.0)[0] == PROBE
    assert p.engine.tick(22.5)[0] == DEAD
    assert p.engine.tick(23.0, writing=True) == (None, 25.0)


def test_a_request_the_server_may_hold_holds_the_keepalive():
    p = EnginePair(keepalive=2.0)
    call = Call(next_request_id(), GET, {Key.BIN: "b", Key.WAIT: 10.0})
    p.engine.track(call, now=0.0)
    assert p.engine.tick(5.0) == (None, 11.0)


def test_backoff_grows_with_jitter_and_ends_after_a_refused_authentication():
    engine = Engine(max_backoff=1.0)
    delays = [engine.retry_delay() for _ in range(6)]
    assert 0.025 <= delays[0] <= 0.05 and 0.5 <= delays[-1] <= 1.0
    engine.refused(NotAuthenticatedError("no"))
    assert engine.retry_delay() is None


def test_the_engine_loads_no_torch():
    code = ("import sys; import tensorshare.protocol.engine, tensorshare.protocol.router; "
            "assert 'torch' not in sys.modules and 'tensorshare._client' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the router


class Member:
    def __init__(self, index, port, opened):
        self.index, self.port, self.opened = index, port, opened
        self.engine = Engine()
        self.closed = False
        self.adopted = []

    def adopt(self, handle):
        self.adopted.append(handle)
        self.engine.adopt(handle)

    def close(self):
        self.closed = True


def _greeting(ports, index, server_id="run-1"):
    return {"code": 220, "id": 0, "workers": WorkerMap(ports, index, server_id).field()}


def test_one_process_is_one_member_for_every_verb():
    router = Router(Member, 8000)
    home = router.start({"code": 220, "id": 0}, "link")
    assert home.opened == "link" and home.port == 8000 and router.count == 1
    assert router.owner("any") is home and router.targets(LIST) == [home] and router.targets(NOOP) == [home]


def test_workers_are_routed_by_declaration_and_made_when_first_needed():
    router = Router(Member, 8000)
    home = router.start(_greeting([9001, 9002, 9003], 1), "link")
    assert home.index == 1 and home.port == 9002 and router.made() == [home]
    owners = {name: router.owner(name) for name in (f"bin-{k}" for k in range(40))}
    assert {m.index for m in owners.values()} == {0, 1, 2}
    assert all(m.port == 9001 + m.index for m in owners.values())
    assert owners["bin-3"] is router.owner("bin-3")  # made once
    assert [m.index for m in router.targets(LIST)] == [0, 1, 2]
    assert router.merged(LIST, [{"bins": {"a": 1}}, {"bins": {"b": 2}}]) == {"bins": {"a": 1, "b": 2}}
    assert router.companion("bin-3") is not router.owner("bin-3")
    assert router.companion("bin-3").index == router.owner("bin-3").index


def test_a_new_map_moves_every_listen_to_its_bins_new_owner():
    router = Router(Member, 8000)
    router.start(_greeting([9001, 9002], 0), None)
    names = [f"bin-{k}" for k in range(20)]
    for name in names:
        router.owner(name).engine.listens.add(Handle(name))
    seen = router.map
    assert router.learn(_greeting([9001, 9002], 0)) is None  # the same workers
    old = router.learn(_greeting([9101, 9102, 9103], 2, "run-2"), "fresh")
    assert old and router.stale(seen) and router.home.opened == "fresh" and router.home.index == 2
    for name in names:
        owner = router.owner(name)
        assert owner.port == 9101 + owner.index and name in owner.engine.listens
    assert not any(m.engine.listens for m in old)
    assert router.fits(1, _greeting([9101, 9102, 9103], 1, "run-2"))
    assert not router.fits(1, _greeting([9101, 9102, 9103], 2, "run-2"))
    assert router.learn({"code": 220, "id": 0}) and router.count == 1  # back to one process


def _listen(engine, handle) -> Call:
    call = Call(next_request_id(), LISTEN, engine.listen_fields(handle))
    call.handle = handle
    return call


def _stop(engine, handle) -> Call:
    command, fields = engine.stop_listening(handle)
    call = Call(next_request_id(), command, fields)
    call.handle = handle
    return call


def _frame(header: dict) -> bytes:
    from tensorshare.wire.frames import frame_head

    return frame_head(header, 0)


# -- the blocking client's driver, against a real server


@pytest.mark.process
def test_an_interrupted_waiting_get_leaves_the_next_item_to_another_reader(server):
    """A notebook's stop button during ``get(wait=...)``: the server must not keep the
    abandoned request and hand it the next item (the connection is reset)."""
    import signal
    import threading

    import torch

    import tensorshare

    with tensorshare.Client("127.0.0.1", server.port, timeout=10) as c, \
            tensorshare.Client("127.0.0.1", server.port, timeout=10) as other:
        main = threading.get_ident()
        timer = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            c.get("engine-interrupted", wait=30)
        timer.join()
        other.append("engine-interrupted", torch.ones(1))
        assert len(other.get("engine-interrupted")) == 1  # not taken by the request nobody waits for
        c.put("engine-after", torch.ones(1))  # the client goes on
        assert c.peek("engine-after")[0].item() == 1.0
