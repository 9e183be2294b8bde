"""The asynchronous client for Twisted code: every method returns a Deferred.

It runs on the reactor the application already runs (nothing is started for you).
:class:`AsyncClient` is a front, as :class:`tensorshare.Client` is: the verbs
(``_client/methods.py``), the value layer (``_client/values.py``: calls planned,
encoded, settled, decoded) and a :class:`~tensorshare.protocol.router.Router`
whose members carry the calls, one connection each; a member here is the Twisted
driver of the client engine (:class:`~tensorshare.drivers.twisted.TwistedMember`,
the one a relay's upstream runs too), which keeps its connection up, reconnecting
with the engine's backoff (authenticating again), restoring its listens and
probing a silent server.  Requests are pipelined on each connection; listen
callbacks run on the reactor thread, as Twisted code expects.  When a connection
drops, its pending Deferreds fail with :class:`ConnectionLostError` at once.  TLS
is Twisted's (pyOpenSSL).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Callable

from twisted.internet import defer

from ._client.connection import DEFAULT_REUSE, NO_VALUE
from ._client.listens import Listening, notification, tell_restored
from ._client.methods import ClientMethods
from ._client.options import DEFAULT, DEFAULT_CONNECT_TIMEOUT, check_address, connect_timeout_for
from ._client.routing import finish
from .table_copy import loading
from ._client.values import Call, Values, merged_result, same_reply
from ._client.zerocopy import SharedAreas
from .drivers.twisted import Options, Remapper, TwistedMember, Wire, first_error, open_nearest, start_members
from .errors import ConnectionLostError, ProtocolError, TensorShareError, UsageError, WrongWorkerError
from .protocol.auth import resolve_token
from .protocol.engine import Notice, next_request_id
from .protocol.messages import Command, Route
from .protocol.router import Router
from .protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")


class AsyncClient(ClientMethods):
    """A tensorshare client whose methods return Deferreds.

    Create it with :meth:`connect`::

        client = yield AsyncClient.connect("127.0.0.1", 8000)
        yield client.put("bin", torch.ones(3))
        items = yield client.peek("bin")
        handle = yield client.listen("bin", print)   # handle.snapshot; yield handle.stop()
    """

    def __init__(self, reactor: Any, host: str, port: int, timeout: float | None, device: Any, max_backoff: float, *,
                 connect_timeout: float | None = None, token: str | bytes | None = None,
                 tls: TLSSettings | None = None, keepalive: float | None = 15.0, reuse: int = DEFAULT_REUSE,
                 zero_copy: bool = True, connector: Callable[[Wire], defer.Deferred] | None = None):
        self.reactor = reactor
        self.host, self.port, self.timeout = host, port, timeout
        self.max_backoff = max_backoff
        self.keepalive = keepalive or None
        self.zero_copy = zero_copy
        self.connect_timeout = connect_timeout_for(connect_timeout, timeout, DEFAULT_CONNECT_TIMEOUT)
        self.values = Values(device, zero_copy, reuse)
        self.device = self.values.device
        # (``connector`` connects a new Wire: Twisted's TCP or TLS endpoints unless given; tests pair in memory.
        # A same-host server's Unix socket is used as the blocking client's is: with zero-copy on.)
        self.options = Options(reactor, host, token=resolve_token(token), tls=tls,
                               connect_timeout=self.connect_timeout, keepalive=self.keepalive, max_backoff=max_backoff,
                               connector=connector, local=zero_copy)
        self.router = Router(self._member, port)
        self.remapper = Remapper(self.options, self.router)
        self._closed = False

    @classmethod
    def connect(cls, host: str = "127.0.0.1", port: int = 8000, *, reactor: Any = None, timeout: float | None = 60.0,
                device: Any = None, max_backoff: float = 2.0, connect_timeout: float | None = None,
                token: str | bytes | None = None, tls: bool | None = None, tls_ca: str | None = None,
                tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                reuse: int = DEFAULT_REUSE, zero_copy: bool = True) -> defer.Deferred[AsyncClient]:
        """Connect, authenticate if the server asks, and fire with the client.

        The options mean what they mean for :class:`tensorshare.Client`: opening a
        connection takes at most ``connect_timeout`` seconds (default: 10, or
        ``timeout`` if that is shorter); ``token`` defaults to
        the ``TENSORSHARE_TOKEN`` environment variable; ``tls``/``tls_ca``/
        ``tls_fingerprint`` choose TLS and whom to trust (needs the ``tls`` extra);
        ``reuse`` bounds the reply memory kept for reuse; ``zero_copy`` passes large
        values through the server's shared memory on its host; an
        :class:`AuthenticationError` is final (no reconnection).  A server started
        with ``--workers N`` gets a connection per worker, all open when this fires.
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

        def failed(failure):
            client.close()  # (members that did connect stop trying)
            return failure

        return client._open().addCallbacks(lambda _: client, failed)

    def _open(self) -> defer.Deferred:
        """Open the first connection and route by its greeting; fires once every member
        is connected."""
        return open_nearest(self.options, self.port, self.options.engine(self.port)).addCallback(self._greeted)

    def _greeted(self, wire: Wire) -> defer.Deferred:
        if self._closed:
            wire.close()
            raise ConnectionLostError("client closed")
        try:
            self.router.start(wire.engine.greeting, wire)
        except ProtocolError as exc:
            wire.close()
            raise ConnectionLostError(f"bad greeting from {self._where}: {exc}") from None
        return start_members(self.router)

    def load_table(self, path: str | os.PathLike[str], name: str | None = None, *,
                   replace: bool = True) -> defer.Deferred[int]:
        """:meth:`tensorshare.Client.load_table`: make a table again from the checkpoint
        ``path`` that ``Client.save`` (or ``tensorshare table save``) wrote; fires with
        its number of rows."""
        return defer.inlineCallbacks(lambda: loading(self, path, name, replace))()

    def close(self) -> None:
        """Close the connections; pending Deferreds fail with ConnectionLostError."""
        self._closed = True
        self.remapper.closed = True
        for member in self.router.everyone():
            member.close()
        self.values.close()

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        home = self.router.home
        return home is not None and home.connected

    @property
    def same_host(self) -> bool:
        """True while the connection uses same-host zero-copy."""
        home = self.router.home
        return home is not None and home.areas is not None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def workers(self) -> int:
        """How many workers the server runs (``--workers``; PROTOCOL.md §14)."""
        return self.router.count

    def worker_of(self, bin: str) -> int | None:
        """The worker that serves ``bin`` (None: the server runs one process)."""
        workers = self.router.map
        return None if workers is None else workers.owner(bin)

    # -- members

    def _member(self, index: int | None, port: int, opened: Wire | None) -> TwistedMember:
        member = TwistedMember(self.options, index, port, opened)
        member.engine.use_sinks(self.values.sinks(member.engine))
        member.answered = self._answered
        member.notified = _notified
        member.restored = partial(tell_restored, where=member.where)
        member.on_ready = self._ready
        member.on_lost = _lost
        member.fits = self.remapper.fits
        member.on_unreached = self.remapper.unreached
        return member

    def _ready(self, member: TwistedMember) -> None:
        member.areas = None
        if self.zero_copy:
            try:
                member.areas = SharedAreas.of(member.engine.greeting)
            except (TensorShareError, OSError) as exc:
                log.info("zero-copy: not using the areas %s offers: %s", member.where, exc)

    # -- calls

    def _call(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE, *, timeout=DEFAULT,
              then: Callable | None = None, on_error: Callable | None = None, decode: bool = True,
              zero_copy: bool | None = True, progress: Callable | None = None, device: Any = None, into: Any = None,
              member: TwistedMember | None = None, listening: Listening | None = None) -> defer.Deferred:
        """A Deferred of a request's result, sent where its declaration routes it (see
        :mod:`._client.methods`).  A request refused with 427 makes the client map the
        workers again; it is not sent again (its value may have changed since)."""
        if progress is not None:
            raise UsageError("progress reports are for the blocking Client")
        router = self.router
        if member is None and router.map is not None and command.route is not Route.OWNER:
            return self._fanned_out(command, fields, value, timeout, then, on_error, decode)
        d = defer.Deferred()
        try:
            self._submit(command, fields, value, d, zero_copy=zero_copy, timeout=timeout, then=then,
                         on_error=on_error, decode=decode, device=device, into=into, member=member,
                         listening=listening)
        except TensorShareError:
            return defer.fail()
        if router.map is not None:
            d.addErrback(self._remap_on)
        return d

    def _fanned_out(self, command: Command, fields: dict | None, value: Any, timeout, then, on_error,
                    decode: bool) -> defer.Deferred:
        """A call whose route names several workers: to every member, their replies
        merged (``MERGE``), or answered once all are (``EVERY``: the last one's result)."""
        merge = command.route is Route.MERGE
        d = defer.gatherResults([self._call(command, fields, value, timeout=timeout,
                                            then=same_reply if merge else then, on_error=on_error, decode=decode,
                                            member=member)
                                 for member in self.router.targets(command)], consumeErrors=True)
        if merge:
            d.addCallback(lambda replies: merged_result(command, replies, then))
        else:
            d.addCallback(lambda results: results[-1])
        return d.addErrback(first_error)

    def _done(self, value: Any) -> defer.Deferred:
        return defer.succeed(value)

    def _later(self, fn: Callable, *args) -> None:
        self.reactor.callLater(0, fn, *args)

    def _submit(self, command: Command, fields: dict | None, value: Any, callback, *,
                zero_copy: bool | None = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, decode: bool = True, raw: bool = False, inline: bool = False,
                device: Any = None, into: Any = None, member: TwistedMember | None = None,
                listening: Listening | None = None) -> None:
        """Send a call; ``callback`` is a ``callback(result, error)`` or a Deferred
        (``inline`` changes nothing here: callbacks run on the reactor thread)."""
        if self._closed:
            raise UsageError("the client is closed")
        router = self.router
        if member is None:
            if router.map is not None and command.route is not Route.OWNER:  # several members
                d = self._call(command, fields, value, timeout=timeout, then=same_reply if raw else then,
                               on_error=on_error, decode=decode)
                if type(callback) is defer.Deferred:
                    d.chainDeferred(callback)
                else:
                    d.addCallbacks(lambda result: callback(result, None), lambda failure: callback(None, failure.value))
                return
            member = router.owner_of(fields)
        failure = member.engine.failure
        if failure is not None:  # a refused authentication: final
            raise failure.with_traceback(None)
        values = self.values
        if values.buffers is not None:
            values.buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        areas = member.areas if zero_copy is not False and self.zero_copy and decode else None
        call = values.call(next_request_id(), command, fields, value, areas, device, into, zero_copy is not None)
        call.callback, call.then, call.on_error, call.decode, call.raw, call.handle, call.via = (
            callback, then, on_error, decode, raw, listening, member)
        if timeout is DEFAULT:
            timeout = self.timeout
        try:
            self._transmit(call, None if timeout is None else self.reactor.seconds() + timeout)
        except BaseException:
            finish(call)
            raise

    def _transmit(self, call: Call, deadline: float | None) -> None:
        parts = self.values.frame(call, call.via.engine.greeting)
        if type(parts) is not list:  # device arrays, staged bucket by bucket: copied out as they come
            parts = [bytes(view) for view, _staged in parts.engine.pieces(parts)]
        call.via.send(call, parts, deadline)

    def _answered(self, call: Call) -> None:
        """A call's attempt is over (reply, error, expiry or loss): settle it and call
        back, or send the attempt a zero-copy refusal calls for."""
        values = self.values
        settled = values.settle(call, call.via.areas)
        if settled is None:
            try:
                self._transmit(call, call.deadline)
                return
            except TensorShareError as exc:
                finish(call)
                settled = None, exc
        result, error = values.result(call, *settled)
        target = call.callback
        if type(target) is defer.Deferred:
            if error is None:
                target.callback(result)
            else:
                target.errback(error)
        else:
            target(result, error)

    def _remap_on(self, failure):
        """A routed call's errback: a 427 means the map is out of date."""
        if failure.check(WrongWorkerError):
            self.remapper.again(failure.getErrorMessage())
        return failure

    def _shared_areas(self):
        home = self.router.home
        return home.areas if home is not None and self.zero_copy else None


def _notified(notice: Notice) -> None:
    note = notification(notice)
    for handle in notice.handles:
        try:
            handle.callback(note)
        except Exception:
            log.exception("tensorshare listen callback %r failed", handle.callback)


def _lost(member: TwistedMember, reason: str) -> None:
    member.areas = None


__all__ = ["AsyncClient"]
