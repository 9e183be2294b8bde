"""The blocking client: plain method calls from any thread, no reactor to manage.

:class:`Client` is a front: the verbs (``_client/methods.py``), the value layer
(``_client/values.py``: calls planned, encoded, settled, decoded) and a
:class:`~tensorshare.protocol.router.Router` whose members carry the calls, one
connection each (``_client/member.py``: a plain socket driven over the client
engine, read by the thread that waits, no thread hand-off on the way).  A server of
one process is one member; a server started with ``--workers N`` gets one member
per worker used, and each call goes where its verb's declaration routes it.
Notifications and callbacks of non-blocking calls run on one dispatcher thread,
never on a thread that reads a socket.  See docs/design.md for why it is built
this way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ._client.connection import DEFAULT_REUSE, NO_VALUE, ListenSnapshot, Notification
from ._client.dispatch import Dispatcher
from ._client.express import MISSED
from ._client.listens import Listening
from ._client.member import Member, StaleMapError
from ._client.methods import ClientMethods
from ._client.options import (
    DEFAULT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_RETRY_FOR, Timeout, check_address, connect_timeout_for,
)
from ._client.progress import Progress
from ._client.routing import finish
from ._client.sockets import open_link
from ._client.spin import DEFAULT_LIMIT as DEFAULT_SPIN
from ._client.table_copy import TableCopies
from ._client.tables import priority_fields
from ._client.unawaited import Unawaited
from ._client.values import Call, Values, merged_result, same_reply
from .errors import (
    ConnectionLostError, ProtocolError, TensorShareError, UsageError, WrongServerError, WrongWorkerError,
)
from .protocol.auth import resolve_token
from .protocol.engine import Engine, next_request_id
from .protocol.messages import TPRIORITY, Command, Key, Route
from .protocol.retry import Backoff
from .protocol.router import Router
from .protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")

__all__ = ["Client", "Listening", "ListenSnapshot", "Notification", "connect", "DEFAULT", "Timeout"]


class Settings:
    """How a blocking client's members connect and wait (checked once, shared by all)."""

    def __init__(self, host: str, port: int, timeout: float | None, connect_timeout: float | None, reconnect: bool,
                 max_backoff: float, token, tls: TLSSettings | None, keepalive: float | None, zero_copy: bool,
                 spin: float):
        self.host, self.port = host, port
        self.timeout = timeout
        self.connect_timeout = connect_timeout_for(connect_timeout, timeout, DEFAULT_CONNECT_TIMEOUT)
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.token = resolve_token(token)
        self.tls = tls
        self.ssl_context = None if tls is None else tls.ssl_context()
        self.keepalive = keepalive or None
        self.zero_copy = zero_copy
        self.spin = spin

    def engine(self, port: int) -> Engine:
        return Engine(self.token, f"{self.host}:{port}", keepalive=self.keepalive, max_backoff=self.max_backoff)


def _inline(header: dict) -> bool:
    """Whether a reply carries its items in its payload only (no reference to the
    server's files or to device memory): no zero-copy fallback can be wanted then."""
    return Key.REFS not in header and Key.CUDA not in header


class Client(TableCopies, ClientMethods):
    """A blocking, thread-safe tensorshare client.

    ``put``, ``append``, ``get``, ``peek``, ``list``, ``delete`` and ``listen`` block
    until the server answers (at most ``timeout`` seconds) and return its result or
    raise a :class:`~tensorshare.errors.TensorShareError`.  Tensors come back on the
    CPU, or on ``device`` if one is given.  A lost connection fails the calls in
    flight with :class:`ConnectionLostError`; the next call reconnects.

    Opening a connection (TCP, TLS, greeting, authentication) takes at most
    ``connect_timeout`` seconds (default: 10, or ``timeout`` if that is shorter);
    a peer that turns out not to be a tensorshare server (a TLS server reached
    without TLS, an HTTP server...) raises
    :class:`~tensorshare.errors.WrongServerError` as soon as that shows (about a
    second when it says nothing first).  ``token`` (default: the ``TENSORSHARE_TOKEN``
    environment variable) authenticates to a server that requires it and makes the
    client require the server to prove it knows the token too; it is never sent.
    ``tls=True`` speaks TLS, verifying the server against the system's CAs and the
    host name; ``tls_ca`` names a PEM file of CAs to trust instead, and
    ``tls_fingerprint`` pins the SHA-256 fingerprint of the server's certificate
    (either implies ``tls=True``; see :mod:`tensorshare.protocol.tls`).  An
    authentication failure (:class:`~tensorshare.errors.AuthenticationError`) is
    final: the client does not reconnect and every later call raises it.  While a
    thread reads the socket, a server silent for ``keepalive`` seconds is probed
    with NOOP, and the connection is dropped (then re-opened) if it stays silent as
    long again.

    With ``zero_copy`` (the default), a client on the server's host passes large
    values through the server's shared memory instead of the socket
    (:attr:`same_host` says whether it does): ``put``/``append`` write the value
    there once and the server takes the files over, ``get``/``peek`` return tensors
    that map the server's files copy-on-write (changing them changes nothing
    stored).  ``zero_copy=False`` sends everything over TCP.

    A server started with ``--workers N`` names its workers when the client
    connects: the client then keeps one connection per worker whose bins it uses
    and sends each call where its verb's declaration routes it (to the worker that
    owns its bin; LIST to all, merged; PROTOCOL.md §14), as :attr:`workers` says.

    A call waiting for its reply polls the socket for up to ``spin`` seconds
    before it sleeps, while recent replies came within that time: a quick reply
    then costs no thread wake-up.  ``spin=0`` always sleeps at once.

    Large replies (1 MiB and more) are received into arrays that earlier replies of
    the same size were received into, once nothing refers to those any more (every
    value built on them was dropped).  The client keeps up to ``reuse`` bytes of
    such arrays (default 1 GiB; 0: new memory every time); those unused for about
    10 s are let go at its next call, all of them at :meth:`close`.
    """

    _blocking = True

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float | None = 60.0, *,
                 connect_timeout: float | None = None, device: Any = None, reconnect: bool = True,
                 max_backoff: float = 2.0, token: str | bytes | None = None, tls: bool | None = None,
                 tls_ca: str | None = None, tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                 zero_copy: bool = True, spin: float = DEFAULT_SPIN, reuse: int = DEFAULT_REUSE):
        check_address(host, port)
        self.settings = settings = Settings(host, port, timeout, connect_timeout, reconnect, max_backoff, token,
                                            TLSSettings.from_options(tls, tls_ca, tls_fingerprint), keepalive,
                                            zero_copy, spin)
        self.host, self.port, self.timeout, self.device = host, port, timeout, device
        self.zero_copy = zero_copy
        self.values = Values(device, zero_copy, reuse)
        self.router = Router(self._member, port)
        self._lock = threading.Lock()  # the dispatcher's making, and a new map's
        self._dispatcher: Dispatcher | None = None
        self._closed = False
        self._unawaited = Unawaited()
        link = open_link(host, port, settings.connect_timeout, settings.tls, settings.ssl_context,
                         settings.engine(port))
        try:
            self.router.start(link.engine.greeting, link)
        except ProtocolError as exc:
            link.close()
            raise ConnectionLostError(f"bad greeting from {self._where}: {exc}") from None

    @property
    def connect_timeout(self) -> float:
        return self.settings.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, seconds: float) -> None:
        self.settings.connect_timeout = seconds

    @property
    def reconnect(self) -> bool:
        return self.settings.reconnect

    @property
    def keepalive(self) -> float | None:
        return self.settings.keepalive

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _member(self, index: int | None, port: int, opened) -> Member:
        return Member(self, index, port, opened)

    def close(self) -> None:
        """Close the connections; calls in flight fail, later calls raise UsageError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for member in self.router.everyone():
            member.close()
        self.values.close()
        if self._dispatcher is not None:
            self._dispatcher.stop(timeout=0)
        self.join()

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the client's threads to end after :meth:`close` (skipping the
        calling thread), so that none still runs user or torch code when the
        interpreter exits, which can abort the process."""
        for member in self.router.everyone():
            member.join(timeout)
        thread = self._dispatcher and self._dispatcher.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def connected(self) -> bool:
        return self.router.home.connected

    @property
    def same_host(self) -> bool:
        """True while the connection uses same-host zero-copy (the server's shared
        memory was offered and verified to be on this host)."""
        return self.router.home.areas is not None

    @property
    def device_references(self) -> bool:
        """True while the server, on this host, takes puts by device reference
        (``put(..., by_reference=True)`` then shares GPU memory: PROTOCOL.md §13)."""
        areas = self._shared_areas()
        return areas is not None and bool(areas.device_refs)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def workers(self) -> int:
        """How many workers the server runs (``--workers``): this client connects to
        each whose bins it uses (PROTOCOL.md §14)."""
        return self.router.count

    def worker_of(self, bin: str) -> int | None:
        """The worker that serves ``bin`` (None: the server runs one process).  Requests
        about bins of one worker travel on one connection, in order; about bins of two
        workers, on two, whose relative order is not kept."""
        workers = self.router.map
        return None if workers is None else workers.owner(bin)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self.connected else "disconnected"
        return f"<tensorshare.Client {self._where} {state}>"

    # ------------------------------------------------------------------ calls

    def _deadline(self, timeout) -> float | None:
        if timeout is DEFAULT:
            timeout = self.timeout
        return None if timeout is None else time.monotonic() + timeout

    def _call(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE, *, timeout=DEFAULT,
              then: Callable | None = None, on_reply: Callable | None = None, on_error: Callable | None = None,
              decode: bool = True, zero_copy: bool | None = True, progress: Callable | None = None, device: Any = None,
              into: Any = None, member: Member | None = None, listening: Listening | None = None) -> Any:
        """Send a request where its declaration routes it and wait for its reply (see
        :mod:`._client.methods`); ``progress(done, total)`` hears of the bytes of a
        large request sent and of its reply received.  A request refused with 427, or
        not sent because the map was stale, goes once more to its owner in the new map
        (nothing was done either way)."""
        if self._closed:
            raise UsageError("the client is closed")
        router = self.router
        seen = router.map
        chosen = member is not None  # (by a fan-out: a stale map is its to handle, for every member at once)
        if member is None:
            if seen is None:  # a server of one process: its one member (no routing to do)
                member = router.home
            elif command.route is not Route.OWNER:
                return self._fanned_out(command, fields, value, timeout, then, on_error, decode)
            else:
                member = router.owner_of(fields)
        if timeout is DEFAULT:  # (what _deadline does, without a call on every request)
            timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        buffers = self.values.buffers
        if buffers is not None:
            buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        try:
            if (then is None and on_error is None and progress is None and device is None and into is None
                    and listening is None and decode and member.link is not None):
                result = member.express.call(command, fields, value, deadline,  # (_client/express.py)
                                             member.areas if zero_copy is not False and self.zero_copy else None)
                if result is not MISSED:
                    return result
            return self._on(member, command, fields, value, deadline, then, on_error, decode, zero_copy, progress,
                            device, into, listening)
        except (StaleMapError, WrongWorkerError) as exc:
            if not self._remap(exc, seen) or chosen:
                raise
        return self._on(router.owner_of(fields), command, fields, value, deadline, then, on_error, decode, zero_copy,
                        progress, device, into, listening)

    def _on(self, member: Member, command: Command, fields: dict | None, value: Any, deadline: float | None,
            then: Callable | None, on_error: Callable | None, decode: bool, zero_copy: bool | None,
            progress: Callable | None, device: Any, into: Any, listening: Listening | None = None) -> Any:
        """The result of a call on ``member``'s connection (trying again as a zero-copy
        refusal says)."""
        values = self.values
        areas = (member.areas if member.link is not None else member.shared_areas(deadline)) \
            if zero_copy is not False and self.zero_copy else None
        call = values.call(next_request_id(), command, fields, value, areas, device, into, zero_copy is not None)
        call.then, call.on_error, call.decode, call.handle = then, on_error, decode, listening
        try:
            parts = values.frame(call, member.engine.greeting)
            member.call(call, parts, deadline, None if progress is None else Progress(progress, call.rid))
        except BaseException:
            finish(call)
            raise
        return self._settled(member, call, deadline, progress)

    def _settled(self, member: Member, call: Call, deadline: float | None, progress: Callable | None = None) -> Any:
        """The result of ``call``, sent on ``member`` and answered or failed: its reply
        read, or the attempt a zero-copy refusal calls for sent, and so on."""
        values = self.values
        try:
            while True:
                if call.error is None and call.cleanup is None and call.then is None and call.on_error is None \
                        and (call.fallback is None or _inline(call.frame.header)):
                    return values.read_result(call, member.areas)  # the usual case: one attempt, the default result
                settled = values.settle(call, member.areas)
                if settled is not None:
                    break
                parts = values.frame(call, member.engine.greeting)
                member.call(call, parts, deadline, None if progress is None else Progress(progress, call.rid))
        except BaseException:
            finish(call)
            raise
        result, error = values.result(call, *settled)
        if error is not None:
            raise error
        return result

    def _fanned_out(self, command: Command, fields: dict | None, value: Any, timeout, then, on_error,
                    decode: bool) -> Any:
        """A call whose route names several workers: to every member, their replies
        merged (``MERGE``), or answered once all are (``EVERY``: the last one's result).
        A member found stale (the server runs other workers now) makes the whole
        fan-out go once more, to the members of the new map (these verbs change
        nothing, or the same again)."""
        router = self.router
        for again in (False, True):
            seen = router.map
            members = router.targets(command)
            try:
                if command.route is Route.MERGE:
                    replies = [self._call(command, fields, value, timeout=timeout, then=same_reply, on_error=on_error,
                                          decode=decode, member=member) for member in members]
                    return merged_result(command, replies, then)
                for member in members[:-1]:
                    self._call(command, fields, value, timeout=timeout, then=then, on_error=on_error, decode=decode,
                               member=member)
                return self._call(command, fields, value, timeout=timeout, then=then, on_error=on_error,
                                  decode=decode, member=members[-1])
            except (StaleMapError, WrongWorkerError) as exc:
                if again or not (router.stale(seen) or self._remap(exc, seen)):
                    raise
        raise AssertionError("unreachable")  # (the second pass returns or raises)

    def update_priorities_nowait(self, name: str, keys: Any, priorities: Any, *, timeout: Timeout = DEFAULT) -> None:
        """:meth:`update_priorities` without waiting for its reply, as a learner's loop
        wants: it returns at once; the server applies it before anything sent after
        it, and the next call on the connection reads its reply on the way (no round
        trip of its own).  Its error, if any, is raised by the next
        ``update_priorities`` (either) or :meth:`flush` (``_client/unawaited.py``)."""
        if self._closed:
            raise UsageError("the client is closed")
        if self._unawaited:
            self._settle_unawaited(timeout)
        self._unawaited.send(self, TPRIORITY, priority_fields(name, keys, priorities), self._deadline(timeout))

    def _settle_unawaited(self, timeout) -> None:
        self._unawaited.settle(self, self._deadline(timeout))

    def _done(self, value: Any) -> Any:
        return value

    def _later(self, fn: Callable, *args) -> None:
        self.callbacks().submit(fn, *args)

    def _submit(self, command: Command, fields: dict | None, value: Any, callback: Callable, *,
                zero_copy: bool | None = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, decode: bool = True, raw: bool = False, inline: bool = False,
                device: Any = None, into: Any = None, member: Member | None = None,
                listening: Listening | None = None) -> None:
        """Send a call whose ``callback(result, error)`` runs when it is settled (on the
        dispatcher thread; ``inline``: on the reading thread)."""
        if self._closed:
            raise UsageError("the client is closed")
        router = self.router
        if member is None and router.map is not None and command.route is not Route.OWNER:  # several members
            def fanned_out() -> None:
                try:
                    result, error = self._call(command, fields, value, timeout=timeout,
                                               then=same_reply if raw else then, on_error=on_error,
                                               decode=decode), None
                except TensorShareError as exc:
                    result, error = None, exc
                callback(result, error)

            self._later(fanned_out)
            return
        if member is None:
            member = router.owner_of(fields)
        deadline = self._deadline(timeout)
        areas = member.shared_areas(deadline) if zero_copy is not False and self.zero_copy else None
        call = self.values.call(next_request_id(), command, fields, value, areas, device, into, zero_copy is not None)
        call.callback, call.then, call.on_error, call.decode, call.raw, call.inline, call.handle = (
            callback, then, on_error, decode, raw, inline, listening)
        self._send_on(member, call, deadline)

    def _send_on(self, member: Member, call: Call, deadline: float | None) -> None:
        call.deadline, call.via = deadline, member
        try:
            parts = self.values.frame(call, member.engine.greeting)
        except BaseException:
            finish(call)
            raise
        try:
            member.submit(call, parts, deadline)
        except StaleMapError:  # the workers were mapped again: nothing was sent, its owner is another member
            call.via = member = self.router.owner_of(call.fields)
            member.submit(call, parts, deadline)

    def complete(self, call: Call) -> None:
        """Settle a non-blocking call (on the dispatcher thread) and call back, or send the
        attempt a zero-copy refusal calls for."""
        member = call.via
        settled = self.values.settle(call, member.areas)
        if settled is not None:
            call.callback(*self.values.result(call, *settled))
            return
        self._retry(call, member)

    def complete_inline(self, call: Call) -> None:
        """Settle an inline call on the reading thread (its callback is quick and does
        not call the client); another attempt, if one is due, goes out from the
        dispatcher thread, since sending may block."""
        member = call.via
        settled = self.values.settle(call, member.areas)
        if settled is None:
            self.callbacks().submit(self._retry, call, member)
            return
        try:
            call.callback(*self.values.result(call, *settled))
        except Exception:
            log.exception("tensorshare callback %r failed", call.callback)

    def _retry(self, call: Call, member: Member) -> None:
        try:
            parts = self.values.frame(call, member.engine.greeting)
        except TensorShareError as exc:
            finish(call)
            call.callback(*self.values.result(call, None, exc))
            return
        member.submit(call, parts, call.deadline)

    def callbacks(self) -> Dispatcher:
        """The one thread that runs every member's callbacks, in order."""
        if self._dispatcher is None:
            with self._lock:
                if self._dispatcher is None:
                    self._dispatcher = Dispatcher(f"tensorshare-callbacks-{self.port}")
        return self._dispatcher

    def _shared_areas(self):
        return self.router.home.shared_areas(self._deadline(DEFAULT)) if self.zero_copy else None

    def _exported(self):
        return self.values.exported()

    def _listening(self, member: Member, handle: Listening) -> Listening:
        member.reader.ensure()  # a thread reads while nobody calls
        return handle

    # ------------------------------------------------------------------ members and the map

    def fits(self, member: Member, greeting: dict) -> bool:
        """Whether ``member``'s new connection, greeted with ``greeting``, reached the
        worker it was made for (if not, the workers are mapped again)."""
        if self.router.fits(member.index, greeting):
            return True
        self._remap(ConnectionLostError(f"{member.where} greeted as another worker"), member.map)
        return False

    def unreachable(self, member: Member, error: ConnectionLostError) -> bool:
        """``member`` could not connect: True if the server runs other workers now (the
        workers were mapped again: the request goes to its new owner)."""
        return member.map is not None and self._remap(error, member.map)

    def connection_lost(self, member: Member) -> None:
        exports = self.values.exports
        if exports is not None and member not in self.router.companions.values():
            exports.lost()  # the server let go of this connection's device references (an upload's holds none)

    def _remap(self, error: BaseException, seen) -> bool:
        """Map the workers again from the public address; True if the map changed since
        ``seen`` (one thread at a time maps; the others find the new map in place)."""
        router = self.router
        with self._lock:
            if router.stale(seen):
                return True
            settings = self.settings
            try:
                link = open_link(self.host, self.port, settings.connect_timeout, settings.tls, settings.ssl_context,
                                 settings.engine(self.port))
            except TensorShareError as exc:
                log.info("cannot map the workers of %s again (%s): %s", self._where, error, exc)
                return False
            old = router.learn(link.engine.greeting, link)
            if old is None:
                link.close()  # the same workers: the members reconnect by themselves
                return False
        log.warning("%s runs other workers now (%s): mapping them again", self._where, error)
        for member in old:
            member.close()
        return True


def connect(host: str = "127.0.0.1", port: int = 8000, *, retry_for: float | None = None, **options: Any) -> Client:
    """A :class:`Client`, retrying with backoff for up to ``retry_for`` seconds while the
    server is not up yet (processes of a job often start in any order).

    ``options`` are :class:`Client`'s (``token``, ``tls``, ``timeout``...).
    ``retry_for`` defaults to 30 s, or the ``timeout`` option if that is shorter; no
    attempt outlasts it.  Raises :class:`ConnectionLostError` if the server still
    cannot be reached; any other error, such as an :class:`AuthenticationError` or a
    :class:`WrongServerError`, at once.
    """
    timeout = options.get("timeout", 60.0)
    retry_for = connect_timeout_for(retry_for, timeout, DEFAULT_RETRY_FOR)
    each = connect_timeout_for(options.pop("connect_timeout", None), timeout, DEFAULT_CONNECT_TIMEOUT)
    deadline = time.monotonic() + retry_for
    backoff = Backoff(0.05, 1.0)
    told = False  # that we keep trying (a process waiting silently for 30 s looks hung)
    while True:
        try:
            client = Client(host, port, connect_timeout=max(min(each, deadline - time.monotonic()), 0.01), **options)
            client.connect_timeout = each  # for its reconnections: the retry's remaining time was this one's
            return client
        except WrongServerError:
            raise
        except ConnectionLostError as exc:
            left = deadline - time.monotonic()
            if left < 0.01:
                raise ConnectionLostError(f"{exc} (tried for {retry_for:g}s)") from None
            if not told:
                told = True
                log.warning("%s; trying again for up to %.0fs more", exc, left)
            time.sleep(min(backoff.next(), left))
