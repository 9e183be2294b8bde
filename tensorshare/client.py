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
each frame goes, is ``_client/leader.py``); the rest is shared: the verbs
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
from ._client.connection import (
    DEFAULT_REUSE, NO_VALUE, ListenSnapshot, Notification, next_request_id, request_frame,
)
from ._client.core import ClientCore
from ._client.dispatch import Dispatcher
from ._client.leader import LeaderFollower
from .protocol.keepalive import DEAD, PROBE, Keepalive
from ._client.listens import Listening
from ._client.reader import BackgroundReader
from ._client.methods import DEFAULT
from ._client.options import DEFAULT_CONNECT_TIMEOUT, DEFAULT_RETRY_FOR, check_address, connect_timeout_for
from .protocol.retry import Backoff
from ._client.routing import finish
from ._client.sockets import SMALL_FRAME, Link, open_link
from ._client.spin import DEFAULT_LIMIT as DEFAULT_SPIN
from ._client.spin import ReplySpin
from ._client.table_copy import TableCopies
from ._client.workers import StaleMapError, Workers, finish_merged, same_reply
from ._client.zerocopy import SharedAreas
from .errors import (
    AuthenticationError, ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UsageError,
    WrongServerError, WrongWorkerError,
)
from .protocol.messages import LIST, NOOP, Command, Key
from .protocol.placement import WorkerMap
from .protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")

__all__ = ["Client", "Listening", "ListenSnapshot", "Notification", "connect"]

_IDLE_CHECK = 1.0  # seconds of quiet after which a request first reads what the server sent meanwhile


class Client(TableCopies, LeaderFollower, ClientCore):
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
        link = self._connect()
        try:
            workers = WorkerMap.of(link.conn.greeting)
        except ProtocolError as exc:
            self._drop_connection(link, ConnectionLostError(f"bad greeting from {self._where}: {exc}"))
            raise ConnectionLostError(f"bad greeting from {self._where}: {exc}") from None
        if workers is not None:  # several workers: route each call to its bin's (_client/workers.py)
            with self._cond:
                self._link = None  # the home member's from now on
            self._workers = Workers(self, workers)
            self._workers.members[workers.index] = self._workers.home = self._worker_client(workers.index, link)

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
        self._workers: Workers | None = None  # the members, when the server runs several workers
        self._front: Client | None = None  # the client this one is a member of (it routes to us)
        self._remap_lock = threading.Lock()

    _blocking = True

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

    def __exit__(self, *exc) -> None:
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
        if workers is not None:  # a member sends it (see _client/workers.py)
            if command.takes_bin:
                for again in (False, True):
                    seen = workers.map
                    try:
                        return workers.owner(fields)._call(
                            command, fields, value, timeout=timeout, then=then, on_reply=on_reply,
                            on_error=on_error, decode=decode, zero_copy=zero_copy, progress=progress)
                    except StaleMapError:  # not sent, and the workers were mapped again: once more
                        if again:
                            raise
                    except WrongWorkerError as exc:  # nothing was done: map the workers again, and once more
                        if again or not self._remap(exc, seen):
                            raise
            if command is LIST:
                replies = [member._call(command, fields, value, timeout=timeout, then=same_reply, on_error=on_error,
                                        decode=decode, zero_copy=zero_copy) for member in workers.all()]
                return finish_merged(Workers.merged(replies), then)
            if command is NOOP:  # every connection in use: a ping after calls returns once all are answered
                for member in workers.made()[:-1]:
                    member._call(command, fields, value, timeout=timeout, on_error=on_error)
                return workers.made()[-1]._call(command, fields, value, timeout=timeout, then=then, on_error=on_error)
            return workers.home._call(command, fields, value, timeout=timeout, then=then, on_reply=on_reply,
                                      on_error=on_error, decode=decode, zero_copy=zero_copy, progress=progress)
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
        try:
            while True:
                try:
                    parts = self._request_parts(call)
                    self._before_request()
                    with self._cond:
                        self._calls.add(call)
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
            raise
        reply, error = settled
        if error is None and call.then is None and not call.raw:  # the usual case
            return reply.result
        result, error = self._result(call, reply, error)
        if error is not None:
            raise error
        return result

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
        if self._workers is not None and command is LIST:  # every worker's: asked in turn on the dispatcher thread
            def listed() -> None:
                try:
                    result, error = self._call(LIST, fields, timeout=timeout, then=same_reply if raw else then,
                                               on_error=on_error, decode=decode), None
                except TensorShareError as exc:
                    result, error = None, exc
                callback(result, error)
            self._later(listed)
            return
        if self._workers is not None:  # its bin's member sends it
            self._workers.owner(fields)._submit(command, fields, value, callback, zero_copy=zero_copy,
                                                timeout=timeout, then=then, on_error=on_error, on_reply=on_reply,
                                                decode=decode, raw=raw, inline=inline)
            return
        areas = self._areas(DEFAULT) if zero_copy and self.zero_copy else None
        call = self._new_call(command, fields, value, areas, callback, then, on_error, on_reply, None, decode, raw,
                              device=device, into=into)
        call.inline = inline
        try:
            parts = self._request_parts(call)
        except BaseException:
            finish(call)
            raise
        self._send_call(call, parts)

    def _send_call(self, call: Call, parts: list) -> None:
        """Send a non-blocking call's frame; its callback hears of a failure."""
        try:
            self._deliver(call, parts, self._deadline(DEFAULT), may_hold=True)
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
        self._send_call(call, parts)

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

    # ------------------------------------------------------------------ sending

    def _send(self, parts: list, deadline: float | None, rid: int, may_hold: bool = False,
              progress: Progress | None = None) -> None:
        """Send request ``rid``'s frame; ``may_hold``: a small one may wait in the
        coalescer while an earlier request awaits its reply (see :mod:`._client.coalesce`)."""
        link = self._ensure_connected(deadline)
        with self._send_lock:
            coalescer = self._coalescer
            if type(parts) is not list:  # StagedParts: device arrays, staged bucket by bucket as they go
                self._send_staged(link, parts, deadline, rid, progress)
                return
            if not (may_hold and not link.tls and coalescer.awaiting(link)
                    and sum(map(len, parts)) <= SMALL_FRAME and coalescer.hold(link, rid, b"".join(parts))):
                if progress is None:
                    self._send_locked(link, parts, deadline, rid)
                else:  # piece by piece, reporting each
                    for i, piece in enumerate(progress.pieces(parts)):
                        self._send_locked(link, piece, deadline, rid if i == 0 else None)
                        progress.sent(piece)
                return
        # Held.  The replies it waits for may all have come while we held the lock,
        # and a reader that then found the lock taken did not send what is held: do.
        if not coalescer.awaiting(link):
            with self._send_lock:
                if coalescer and link is self._link:
                    self._send_locked(link, [], deadline)

    def _send_staged(self, link: Link, parts, deadline: float | None, rid: int,
                     progress: Progress | None) -> None:
        """Send a frame holding device arrays (the caller holds the send lock): each
        bucket the engine stages goes out before the next is asked for (its buffer
        is then reused), while the buckets after it are being copied."""
        pending, first = [], True
        for view, staged in parts.engine.pieces(parts):
            pending.append(view)
            if staged:
                self._send_locked(link, pending, deadline, rid if first else None)
                if progress is not None:
                    progress.sent(pending)
                pending, first = [], False
        if pending or first:
            self._send_locked(link, pending, deadline, rid if first else None)
            if progress is not None:
                progress.sent(pending)

    def _send_held(self, link: Link) -> None:
        """Send what the coalescer holds, as far as the socket takes it now (a reader:
        never waits for the socket, nor for a sender, which sends it first anyway)."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            if link is not self._link or not self._coalescer:
                return
            frames = self._coalescer.take(link)
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            try:
                sent = link.send_now(data)
            except OSError as exc:
                raise self._lost(link, exc) from None
            if sent < len(data):
                self._coalescer.keep_rest(memoryview(data)[sent:])
        finally:
            self._send_lock.release()

    def _send_locked(self, link: Link, parts: list, deadline: float | None, rid: int | None = None) -> None:
        """Write what the coalescer holds, then request ``rid``'s whole frame (the caller
        holds the send lock).  With keepalive on, a server that takes no byte for
        twice ``keepalive`` seconds is presumed dead."""
        if link is not self._link:
            # Replaced since the caller picked it up: what the coalescer holds now is
            # the new connection's, and must not be taken for this one.
            raise ConnectionLostError(f"connection to {self._where} lost")
        held = self._coalescer.take(link, rid)
        if held:  # many small frames: one part (one iovec) for all of them
            parts = [held[0] if len(held) == 1 else b"".join(held), *parts]
        stall = None if self.keepalive is None else 2 * self.keepalive
        try:
            link.send_all(parts, deadline, stall)
        except TimeoutError:
            # A partly sent frame leaves the stream unusable: start afresh.
            self._drop_connection(link, ConnectionLostError("send timed out; connection reset"))
            raise
        except (OSError, ValueError, AttributeError) as exc:  # ValueError/AttributeError: closed by another thread
            raise self._lost(link, exc) from None

    def _before_request(self) -> None:
        """Note that a request is about to go out (the keepalive counts silence from
        it) and, on a connection quiet for a while, first read what the server sent
        meanwhile (late replies, or the 421 it sends before closing an idle
        connection), so that a connection it has closed is replaced by the request
        instead of failing it.  Called before the request is registered, so that
        dropping the connection does not fail the request too."""
        now = time.monotonic()
        quiet = now - max(self._last_heard, self._last_sent)
        self._last_sent = now
        link = self._link
        if quiet <= _IDLE_CHECK or link is None:
            return
        with self._cond:
            if self._reading or link is not self._link:
                return  # another thread reads: it will notice a close itself
            self._reading = True
        try:
            while self._link is link and link.data_waiting():
                self._read_some(time.monotonic() + 0.1)
        except (TimeoutError, ConnectionLostError):
            pass  # half a TLS record (read on later), or the connection is gone (the request reconnects)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _server_holds(self, wait: float) -> None:
        state = self._keepalive_state
        if state is not None:
            state.hold(time.monotonic() + wait + 1.0)

    def _keepalive(self, link: Link) -> float | None:
        """Probe a server silent for ``keepalive`` seconds with a NOOP, and drop the
        connection (ConnectionLostError) if nothing comes for as long after the
        probe.  Returns when to check next (None: keepalive is off)."""
        state = self._keepalive_state
        if state is None:
            return None
        now = time.monotonic()
        action, wake = state.due(now, self._last_heard, self._last_sent)
        if action == DEAD:
            err = ConnectionLostError(f"{self._where} sent nothing for {self.keepalive:g}s after a "
                                      f"keepalive probe: connection presumed dead")
            self._drop_connection(link, err)
            raise err
        if action == PROBE:
            if not self._send_lock.acquire(blocking=False):
                return now + 0.5  # a request is going out: the server has that to read first
            try:
                # No deadline: a probe that cannot go out trips the stall limit (ConnectionLostError).
                probe = next_request_id()
                self._send_locked(link, request_frame(probe, NOOP), None, probe)
            finally:
                self._send_lock.release()
            state.probed(now)  # its reply has an id nobody waits for: it is dropped on arrival
        return wake

    # ------------------------------------------------------------------ workers (_client/workers.py)

    def _worker_client(self, index: int, link: Link | None = None) -> "Client":
        """The member of worker ``index``: a client like this one on that worker's port,
        taking ``link`` (already open to that worker) or connecting."""
        workers = self._workers
        member = type(self).__new__(type(self))
        port = self.port if not workers.map.id else workers.map.ports[index]
        member._configure(self.host, port, **self._options)
        member._front, member._worker_index, member._map = self, index, workers.map
        member._callbacks = self._callbacks  # one dispatcher thread runs every member's callbacks, in order
        if link is None:
            member._connect()
        else:
            member._take(link)
        return member

    def _remap(self, error: BaseException, seen=None) -> bool:
        """Map the workers again from the public address; True if the map changed
        (since ``seen``, the map the caller routed by, if given: one thread at a time
        maps, and the others find the new map in place)."""
        with self._remap_lock:
            if seen is not None and self._workers.map is not seen:
                return True
            return self._remap_now(error)

    def _remap_now(self, error: BaseException) -> bool:
        workers = self._workers
        try:
            link = open_link(self.host, self.port, self.connect_timeout, self._tls, self._ssl_context,
                             self._new_connection())
        except TensorShareError as exc:
            log.info("cannot map the workers of %s again (%s): %s", self._where, error, exc)
            return False
        try:
            fresh = WorkerMap.of(link.conn.greeting)
        except ProtocolError:
            fresh = None
        if not workers.changed(fresh):
            link.close()  # the same workers: the members reconnect by themselves
            return False
        workers.replace(fresh, lambda index: self._worker_client(index, link), error)
        return True

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
            if self._front is not None and self._front._remap(exc, self._map):  # the server moved its workers
                raise StaleMapError(str(exc)) from None
            raise
        return self._take(link)

    def _take(self, link: Link) -> Link:
        """Make the opened ``link`` current."""
        try:
            front = self._front
            if front is None and self._workers is None and Key.WORKERS in link.conn.greeting and self._ever_connected:
                log.warning("%s runs several workers since this client connected: it keeps to the one it reached "
                            "(requests for other workers' bins get 427); make a new client to use them all",
                            self._where)
            if front is not None and not front._workers.fits(self._worker_index, link.conn.greeting):
                link.close()
                front._remap(ConnectionLostError(f"{self._where} greeted as another worker"), self._map)
                raise StaleMapError(f"{front._where} now runs other workers than this client mapped")
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


def connect(host: str = "127.0.0.1", port: int = 8000, *, retry_for: float | None = None, **options) -> Client:
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
            time.sleep(min(backoff.next(), left))

