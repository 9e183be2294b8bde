"""Hardening (issue #7): token authentication, TLS, connection and idle limits, keepalive.

Real server processes on loopback and real sockets, except the first section,
which drives the sans-IO session directly.  Time limits are set small (1 s) so
that the tests stay fast.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorshare
from serverproc import FakeServer, OneConnectionServer, ServerProcess
from tensorshare.protocol import auth
from tensorshare.errors import (
    AuthenticationError, ConnectionLostError, NotAuthenticatedError, ServerUnavailableError, UntrustedServerError,
    UsageError, WrongServerError,
)
from tensorshare.wire.frames import FrameDecoder, frame_head
from wiretools import CollectingOutbox, RawConnection, raw_frame, wait_for

TOKEN = "test-token-9f2c41d7be8a4c02"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from certs import make_certificates

    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")  # a trailing newline is not part of the token
    return str(path)


@pytest.fixture(scope="module")
def auth_server(token_file):
    proc = ServerProcess("--token-file", token_file)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tls_server(token_file, certs):
    proc = ServerProcess("--token-file", token_file, "--tls-cert", certs.cert, "--tls-key", certs.key)
    yield proc
    proc.stop()


def auth_request(greeting: dict, token: str = TOKEN, rid: int = 1) -> tuple[bytes, bytes]:
    """An AUTH request answering ``greeting``'s challenge, and the proof the server owes."""
    client_nonce = auth.new_nonce()
    proof, server_proof = auth.proofs(auth.token_bytes(token), greeting["nonce"], client_nonce)
    frame = frame_head({"op": "AUTH", "id": rid, "mech": auth.MECHANISM, "nonce": client_nonce, "proof": proof}, 0)
    return frame, server_proof


def auth_frame(greeting: dict, token: str = TOKEN, rid: int = 1) -> bytes:
    return auth_request(greeting, token, rid)[0]


# --------------------------------------------------------------- sans-IO session


def session(**settings):
    from tensorshare_server import ServerConfig
    from tensorshare_server.protocol.session import ServerSession
    from tensorshare_server.root import build_state

    state = settings.pop("state", None) or build_state(ServerConfig(**settings))
    outbox = CollectingOutbox()
    s = ServerSession(state, outbox, "peer")
    s.connection_made()
    return s, outbox


def test_session_serves_nothing_before_auth():
    s, out = session(token=TOKEN)
    greeting = out.headers[0]
    assert greeting["code"] == 220 and greeting["auth"] == "hmac-sha256" and len(greeting["nonce"]) == 32
    s.data_received(raw_frame(7, "PUT", "b", torch.ones(3)))  # a payload: refused as its prefix arrives
    assert out.headers[-1]["code"] == 530 and out.closed
    assert s.state.store.listing() == {}
    s, out = session(token=TOKEN)
    s.data_received(raw_frame(8, "LIST"))
    assert out.headers[-1] == {"code": 530, "id": 8, "msg": "authentication required"} and out.closed


def test_session_auth_then_requests():
    s, out = session(token=TOKEN)
    request, server_proof = auth_request(out.headers[0], rid=3)
    s.data_received(request + raw_frame(4, "NOOP"))  # a NOOP pipelined behind AUTH
    assert out.headers[1] == {"code": 230, "id": 3, "proof": server_proof}
    assert out.headers[2] == {"code": 200, "id": 4}
    s.data_received(raw_frame(5, "PUT", "b", torch.zeros(3)))  # full limits now
    assert out.headers[3]["code"] == 250
    s.data_received(auth_frame(out.headers[0], rid=6))
    assert out.headers[4]["code"] == 503 and not out.closed


def test_session_refuses_a_payload_pipelined_before_the_auth_reply():
    s, out = session(token=TOKEN)
    s.data_received(auth_frame(out.headers[0]) + raw_frame(2, "PUT", "b", torch.ones(3)))
    assert [h["code"] for h in out.headers[1:]] == [230, 530] and out.closed
    assert s.state.store.listing() == {}


@pytest.mark.parametrize("change", ["proof", "nonce", "mech", "token"])
def test_session_wrong_auth_closes(change):
    s, out = session(token=TOKEN)
    good = FrameDecoder().feed(auth_frame(out.headers[0], token="another-token" if change == "token" else TOKEN))
    header = dict(good[0].header)
    if change == "proof":
        header["proof"] = bytes(32)
    elif change == "nonce":
        header["nonce"] = b"short"
    elif change == "mech":
        header["mech"] = "plain"
    s.data_received(frame_head(header, 0))
    assert out.headers[-1]["code"] == 530 and out.headers[-1]["id"] == 1 and out.closed


def test_session_without_token_refuses_auth_with_503():
    s, out = session()
    assert "auth" not in out.headers[0] and "nonce" not in out.headers[0]
    s.data_received(frame_head({"op": "AUTH", "id": 1, "mech": auth.MECHANISM, "nonce": bytes(32),
                                "proof": bytes(32)}, 0) + raw_frame(2, "NOOP"))
    assert out.headers[1]["code"] == 503 and out.headers[2] == {"code": 200, "id": 2} and not out.closed


def test_session_time_limits():
    s, out = session(idle_timeout=1.0)  # not listening: closed when idle
    s.tick(100.0)
    s.tick(100.9)
    assert not out.closed
    s.data_received(raw_frame(1, "NOOP"))
    s.tick(101.5)  # heard since the last tick: the silence starts again
    s.tick(102.4)
    assert not out.closed
    s.tick(102.6)
    assert out.headers[-1]["code"] == 421 and out.closed

    s, out = session(idle_timeout=1.0)  # listening: pinged, kept
    s.data_received(raw_frame(1, "LISTEN", "b"))
    s.tick(0.0)
    s.tick(1.0)
    s.tick(1.5)
    s.tick(2.0)
    pings = [h for h in out.headers if h["code"] == 110]
    assert len(pings) == 2 and pings[0] == {"code": 110, "id": 0, "msg": "keepalive"} and not out.closed
    s, out = session(idle_timeout=1.0)
    s.tick(0.0)
    s.tick(5.0, sending=True)  # a reply still going out is not idleness
    assert not out.closed

    s, out = session(token=TOKEN, auth_timeout=2.0, idle_timeout=0)
    s.tick(10.0)
    s.data_received(raw_frame(1, "NOOP")[:10])  # bytes, but no authentication
    s.tick(11.9)
    assert not out.closed
    s.tick(12.0)
    assert out.headers[-1] == {"code": 530, "id": 0, "msg": "authentication timed out"} and out.closed


def test_server_token_sources(tmp_path, monkeypatch):
    from tensorshare_server import ServerConfig

    monkeypatch.delenv("TENSORSHARE_TOKEN", raising=False)
    assert ServerConfig().auth_token() is None
    monkeypatch.setenv("TENSORSHARE_TOKEN", " from-env ")
    assert ServerConfig().auth_token() == b"from-env"
    path = tmp_path / "t"
    path.write_text("from-file\n")
    assert ServerConfig(token_file=str(path)).auth_token() == b"from-file"
    assert ServerConfig(token="given", token_file=str(path)).auth_token() == b"given"
    assert "given" not in repr(ServerConfig(token="given"))
    with pytest.raises(UsageError):
        ServerConfig(token="  ").auth_token()


def test_session_connection_limit():
    first, _ = session(max_connections=1)
    second, out = session(state=first.state)
    assert out.headers == [{"code": 421, "id": 0, "msg": "too many connections; try again later"}] and out.closed
    second.connection_lost()
    first.connection_lost()
    third, out = session(state=first.state)
    assert out.headers[0]["code"] == 220 and first.state.connections == 1


def test_keepalive_decisions():
    from tensorshare.protocol.keepalive import DEAD, PROBE, Keepalive

    k = Keepalive(1.0)
    assert k.due(10.0, last_heard=9.5, last_sent=0.0) == (None, 10.5)
    assert k.due(10.0, last_heard=9.0, last_sent=9.8) == (None, 10.8)  # a request just went out
    assert k.due(10.6, last_heard=9.5, last_sent=0.0) == (PROBE, 11.6)
    k.probed(10.6)
    assert k.due(11.0, last_heard=9.5, last_sent=10.6) == (None, 11.6)
    assert k.due(11.6, last_heard=9.5, last_sent=10.6) == (DEAD, 11.6)
    k = Keepalive(1.0)
    k.probed(10.0)
    assert k.due(10.5, last_heard=10.2, last_sent=10.0) == (None, 11.2)  # answered: quiet again from 10.2
    assert k.probe_at is None
    k = Keepalive(1.0)
    k.probed(10.0)
    k.hold(20.0)  # a request asked the server to hold it: the probe's reply waits behind it
    assert k.due(11.5, last_heard=9.0, last_sent=10.0) == (None, 20.0)
    assert k.due(20.0, last_heard=9.0, last_sent=10.0) == (PROBE, 21.0)  # past the hold: probe again
    k.probed(20.0)
    assert k.due(21.0, last_heard=9.0, last_sent=20.0) == (DEAD, 21.0)


def test_a_request_waiting_in_the_server_outlasts_the_keepalive(server):
    """The keepalive probe queues behind an APPEND held by the server: silence then
    is no sign of a dead server."""
    with tensorshare.Client("127.0.0.1", server.port, keepalive=0.3, timeout=10) as c:
        c.delete("s-held") if "s-held" in c.list() else None
        c.append("s-held", 1)
        start = time.monotonic()
        with pytest.raises(tensorshare.errors.BusyError):
            c.append("s-held", 2, below=1, timeout=1.5)
        assert time.monotonic() - start >= 1.4
        assert c.peek("s-held") == [1]


# --------------------------------------------------------------- authentication


def test_right_token_works(auth_server):
    with tensorshare.Client("127.0.0.1", auth_server.port, token=TOKEN, timeout=10) as c:
        c.put("s-ok", {"t": torch.arange(4)})
        assert torch.equal(c.peek("s-ok")[0]["t"], torch.arange(4))


def test_token_from_environment(auth_server, monkeypatch):
    monkeypatch.setenv("TENSORSHARE_TOKEN", TOKEN)
    with tensorshare.connect("127.0.0.1", auth_server.port, timeout=10) as c:
        assert c.ping() < 5


def test_wrong_or_missing_token_is_refused(auth_server):
    with pytest.raises(NotAuthenticatedError) as info:
        tensorshare.Client("127.0.0.1", auth_server.port, token="not-the-token", connect_timeout=5)
    assert info.value.code == 530 and "failed" in str(info.value)
    with pytest.raises(NotAuthenticatedError, match="requires a token"):
        tensorshare.Client("127.0.0.1", auth_server.port, connect_timeout=5)
    with pytest.raises(AuthenticationError):  # connect() does not retry it
        tensorshare.connect("127.0.0.1", auth_server.port, token="not-the-token", retry_for=30)


def test_wrong_proof_gets_530_and_close(auth_server):
    raw = RawConnection(auth_server.port)
    raw.send(auth_frame(raw.greeting.header, token="not-the-token", rid=9))
    assert raw.read_frame().header == {"code": 530, "id": 9, "msg": "authentication failed"}
    assert raw.closed_by_peer()
    raw.close()


def test_nothing_served_before_auth(auth_server):
    raw = RawConnection(auth_server.port)
    raw.send(raw_frame(1, "PUT", "s-sneaky", torch.ones(1000)))
    reply = raw.read_frame().header
    assert reply["code"] == 530 and "authentication required" in reply["msg"]
    assert raw.closed_by_peer()
    raw.close()
    raw = RawConnection(auth_server.port)
    raw.send(raw_frame(2, "PUT", "s-sneaky", None) + raw_frame(3, "LIST"))  # no payload: its own id
    assert raw.read_frame().header == {"code": 530, "id": 2, "msg": "authentication required"}
    assert raw.closed_by_peer() and not raw.frames  # LIST was not answered
    raw.close()
    with tensorshare.Client("127.0.0.1", auth_server.port, token=TOKEN) as c:
        assert "s-sneaky" not in c.list()


class RecordingProxy(OneConnectionServer):
    """A loopback TCP proxy to ``port`` that records what the client sends."""

    def __init__(self, port: int):
        self.target = port
        self.sent = bytearray()
        super().__init__()

    def serve(self, client: socket.socket) -> None:
        client.settimeout(None)
        upstream = socket.create_connection(("127.0.0.1", self.target))

        def pump(src, dst, record):
            try:
                while data := src.recv(1 << 16):
                    if record:
                        self.sent += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock in (src, dst):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        pump(client, upstream, True)
        back.join(10)
        upstream.close()


def test_token_never_crosses_the_wire(auth_server):
    proxy = RecordingProxy(auth_server.port)
    # (zero_copy=False: over TCP through the proxy, not the server's same-host Unix socket)
    with tensorshare.Client("127.0.0.1", proxy.port, token=TOKEN, timeout=10, zero_copy=False) as c:
        c.put("s-wire", "payload")
    proxy.close()
    sent = bytes(proxy.sent)
    assert b"AUTH" in sent and b"s-wire" in sent  # the capture is real
    for form in (TOKEN.encode(), TOKEN.encode().hex().encode(), auth.token_bytes(TOKEN)[:12]):
        assert form not in sent


class FakeAuthServer(OneConnectionServer):
    """Asks for a token like tensorshare, then answers AUTH with a made-up proof:
    a server that would accept anyone."""

    def serve(self, conn: socket.socket) -> None:
        conn.sendall(frame_head({"code": 220, "id": 0, "msg": "hi", "auth": auth.MECHANISM,
                                 "nonce": auth.new_nonce()}, 0))
        decoder = FrameDecoder()
        try:
            while data := conn.recv(1 << 16):
                for frame in decoder.feed(data):
                    conn.sendall(frame_head({"code": 230, "id": frame.header["id"], "proof": bytes(32)}, 0))
        except OSError:
            pass


def test_client_is_not_fooled_by_a_server_without_the_token():
    fake = FakeAuthServer()
    try:
        with pytest.raises(UntrustedServerError, match="does not know the token"):
            tensorshare.Client("127.0.0.1", fake.port, token=TOKEN, connect_timeout=5)
    finally:
        fake.close()
    with FakeServer() as plain:  # asks for no token at all
        with pytest.raises(UntrustedServerError, match="asks for no token"):
            tensorshare.Client("127.0.0.1", plain.port, token=TOKEN, connect_timeout=5)


def test_callback_client_with_token(auth_server):
    from tensorshare import TensorShare

    replies = []
    done = threading.Event()
    with TensorShare("127.0.0.1", auth_server.port, token=TOKEN, timeout=10) as ts:
        ts.put("s-compat", torch.ones(2), callback=replies.append)
        ts.peek("s-compat", callback=lambda r: (replies.append(r), done.set()))
        assert done.wait(10)
    assert replies[0] == {"status": "OK"}
    assert replies[1]["status"] == "OK" and torch.equal(replies[1]["data"], torch.ones(2))
    with pytest.raises(NotAuthenticatedError):
        TensorShare("127.0.0.1", auth_server.port, token="not-the-token", connect_timeout=5)


def test_rl_peers_pass_the_token_on(auth_server):
    from tensorshare import RLTrainer, RLWorker

    with RLTrainer("127.0.0.1", auth_server.port, experiment="s-rl", token=TOKEN) as trainer, \
            RLWorker("127.0.0.1", auth_server.port, experiment="s-rl", token=TOKEN) as worker:
        trainer.publish_parameters({"w": torch.ones(2)})
        assert torch.equal(worker.await_new_parameters(timeout=10)["w"], torch.ones(2))
        worker.add_data(7)
        assert trainer.get_data(timeout=10) == [7]
    with RLTrainer("127.0.0.1", 0, host_server=True, experiment="s-rl", token=TOKEN) as trainer:
        with pytest.raises(NotAuthenticatedError):  # the hosted server asks for the trainer's token
            tensorshare.Client("127.0.0.1", trainer.server.port)


@pytest.mark.process
def test_reconnect_reauthenticates_and_a_changed_token_is_final(token_file, tmp_path):
    proc = ServerProcess("--token-file", token_file)
    try:
        c = tensorshare.Client("127.0.0.1", proc.port, token=TOKEN, timeout=10, connect_timeout=2)
        seen = []
        c.listen("s-re", seen.append)
        proc.restart()  # same port, same token: the client authenticates again by itself
        assert wait_for(lambda: any(n.op == "LISTEN" for n in seen), timeout=15)
        c.append("s-re", 1)
        assert wait_for(lambda: seen[-1].op == "APPEND")
        assert c.peek("s-re") == [1]

        other = tmp_path / "other-token"
        other.write_text("a-different-token-0123456789")
        proc.args = ["--token-file", str(other)]
        proc.restart()
        assert wait_for(lambda: c.router.home.engine.failure is not None, timeout=15)  # the reader tried and gave up
        with pytest.raises(NotAuthenticatedError):
            c.peek("s-re")
        time.sleep(1.0)  # no reconnect loop hammering the server meanwhile
        c.close()
    finally:
        proc.stop()
    assert proc.stderr.count("authentication failed") == 1, proc.stderr  # one try, then final


# --------------------------------------------------------------- TLS


def test_tls_round_trip_of_a_large_tensor(tls_server, certs):
    big = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    with tensorshare.Client("127.0.0.1", tls_server.port, token=TOKEN, tls_ca=certs.ca, timeout=60) as c:
        assert c.router.home.link.tls and c.router.home.local is None  # (a TLS server names no Unix socket)
        seen = []
        c.listen("s-tls", seen.append)
        c.put("s-tls", big)
        [back] = c.get("s-tls")
        assert torch.equal(back, big)
        assert wait_for(lambda: [n.op for n in seen] == ["PUT", "GET"])
    with tensorshare.Client("localhost", tls_server.port, token=TOKEN, tls_fingerprint=certs.fingerprint) as c:
        c.put("s-tls-pin", torch.arange(10))  # pinned: no CA needed
        assert torch.equal(c.peek("s-tls-pin")[0], torch.arange(10))


def test_wrong_certificate_is_refused(tls_server, certs):
    with pytest.raises(UntrustedServerError, match="not the pinned one"):
        tensorshare.Client("127.0.0.1", tls_server.port, token=TOKEN, tls_fingerprint=certs.other_fingerprint)
    with pytest.raises(UntrustedServerError, match="not trusted"):  # the system's CAs do not know ours
        tensorshare.Client("127.0.0.1", tls_server.port, token=TOKEN, tls=True)
    with pytest.raises(UsageError):
        tensorshare.Client("127.0.0.1", tls_server.port, tls_fingerprint="12:34")


def test_plaintext_client_against_tls_server_fails_cleanly(tls_server):
    start = time.monotonic()
    with pytest.raises(ConnectionLostError, match="tls=True"):
        tensorshare.Client("127.0.0.1", tls_server.port, token=TOKEN, connect_timeout=1)
    assert time.monotonic() - start < 3


def test_tls_client_against_plaintext_server_fails_cleanly(auth_server, certs):
    start = time.monotonic()
    with pytest.raises(WrongServerError, match="is a tensorshare server without TLS: connect without tls="):
        tensorshare.Client("127.0.0.1", auth_server.port, token=TOKEN, tls_ca=certs.ca, connect_timeout=5)
    assert time.monotonic() - start < 3


@pytest.mark.process
def test_tls_connections_never_take_the_direct_send_path(certs):
    """FrameWriter sends small replies straight to a plain TCP socket; on TLS that
    would bypass the encryption."""
    from twisted.internet import reactor
    from twisted.internet.threads import blockingCallFromThread
    from tensorshare_server import EmbeddedServer

    def writers(server):
        factory = server._port.factory
        factory = getattr(factory, "wrappedFactory", factory)
        return [proto.writer._socket for proto in factory.live]

    with EmbeddedServer(port=0, tls_cert=certs.cert, tls_key=certs.key) as tls, EmbeddedServer(port=0) as plain:
        with tensorshare.Client("127.0.0.1", tls.port, tls_ca=certs.ca) as c, \
                tensorshare.Client("127.0.0.1", plain.port) as p:
            c.put("x", torch.zeros(1 << 20))
            assert torch.equal(c.peek("x")[0], torch.zeros(1 << 20))
            p.ping()  # the plain server has its connection open too
            assert blockingCallFromThread(reactor, writers, tls) == [None]
            assert blockingCallFromThread(reactor, writers, plain)[0] is not None  # the check can fail


# --------------------------------------------------------------- limits and keepalive


def first_reply(port: int) -> tuple[dict, bool]:
    """The first frame a new connection gets, and whether the server then closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        decoder, frames = FrameDecoder(), []
        while not frames:
            data = sock.recv(1 << 16)
            assert data, "closed without a word"
            frames = decoder.feed(data)
        sock.settimeout(0.5)
        try:
            closed = sock.recv(1 << 16) == b""
        except socket.timeout:
            closed = False
        return frames[0].header, closed


@pytest.mark.process
def test_max_connections_gets_421():
    proc = ServerProcess("--max-connections", "2")
    try:
        first, second = RawConnection(proc.port), RawConnection(proc.port)
        header, closed = first_reply(proc.port)
        assert header["code"] == 421 and "too many connections" in header["msg"] and closed
        with pytest.raises(ServerUnavailableError):
            tensorshare.Client("127.0.0.1", proc.port)
        first.close()
        assert wait_for(lambda: first_reply(proc.port)[0]["code"] == 220)  # a slot is free again
        second.close()
    finally:
        proc.stop()


@pytest.mark.process
def test_idle_timeout_drops_idle_connections_but_keeps_listeners():
    proc = ServerProcess("--idle-timeout", "0.5")
    try:
        start = time.monotonic()
        idle, listener = RawConnection(proc.port), RawConnection(proc.port)
        listener.send(raw_frame(1, "LISTEN", "s-idle"))
        assert listener.read_frame().header["code"] == 200
        reply = idle.read_frame().header
        assert reply["code"] == 421 and "idle" in reply["msg"] and idle.closed_by_peer()
        assert 0.45 < time.monotonic() - start < 5
        assert listener.read_frame().header == {"code": 110, "id": 0, "msg": "keepalive"}
        assert listener.read_frame().header["code"] == 110  # still there, pinged again
        listener.send(raw_frame(2, "NOOP"))
        assert listener.read_frame().header == {"code": 200, "id": 2}
        idle.close()
        listener.close()

        with tensorshare.Client("127.0.0.1", proc.port, timeout=10) as c:
            c.put("s-idle", 1)
            time.sleep(1.25)  # the server closes the idle connection meanwhile
            assert c.peek("s-idle") == [1]  # and the next call opens a new one unnoticed
    finally:
        proc.stop()


def test_keepalive_detects_a_silent_server():
    with FakeServer() as fake:  # greets, then never answers
        c = tensorshare.Client("127.0.0.1", fake.port, timeout=None, keepalive=0.3, reconnect=False)
        start = time.monotonic()
        with pytest.raises(ConnectionLostError, match="keepalive"):
            c.ping()  # no timeout: only the keepalive ends it
        assert time.monotonic() - start < 3
        c.close()


def test_listening_client_detects_a_stopped_server_and_recovers(fresh_server):
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=5, connect_timeout=1, keepalive=0.5)
    seen = []
    c.listen("s-stop", seen.append)
    os.kill(fresh_server.pid, signal.SIGSTOP)  # the kernel still ACKs; the process is silent
    try:
        assert wait_for(lambda: not c.connected, timeout=5)  # probed, no answer, dropped
    finally:
        os.kill(fresh_server.pid, signal.SIGCONT)
    assert wait_for(lambda: any(n.op == "LISTEN" for n in seen), timeout=15)
    c.append("s-stop", 1)
    assert wait_for(lambda: seen[-1].op == "APPEND")
    c.close()


def test_sender_detects_a_server_that_stopped_reading(fresh_server):
    c = tensorshare.Client("127.0.0.1", fresh_server.port, timeout=None, keepalive=0.3, reconnect=False,
                          zero_copy=False)  # the bytes must go through the socket
    c.ping()
    os.kill(fresh_server.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionLostError, match="took no bytes"):
            c.put("s-stall", torch.zeros(64 << 20, dtype=torch.uint8))  # more than the socket buffers hold
        assert time.monotonic() - start < 10
    finally:
        os.kill(fresh_server.pid, signal.SIGCONT)
    c.close()


# --------------------------------------------------------------- the AsyncClient




def run_async(*args) -> None:
    script = os.path.join(os.path.dirname(__file__), "async_procs.py")
    result = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and f"{args[0]} ok" in result.stdout, result.stdout + result.stderr[-3000:]


def test_async_client_token_and_tls(tls_server, auth_server, certs):
    run_async("tls", tls_server.port, TOKEN, certs.ca, certs.fingerprint, certs.other_fingerprint)
    run_async("plain", auth_server.port, TOKEN, certs.ca)


@pytest.mark.process
def test_async_client_reauthenticates_and_stops_at_a_refusal():
    run_async("final", 0, TOKEN)


@pytest.mark.process
def test_async_client_close_ends_tls_connections(certs):
    run_async("close", 0, certs.cert, certs.key, certs.ca)


# --------------------------------------------------------------- the command line


@pytest.mark.process
def test_cli_security_options(certs, tmp_path):
    def server(*args):
        return subprocess.run([sys.executable, "-m", "tensorshare_server", "--port", "0", *args],
                              capture_output=True, text=True, timeout=60)

    out = server("--help")
    for option in ("--token-file", "--tls-cert", "--tls-key", "--max-connections", "--idle-timeout",
                   "--auth-timeout", "TENSORSHARE_TOKEN"):
        assert option in out.stdout
    missing = server("--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "cannot read the token file" in missing.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "token is empty" in server("--token-file", str(empty)).stderr
    mismatch = server("--tls-cert", certs.ca, "--tls-key", certs.key)  # the CA's certificate, the server's key
    assert mismatch.returncode == 2 and "bad TLS certificate or key" in mismatch.stderr
    assert "needs tls_cert" in server("--tls-key", certs.key).stderr
