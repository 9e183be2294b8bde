"""The blocking client: plain method calls from any thread, no reactor to manage.

The calling thread sends its request itself and, if no other thread is reading,
reads the socket itself until its reply arrives ("leader/follower"): a round trip
costs two system calls and no thread hand-off.  Replies for other threads are
handed to them; notifications and callbacks of non-blocking calls go to one
dispatcher thread, so user callbacks never run on a thread that reads the socket.
While the client listens (or non-blocking calls are in flight) a background
reader keeps the socket drained, reconnects with backoff when the server goes
away and restores the listens.  A reading thread probes a server that has gone
silent with NOOP (``keepalive``) and drops a connection that stays silent.

What this module owns is that threading (the reading itself, who reads and where
each frame goes, is ``_client/leader.py``; the writing, ``_client/sending.py``;
serving a multi-worker server through one connection per worker,
``_client/front.py``); the rest is shared: the verbs
(``_client/methods.py``), the call table, planning and settling
(``_client/core.py``), the socket (``_client/sockets.py``), coalescing of
pipelined small requests (``_client/coalesce.py``) and reply polling
(``_client/spin.py``).  See docs/design.md for why it is built this way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ._client.calls import Call
from ._client.progress import Progress
from ._client.coalesce import Coalescer
from ._client.connection import DEFAULT_REUSE, NO_VALUE, ListenSnapshot, Notification
from ._client.core import ClientCore
from ._client.dispatch import Dispatcher
from ._client.front import Front
from ._client.leader import LeaderFollower
from .protocol.keepalive import Keepalive
from ._client.listens import Listening
from ._client.reader import BackgroundReader
from ._client.methods import DEFAULT
from ._client.options import DEFAULT_CONNECT_TIMEOUT, DEFAULT_RETRY_FOR, check_address, connect_timeout_for
from .protocol.retry import Backoff
from ._client.routing import finish
from ._client.sending import Sender
from ._client.sockets import SMALL_FRAME, Link, open_link
from ._client.spin import DEFAULT_LIMIT as DEFAULT_SPIN
from ._client.spin import ReplySpin
from ._client.table_copy import TableCopies
from ._client.workers import StaleMapError
from ._client.zerocopy import SharedAreas
from .errors import (
    AuthenticationError, ConnectionLostError, TensorShareError, TimeoutError, UsageError, WrongServerError,
    WrongWorkerError,
)
from .protocol.messages import Command, Route
from .protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")

__all__ = ["Client", "Listening", "ListenSnapshot", "Notification", "connect"]


class Client(Front, TableCopies, LeaderFollower, Sender, ClientCore):
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

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float | None = 60.0, *,
                 connect_timeout: float | None = None, device: Any = None, reconnect: bool = True,
                 max_backoff: float = 2.0, token: str | bytes | None = None, tls: bool | None = None,
                 tls_ca: str | None = None, tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                 zero_copy: bool = True, spin: float = DEFAULT_SPIN, reuse: int = DEFAULT_REUSE):
        check_address(host, port)
        self._options = dict(timeout=timeout, connect_timeout=connect_timeout, device=device, reconnect=reconnect,
                             max_backoff=max_backoff, token=token, tls=tls, tls_ca=tls_ca,
                             tls_fingerprint=tls_fingerprint, keepalive=keepalive, zero_copy=zero_copy, spin=spin,
                             reuse=reuse)  # (a multi-worker server's members get the same)
        self._configure(host, port, **self._options)
        self._become_front(self._connect())  # a multi-worker server's greeting: route by declaration (.front)

    def _configure(self, host: str, port: int, *, timeout: float | None, connect_timeout: float | None, device: Any,
                   reconnect: bool, max_backoff: float, token: str | bytes | None, tls: bool | None,
                   tls_ca: str | None, tls_fingerprint: str | None, keepalive: float | None, zero_copy: bool,
                   spin: float, reuse: int) -> None:
        """Everything of :meth:`__init__` but connecting."""
        self._cond = threading.Condition()
        settings = TLSSettings.from_options(tls, tls_ca, tls_fingerprint)
        self._init_core(host, port, timeout=timeout, device=device, zero_copy=zero_copy, reuse=reuse, token=token,
                        tls=settings, keepalive=keepalive, lock=self._cond)
        self.connect_timeout = connect_timeout_for(connect_timeout, timeout, DEFAULT_CONNECT_TIMEOUT)
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self._ssl_context = None if settings is None else settings.ssl_context()
        self._spin = ReplySpin(spin)  # used by the thread reading for its own reply
        self._failure: AuthenticationError | None = None  # final: no more connections after it
        self._last_heard = self._last_sent = 0.0  # time.monotonic() of the last bytes in / request out
        self._keepalive_state: Keepalive | None = None  # of the current connection
        self._send_lock = threading.Lock()
        self._coalescer = Coalescer(SMALL_FRAME)  # requests in flight, small ones held back meanwhile (send lock)
        self._connect_lock = threading.Lock()
        self._link: Link | None = None
        self._reading = False  # a thread is the leader: it reads the socket
        self._ever_connected = False
        self._reader = BackgroundReader(self)  # keeps the socket drained while callbacks wait
        self._dispatcher: Dispatcher | None = None
        self._remap_lock = threading.Lock()  # (a front's: _client/front.py)

    _blocking = True

    def close(self) -> None:
        """Close the connection; calls in flight fail, later calls raise UsageError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._listens.clear()
            self._cond.notify_all()  # an idle reader ends now
        if self._workers is not None:
            self._workers.close()
        self._drop_connection(self._link, ConnectionLostError("client closed"))
        if self._exports is not None:
            self._exports.close()
        if self._dispatcher is not None:
            self._dispatcher.stop(timeout=0)
        if self._buffers is not None:
            self._buffers.clear()
        self.join()

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the client's threads to end after :meth:`close` (skipping the
        calling thread), so that none still runs user or torch code when the
        interpreter exits, which can abort the process."""
        me = threading.current_thread()
        for member in self._workers.made() if self._workers is not None else ():
            member.join(timeout)
        for thread in (self._reader.thread, self._dispatcher and self._dispatcher.thread):
            if thread is not None and thread is not me:
                thread.join(timeout)

    @property
    def connected(self) -> bool:
        if self._workers is not None:
            return self._workers.home.connected
        return self._link is not None

    @property
    def same_host(self) -> bool:
        """True while the connection uses same-host zero-copy (the server's shared
        memory was offered and verified to be on this host)."""
        if self._workers is not None:
            return self._workers.home.same_host
        link = self._link
        return link is not None and link.conn.areas is not None

    @property
    def workers(self) -> int:
        """How many workers the server runs (``--workers``): this client connects to
        each whose bins it uses (PROTOCOL.md §14)."""
        return 1 if self._workers is None else self._workers.map.count

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self._link else "disconnected"
        return f"<tensorshare.Client {self._where} {state}>"

    # ------------------------------------------------------------------ calls

    def _call(self, command: Command, fields: dict | None = None, value: Any = NO_VALUE, *, timeout=DEFAULT,
              then: Callable | None = None, on_reply: Callable | None = None, on_error: Callable | None = None,
              decode: bool = True, zero_copy: bool = True, progress: Callable | None = None, device: Any = None,
              into: Any = None) -> Any:
        """Send a request and wait for its reply (see :mod:`._client.methods`);
        ``progress(done, total)`` hears of the bytes of a large request sent and of
        its reply received (:class:`._client.progress.Progress`)."""
        workers = self._workers
        if workers is not None:  # a member sends it, as the verb's declaration routes it (_client/front.py)
            seen, error = workers.map, None
            if command.route is Route.OWNER:
                try:  # (the usual case: its arguments passed on as they are, no dict of them made)
                    return workers.owner(fields)._call(
                        command, fields, value, timeout=timeout, then=then, on_reply=on_reply, on_error=on_error,
                        decode=decode, zero_copy=zero_copy, progress=progress, device=device, into=into)
                except (StaleMapError, WrongWorkerError) as exc:  # nothing was done: once more, if the map changed
                    error = exc
            return self._routed_call(command, fields, value, dict(
                timeout=timeout, then=then, on_reply=on_reply, on_error=on_error, decode=decode, zero_copy=zero_copy,
                progress=progress, device=device, into=into), error, seen)
        if timeout is DEFAULT:
            timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._buffers is not None:
            self._buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        link = self._link
        if link is not None:
            areas = link.conn.areas if zero_copy and self.zero_copy else None
        else:
            areas = self._areas(deadline) if zero_copy and self.zero_copy else None
        call = self._new_call(command, fields, value, areas, None, then, on_error, on_reply, None, decode,
                              device=device, into=into)
        sent = set()  # request ids of the attempts that went out (or began to)
        try:
            while True:
                try:
                    parts = self._request_parts(call)
                    self._before_request()
                    with self._cond:
                        self._calls.add(call)
                    sent.add(call.rid)
                    if progress is None:
                        self._send(parts, deadline, call.rid)
                        outcome = self._await(call, deadline)
                    else:
                        tracker = Progress(progress, call.rid)
                        self._send(tracker.sending(parts), deadline, call.rid, progress=tracker)
                        outcome = self._await(call, deadline, tracker)
                except TensorShareError as exc:
                    outcome = exc
                finally:
                    with self._cond:
                        self._calls.pop(call.rid)
                settled = self._settle(call, outcome)
                if settled is not None:
                    break
        except BaseException:
            finish(call)
            if call.outcome is None and call.rid in sent:
                self._abandon()
            raise
        reply, error = settled
        if error is None and call.then is None and not call.raw:  # the usual case
            return reply.result
        result, error = self._result(call, reply, error)
        if error is not None:
            raise error
        return result

    def _abandon(self) -> None:
        """A call in flight was interrupted (KeyboardInterrupt...): nobody will take its
        reply, and its frame may be half sent.  Reset the connection: the server drops
        a request it holds (a waiting GET takes nothing), where it would otherwise
        hand what it takes to a caller who left.  Other calls in flight on it fail
        with ConnectionLostError; the next call connects again."""
        self._drop_connection(self._link, ConnectionLostError(
            f"connection to {self._where} reset: a call on it was interrupted"))

    def _done(self, value: Any) -> Any:
        return value

    def _later(self, fn: Callable, *args) -> None:
        self._callbacks().submit(fn, *args)

    def _submit(self, command: Command, fields: dict | None, value: Any, callback: Callable, *,
                zero_copy: bool = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, on_reply: Callable | None = None, decode: bool = True,
                raw: bool = False, inline: bool = False, device: Any = None, into: Any = None) -> None:
        if self._closed:
            raise UsageError("the client is closed")
        if self._workers is not None:  # a member sends it, as the verb's declaration routes it (_client/front.py)
            self._routed_submit(command, fields, value, callback, dict(
                zero_copy=zero_copy, timeout=timeout, then=then, on_error=on_error, on_reply=on_reply, decode=decode,
                raw=raw, inline=inline, device=device, into=into))
            return
        deadline = self._deadline(timeout)  # for connecting and sending; the reply is awaited by no one
        areas = self._areas(deadline) if zero_copy and self.zero_copy else None
        call = self._new_call(command, fields, value, areas, callback, then, on_error, on_reply, None, decode, raw,
                              device=device, into=into)
        call.inline = inline
        try:
            parts = self._request_parts(call)
        except BaseException:
            finish(call)
            raise
        self._send_call(call, parts, deadline)

    def _send_call(self, call: Call, parts: list, deadline: float | None) -> None:
        """Send a non-blocking call's frame within ``deadline``; its callback hears of a failure."""
        try:
            self._deliver(call, parts, deadline, may_hold=True)
        except TensorShareError as exc:
            with self._cond:
                mine = self._calls.pop(call.rid) is not None  # else the lost connection failed it already
            if mine:
                self._callbacks().submit(self._complete, call, exc)
            return
        self._reader.ensure()

    def _complete(self, call: Call, outcome: Any) -> None:
        """Settle a non-blocking call (on the dispatcher thread) and call back, or send
        the attempt a zero-copy refusal calls for."""
        settled = self._settle(call, outcome)
        if settled is not None:
            self._call_back(call, *settled)
            return
        self._complete_retry(call)

    def _complete_inline(self, call: Call, frame) -> None:
        """Settle an inline call on the reading thread (its callback is quick and does
        not call the client); another attempt, if one is due, goes out from the
        dispatcher thread, since sending may block."""
        settled = self._settle(call, frame)
        if settled is None:
            self._callbacks().submit(self._complete_retry, call)
            return
        try:
            self._call_back(call, *settled)
        except Exception:
            log.exception("tensorshare callback %r failed", call.callback)

    def _complete_retry(self, call: Call) -> None:
        try:
            parts = self._request_parts(call)
        except TensorShareError as exc:
            finish(call)
            self._call_back(call, None, exc)
            return
        self._send_call(call, parts, self._deadline(DEFAULT))

    def _deliver(self, call: Call, parts: list, deadline: float | None, may_hold: bool = False) -> None:
        self._before_request()
        with self._cond:
            self._calls.add(call)
        self._send(parts, deadline, call.rid, may_hold)

    def _deadline(self, timeout) -> float | None:
        if timeout is DEFAULT:
            timeout = self.timeout
        return None if timeout is None else time.monotonic() + timeout

    def _connection(self):
        link = self._link
        return None if link is None else link.conn

    def _areas(self, deadline: float | None) -> SharedAreas | None:
        """The shared areas of the current connection (connecting first if need be)."""
        link = self._link
        if link is None:
            try:
                link = self._ensure_connected(deadline)
            except TensorShareError:
                return None  # the request itself will say what is wrong
        return link.conn.areas

    def _shared_areas(self) -> SharedAreas | None:
        if self._workers is not None:  # any worker's will do: its drafts move to whichever takes the put
            return self._workers.home._shared_areas()
        return self._areas(self._deadline(DEFAULT)) if self.zero_copy else None

    def _listening(self, handle: Listening) -> Listening:
        self._reader.ensure()
        return handle

    def _callbacks(self) -> Dispatcher:
        if self._dispatcher is None:
            with self._cond:
                if self._dispatcher is None:
                    self._dispatcher = Dispatcher(f"tensorshare-callbacks-{self.port}")
        return self._dispatcher

    # ------------------------------------------------------------------ connections

    def _connect(self, deadline: float | None = None) -> Link:
        """Open a connection (see :func:`._client.sockets.open_link`) and make it current,
        within ``connect_timeout`` and the calling request's ``deadline``."""
        within = self.connect_timeout
        if deadline is not None:
            within = max(min(within, deadline - time.monotonic()), 0.001)
        try:
            link = open_link(self.host, self.port, within, self._tls, self._ssl_context, self._new_connection())
        except ConnectionLostError as exc:
            self._member_unreachable(exc)  # (a member whose server moved its workers: StaleMapError)
            raise
        return self._take(link)

    def _take(self, link: Link) -> Link:
        """Make the opened ``link`` current."""
        try:
            self._check_greeting(link)  # (.front: a member greeted by another worker than its own)
            if self.zero_copy:
                link.conn.areas = SharedAreas.of(link.conn.greeting)
        except BaseException:
            link.close()
            raise
        with self._cond:
            if self._closed:  # closed while we connected: do not leave a socket behind
                link.close()
                raise UsageError("the client is closed")
            self._link = link
            self._ever_connected = True
            self._last_heard = time.monotonic()
            self._keepalive_state = None if self.keepalive is None else Keepalive(self.keepalive)
        return link

    def _ensure_connected(self, deadline: float | None) -> Link:
        link = self._link
        if link is not None:
            return link
        if self._closed:
            raise UsageError("the client is closed")
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if not self.reconnect and self._ever_connected:
            raise ConnectionLostError(f"connection to {self._where} lost (reconnect=False)")
        with self._connect_lock:
            if self._link is not None:
                return self._link
            if self._failure is not None:
                raise self._failure.with_traceback(None)
            try:
                link = self._connect(deadline)
            except AuthenticationError as exc:
                self._failure = exc  # a wrong token or an untrusted server stays so: do not hammer it
                raise
        self._relisten()  # outside the lock: these sends may need to reconnect
        return link

    def _lost(self, link: Link, exc: BaseException) -> ConnectionLostError:
        """Drop ``link``, which failed with ``exc``; the error to raise."""
        err = ConnectionLostError(f"connection to {self._where} lost: {exc}")
        self._drop_connection(link, err)
        return err

    def _drop_connection(self, link: Link | None, error: BaseException) -> None:
        """Close ``link`` (if still current) and fail every call in flight on it."""
        with self._cond:
            if link is None or link is not self._link:
                return
            self._link = None
            failed = []
            for call in self._calls.take_all():
                if call.callback is None:
                    call.outcome = error
                else:
                    failed.append(call)
            self._cond.notify_all()
        link.close()
        if self._exports is not None:  # the server let go of this connection's device references
            self._exports.lost()
        for call in failed:
            self._callbacks().submit(self._complete, call, error)


def connect(host: str = "127.0.0.1", port: int = 8000, *, retry_for: float | None = None,
            **options: Any) -> Client:
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

