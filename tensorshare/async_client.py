"""The asynchronous client for Twisted code: every method returns a Deferred.

It runs on the reactor the application already runs (nothing is started for you)
and shares everything but its transport with the blocking client: the verbs
(``_client/methods.py``), the call table, zero-copy routing, listen handles and
relistening (``_client/core.py``), the sans-IO protocol (``_client/connection.py``)
and the jittered backoff (``tensorshare/protocol/retry.py``).  Requests are pipelined on one
connection; listen callbacks run on the reactor thread, as Twisted code expects.
When the connection drops, pending Deferreds fail with
:class:`ConnectionLostError` at once, and the client reconnects with backoff
(authenticating again) and restores its listens.  TLS is Twisted's (pyOpenSSL); a
server silent for ``keepalive`` seconds is probed with NOOP and the connection
dropped if it stays silent as long again.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

from twisted.internet import defer
from twisted.internet.error import ConnectError
from twisted.internet.endpoints import SSL4ClientEndpoint, TCP4ClientEndpoint, connectProtocol

from ._client.calls import Call
from ._client.connection import DEFAULT_REUSE, NO_VALUE, next_request_id, request_frame
from ._client.core import ClientCore
from ._client.methods import DEFAULT
from ._client.options import DEFAULT_CONNECT_TIMEOUT, check_address, connect_timeout_for
from .protocol.retry import Backoff
from ._client.routing import finish
from ._client.twisted_wire import Wire
from ._client.workers import StaleMapError, Workers, finish_merged, same_reply
from ._client.zerocopy import SharedAreas
from .errors import (
    AuthenticationError, ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UsageError,
    WrongWorkerError,
)
from .protocol.messages import NOOP, Command, Route
from .protocol.peers import PROBE_AFTER
from .protocol.placement import WorkerMap
from .protocol.tls import TLSSettings
from .wire.frames import Frame

log = logging.getLogger("tensorshare.client")


class AsyncClient(ClientCore):
    """A tensorshare client whose methods return Deferreds.

    Create it with :meth:`connect`::

        client = yield AsyncClient.connect("127.0.0.1", 8000)
        yield client.put("bin", torch.ones(3))
        items = yield client.peek("bin")
        handle = yield client.listen("bin", print)   # handle.snapshot; yield handle.stop()
    """

    def __init__(self, reactor, host: str, port: int, timeout: float | None, device: Any, max_backoff: float, *,
                 connect_timeout: float | None = None, token: str | bytes | None = None,
                 tls: TLSSettings | None = None, keepalive: float | None = 15.0, reuse: int = DEFAULT_REUSE,
                 zero_copy: bool = True, connector: Callable[[Wire], defer.Deferred] | None = None):
        self._init_core(host, port, timeout=timeout, device=device, zero_copy=zero_copy, reuse=reuse, token=token,
                        tls=tls, keepalive=keepalive, lock=contextlib.nullcontext())  # one thread: the reactor's
        self.reactor = reactor
        self.max_backoff = max_backoff
        self.connect_timeout = connect_timeout_for(connect_timeout, timeout, DEFAULT_CONNECT_TIMEOUT)
        self._tls_options = None if tls is None else tls.twisted_options(host)
        self._failure: AuthenticationError | None = None  # final: no more connections after it
        self._keepalive_timer = None
        self._wire: Wire | None = None
        self._sweeper = None  # the one timer that expires calls
        self._sweep_at = 0.0  # when it runs
        self._backoff = Backoff(0.05, max_backoff)
        self._retry = None
        # Connects a new Wire to the server (a Deferred firing once connected):
        # Twisted's TCP or TLS endpoints unless given (tests pair the two ends in memory).
        self._connector = connector or self._connect_endpoint
        self._given_connector = connector  # (its members connect the same way: tests pair them in memory)
        self._front: AsyncClient | None = None  # the client this one is a member of (it routes to us)
        self._reuse = reuse  # (its members keep as much reply memory)
        self._opening: defer.Deferred | None = None  # a member's first connection, while it opens
        self._remapping: defer.Deferred | None = None

    @classmethod
    def connect(cls, host: str = "127.0.0.1", port: int = 8000, *, reactor=None, timeout: float | None = 60.0,
                device: Any = None, max_backoff: float = 2.0, connect_timeout: float | None = None,
                token: str | bytes | None = None, tls: bool | None = None, tls_ca: str | None = None,
                tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                reuse: int = DEFAULT_REUSE, zero_copy: bool = True) -> defer.Deferred:
        """Connect, authenticate if the server asks, and fire with the client.

        The options mean what they mean for :class:`tensorshare.Client`: opening a
        connection takes at most ``connect_timeout`` seconds (default: 10, or
        ``timeout`` if that is shorter); ``token`` defaults to
        the ``TENSORSHARE_TOKEN`` environment variable; ``tls``/``tls_ca``/
        ``tls_fingerprint`` choose TLS and whom to trust (needs the ``tls`` extra);
        ``reuse`` bounds the reply memory kept for reuse; ``zero_copy`` passes large
        values through the server's shared memory on its host; an
        :class:`AuthenticationError` is final (no reconnection).
        """
        if reactor is None:
            from twisted.internet import reactor
        try:
            check_address(host, port)
            settings = TLSSettings.from_options(tls, tls_ca, tls_fingerprint)
            client = cls(reactor, host, port, timeout, device, max_backoff, connect_timeout=connect_timeout,
                         token=token, tls=settings, keepalive=keepalive, reuse=reuse, zero_copy=zero_copy)
        except TensorShareError:
            return defer.fail()
        return client._open().addCallback(lambda _: client)

    def close(self) -> None:
        """Close the connection; pending Deferreds fail with ConnectionLostError."""
        self._closed = True
        self._listens.clear()
        if self._workers is not None:
            self._workers.close()
        for timer in (self._retry, self._sweeper, self._keepalive_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._retry = self._sweeper = self._keepalive_timer = None
        if self._buffers is not None:
            self._buffers.clear()
        if self._wire is not None:
            self._wire.flush()  # what was queued this turn still goes out
            self._wire.transport.unregisterProducer()  # TLS closes only without a producer
            self._wire.transport.loseConnection()

    @property
    def connected(self) -> bool:
        if self._workers is not None:
            return self._workers.home.connected
        return self._wire is not None

    @property
    def same_host(self) -> bool:
        """True while the connection uses same-host zero-copy."""
        if self._workers is not None:
            return self._workers.home.same_host
        return self._wire is not None and self._wire.conn.areas is not None

    @property
    def workers(self) -> int:
        """How many workers the server runs (``--workers``; PROTOCOL.md §14)."""
        return 1 if self._workers is None else self._workers.map.count

    def worker_of(self, bin: str) -> int | None:
        """The worker that serves ``bin`` (None: the server runs one process)."""
        return None if self._workers is None else self._workers.map.owner(bin)

    # -- calls

    def _call(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE, *, timeout=DEFAULT,
              then: Callable | None = None, on_reply: Callable | None = None, on_error: Callable | None = None,
              decode: bool = True, zero_copy: bool = True, progress: Callable | None = None, device: Any = None,
              into: Any = None) -> defer.Deferred:
        if progress is not None:
            raise UsageError("progress reports are for the blocking Client")
        if self._workers is not None:  # a member sends it, as the verb's declaration routes it (_client/workers.py)
            return self._routed_call(command, fields, value, dict(
                timeout=timeout, then=then, on_reply=on_reply, on_error=on_error, decode=decode, zero_copy=zero_copy,
                device=device, into=into))
        d = defer.Deferred()
        try:
            self._submit(command, fields, value, d, zero_copy=zero_copy, timeout=timeout, then=then,
                         on_reply=on_reply, on_error=on_error, decode=decode, device=device, into=into)
        except TensorShareError:
            return defer.fail()
        return d

    def _done(self, value: Any) -> defer.Deferred:
        return defer.succeed(value)

    def _later(self, fn: Callable, *args) -> None:
        self.reactor.callLater(0, fn, *args)

    def _submit(self, command: Command, fields: dict | None, value: Any, callback, *,
                zero_copy: bool = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, on_reply: Callable | None = None, decode: bool = True,
                raw: bool = False, inline: bool = False, device: Any = None, into: Any = None) -> None:
        """Send a call; ``callback`` is a ``callback(result, error)`` or a Deferred
        (``inline`` changes nothing here: callbacks run on the reactor thread)."""
        if self._closed:
            raise UsageError("the client is closed")
        if self._workers is not None:  # a member sends it, as the verb's declaration routes it (_client/workers.py)
            if command.route is Route.OWNER:
                self._workers.owner(fields)._submit(command, fields, value, callback, zero_copy=zero_copy,
                                                    timeout=timeout, then=then, on_error=on_error, on_reply=on_reply,
                                                    decode=decode, raw=raw, device=device, into=into)
                return
            d = self._routed_call(command, fields, value, dict(timeout=timeout, then=same_reply if raw else then,
                                                               on_error=on_error, decode=decode))
            if type(callback) is defer.Deferred:
                d.chainDeferred(callback)
            else:
                d.addCallbacks(lambda result: callback(result, None), lambda failure: callback(None, failure.value))
            return
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if self._wire is None:
            raise ConnectionLostError(f"not connected to {self._where} (reconnecting)")
        if self._buffers is not None:
            self._buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        areas = self._wire.conn.areas if zero_copy and decode and self.zero_copy else None
        timeout = self.timeout if timeout is DEFAULT else timeout
        deadline = None if timeout is None else self.reactor.seconds() + timeout
        call = self._new_call(command, fields, value, areas, callback, then, on_error, on_reply, deadline, decode, raw,
                              device=device, into=into)
        try:
            self._transmit(call, deadline)
        except BaseException:
            finish(call)
            raise

    def _transmit(self, call: Call, deadline: float | None, may_hold: bool = False) -> None:
        parts = self._request_parts(call)
        self._calls.add(call)
        self._wire.send(parts)
        if deadline is not None:
            self._sweep_by(deadline)

    def _complete(self, call: Call, outcome: Any) -> None:
        """Settle a call and call back, or send the attempt a zero-copy refusal calls for."""
        if type(outcome) is Frame and call.fallback is None and call.cleanup is None and call.then is None \
                and not call.raw and type(call.callback) is defer.Deferred:
            # The usual case (one attempt, the default result, a Deferred): no detours.
            try:
                result = self._read(call, outcome).result
            except TensorShareError as exc:
                if call.on_error is not None and call.on_error(exc):
                    call.callback.callback(None)
                else:
                    call.callback.errback(exc)
                return
            call.callback.callback(result)
            return
        settled = self._settle(call, outcome)
        if settled is not None:
            self._call_back(call, *settled)
            return
        try:
            if self._wire is None:
                raise ConnectionLostError(f"not connected to {self._where} (reconnecting)")
            self._transmit(call, call.deadline)
        except TensorShareError as exc:
            finish(call)
            self._call_back(call, None, exc)

    def _call_back(self, call: Call, reply, error) -> None:
        result, error = self._result(call, reply, error)
        target = call.callback
        if type(target) is defer.Deferred:
            if error is not None:
                target.errback(error)
            else:
                target.callback(result)
        else:
            target(result, error)

    def _connection(self):
        return None if self._wire is None else self._wire.conn

    # -- timeouts

    def _sweep_by(self, deadline: float) -> None:
        """Make sure the sweeper runs by ``deadline`` (one timer for all calls: a
        DelayedCall per request cost more than the rest of a small request)."""
        sweeper = self._sweeper
        if sweeper is not None:
            if self._sweep_at <= deadline:  # (the usual case: it runs earlier already)
                return
            if sweeper.active():
                sweeper.cancel()
        self._sweep_at = deadline
        self._sweeper = self.reactor.callLater(max(deadline - self.reactor.seconds(), 0.0), self._sweep)

    def _sweep(self) -> None:
        """Fail the calls whose deadline has passed."""
        self._sweeper = None
        now = self.reactor.seconds()
        for call in [call for call in self._calls if call.deadline is not None and call.deadline <= now]:
            self._calls.pop(call.rid)
            self._complete(call, TimeoutError(f"no reply from {self._where} in time"))
        deadlines = [call.deadline for call in self._calls if call.deadline is not None]
        if deadlines:
            self._sweep_by(max(min(deadlines), now + 0.01))

    # -- incoming frames

    def _frame_received(self, wire: Wire, frame) -> None:
        if wire is not self._wire:
            return
        jobs: list = []
        try:
            call = self._sort(frame, wire.conn, jobs)
        except ProtocolError as exc:
            log.warning("bad reply from %s: %s; closing", self._where, exc)
            wire.transport.abortConnection()
            return
        for callback, args in jobs:
            try:
                callback(*args)
            except Exception:
                log.exception("tensorshare listen callback %r failed", callback)
        if call is not None:
            self._complete(call, frame)

    # -- connections

    def _connect_endpoint(self, wire: Wire) -> defer.Deferred:
        if self._tls_options is None:
            endpoint = TCP4ClientEndpoint(self.reactor, self.host, self.port, timeout=self.connect_timeout)
        else:
            endpoint = SSL4ClientEndpoint(self.reactor, self.host, self.port, self._tls_options,
                                          timeout=self.connect_timeout)
        return connectProtocol(endpoint, wire)

    def _open(self) -> defer.Deferred:
        wire = Wire(self)
        # The endpoint bounds the TCP connect; this bounds TLS, greeting and AUTH too.
        timers = [self.reactor.callLater(self.connect_timeout, wire.abandon_opening)]
        if self._tls is None and self._connector == self._connect_endpoint:  # a real socket: probe a silent peer
            timers.append(self.reactor.callLater(min(PROBE_AFTER, self.connect_timeout / 2), wire.probe_peer))

        def stop_timer(result):
            for timer in timers:
                if timer.active():
                    timer.cancel()
            return result

        d = self._connector(wire)
        d.addCallback(lambda _: wire.greeted)
        d.addBoth(stop_timer)
        d.addCallback(self._opened)
        d.addErrback(self._open_failed)
        return d

    def _opened(self, wire: Wire) -> defer.Deferred | None:
        front = self._front
        if front is None and self._workers is None:
            try:
                workers = WorkerMap.of(wire.conn.greeting)
            except ProtocolError as exc:
                wire.transport.abortConnection()
                raise ConnectionLostError(f"bad greeting from {self._where}: {exc}") from None
            if workers is not None:  # several workers: route each call to its bin's (_client/workers.py)
                return self._route(workers, wire)
        elif front is not None and not front._workers.fits(self._worker_index, wire.conn.greeting):
            wire.transport.abortConnection()
            front._remap(ConnectionLostError(f"{self._where} greeted as another worker"))
            raise StaleMapError(f"{front._where} now runs other workers than this client mapped")
        if self.zero_copy:
            wire.conn.areas = SharedAreas.of(wire.conn.greeting)
        self._wire = wire
        self._backoff.reset()
        if self.keepalive is not None and self._keepalive_timer is None:
            self._keepalive_timer = self.reactor.callLater(self.keepalive, self._check_alive)
        self._relisten()

    def _open_failed(self, failure):
        if self._front is not None and failure.check(ConnectError):  # gone, or moved: map the workers again
            self._front._remap(failure.value)
        if failure.check(AuthenticationError):
            self._failure = failure.value  # a wrong token or an untrusted server stays so: do not hammer it
        if failure.check(TensorShareError):
            return failure
        raise ConnectionLostError(f"cannot connect to {self._where}: {failure.getErrorMessage()}")

    def _connection_lost(self, wire: Wire, reason) -> None:
        if wire is not self._wire:
            return
        self._wire = None
        error = ConnectionLostError(f"connection to {self._where} lost: {reason.getErrorMessage()}")
        for call in self._calls.take_all():
            self._complete(call, error)
        if not self._closed:
            self._schedule_reconnect()

    def _schedule_reconnect(self) -> None:
        def attempt() -> None:
            self._retry = None
            if not self._closed:
                self._open().addErrback(retry_unless_final)

        def retry_unless_final(failure) -> None:
            if self._failure is not None:
                log.error("cannot reconnect to %s: %s; giving up", self._where, failure.getErrorMessage())
            else:
                self._schedule_reconnect()

        self._retry = self.reactor.callLater(self._backoff.next(), attempt)

    # -- workers (_client/workers.py)

    def _route(self, workers: WorkerMap, wire: Wire) -> defer.Deferred:
        """Become the front of one member per worker (``wire`` is the home member's);
        fires once every member is connected."""
        self._workers = Workers(self, workers)
        self._workers.members[workers.index] = self._workers.home = self._worker_client(workers.index, wire)
        return self._members_connected()

    def _routed_call(self, command: Command, fields: dict | None, value: Any, options: dict) -> defer.Deferred:
        """A call sent where ``command``'s declaration routes it: to its bin's owner (a
        427 maps the workers again), or to several members, their replies merged
        (``MERGE``) or the last one's result once all are in (``EVERY``)."""
        workers = self._workers
        if command.route is Route.OWNER:
            return workers.owner(fields)._call(command, fields, value, **options).addErrback(self._remap_on)
        then = options.pop("then")
        merge = command.route is Route.MERGE
        d = defer.gatherResults([member._call(command, fields, value, then=same_reply if merge else then, **options)
                                 for member in workers.targets(command)], consumeErrors=True)
        d.addCallback(lambda replies: finish_merged(workers.merged(command, replies), then) if merge else replies[-1])
        return d.addErrback(_first_error)

    def _members_connected(self) -> defer.Deferred:
        opening = [member._opening for member in self._workers.all() if member._opening is not None]
        return defer.gatherResults(opening, consumeErrors=True).addErrback(_first_error)

    def _worker_client(self, index: int, wire: Wire | None = None) -> "AsyncClient":
        """The member of worker ``index``: a client like this one on that worker's port,
        taking ``wire`` (already open to that worker) or connecting (``_opening``)."""
        workers = self._workers
        port = self.port if not workers.map.id else workers.map.ports[index]
        member = type(self)(self.reactor, self.host, port, self.timeout, self.device, self.max_backoff,
                            connect_timeout=self.connect_timeout, token=self._token, tls=self._tls,
                            keepalive=self.keepalive, reuse=self._reuse, zero_copy=self.zero_copy,
                            connector=self._given_connector)
        member._front, member._worker_index = self, index
        if wire is None:
            member._opening = member._open()
            member._opening.addBoth(member._opened_now)
        else:
            wire.client = member
            wire.conn.decoder.sink_factory = member._new_connection().decoder.sink_factory  # (its replies are its)
            member._opened(wire)
        return member

    def _opened_now(self, result):
        self._opening = None
        return result

    def _remap(self, error: BaseException) -> defer.Deferred:
        """Map the workers again from the public address (once at a time); fires with
        True if the map changed."""
        if self._remapping is not None:
            return self._remapping
        wire = Wire(self)
        timer = self.reactor.callLater(self.connect_timeout, wire.abandon_opening)
        d = self._remapping = self._connector(wire)
        d.addCallback(lambda _: wire.greeted)

        def greeted(_) -> bool:
            try:
                fresh = WorkerMap.of(wire.conn.greeting)
            except ProtocolError:
                fresh = None
            if not self._workers.changed(fresh):
                wire.transport.loseConnection()  # the same workers: the members reconnect by themselves
                return False
            self._workers.replace(fresh, lambda index: self._worker_client(index, wire), error)
            self._workers.all()  # the others connect now
            return True

        def failed(failure) -> bool:
            log.info("cannot map the workers of %s again (%s): %s", self._where, error, failure.getErrorMessage())
            return False

        def done(result):
            self._remapping = None
            if timer.active():
                timer.cancel()
            return result

        return d.addCallbacks(greeted, failed).addBoth(done)

    def _remap_on(self, failure):
        """A routed call's errback: a 427 means the map is out of date (the call itself is
        not sent again: its value may have changed since it was made)."""
        if failure.check(WrongWorkerError) and self._workers is not None:
            self._remap(failure.value)
        return failure

    def _server_holds(self, wait: float) -> None:
        wire = self._wire
        if wire is not None and wire.traffic.keepalive is not None:
            wire.traffic.keepalive.hold(self.reactor.seconds() + wait + 1.0)

    def _check_alive(self) -> None:
        """Probe a server silent for ``keepalive`` seconds with a NOOP; abort the
        connection (and so reconnect) if nothing comes for as long after it."""
        self._keepalive_timer = None
        wire = self._wire
        if self._closed or wire is None:
            return  # the next connection starts the timer again

        def drop() -> None:
            log.warning("%s sent nothing for %gs after a keepalive probe: dropping the connection",
                        self._where, self.keepalive)
            wire.transport.abortConnection()

        delay = wire.traffic.check(lambda: wire.send(request_frame(next_request_id(), NOOP)), drop)
        if delay is not None:
            self._keepalive_timer = self.reactor.callLater(delay, self._check_alive)


def _first_error(failure):
    """The failure of the first of several calls that failed (gatherResults wraps it)."""
    return failure.value.subFailure if isinstance(failure.value, defer.FirstError) else failure
