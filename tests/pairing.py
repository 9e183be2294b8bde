"""The two ends of the protocol paired in memory, no socket, no reactor.

:class:`Pair` joins the client's sans-IO protocol (``tensorshare._client.connection``)
to a real :class:`ServerSession` over a real in-memory store: bytes the client
sends go to ``session.data_received`` (whole, or split as a test likes), frames
the session queues go to the client's decoder.  Microseconds per exchange, and
every edge reachable, as h11's tests pair two connections.

:func:`async_pair` does the same one level up: an :class:`~tensorshare.AsyncClient`
connected through Twisted's ``iosim`` transports to the real server protocol,
driven by a :class:`~twisted.internet.task.Clock`; :class:`PairedWorkers`, to the
real sessions of the workers of a multi-worker server, each behind its own port.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python import failure
from twisted.test import iosim

from tensorshare._client.connection import NO_VALUE, read_reply, request_frame
from tensorshare.protocol.engine import next_request_id
from tensorshare.protocol.handshake import CLIENT_FRAME_LIMITS, Handshake
from tensorshare.protocol.messages import Command
from tensorshare.protocol.placement import WorkerMap
from tensorshare.wire.frames import Frame, FrameDecoder
from tensorshare_server.config import ServerConfig
from tensorshare_server.net.service import TensorShareFactory
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import build_state
from wiretools import OutboxBase


class Outbox(OutboxBase):
    """A session's outbox that keeps the bytes of every frame queued."""

    def __init__(self):
        super().__init__()
        self.data = bytearray()

    def send(self, parts, on_abandon=None, on_written=None):
        for part in parts:
            self.data += part if type(part) is bytes else part.tobytes() if hasattr(part, "tobytes") else bytes(part)
        if on_written is not None:
            on_written()
        return None


class HeldJobs:
    """Disk jobs (server/bins/jobs.py's Jobs) that run when the test says (:meth:`release`)."""

    def __init__(self):
        self.queued = []

    def run(self, lane, fn, args=(), done=None):
        self.queued.append((fn, args, done))

    def run_threadsafe(self, lane, fn, args):
        self.run(lane, fn, args)

    def release(self):
        queued, self.queued = self.queued, []
        for fn, args, done in queued:
            try:
                result, error = fn(*args), None
            except Exception as exc:  # noqa: BLE001 - handed to done, as the real jobs do
                result, error = None, exc
            if done is not None:
                done(result, error)


class Opening(Handshake):
    """A client connection's opening (greeting, AUTH) and its frames, for :class:`Pair`."""

    def __init__(self, token: bytes | None):
        super().__init__(token, next_request_id)
        self.decoder = FrameDecoder(limits=CLIENT_FRAME_LIMITS)

    def feed(self, data: bytes) -> list[Frame]:
        return self.decoder.feed(data)


class Pair:
    """A client protocol and a server session joined in memory."""

    def __init__(self, token: bytes | str | None = None, *, same_host: bool = False, state=None, **config):
        self.state = state or build_state(ServerConfig(token=token, **config), clock=Clock())
        self.clock = self.state.waits.clock  # times requests that wait in the server: advance it
        self.outbox = Outbox()
        self.session = ServerSession(self.state, self.outbox, "pair", same_host=same_host)
        self.client = Opening(None if token is None else (token.encode() if isinstance(token, str) else token))
        self.session.connection_made()
        for frame in self.receive():
            request = self.client.opening(frame)
            if request is not None:
                self.session.data_received(request)
                for reply in self.receive():
                    self.client.opening(reply)

    def send(self, data: bytes, *, split: int | None = None) -> None:
        """Give the session ``data`` at once, or in pieces of ``split`` bytes."""
        if split is None:
            self.session.data_received(data)
            return
        for i in range(0, len(data), split):
            self.session.data_received(data[i : i + split])

    def send_request(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE) -> int:
        """Send one request without looking for its reply; returns its id."""
        rid = next_request_id()
        self.send(b"".join(bytes(p) for p in request_frame(rid, command, fields, value)))
        return rid

    def receive(self) -> list[Frame]:
        """Frames the session queued since the last call, decoded by the client."""
        data, self.outbox.data = bytes(self.outbox.data), bytearray()
        return self.client.feed(data) if data else []

    def call(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE, *,
             split: int | None = None):
        """Send one request the way the clients do; its reply, checked and decoded
        (the :class:`RemoteError` of an error reply is raised)."""
        rid = next_request_id()
        self.send(b"".join(bytes(p) for p in request_frame(rid, command, fields, value)), split=split)
        replies = [f for f in self.receive() if f.header.get("id") == rid]
        assert len(replies) == 1, replies
        return read_reply(command, replies[0])

    def close(self) -> None:
        self.session.connection_lost()
        self.state.storage.close()


def headers(frames: list[Frame]) -> list[dict]:
    return [frame.header for frame in frames]


def decode(data: bytes) -> list[dict]:
    return [frame.header for frame in FrameDecoder().feed(data)]


def result_of(d: defer.Deferred, pump) -> object:
    """Pump until ``d`` fires; its result (a failure is raised)."""
    out = []
    d.addBoth(out.append)
    pump.flush()
    assert out, "the Deferred did not fire"
    if isinstance(out[0], failure.Failure):
        out[0].raiseException()
    return out[0]


def async_pair(clock: Clock | None = None, *, client_options: dict | None = None, **config):
    """An AsyncClient connected in memory to a real server protocol.

    Returns ``(client, pump, clock, state)``; ``pump.flush()`` moves bytes both ways
    (advancing ``clock`` a little each time) until nothing is left to move.  The
    client's connector connects every (re)connection the same way, so a test can
    drop the connection (``client.router.home.wire.transport.loseConnection()``)
    and watch it come back."""
    from tensorshare import AsyncClient

    clock = clock or Clock()
    state = build_state(ServerConfig(**config))
    factory = TensorShareFactory(state, clock=clock)
    pumps: list = []

    def connector(wire) -> defer.Deferred:
        server = factory.buildProtocol(None)
        client_address, server_address = IPv4Address("TCP", "127.0.0.1", 40000 + len(pumps)), IPv4Address(
            "TCP", "127.0.0.1", 8000)
        server_transport = _ServerTransport(server, True, server_address, client_address)
        client_transport = iosim.FakeTransport(wire, False, client_address, server_address)
        pump = iosim.connect(server, server_transport, wire, client_transport, clock=clock, greet=False)
        pumps.append(pump)
        return defer.succeed(wire)

    options = {"timeout": 10.0, "keepalive": None, **(client_options or {})}
    client = AsyncClient(clock, "127.0.0.1", 0, options.pop("timeout"), None, 1.0, connector=connector, **options)
    opened = client._open()
    pump = _Pumps(pumps)
    pump.flush()
    result = []
    opened.addBoth(result.append)
    assert result and result[0] is None, result
    return client, pump, clock, state


class PairedWorkers:
    """N real worker states, each behind its own port, and a connector that pairs an
    AsyncClient's wires with the worker its port names (the public port: worker 0)."""

    PUBLIC = 8000

    def __init__(self, count: int, clock: Clock, **config):
        self.clock = clock
        self.config = config  # the workers' settings (ServerConfig's)
        self.pumps: list = []
        self.use(count)

    def use(self, count: int, base: int = 8001) -> None:
        """Serve with ``count`` workers on ports ``base``... from now on (a restart)."""
        self.workers = WorkerMap([base + k for k in range(count)], 0, f"run-{base}-{count}")
        self.states = []
        self.factories = {}
        for k in range(count):
            state = build_state(ServerConfig(**self.config), clock=self.clock)
            state.workers = WorkerMap(self.workers.ports, k, self.workers.id)  # (as app.listen makes a worker's)
            self.states.append(state)
            self.factories[self.workers.ports[k]] = TensorShareFactory(state, clock=self.clock)
        self.factories[self.PUBLIC] = self.factories[self.workers.ports[0]]

    def connector(self, wire) -> defer.Deferred:
        factory = self.factories.get(wire.client.port)
        if factory is None:
            return defer.fail(ConnectionRefusedError())
        server = factory.buildProtocol(None)
        here, there = IPv4Address("TCP", "127.0.0.1", 40000 + len(self.pumps)), IPv4Address(
            "TCP", "127.0.0.1", wire.client.port)
        pump = iosim.connect(server, _ServerTransport(server, True, there, here), wire,
                             iosim.FakeTransport(wire, False, here, there), clock=self.clock, greet=False)
        self.pumps.append(pump)
        return defer.succeed(wire)

    def client(self):
        """An AsyncClient of the public port, connected to every worker."""
        from tensorshare import AsyncClient

        client = AsyncClient(self.clock, "127.0.0.1", self.PUBLIC, 10.0, None, 0.2, keepalive=None,
                             connector=self.connector)
        self.run(client._open())
        return client

    def flush(self) -> None:
        _Pumps(self.pumps).flush(200)

    def run(self, d: defer.Deferred):
        """Pump until ``d`` fires; its result (or raise its failure)."""
        out = []
        d.addBoth(out.append)
        for _ in range(100):
            self.flush()
            if out:
                break
            self.clock.advance(0.05)
        assert out, "the Deferred never fired"
        if isinstance(out[0], failure.Failure):
            out[0].raiseException()
        return out[0]


class _ServerTransport(iosim.FakeTransport):
    """Twisted's fake transport with the ``connected`` flag a real TCP transport has
    (the server checks it before resuming reads)."""

    @property
    def connected(self) -> bool:
        return not self.disconnected


class _Pumps:
    """Pumps every connection made so far (a reconnection makes a new one)."""

    def __init__(self, pumps: list):
        self.pumps = pumps

    def flush(self, rounds: int = 50) -> None:
        for _ in range(rounds):
            moved = False
            for pump in list(self.pumps):
                moved |= bool(pump.pump())
            if not moved:
                return


class EnginePair:
    """A client :class:`~tensorshare.protocol.engine.Engine` joined in memory to a real
    server session over a real store (the engine's sans-IO life, byte for byte).

    :meth:`pump` moves bytes both ways until neither side has more, feeding the
    engine ``split`` bytes at a time if given, and returns the engine's events;
    :meth:`reconnect` gives the engine a fresh session on the same state, as after
    a lost connection."""

    def __init__(self, token: bytes | str | None = None, *, state=None, keepalive: float | None = None,
                 split: int | None = None, **config):
        from tensorshare.protocol.engine import Engine

        self.state = state or build_state(ServerConfig(token=token, **config), clock=Clock())
        key = token.encode() if isinstance(token, str) else token
        self.engine = Engine(key, "pair", keepalive=keepalive)
        self.split = split
        self.now = 0.0
        self.events: list = []
        self.reconnect()

    def reconnect(self, state=None) -> list:
        """A new connection (to ``state``'s server, if given); the opening's events."""
        if state is not None:
            self.state = state
        self.outbox = Outbox()
        self.session = ServerSession(self.state, self.outbox, "pair")
        self.engine.connected(self.now)
        self.session.connection_made()
        return self.pump()

    def send(self, parts) -> None:
        self.session.data_received(b"".join(bytes(p) for p in parts))

    def pump(self) -> list:
        events = []
        while True:
            for data in self.engine.take_outbox():
                self.session.data_received(data)
            data, self.outbox.data = bytes(self.outbox.data), bytearray()
            if not data:
                return events
            step = self.split or len(data)
            for i in range(0, len(data), step):
                events += self.engine.receive(data[i : i + step], self.now)

    def call(self, command, fields=None, value=None):
        """Send one call; the call, answered (its ``frame`` and ``error``)."""
        from tensorshare.protocol.engine import Call, next_request_id

        call = Call(next_request_id(), command, fields)
        self.send(self.engine.request(call, value))
        events = self.pump()
        assert call in events, events
        self.events += [e for e in events if e is not call]
        return call

    def lose(self) -> list:
        """The connection drops: the calls it failed."""
        self.session.connection_lost()
        return self.engine.lost(ConnectionError("gone"))
