"""A relay's connections to its upstream: the client engine's third driver, on raw values, torch-free.

A server process loads neither torch nor the client library, relays included, and a
relay needs little of a client: requests whose replies it passes on or installs
raw (never decoded), listens, and a copy's payload received where it says.  So it
drives the clients' own engine (:mod:`tensorshare.protocol.engine`: calls in flight
checked by declaration, notifications, listens restored on every new connection,
keepalive, backoff) through the Twisted driver both Twisted ends share
(:mod:`tensorshare.drivers.twisted`) and routes with the clients' own
:class:`~tensorshare.protocol.router.Router`: one connection, or one per worker of a
multi-worker upstream, each request where its verb's declaration routes it (to the
worker that owns its bin, where its listen lives too; LIST to every worker, their
bins merged).

:class:`Upstream` is what the follower talks to.  It connects (retrying until the
upstream answers) and keeps every connection up.  Calls in flight when one drops
fail with :class:`ConnectionLostError`; nothing is sent twice, except a request
refused with 427, sent once more to its owner once the workers are mapped again
(nothing changed on a 427).  A connection greeted by another worker than it was
opened for, a worker that cannot be reached and a 427 make the relay map the
workers again from the upstream's address (one mapping at a time); listens move
to their bins' new owners, which listen again once connected.  A refused
authentication is final (``on_refused``).  A payload is received into one
``bytearray`` (:class:`ArraySink`), unless ``arriving`` gives a sink for a copy of a
bin (cut-through, :mod:`.stream`).

A request the upstream may hold (one with ``wait``, PROTOCOL.md §4.5) goes on a
connection of its own (:meth:`Upstream.call_alone`), never on the one every other
request of the relay takes, which it would hold up for as long as it waits (the
requests of a connection are answered in order).  Cancelling it closes that
connection, and the upstream drops the request unrun, as it does any client's that
goes: a relay's client that goes while its GET waits takes nothing.  A connection
whose request was answered serves the next one (:data:`SPARE` kept idle per worker).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

from twisted.internet import defer

from tensorshare.drivers.twisted import Options, Remapper, TwistedMember, Wire, first_error, open_wire, start_members
from tensorshare.errors import AuthenticationError, ConnectionLostError, ProtocolError, RemoteError, WrongWorkerError
from tensorshare.protocol.engine import Call, Notice, RawValue, Restored, frame_of, next_request_id
from tensorshare.protocol.messages import ITEMS, LISTEN, NOTIFY, PEEK, Command, Key, Route
from tensorshare.protocol.placement import WorkerMap
from tensorshare.protocol.router import Router
from tensorshare.protocol.tls import TLSSettings
from tensorshare.wire.frames import Frame

log = logging.getLogger("tensorshare.server.relay")

INCOMING = "INCOMING"  # the op of the notification that announces (or carries) a copy arriving (§11)
_PREFIX = "relay: upstream "
SPARE = 8  # idle connections of their own (call_alone) kept per worker for the next requests that may wait
SPARE_IDLE_S = 60.0  # seconds such a spare connection is kept idle before it is closed


class ArraySink:
    """A payload received into one ``bytearray``; the frame's payload is a read-only view of it."""

    def __init__(self, nbytes: int):
        self.array = bytearray(nbytes)
        self._view = memoryview(self.array)
        self._filled = 0

    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def filled(self) -> int:
        """Bytes received so far."""
        return self._filled

    def write(self, data) -> None:
        n = len(data)
        self._view[self._filled:self._filled + n] = data
        self._filled += n

    def finish(self):
        return self._view.toreadonly()


class Reply:
    """An upstream's success reply: its header and its frame (payload undecoded)."""

    __slots__ = ("header", "frame")

    def __init__(self, header: dict, frame: Frame):
        self.header, self.frame = header, frame


class _Call(Call):
    __slots__ = ("deferred",)


class _Listen:
    """One listen of the relay: a bin and the callback of its notifications."""

    __slots__ = ("bin", "callback", "every_append", "stopping")

    def __init__(self, name: str, callback: Callable):
        self.bin, self.callback = name, callback
        self.every_append, self.stopping = True, False


class Upstream:
    """The relay's connections to its upstream (see the module docstring).

    Hooks the relay sets: ``on_ready()`` once every connection is up (the first time
    and each time again), ``on_lost(reason, serves)`` when one drops (``serves(bin)``:
    whether that bin's copies travelled on it), ``on_refused(error)`` when the
    upstream refuses the relay, ``arriving(bin, header, nbytes)`` for the sink of a
    copy of a bin (None: an :class:`ArraySink`)."""

    def __init__(self, reactor, host: str, port: int, *, token: bytes | None = None, tls: TLSSettings | None = None,
                 connect_timeout: float = 10.0, keepalive: float | None = 15.0, max_backoff: float = 2.0):
        self.reactor, self.host, self.port = reactor, host, port
        self.options = Options(reactor, host, token=token, tls=tls, connect_timeout=connect_timeout,
                               keepalive=keepalive, max_backoff=max_backoff, probe_peer=False, log_prefix=_PREFIX,
                               sinks=lambda header, nbytes: ArraySink(nbytes))
        self.on_ready: Callable[[], None] | None = None
        self.on_lost: Callable[[str, Callable[[str], bool]], None] | None = None
        self.on_refused: Callable[[BaseException], None] | None = None
        self.arriving: Callable | None = None
        self.router = Router(self._member, port)
        self.remapper = Remapper(self.options, self.router)
        self._pending: dict[str, _Listen] = {}  # listens sent, not answered yet (restored if their connection drops)
        self._bootstrap = self.options.engine(port)  # (its backoff paces the attempts at a first connection)
        self._bootstrap_timer = None
        self._closed = False
        self._alone: set[TwistedMember] = set()  # connections of their own (call_alone), busy or spare
        self._spare: dict[int, list[TwistedMember]] = {}  # port -> those idle, the most recently used last
        self._spare_timers: dict[TwistedMember, object] = {}  # an idle one's: closes it once idle too long

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def map(self) -> WorkerMap | None:
        return self.router.map

    @property
    def connected(self) -> bool:
        """Whether the connection to every worker of the upstream is open."""
        members = self.router.members
        return bool(members) and all(m is not None and m.connected for m in members)

    def reaches(self, name: str | None) -> bool:
        """Whether the connection to the worker that owns bin ``name`` is open (None:
        :attr:`connected`).  One worker restarting leaves the others' bins reachable."""
        router = self.router
        if name is None or router.map is None or not router.members:
            return self.connected
        member = router.members[router.map.owner(name)]
        return member is not None and member.connected

    # -- connecting

    def start(self) -> None:
        """Connect (and keep connecting whenever a connection drops)."""
        self._bootstrap_timer = None
        if self._closed:
            return
        open_wire(self.options, self.port, self.options.engine(self.port)).addCallbacks(self._greeted, self._unreached)

    def _greeted(self, wire: Wire) -> None:
        if self._closed:
            wire.close()
            return
        try:
            self.router.start(wire.engine.greeting, wire)
        except ProtocolError as exc:
            log.warning("%s%s: %s", _PREFIX, self.where, exc)
            wire.close()
            self._start_later()
            return
        start_members(self.router).addErrback(lambda failure: None)  # (each keeps trying by itself)

    def _unreached(self, failure) -> None:
        if self._closed:
            return
        if failure.check(AuthenticationError):  # final: a relay does not hammer an upstream that will not have it
            if self.on_refused is not None:
                self.on_refused(failure.value)
            return
        log.info("%s%s unreachable (%s); trying again", _PREFIX, self.where, failure.getErrorMessage())
        self._start_later()

    def _start_later(self) -> None:
        self._bootstrap_timer = self.reactor.callLater(self._bootstrap.retry_delay(), self.start)

    def close(self) -> None:
        self._closed = True
        if self._bootstrap_timer is not None and self._bootstrap_timer.active():
            self._bootstrap_timer.cancel()
        self.remapper.closed = True
        for member in self.router.everyone():
            member.close()
        for member in list(self._alone):
            self._close_alone(member)

    def _member(self, index: int | None, port: int, opened: Wire | None) -> TwistedMember:
        member = TwistedMember(self.options, index, port, opened)
        member.engine.use_sinks(partial(self._sink, member))
        member.answered = _settle
        member.notified = _notified
        member.restored = self._restored
        member.on_ready = self._ready
        member.on_lost = self._lost
        member.on_refused = lambda member, error: self.on_refused is not None and self.on_refused(error)
        member.fits = self.remapper.fits
        member.on_unreached = self.remapper.unreached
        return member

    def _ready(self, member: TwistedMember) -> None:
        if self.on_ready is not None:  # (each worker's connection: its bins are reachable again)
            self.on_ready()

    def _lost(self, member: TwistedMember, reason: str) -> None:
        if self.on_lost is not None:
            self.on_lost(reason, lambda name: member not in self.router.members or self.router.owner(name) is member)

    # -- requests, where their declarations route them

    def call(self, command: Command, fields: dict, value: tuple | None = None,
             timeout: float | None = None) -> defer.Deferred:
        """Send a request; a Deferred of its :class:`Reply`, or of the error (the
        upstream's refusal as a :class:`RemoteError`, :class:`ConnectionLostError`,
        :class:`TimeoutError` after ``timeout`` seconds).  ``value``: ``(description,
        payload parts, payload bytes)`` of a verb that carries one, sent as it came."""
        router = self.router
        if router.home is None:
            raise ConnectionLostError(f"not connected to upstream {self.where}")
        if command.route is Route.OWNER:
            seen = router.map
            d = self._send(router.owner(fields[Key.BIN]), command, fields, value, timeout)
            if seen is None:
                return d
            return d.addErrback(self._wrong_worker, seen,
                                lambda: self._send(self.router.owner(fields[Key.BIN]), command, fields, value, timeout))
        members = router.all() if command.route is Route.MERGE else [router.home]  # (EVERY: the relay sends none)
        if len(members) == 1:
            return self._send(members[0], command, fields, value, timeout)
        d = defer.gatherResults([self._send(m, command, fields, value, timeout) for m in members],
                                consumeErrors=True)
        d.addCallback(lambda replies: Reply(router.merged(command, [reply.header for reply in replies]),
                                            replies[0].frame))
        return d.addErrback(first_error)

    def _send(self, member: TwistedMember, command: Command, fields: dict, value: tuple | None,
              timeout: float | None, handle: _Listen | None = None,
              canceller: Callable | None = None) -> defer.Deferred:
        call = _Call(next_request_id(), command, fields)
        call.deferred = defer.Deferred(canceller)
        call.handle = handle
        parts = frame_of(call, None if value is None else RawValue(*value))
        member.send(call, parts, None if timeout is None else self.reactor.seconds() + timeout)
        return call.deferred

    def _wrong_worker(self, failure, seen: WorkerMap, resend: Callable[[], defer.Deferred]):
        """A 427: the workers changed since ``seen``; map them again and send the request
        once more (``resend()``), to its owner then."""
        failure.trap(WrongWorkerError)

        def again(changed: bool):
            if not changed:
                return failure
            return resend()

        return self.remapper.again(failure.getErrorMessage(), seen).addCallback(again)

    # -- requests the upstream may hold, each on a connection of its own

    def call_alone(self, command: Command, fields: dict, value: tuple | None = None,
                   timeout: float | None = None) -> defer.Deferred:
        """As :meth:`call`, for a request about a bin that the upstream may hold (one with
        ``wait``), sent on a connection of its own to the bin's worker (see the module
        docstring).  Cancelling the Deferred closes that connection: the upstream drops
        the request if it still holds it, and the Deferred fails."""
        router = self.router
        if router.home is None:
            raise ConnectionLostError(f"not connected to upstream {self.where}")

        def send() -> defer.Deferred:
            workers = self.router.map
            port = self.router.port_of(None if workers is None else workers.owner(fields[Key.BIN]))
            return self._aside(port).addCallback(self._send_alone, command, fields, value, timeout)

        seen = router.map
        d = send()
        return d if seen is None else d.addErrback(self._wrong_worker, seen, send)

    def _send_alone(self, member: TwistedMember, command: Command, fields: dict, value: tuple | None,
                    timeout: float | None) -> defer.Deferred:
        d = self._send(member, command, fields, value, timeout, canceller=lambda _: self._close_alone(member))

        def answered(result):
            # Answered (a refusal included): the connection is in step and serves the next
            # request; after anything else (lost, timed out, cancelled) it is closed.
            if isinstance(result, Reply) or result.check(RemoteError):
                self._keep_spare(member)
            else:
                self._close_alone(member)
            return result

        return d.addBoth(answered)

    def _aside(self, port: int) -> defer.Deferred:
        """A Deferred of a connection of its own to ``port`` with no request on it: a
        spare one, else a new one (cancelling the Deferred gives up on opening it)."""
        spare = self._spare.get(port)
        while spare:
            member = spare.pop()
            timer = self._spare_timers.pop(member)
            if timer.active():
                timer.cancel()
            if member.connected:
                return defer.succeed(member)
            self._close_alone(member)
        if self._closed:
            return defer.fail(ConnectionLostError(f"not connected to upstream {self.where}"))
        member = TwistedMember(self.options, None, port)
        member.answered = _settle
        member.on_lost = lambda member, reason: self._close_alone(member)
        self._alone.add(member)
        d = defer.Deferred(lambda d: self._close_alone(member))

        def opened(_) -> None:
            if not d.called:
                d.callback(member)

        def failed(failure) -> None:
            self._close_alone(member)  # (no retrying: the request fails, with 421)
            if not d.called:
                d.errback(failure)

        member.start().addCallbacks(opened, failed)
        return d

    def _keep_spare(self, member: TwistedMember) -> None:
        spare = self._spare.setdefault(member.port, [])
        if self._closed or member not in self._alone or not member.connected or len(spare) >= SPARE:
            self._close_alone(member)
            return
        spare.append(member)
        self._spare_timers[member] = self.reactor.callLater(SPARE_IDLE_S, self._close_alone, member)

    def _close_alone(self, member: TwistedMember) -> None:
        """Close a connection of its own (its request in flight, if any, fails)."""
        if member not in self._alone:
            return
        self._alone.discard(member)
        timer = self._spare_timers.pop(member, None)
        if timer is not None:  # (a spare one)
            if timer.active():
                timer.cancel()
            self._spare[member.port].remove(member)
        member.close()

    # -- listens

    def listen(self, name: str, callback: Callable[[dict, object], None]) -> defer.Deferred:
        """Listen to bin ``name``: ``callback(header, payload)`` for each notification
        (a copy's bytes as the payload of an ``INCOMING``), and, after each
        reconnection, with the bin's state then (``op`` ``LISTEN``).  A Deferred of
        the LISTEN reply's header (the snapshot)."""
        member = self.router.owner(name)
        if member is None:
            raise ConnectionLostError(f"not connected to upstream {self.where}")
        handle = _Listen(name, callback)
        fields = member.engine.listen_fields(handle)
        self._pending[name] = handle
        try:
            d = self._send(member, LISTEN, fields, None, None, handle)
        except ConnectionLostError:
            del self._pending[name]
            member.adopt(handle)  # listened to once connected
            raise

        def answered(result):
            # (on a reply the engine made the handle active as it arrived, before any later frame)
            if self._pending.get(name) is handle:
                del self._pending[name]
                if not isinstance(result, Reply) and result.check(ConnectionLostError):
                    self.router.owner(name).adopt(handle)  # listened to again once connected
            return result

        return d.addBoth(answered).addCallback(lambda reply: reply.header)

    def unlisten(self, name: str) -> None:
        """Listen to bin ``name`` no more (here at once; upstream once its UNLISTEN is in)."""
        self._pending.pop(name, None)
        member = self.router.owner(name)
        if member is None:
            return
        for handle in member.engine.listens.handles(name):
            stop = member.engine.stop_listening(handle)
            if stop is None or member.wire is None:
                member.engine.listens.remove(handle)
                continue
            self._send(member, *stop, None, None, handle).addErrback(
                lambda failure: log.info("relay: could not stop listening to %r upstream: %s", name,
                                         failure.getErrorMessage()))

    def listening(self, name: str) -> bool:
        """Whether bin ``name`` is listened to (or being: each new connection listens again)."""
        if name in self._pending:
            return True
        member = self.router.owner(name)
        return member is not None and name in member.engine.listens

    def _restored(self, event: Restored) -> None:
        if event.error is not None:
            log.warning("relay: could not listen to %r upstream again: %s", event.bin, event.error)
            return
        for handle in event.handles:
            handle.callback({**event.header, Key.BIN: event.bin, Key.OP: "LISTEN"}, None)

    # -- incoming payloads

    def _sink(self, member: TwistedMember, header: dict, nbytes: int):
        """The sink of a frame's payload: the relay's for a copy of a bin it wants to
        pass on as it arrives, else an :class:`ArraySink`."""
        if nbytes and self.arriving is not None:
            name = _copy_of(header, member.engine.calls)
            if name is not None:
                sink = self.arriving(name, header, nbytes)
                if sink is not None:
                    return sink
        return ArraySink(nbytes)


def _copy_of(header: dict, calls: dict) -> str | None:
    """The bin whose copy a frame carries: a 226 answering a PEEK ``incoming``, or an
    ``INCOMING`` notification; None for any other frame."""
    code, rid = header.get(Key.CODE), header.get(Key.ID)
    if code == NOTIFY and rid == 0 and header.get(Key.OP) == INCOMING and type(header.get(Key.BIN)) is str:
        return header[Key.BIN]
    if code == ITEMS and type(rid) is int:
        call = calls.get(rid)
        if call is not None and call.command is PEEK and call.fields.get(Key.INCOMING):
            return call.fields[Key.BIN]
    return None


def _settle(call: _Call) -> None:
    if call.error is not None:
        call.deferred.errback(call.error)
    else:
        call.deferred.callback(Reply(call.frame.header, call.frame))


def _notified(notice: Notice) -> None:
    for handle in notice.handles:
        try:
            handle.callback(notice.header, notice.frame.payload)
        except Exception:  # a bug of the relay's: the connection goes on
            log.exception("relay: handling a notification of %r failed", notice.bin)


__all__ = ["ArraySink", "INCOMING", "Reply", "Upstream"]
