"""The blocking client: plain method calls from any thread, no reactor to manage.

Design (measured, see README "Design notes"): the client talks over a plain
non-blocking socket with the sans-IO :mod:`.connection` core.  The calling thread
sends its request itself and, if no other thread is reading, reads the socket
itself until its reply arrives ("leader/follower"): a round trip costs two system
calls and no thread hand-off.  Replies for other threads are handed to them;
notifications and callbacks of non-blocking calls go to one dispatcher thread, so
user callbacks never run on a thread that reads the socket.  While the client
listens to bins a background reader keeps the socket drained, reconnects with
backoff when the server goes away and restores the listens.

Over TLS the socket is a stdlib :class:`ssl.SSLSocket`, still non-blocking: a read
is tried before waiting (the SSL object may hold decrypted bytes that ``poll``
cannot see), a want-read/want-write waits for the socket, and one lock keeps two
threads from using the SSL object at once.  A reading thread probes a server that
has gone silent with NOOP (``keepalive``) and drops a connection that stays silent.

On the server's host the client uses same-host zero-copy by default (see
:mod:`.zerocopy`): large values are written into the server's shared memory and
named in the request, and replies refer to the server's files, which the client
maps copy-on-write.  Whatever cannot go that way goes over TCP.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
import time
from functools import partial
from typing import Any, Callable

from .protocol import messages as protocol
from .protocol.auth import resolve_token
from ._client.connection import (
    DEAD, DEFAULT_REUSE, NO_VALUE, PROBE, ClientConnection, Keepalive, ListenSnapshot, Notification, check_reply,
    int_field, item_table, next_request_id, notification_of, reply_buffers, reply_value, report_unsolicited,
    request_frame,
)
from ._client.coalesce import Coalescer
from .errors import (
    AuthenticationError, ConnectionLostError, ProtocolError, TensorShareError, TimeoutError, UntrustedServerError,
    UsageError, ZeroCopyError, ZeroCopyUnavailableError,
)
from ._client.spin import DEFAULT_LIMIT as DEFAULT_SPIN
from ._client.spin import ReplySpin
from .protocol.tls import TLSSettings
from .wire.codec import Encoded, encode
from .wire.frames import Frame
from ._client.zerocopy import SharedAreas, shared_copy

log = logging.getLogger("tensorshare.client")

_DEFAULT = object()  # "use the client's timeout"
_ZERO_COPY_VERBS = frozenset({protocol.PUT, protocol.APPEND, protocol.GET, protocol.PEEK})
_IOV_MAX = 1024
_SMALL_FRAME = 64 << 10  # frames up to this size are joined and sent with one send()
_TLS_CHUNK = 1 << 20  # bytes handed to one SSL write (a retry after want-write repeats the same slice)
_IDLE_CHECK = 1.0  # seconds of quiet after which a request first reads what the server sent meanwhile
_READER_LINGER = 2.0  # seconds an idle background reader waits for more work before it ends


class _Dispatcher:
    """One daemon thread that runs callbacks in order; a failing callback is logged once."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> None:
        self._queue.put([(fn, args)])

    def submit_all(self, jobs: list) -> None:
        """Queue ``(fn, args)`` jobs to run in order, with one hand-off for all."""
        self._queue.put(jobs)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is queued, then end the thread (waiting for it unless called from it)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            jobs = self._queue.get()
            if jobs is None:
                return
            for fn, args in jobs:
                try:
                    fn(*args)
                except Exception:  # a user callback failed: report it, never call it again for this event
                    log.exception("tensorshare callback %r failed", fn)


class Listening:
    """Handle of a :meth:`Client.listen`; ``stop()`` ends it."""

    def __init__(self, client: "Client", name: str, callback: Callable, snapshot: ListenSnapshot):
        self.client, self.bin, self.callback, self.snapshot = client, name, callback, snapshot

    def stop(self) -> None:
        self.client._unlisten(self)

    close = stop


class Client:
    """A blocking, thread-safe tensorshare client.

    ``put``, ``append``, ``get``, ``peek``, ``list``, ``delete`` and ``listen`` block
    until the server answers (at most ``timeout`` seconds) and return its result or
    raise a :class:`~tensorshare.errors.TensorShareError`.  Tensors come back on the
    CPU, or on ``device`` if one is given.  A lost connection fails the calls in
    flight with :class:`ConnectionLostError`; the next call reconnects.

    Opening a connection (TCP, TLS, greeting, authentication) takes at most
    ``connect_timeout`` seconds.  ``token`` (default: the ``TENSORSHARE_TOKEN``
    environment variable) authenticates to a server that requires it and makes the
    client require the server to prove it knows the token too; it is never sent.
    ``tls=True`` speaks TLS, verifying the server against the system's CAs and the
    host name; ``tls_ca`` names a PEM file of CAs to trust instead, and
    ``tls_fingerprint`` pins the SHA-256 fingerprint of the server's certificate
    (either implies ``tls=True``; see :mod:`tensorshare.tls`).  An authentication
    failure (:class:`~tensorshare.errors.AuthenticationError`) is final: the client
    does not reconnect and every later call raises it.  While a thread reads the
    socket, a server silent for ``keepalive`` seconds is probed with NOOP, and the
    connection is dropped (then re-opened) if it stays silent as long again.

    With ``zero_copy`` (the default), a client on the server's host passes large
    values through the server's shared memory instead of the socket
    (:attr:`same_host` says whether it does): ``put``/``append`` write the value
    there once and the server takes the files over, ``get``/``peek`` return tensors
    that map the server's files copy-on-write (changing them changes nothing
    stored).  ``zero_copy=False`` sends everything over TCP.

    A call waiting for its reply polls the socket for up to ``spin`` seconds
    before it sleeps, while recent replies came within that time (see
    :mod:`.spin`): a quick reply then costs no thread wake-up.  ``spin=0`` always
    sleeps at once.

    Large replies (1 MiB and more) are received into arrays that earlier replies of
    the same size were received into, once nothing refers to those any more (every
    value built on them was dropped): memory already touched, which takes bytes
    several times faster than new pages on some machines.  The client keeps up to
    ``reuse`` bytes of such arrays (default 1 GiB; 0: new memory every time); those
    unused for about 10 s are let go at its next call, all of them at :meth:`close`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float | None = 60.0, *,
                 connect_timeout: float = 10.0, device: Any = None, reconnect: bool = True,
                 max_backoff: float = 2.0, token: str | bytes | None = None, tls: bool | None = None,
                 tls_ca: str | None = None, tls_fingerprint: str | None = None, keepalive: float | None = 15.0,
                 zero_copy: bool = True, spin: float = DEFAULT_SPIN, reuse: int = DEFAULT_REUSE):
        self.host, self.port = host, port
        self.zero_copy = zero_copy
        self._buffers = reply_buffers(reuse)  # arrays large replies were received into
        self._spin = ReplySpin(spin)  # used by the thread reading for its own reply
        self._releases: list[int] = []  # 226 replies whose references we mapped: told to the server
        self._release_lock = threading.Lock()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.device = device
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.keepalive = keepalive or None
        self._token = resolve_token(token)
        self._tls = TLSSettings.from_options(tls, tls_ca, tls_fingerprint)
        self._ssl_context = None if self._tls is None else self._tls.ssl_context()
        self._ssl_lock = threading.Lock()  # an SSL object serves one call at a time; never held while waiting
        self._failure: AuthenticationError | None = None  # final: no more connections after it
        self._last_heard = self._last_sent = 0.0  # time.monotonic() of the last bytes in / request out
        self._keepalive_state: Keepalive | None = None  # of the current connection
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._coalescer = Coalescer(_SMALL_FRAME)  # requests in flight, small ones held back meanwhile (send lock)
        self._connect_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._conn: ClientConnection | None = None
        self._readable = self._writable = self._readwrite = None  # poll objects of the current socket
        self._reading = False
        self._replies: dict[int, Frame | BaseException] = {}
        self._waiting: set[int] = set()
        self._reply_hooks: dict[int, Callable[[Frame], None]] = {}  # run by the reader on arrival
        self._pending_async: dict[int, tuple[str, Callable]] = {}
        self._listens: dict[str, list[Listening]] = {}
        self._closed = False
        self._ever_connected = False
        self._reader: threading.Thread | None = None
        self._reader_idle = False  # the background reader waits for work (see _reader_loop)
        self._dispatcher: _Dispatcher | None = None
        self._connect()

    # ------------------------------------------------------------------ public API

    def put(self, bin: str, value: Any, *, tag: int | None = None, timeout: float | None = _DEFAULT) -> int:
        """Replace the items of ``bin`` with ``value``; returns the bin's item count (1).

        ``tag``, an optional 64-bit integer stored with the item, reaches listeners
        in the notification (a version number, say), so they need not download it.
        The value has been sent when this returns: changing it afterwards is safe.
        """
        return self._store(protocol.PUT, bin, value, tag, timeout)

    def append(self, bin: str, value: Any, *, tag: int | None = None, timeout: float | None = _DEFAULT) -> int:
        """Add ``value`` as one more item of ``bin``; returns the bin's new item count."""
        return self._store(protocol.APPEND, bin, value, tag, timeout)

    def get(self, bin: str, timeout: float | None = _DEFAULT, *, with_seq: bool = False) -> list:
        """Take all items out of ``bin`` (it stays, empty); returns them in order.

        With ``with_seq=True`` returns ``(items, seq)``: seq is this take's sequence
        number, so a listener can tell the notifications of later changes (higher
        seq) from those of earlier ones.
        """
        items, frame = self._read(protocol.GET, bin, timeout)
        return (items, int_field(frame.header, "seq")) if with_seq else items

    def peek(self, bin: str, timeout: float | None = _DEFAULT) -> list:
        """Return all items of ``bin`` without removing them."""
        return self._read(protocol.PEEK, bin, timeout)[0]

    def save(self, bin: str, path, *, overwrite: bool = False, timeout: float | None = _DEFAULT) -> int:
        """Write the items of ``bin`` (which keeps them) to the local directory ``path``.

        The bytes the server sent go straight to memory-mappable files, one
        numbered subdirectory per item (tensordict's layout); nothing is decoded or
        pickled.  ``tensorshare.load_memmap(path)`` maps them back.  Returns the
        number of items saved.
        """
        from .memmap import save_items

        frame = self._call(protocol.PEEK, bin, timeout=timeout, decode=False)
        table = item_table(check_reply(frame), frame.payload_len)
        payload = memoryview(frame.payload) if frame.payload_len else memoryview(b"")
        items, base = [], 0
        for blob, size, _ref in table:
            items.append((blob, payload[base : base + size], size))
            base += size
        save_items(path, items, overwrite=overwrite)
        return len(items)

    def shared(self, value: Any) -> Any:
        """A copy of ``value`` whose tensors and arrays live in the server's shared memory.

        Compute into them as into any tensor; a ``put``/``append`` of a value holding
        one of them (whole, as returned here) then hands its pages to the server
        instead of copying them.  From then on the tensor is copy-on-write: later
        changes copy the pages they touch and are not seen by the server, and the next
        put copies it as any tensor.  A tensor on the ``meta`` device gives a
        zero-filled tensor of its shape and dtype, with nothing copied.  Without
        same-host zero-copy this returns ``value`` (meta tensors as zeros).
        """
        areas = self._areas(_DEFAULT)
        if areas is None or areas.incoming is None:
            return shared_copy(value, None)
        return areas.shared(value)

    def list(self, timeout: float | None = _DEFAULT) -> dict[str, int]:
        """``{bin: n_items}`` for every bin on the server."""
        return self._call(protocol.LIST, timeout=timeout)

    def delete(self, bin: str, timeout: float | None = _DEFAULT) -> None:
        """Remove ``bin`` and its items."""
        self._call(protocol.DELETE, bin, timeout=timeout)

    def ping(self, timeout: float | None = _DEFAULT) -> float:
        """Round-trip a NOOP; returns the seconds it took."""
        start = time.perf_counter()
        self._call(protocol.NOOP, timeout=timeout)
        return time.perf_counter() - start

    def listen(self, bin: str, callback: Callable[[Notification], Any],
               timeout: float | None = _DEFAULT) -> Listening:
        """Call ``callback(notification)`` on every change to ``bin``, from now on.

        Returns once the server has started listening: no change after this call
        returns is missed.  The handle's ``snapshot`` is the bin's state at that
        moment; ``handle.stop()`` stops listening.  Callbacks run in order on the
        client's dispatcher thread, never on a thread that reads the socket.
        A client that falls far behind (PROTOCOL.md §8.7) gets only the latest
        change per bin: ``seq`` always grows but may skip.
        """
        handle = Listening(self, bin, callback, None)

        def activate(frame: Frame) -> None:
            # Runs on the reading thread as the reply arrives, before any later
            # frame: a notification right behind the reply must find the handle.
            if frame.header.get("code") == protocol.OK:
                handle.snapshot = reply_value(protocol.LISTEN, frame)
                self._listens.setdefault(bin, []).append(handle)

        try:
            self._call(protocol.LISTEN, bin, timeout=timeout, on_reply=activate)
        except TimeoutError:
            with self._cond:
                orphan = not self._listens.get(bin)
            if orphan:  # the server may listen by now: ask it to stop, best effort
                try:
                    self.submit(protocol.UNLISTEN, bin)
                except TensorShareError:
                    pass
            raise
        self._ensure_reader()
        return handle

    def close(self) -> None:
        """Close the connection; calls in flight fail, later calls raise UsageError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._listens.clear()
            self._cond.notify_all()  # an idle reader ends now
        self._drop_connection(self._sock, ConnectionLostError("client closed"))
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
        for thread in (self._reader, self._dispatcher and self._dispatcher.thread):
            if thread is not None and thread is not me:
                thread.join(timeout)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def same_host(self) -> bool:
        """True while the connection uses same-host zero-copy (the server's shared
        memory was offered and verified to be on this host)."""
        conn = self._conn
        return conn is not None and conn.areas is not None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self._sock else "disconnected"
        return f"<tensorshare.Client {self.host}:{self.port} {state}>"

    # ------------------------------------------------- non-blocking form (callbacks)

    def submit(self, op: str, bin: str | None = None, value: Any = NO_VALUE,
               callback: Callable[[Any, BaseException | None], Any] | None = None, *, tag: int | None = None,
               zero_copy: bool = True) -> None:
        """Send a request without waiting; ``callback(result, error)`` runs on the
        dispatcher thread when the reply arrives.  The value has been copied out when
        this returns (onto the socket, into the server's shared memory, or, for a
        small request made while earlier ones await their replies, into the queue
        of requests sent together with the next; see :mod:`.coalesce`), so later
        changes to it are not sent.  ``zero_copy=False``: over TCP only.
        """
        if self._closed:
            raise UsageError("the client is closed")
        extra = None
        areas = self._areas(_DEFAULT) if zero_copy and op in _ZERO_COPY_VERBS else None
        if areas is not None:
            if op in (protocol.PUT, protocol.APPEND) and value is not NO_VALUE and areas.incoming is not None:
                value, extra, callback = self._submit_shared(areas, op, bin, value, tag, callback)
            elif op in (protocol.GET, protocol.PEEK):
                extra = {protocol.REF: areas.usable}
                callback = self._submit_read(op, bin, callback)
        rid = next_request_id()
        parts = request_frame(rid, op, bin, value, tag, self._with_releases(extra))
        deadline = self._deadline(_DEFAULT)
        self._before_request()
        with self._cond:
            self._pending_async[rid] = (op, callback)
        try:
            self._send(parts, deadline, rid, may_hold=True)
        except TensorShareError as exc:
            with self._cond:
                entry = self._pending_async.pop(rid, None)
            if entry is not None:
                self._complete_async(entry, None, exc)
            return
        self._ensure_reader()

    # ------------------------------------------------------------------ internals

    def _deadline(self, timeout) -> float | None:
        if timeout is _DEFAULT:
            timeout = self.timeout
        return None if timeout is None else time.monotonic() + timeout

    def _call(self, op: str, name: str | None = None, value: Any = NO_VALUE, *, tag: int | None = None,
              timeout=_DEFAULT, on_reply: Callable[[Frame], None] | None = None, decode: bool = True,
              extra: dict | None = None) -> Any:
        rid = next_request_id()
        parts = request_frame(rid, op, name, value, tag, self._with_releases(extra))
        deadline = self._deadline(timeout)
        if self._buffers is not None:
            self._buffers.maybe_trim()  # reply arrays unused for a while go back to the system
        self._before_request()
        with self._cond:
            self._waiting.add(rid)
            if on_reply is not None:
                self._reply_hooks[rid] = on_reply
        try:
            self._send(parts, deadline, rid)
            frame = self._await(rid, deadline)
        finally:
            with self._cond:
                self._waiting.discard(rid)
                self._replies.pop(rid, None)
                self._reply_hooks.pop(rid, None)
        return self._decode(op, frame) if decode else frame

    # -- same-host zero-copy (see tensorshare.zerocopy)

    def _areas(self, timeout) -> SharedAreas | None:
        """The shared areas of the current connection (connecting first if need be)."""
        if not self.zero_copy:
            return None
        conn = self._conn
        if conn is None:
            try:
                self._ensure_connected(self._deadline(timeout))
            except TensorShareError:
                return None  # the request itself will say what is wrong
            conn = self._conn
        return conn.areas if conn is not None else None

    def _with_releases(self, extra: dict | None) -> dict | None:
        """``extra`` plus the ids of replies whose references we no longer need."""
        if not self._releases:
            return extra
        with self._release_lock:
            ids, self._releases = self._releases, []
        return {**extra, protocol.RELEASE: ids} if extra else {protocol.RELEASE: ids}

    def _decode(self, op: str, frame: Frame) -> Any:
        """The result of a reply; items it refers to are mapped from the server's files."""
        conn = frame.origin
        areas = conn.areas if conn is not None else None
        try:
            return reply_value(op, frame, self.device, areas=areas)
        finally:
            if areas is not None and frame.header.get(protocol.REFS) and conn is self._conn:
                with self._release_lock:  # mapped (or failed): the server may let the files go
                    self._releases.append(frame.header["id"])

    def _store(self, op: str, bin: str, value: Any, tag: int | None, timeout) -> int:
        """PUT/APPEND: through the server's shared memory if we can, else over TCP."""
        areas = self._areas(timeout)
        if areas is None or areas.incoming is None:
            return self._call(op, bin, value, tag=tag, timeout=timeout)
        enc = encode(value)
        name = self._write_shared(areas, enc, tag)
        if name is None:
            return self._call(op, bin, enc, tag=tag, timeout=timeout)
        try:
            return self._call(op, bin, tag=tag, timeout=timeout, extra=_shared_fields(enc, name))
        except ZeroCopyUnavailableError as exc:
            log.info("the server did not take a value through shared memory (%s): sending it over TCP", exc)
            return self._call(op, bin, enc, tag=tag, timeout=timeout)
        finally:
            areas.discard(name)  # gone already if the server took it

    def _write_shared(self, areas: SharedAreas, enc: Encoded, tag: int | None) -> str | None:
        """Write ``enc`` into the incoming directory; None if too small to be worth it or
        if shared memory is full or unusable (the value then goes over TCP)."""
        try:
            return areas.write(enc, tag)
        except OSError as exc:
            log.info("cannot write a value to shared memory (%s): sending it over TCP", exc)
            return None

    def _read(self, op: str, bin: str, timeout) -> tuple[list, Frame]:
        """GET/PEEK asking for references when we can map them: (items, reply frame)."""
        areas = self._areas(timeout)
        extra = {protocol.REF: areas.usable} if areas is not None else None
        frame = self._call(op, bin, timeout=timeout, decode=False, extra=extra)
        try:
            return self._decode(op, frame), frame
        except ZeroCopyError as exc:
            if op != protocol.PEEK:
                raise  # the items were taken: nothing left to read again
            log.warning("cannot map what the server referred to (%s): reading it over TCP", exc)
            frame = self._call(op, bin, timeout=timeout, decode=False)
            return self._decode(op, frame), frame

    def _submit_shared(self, areas: SharedAreas, op: str, bin: str, value: Any, tag: int | None,
                       callback: Callable | None) -> tuple:
        """:meth:`submit` of a PUT/APPEND through shared memory: (value, extra fields, callback)."""
        enc = encode(value)
        name = self._write_shared(areas, enc, tag)
        if name is None:
            return enc, None, callback

        def done(result: Any, error: BaseException | None) -> None:
            try:
                if isinstance(error, ZeroCopyUnavailableError):  # send the written copy over TCP
                    try:
                        resend = areas.written(name)
                    except OSError:
                        pass
                    else:
                        self.submit(op, bin, resend, callback, tag=tag, zero_copy=False)
                        return
            finally:
                areas.discard(name)
            if callback is not None:
                callback(result, error)

        return NO_VALUE, _shared_fields(enc, name), done

    def _submit_read(self, op: str, bin: str, callback: Callable | None) -> Callable:
        """:meth:`submit` of a GET/PEEK with references: a PEEK whose references cannot be
        mapped is sent again over TCP."""
        def done(result: Any, error: BaseException | None) -> None:
            if isinstance(error, ZeroCopyError) and op == protocol.PEEK:
                self.submit(op, bin, callback=callback, zero_copy=False)
            elif callback is not None:
                callback(result, error)

        return done

    def _send(self, parts: list, deadline: float | None, rid: int, may_hold: bool = False) -> None:
        """Send request ``rid``'s frame; ``may_hold``: a small one may wait in the
        coalescer while an earlier request awaits its reply (see :mod:`.coalesce`)."""
        sock = self._ensure_connected(deadline)
        with self._send_lock:
            coalescer = self._coalescer
            if not (may_hold and self._ssl_context is None and coalescer.awaiting(sock)
                    and sum(map(len, parts)) <= _SMALL_FRAME and coalescer.hold(sock, rid, b"".join(parts))):
                self._send_locked(sock, parts, deadline, rid)
                return
        # Held.  The replies it waits for may all have come while we held the lock,
        # and a reader that then found the lock taken did not send what is held: do.
        if not coalescer.awaiting(sock):
            with self._send_lock:
                if coalescer and sock is self._sock:
                    self._send_locked(sock, [], deadline)

    def _send_held(self, sock: socket.socket) -> None:
        """Send what the coalescer holds, as far as the socket takes it now (a reader:
        never waits for the socket, nor for a sender, which sends it first anyway)."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            if sock is not self._sock or not self._coalescer:
                return
            frames = self._coalescer.take(sock)
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._lost(sock, exc) from None
            if sent < len(data):
                self._coalescer.keep_rest(memoryview(data)[sent:])
        finally:
            self._send_lock.release()

    def _send_locked(self, sock: socket.socket, parts: list, deadline: float | None, rid: int | None = None) -> None:
        """Write what the coalescer holds, then request ``rid``'s whole frame (the caller
        holds the send lock).  With keepalive on, a server that takes no byte for
        twice ``keepalive`` seconds is presumed dead."""
        if sock is not self._sock:
            # Replaced since the caller picked it up: what the coalescer holds now is
            # the new connection's, and must not be taken for this one.
            raise ConnectionLostError(f"connection to {self.host}:{self.port} lost")
        held = self._coalescer.take(sock, rid)
        if held:  # many small frames: one part (one iovec) for all of them
            parts = [held[0] if len(held) == 1 else b"".join(held), *parts]
        readable, writable = self._readable, self._writable
        stall = None if self.keepalive is None else 2 * self.keepalive
        try:
            if self._ssl_context is None:
                _send_all(sock, writable, parts, deadline, stall)
            else:
                _send_all_tls(sock, self._ssl_lock, readable, writable, parts, deadline, stall)
        except TimeoutError:
            # A partly sent frame leaves the stream unusable: start afresh.
            self._drop_connection(sock, ConnectionLostError("send timed out; connection reset"))
            raise
        except (OSError, ValueError, AttributeError) as exc:  # ValueError/AttributeError: closed by another thread
            raise self._lost(sock, exc) from None

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
        sock = self._sock
        if quiet <= _IDLE_CHECK or sock is None:
            return
        with self._cond:
            if self._reading or sock is not self._sock:
                return  # another thread reads: it will notice a close itself
            self._reading = True
            readable = self._readable
        try:
            while self._sock is sock and self._data_waiting(sock, readable):
                self._read_some(time.monotonic() + 0.1)
        except (TimeoutError, ConnectionLostError):
            pass  # half a TLS record (read on later), or the connection is gone (the request reconnects)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _data_waiting(self, sock: socket.socket, readable: select.poll) -> bool:
        if self._ssl_context is not None:
            with self._ssl_lock:
                if sock.pending():
                    return True
        return bool(readable.poll(0))

    def _await(self, rid: int, deadline: float | None) -> Frame:
        """Wait for reply ``rid``, reading the socket ourselves when nobody else is."""
        with self._cond:
            while True:
                result = self._replies.pop(rid, None)
                if result is not None:
                    return _raise_or_return(result)
                if not self._reading:
                    self._reading = True
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no reply from {self.host}:{self.port} in time")
                self._cond.wait(remaining)
        try:
            while True:
                with self._cond:
                    result = self._replies.pop(rid, None)
                if result is not None:
                    return _raise_or_return(result)
                self._read_some(deadline, spin=True)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _read_some(self, deadline: float | None, spin: bool = False) -> None:
        """Read once from the socket and dispatch the frames it completes (leader only;
        ``spin``: a caller waiting for its own reply, who may poll before sleeping)."""
        with self._cond:  # these change together on (re)connection
            sock, conn, readable, writable = self._sock, self._conn, self._readable, self._writable
            readwrite = self._readwrite
        if sock is None:
            raise ConnectionLostError(f"not connected to {self.host}:{self.port}")
        if self._coalescer:  # requests held while earlier ones awaited the replies we read
            self._send_held(sock)
            if self._coalescer.partial:  # the socket is full: wake when it takes more, too
                readable, spin = readwrite, False
        wake = self._keepalive(sock)
        until = deadline if wake is None or (deadline is not None and deadline <= wake) else wake
        try:
            if self._ssl_context is None:
                if not spin:
                    _wait(readable, until)
                else:
                    within = None if until is None else until - time.monotonic()
                    started = self._spin.poll(partial(readable.poll, 0), within)
                    if started is not None:  # not there yet: sleep until it is
                        _wait(readable, until)
                        self._spin.waited(started)
                n = sock.recv_into(conn.decoder.get_buffer())
            else:
                n = self._recv_tls(sock, conn.decoder.get_buffer(), readable, writable, until)
            if n == 0:
                raise ConnectionResetError("server closed the connection")
            self._last_heard = time.monotonic()
            frames = conn.decoder.buffer_updated(n)
        except BlockingIOError:
            return
        except TimeoutError:  # our TimeoutError is an OSError too: the connection is fine
            if until is deadline:
                raise
            return  # time for the next keepalive check, not the caller's deadline
        except (OSError, ValueError, ProtocolError) as exc:
            raise self._lost(sock, exc) from None
        jobs: list = []  # callbacks of this read, handed to the dispatcher in one go
        try:
            self._dispatch(frames, conn, jobs)
        except ProtocolError as exc:  # the server sent nonsense: nothing it says can be trusted
            err = ConnectionLostError(f"bad reply from {self.host}:{self.port}: {exc}")
            self._drop_connection(sock, err)
            raise err from None
        if jobs:
            self._callbacks().submit_all(jobs)

    def _recv_tls(self, sock: ssl.SSLSocket, buffer: memoryview, readable: select.poll, writable: select.poll,
                  until: float | None) -> int:
        """One read from the SSL socket into ``buffer`` (TimeoutError at ``until``).

        Tried before waiting: the SSL object may hold decrypted bytes that poll()
        cannot see."""
        while True:
            try:
                with self._ssl_lock:
                    return sock.recv_into(buffer)
            except ssl.SSLWantReadError:
                _wait(readable, until)
            except ssl.SSLWantWriteError:
                _wait(writable, until)

    def _keepalive(self, sock: socket.socket) -> float | None:
        """Probe a server silent for ``keepalive`` seconds with a NOOP, and drop the
        connection (ConnectionLostError) if nothing comes for as long after the
        probe.  Returns when to check next (None: keepalive is off)."""
        state = self._keepalive_state
        if state is None:
            return None
        now = time.monotonic()
        action, wake = state.due(now, self._last_heard, self._last_sent)
        if action == DEAD:
            err = ConnectionLostError(f"{self.host}:{self.port} sent nothing for {self.keepalive:g}s after a "
                                      f"keepalive probe: connection presumed dead")
            self._drop_connection(sock, err)
            raise err
        if action == PROBE:
            if not self._send_lock.acquire(blocking=False):
                return now + 0.5  # a request is going out: the server has that to read first
            try:
                # No deadline: a probe that cannot go out trips the stall limit (ConnectionLostError).
                probe = next_request_id()
                self._send_locked(sock, request_frame(probe, protocol.NOOP), None, probe)
            finally:
                self._send_lock.release()
            state.probed(now)  # its reply has an id nobody waits for: it is dropped on arrival
        return wake

    def _dispatch(self, frames: list, conn: ClientConnection, jobs: list) -> None:
        """Hand each frame of a read to the thread waiting for it, or queue its
        callbacks in ``jobs`` (under one hold of the lock for the whole read)."""
        woken = False
        with self._cond:
            for frame in frames:
                frame.origin = conn  # replies refer to what this connection's greeting offered
                rid = frame.header.get("id")
                if type(rid) is not int:
                    raise ProtocolError(f"reply id must be an integer, got {rid!r:.40}")
                if rid:
                    self._coalescer.answered(rid)
                    if rid in self._waiting:
                        hook = self._reply_hooks.pop(rid, None)
                        if hook is not None:
                            hook(frame)
                        self._replies[rid] = frame
                        woken = True
                        continue
                    entry = self._pending_async.pop(rid, None)
                    if entry is not None and entry[1] is not None:
                        jobs.append((self._complete_from_frame, (entry, frame)))
                    continue
                note = notification_of(frame)
                if note is not None:
                    jobs.extend((handle.callback, (note,)) for handle in self._listens.get(note.bin, ()))
                    continue
                report_unsolicited(frame, f"{self.host}:{self.port}")
            if woken:
                self._cond.notify_all()

    def _complete_from_frame(self, entry: tuple, frame: Frame) -> None:
        """Decode a non-blocking call's reply (on the dispatcher thread) and call back."""
        try:
            result, error = self._decode(entry[0], frame), None
        except TensorShareError as exc:
            result, error = None, exc
        entry[1](result, error)

    def _complete_async(self, entry: tuple, result: Any, error: BaseException | None) -> None:
        if entry[1] is not None:
            self._callbacks().submit(entry[1], result, error)

    def _callbacks(self) -> _Dispatcher:
        if self._dispatcher is None:
            with self._cond:
                if self._dispatcher is None:
                    self._dispatcher = _Dispatcher(f"tensorshare-callbacks-{self.port}")
        return self._dispatcher

    # -- connection management

    def _connect(self) -> tuple[socket.socket, list[str]]:
        """Open a connection: TCP, TLS if asked, the server's greeting and, if it asks,
        authentication.  Blocking, within ``connect_timeout`` in all."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl_context is not None:
                sock = self._start_tls(sock, deadline)
            conn = self._handshake(sock, deadline)
            if self.zero_copy:
                conn.areas = SharedAreas.of(conn.greeting)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        readable, writable = _poller(sock, select.POLLIN), _poller(sock, select.POLLOUT)
        readwrite = _poller(sock, select.POLLIN | select.POLLOUT)
        with self._cond:
            if self._closed:  # closed while we connected: do not leave a socket behind
                sock.close()
                raise UsageError("the client is closed")
            self._sock, self._conn = sock, conn
            self._readable, self._writable, self._readwrite = readable, writable, readwrite
            self._ever_connected = True
            self._last_heard = time.monotonic()
            self._keepalive_state = None if self.keepalive is None else Keepalive(self.keepalive)
            relisten = list(self._listens)
        return sock, relisten

    def _start_tls(self, sock: socket.socket, deadline: float) -> ssl.SSLSocket:
        """The TLS handshake (blocking, until ``deadline``) and the certificate checks."""
        where = f"{self.host}:{self.port}"
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            tls_sock = self._ssl_context.wrap_socket(sock, server_hostname=self.host)
        except ssl.SSLCertVerificationError as exc:
            raise UntrustedServerError(f"the TLS certificate of {where} is not trusted: "
                                       f"{exc.verify_message or exc}") from None
        except OSError as exc:  # ssl.SSLError, a timeout, a reset
            raise ConnectionLostError(f"TLS handshake with {where} failed (is it a TLS server?): {exc}") from None
        try:
            self._tls.check_certificate(tls_sock.getpeercert(binary_form=True))
        except BaseException:
            tls_sock.close()
            raise
        return tls_sock

    def _handshake(self, sock: socket.socket, deadline: float) -> ClientConnection:
        """Read the greeting and authenticate if the server asks (blocking, until ``deadline``)."""
        conn = ClientConnection(token=self._token, reuse=self._buffers)
        where = f"{self.host}:{self.port}"
        try:
            while not conn.ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout("timed out")
                sock.settimeout(remaining)
                data = sock.recv(1 << 16)
                if not data:
                    raise ConnectionResetError("closed before the handshake was over")
                for frame in conn.feed(data):
                    if conn.ready:  # the server sends nothing unasked before a request
                        log.debug("dropping a frame that followed the handshake: %r", frame.header)
                        continue
                    request = conn.opening(frame)
                    if request is not None:
                        sock.sendall(request)
        except socket.timeout:
            hint = "" if self._tls else " (a TLS server? then pass tls=True)"
            raise ConnectionLostError(f"no tensorshare greeting from {where} within "
                                      f"{self.connect_timeout:g}s{hint}") from None
        except OSError as exc:
            raise ConnectionLostError(f"no tensorshare greeting from {where}: {exc}") from None
        return conn

    def _relisten(self, names: list[str]) -> None:
        """Listen again, after a reconnection, to the bins that have handles."""
        for name in names:
            self.submit(protocol.LISTEN, name, callback=self._relistened(name))

    def _relistened(self, name: str) -> Callable:
        def deliver(snapshot: ListenSnapshot | None, error: BaseException | None) -> None:
            if error is not None:
                log.warning("could not listen to %r again after reconnecting: %s", name, error)
                return
            note = Notification(name, snapshot.n_items, snapshot.seq, protocol.LISTEN, snapshot.tag)
            with self._cond:
                handles = list(self._listens.get(name, ()))
            for handle in handles:
                handle.callback(note)
        return deliver

    def _ensure_connected(self, deadline: float | None) -> socket.socket:
        sock = self._sock
        if sock is not None:
            return sock
        if self._closed:
            raise UsageError("the client is closed")
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if not self.reconnect and self._ever_connected:
            raise ConnectionLostError(f"connection to {self.host}:{self.port} lost (reconnect=False)")
        with self._connect_lock:
            if self._sock is not None:
                return self._sock
            if self._failure is not None:
                raise self._failure.with_traceback(None)
            try:
                sock, relisten = self._connect()
            except AuthenticationError as exc:
                self._failure = exc  # a wrong token or an untrusted server stays so: do not hammer it
                raise
        self._relisten(relisten)  # outside the lock: these sends may need to reconnect
        return sock

    def _lost(self, sock: socket.socket, exc: BaseException) -> ConnectionLostError:
        """Drop ``sock``, which failed with ``exc``; the error to raise."""
        err = ConnectionLostError(f"connection to {self.host}:{self.port} lost: {exc}")
        self._drop_connection(sock, err)
        return err

    def _drop_connection(self, sock: socket.socket | None, error: BaseException) -> None:
        """Close ``sock`` (if still current) and fail everything waiting on it."""
        with self._cond:
            if sock is None or sock is not self._sock:
                return
            self._sock = self._conn = None
            for rid in self._waiting:
                self._replies.setdefault(rid, error)
            failed = list(self._pending_async.values())
            self._pending_async.clear()
            self._cond.notify_all()
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in poll()
        except OSError:
            pass
        sock.close()
        for entry in failed:
            self._complete_async(entry, None, error)

    def _unlisten(self, handle: Listening) -> None:
        with self._cond:
            handles = self._listens.get(handle.bin, [])
            if handle in handles:
                handles.remove(handle)
            last = not handles
            if last:
                self._listens.pop(handle.bin, None)
        if last and not self._closed:
            try:
                self._call(protocol.UNLISTEN, handle.bin)
            except ConnectionLostError:
                pass  # a new connection will not listen to it

    # -- background reader (while listening or with non-blocking calls in flight)

    def _needs_reader(self) -> bool:
        return not self._closed and self._failure is None and bool(self._listens or self._pending_async)

    def _ensure_reader(self) -> None:
        if self._reader is not None:  # unlocked fast path: an exiting reader re-checks
            if self._reader_idle:  # set under the lock before it waits: wake it for the new work
                with self._cond:
                    self._cond.notify_all()
            return
        with self._cond:
            if self._reader is not None or not self._needs_reader():
                return
            self._reader = threading.Thread(target=self._reader_loop, name="tensorshare-reader", daemon=True)
            self._reader.start()

    def _reader_loop(self) -> None:
        backoff = 0.05
        idle_since = None
        try:
            while True:
                with self._cond:
                    if not self._needs_reader():
                        # Linger: in a run of non-blocking calls, the calls in flight
                        # often all complete before the next is made, and starting a
                        # thread each time (measured: 1,835 starts in 160,000 pipelined
                        # appends) costs more than the calls.
                        now = time.monotonic()
                        idle_since = now if idle_since is None else idle_since
                        if self._closed or self._failure is not None or now - idle_since >= _READER_LINGER:
                            return
                        self._reader_idle = True
                        self._cond.wait(idle_since + _READER_LINGER - now)
                        self._reader_idle = False
                        continue
                    idle_since = None
                    if self._reading:
                        self._cond.wait(1.0)
                        continue
                    self._reading = True
                failure = None
                try:
                    if self._sock is None:
                        self._ensure_connected(None)
                        backoff = 0.05
                    self._read_some(time.monotonic() + 1.0)
                except TimeoutError:
                    pass
                except TensorShareError as exc:
                    failure = exc
                finally:
                    with self._cond:
                        self._reading = False
                        self._cond.notify_all()
                if failure is not None:
                    if self._closed:
                        return
                    if isinstance(failure, AuthenticationError):
                        log.error("tensorshare reader: %s; not reconnecting", failure)
                        return
                    log.info("tensorshare reader: %s; retrying in %.2fs", failure, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff)
        finally:
            with self._cond:
                self._reader = None
            if self._needs_reader():  # a listen raced with our exit
                self._ensure_reader()


def _shared_fields(enc: Encoded, name: str) -> dict:
    """Header fields of a PUT/APPEND whose value was written to shared memory as ``name``."""
    return {"value": enc.description, protocol.SHM: name, "size": enc.nbytes}


def _raise_or_return(result):
    if isinstance(result, BaseException):
        raise result
    return result


def _poller(sock: socket.socket, events: int) -> select.poll:
    poller = select.poll()
    poller.register(sock, events)
    return poller


def _wait(poller: select.poll, deadline: float | None) -> None:
    """Block until the polled socket is ready or raise TimeoutError at ``deadline``."""
    while True:
        if deadline is None:
            timeout_ms = None
        else:
            timeout_ms = (deadline - time.monotonic()) * 1000
            if timeout_ms <= 0:
                raise TimeoutError("timed out waiting for the server")
        if poller.poll(timeout_ms):
            return


def _wait_to_send(poller: select.poll, deadline: float | None, stall: float | None) -> None:
    """:func:`_wait` for a sender: also raise ConnectionLostError after ``stall``
    seconds (None: no limit) without the socket becoming ready."""
    if stall is not None:
        limit = time.monotonic() + stall
        if deadline is None or limit < deadline:
            try:
                _wait(poller, limit)
            except TimeoutError:
                raise ConnectionLostError(f"the server took no bytes for {stall:g}s") from None
            return
    _wait(poller, deadline)


def _send_all_tls(sock: ssl.SSLSocket, ssl_lock: threading.Lock, readable: select.poll, writable: select.poll,
                  parts: list, deadline: float | None, stall: float | None = None) -> None:
    """Write every part through a non-blocking SSL socket (which has no sendmsg).

    After a want-write OpenSSL must be offered the same bytes again, so each part
    goes out in fixed slices, each retried until it is taken.
    """
    if len(parts) > 1 and sum(map(len, parts)) <= _SMALL_FRAME:
        parts = [b"".join(parts)]
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            try:
                with ssl_lock:
                    sent = sock.send(view[:_TLS_CHUNK])
            except ssl.SSLWantWriteError:
                _wait_to_send(writable, deadline, stall)
                continue
            except ssl.SSLWantReadError:
                _wait_to_send(readable, deadline, stall)
                continue
            view = view[sent:]


def _send_all(sock: socket.socket, writable: select.poll, parts: list, deadline: float | None,
              stall: float | None = None) -> None:
    """Write every part (bytes or memoryview): small frames joined into one send,
    large ones with scatter-gather sends straight from the tensors' memory."""
    if len(parts) == 1 or sum(map(len, parts)) <= _SMALL_FRAME:
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            sent = sock.send(data)  # the usual case: a small frame, all taken at once
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        parts = [memoryview(data)[sent:]]
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    first = 0
    while first < len(views):
        try:
            if first == len(views) - 1:
                sent = sock.send(views[first])
            else:
                sent = sock.sendmsg(views[first : first + _IOV_MAX])
        except BlockingIOError:
            _wait_to_send(writable, deadline, stall)
            continue
        while sent:
            size = views[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


def connect(host: str = "127.0.0.1", port: int = 8000, *, retry_for: float = 30.0, **options) -> Client:
    """A :class:`Client`, retrying with backoff for up to ``retry_for`` seconds while the
    server is not up yet (processes of a job often start in any order).

    ``options`` are :class:`Client`'s (``token``, ``tls``, ``timeout``...).  Raises
    :class:`ConnectionLostError` if the server still cannot be reached; any other
    error, such as an :class:`AuthenticationError`, at once.
    """
    deadline = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            return Client(host, port, **options)
        except ConnectionLostError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
