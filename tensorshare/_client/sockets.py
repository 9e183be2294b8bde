"""The blocking client's transport: one non-blocking socket (TCP, TLS over it, or a same-host Unix socket).

:func:`open_link` opens a connection (TCP, TLS with the certificate checks, the
server's greeting and, if it asks, authentication; :func:`open_local` the same
over a same-host server's Unix socket) and returns a :class:`Link`:
the socket with the protocol state and the poll objects that go with it.  The
link sends whole frames (:meth:`Link.send_all`) and reads into the decoder's
buffer (:meth:`Link.recv_into`), waiting with ``poll`` until a deadline.

Over TLS the socket is a stdlib :class:`ssl.SSLSocket`, still non-blocking: a read
is tried before waiting (the SSL object may hold decrypted bytes that ``poll``
cannot see), a want-read/want-write waits for the socket, and one lock keeps two
threads from using the SSL object at once.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from functools import partial

from ..disk.areas import LOCAL_BUFFER
from ..errors import ConnectionLostError, TensorShareError, TimeoutError, UntrustedServerError, WrongServerError
from ..protocol import peers
from ..protocol.engine import Engine
from ..protocol.tls import TLSSettings

log = logging.getLogger("tensorshare.client")

_IOV_MAX = 1024
SMALL_FRAME = 64 << 10  # frames up to this size are joined and sent with one send()
_MSG_MORE = getattr(socket, "MSG_MORE", 0)  # (Linux; elsewhere a send that is not held back)
IDLE_CHECK = 1.0  # seconds of quiet after which a request first reads what the server sent meanwhile
_TLS_CHUNK = 1 << 20  # bytes handed to one SSL write (a retry after want-write repeats the same slice)


class Link:
    """One open connection of a blocking client: the socket, the engine whose
    connection it is, and poll objects for reading, writing and both."""

    def __init__(self, sock: socket.socket, engine: Engine, tls: bool):
        self.sock, self.engine, self.tls = sock, engine, tls
        self.local = sock.family == socket.AF_UNIX  # the same-host socket: nothing is held back there
        self.readable = _poller(sock, select.POLLIN)
        self.writable = _poller(sock, select.POLLOUT)
        self.readwrite = _poller(sock, select.POLLIN | select.POLLOUT)
        self.ready_now = partial(self.readable.poll, 0)  # whether bytes wait, without waiting (one per link)
        self.ssl_lock = threading.Lock()  # an SSL object serves one call at a time; never held while waiting
        if not tls:  # (one Python frame less on every request)
            self.send_all = partial(_send_all, sock, self.writable)

    def send_all(self, parts: list, deadline: float | None, stall: float | None = None) -> None:
        """Write every part (bytes or memoryview), within ``deadline``; with ``stall``,
        a socket that takes no byte for that long raises ConnectionLostError."""
        if self.tls:
            _send_all_tls(self.sock, self.ssl_lock, self.readable, self.writable, parts, deadline, stall)
        else:
            _send_all(self.sock, self.writable, parts, deadline, stall)

    def send_held(self, data: bytes) -> int:
        """Send what the socket takes of ``data`` now (plain TCP), held back by the
        kernel (``MSG_MORE``) to leave with the next send in one segment: at most
        0.2 s later if nothing follows (Linux's ceiling), or at :meth:`push` (the
        same-host Unix socket holds nothing back: it goes at once there)."""
        try:
            return self.sock.send(data, _MSG_MORE)
        except BlockingIOError:
            return 0

    def push(self) -> None:
        """Send what :meth:`send_held` left held back, now."""
        if self.local:
            return
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (pushes pending segments)
        except OSError:
            pass  # a closed connection: the read that follows says so

    def send_now(self, data) -> int:
        """Send what the socket takes of ``data`` now, without waiting (plain TCP)."""
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0

    def recv_into(self, buffer: memoryview, until: float | None, poller=None) -> int:
        """One read into ``buffer``, waiting (with ``poller``: by default for
        readability) until ``until`` (TimeoutError then)."""
        if self.tls:
            return self._recv_tls(buffer, until)
        wait(poller or self.readable, until)
        return self.sock.recv_into(buffer)

    def recv_ready(self, buffer: memoryview) -> int:
        """A read into ``buffer`` of what has already arrived (plain TCP; may raise BlockingIOError)."""
        return self.sock.recv_into(buffer)

    def _recv_tls(self, buffer: memoryview, until: float | None) -> int:
        while True:
            try:
                with self.ssl_lock:
                    return self.sock.recv_into(buffer)
            except ssl.SSLWantReadError:
                wait(self.readable, until)
            except ssl.SSLWantWriteError:
                wait(self.writable, until)

    def data_waiting(self) -> bool:
        """Whether bytes wait to be read (decrypted ones too, over TLS)."""
        if self.tls:
            with self.ssl_lock:
                if self.sock.pending():
                    return True
        return bool(self.readable.poll(0))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in poll()
        except OSError:
            pass
        self.sock.close()


def open_link(host: str, port: int, connect_timeout: float, tls: TLSSettings | None,
              ssl_context: ssl.SSLContext | None, engine: Engine) -> Link:
    """Open a connection for ``engine``: TCP, TLS if asked, the server's greeting and,
    if it asks, authentication (and the listens the engine restores, sent).
    Blocking, within ``connect_timeout`` in all."""
    deadline = time.monotonic() + connect_timeout
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as exc:
        hint = peers.unreachable_hint(isinstance(exc, ConnectionRefusedError), port)
        raise ConnectionLostError(f"cannot connect to {where}: {exc}{hint}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            sock = _start_tls(sock, host, ssl_context, tls, deadline)
        _handshake(sock, engine, where, deadline, connect_timeout, tls is not None)
        sock.setblocking(False)
    except BaseException as exc:
        sock.close()
        engine.refused(exc)
        raise
    return Link(sock, engine, ssl_context is not None)


def open_local(path: str, connect_timeout: float, engine: Engine, where: str) -> Link:
    """Open a connection for ``engine`` over the server's Unix socket ``path`` (a
    same-host server's, checked by :func:`~tensorshare.disk.areas.local_socket`):
    its greeting and, if it asks, authentication, as over TCP, without the TCP stack
    beneath (PROTOCOL.md §10.1).  Blocking, within ``connect_timeout`` in all."""
    deadline = time.monotonic() + connect_timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER)
        sock.settimeout(connect_timeout)
        sock.connect(path)
        _handshake(sock, engine, where, deadline, connect_timeout, tls=False, probe=False)
        sock.setblocking(False)
    except BaseException as exc:
        sock.close()
        engine.refused(exc)
        if isinstance(exc, OSError) and not isinstance(exc, TensorShareError):
            raise ConnectionLostError(f"cannot connect to {where} through {path}: {exc}") from None
        raise
    return Link(sock, engine, False)


def _start_tls(sock: socket.socket, host: str, context: ssl.SSLContext, tls: TLSSettings,
               deadline: float) -> ssl.SSLSocket:
    """The TLS handshake (blocking, until ``deadline``) and the certificate checks."""
    port = sock.getpeername()[1]
    where = f"{host}:{port}"
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        tls_sock = context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        raise UntrustedServerError(f"the TLS certificate of {where} is not trusted: "
                                   f"{exc.verify_message or exc}") from None
    except OSError as exc:  # ssl.SSLError, a timeout, a reset
        if isinstance(exc, ssl.SSLError) and peers.probe(host, port, 1.0)[0] == peers.TENSORSHARE:
            raise peers.plain_server(where) from None  # it greets in plain text
        raise ConnectionLostError(f"TLS handshake with {where} failed (is it a TLS server?): {exc}") from None
    try:
        tls.check_certificate(tls_sock.getpeercert(binary_form=True))
    except BaseException:
        tls_sock.close()
        raise
    return tls_sock


def _handshake(sock: socket.socket, engine: Engine, where: str, deadline: float,
               connect_timeout: float, tls: bool, probe: bool = True) -> None:
    """Read the greeting and authenticate if the server asks (blocking, until ``deadline``).

    A plaintext TCP peer silent for :data:`~.peers.PROBE_AFTER` seconds is probed on a
    second connection (:func:`.peers.probe`): a TLS or HTTP server is told at once
    instead of after the whole timeout."""
    probe_at = None if tls or not probe else time.monotonic() + min(peers.PROBE_AFTER, connect_timeout / 2)
    speaks = None  # what the probe found, if it ran
    engine.connected(time.monotonic())
    try:
        while not engine.ready:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise socket.timeout("timed out")
            if probe_at is not None and now >= probe_at:
                probe_at = None
                host, port = sock.getpeername()[:2]
                speaks, first = peers.probe(host, port, min(remaining, 1.0))
                if speaks in (peers.TLS, peers.HTTP):
                    raise peers.wrong_server(where, first, speaks)
                continue
            sock.settimeout(remaining if probe_at is None else min(remaining, probe_at - now))
            try:
                data = sock.recv(1 << 16)
            except socket.timeout:
                if probe_at is not None and time.monotonic() < deadline:
                    continue  # time to probe
                raise
            if not data:
                raise ConnectionResetError("closed before the handshake was over")
            probe_at = None  # it speaks: what it says tells
            engine.receive(data, time.monotonic())  # (the server sends nothing unasked after its opening)
            if engine.outbox:  # AUTH; once ready, the listens restored
                sock.sendall(b"".join(engine.take_outbox()))
    except WrongServerError:
        raise
    except socket.timeout:
        raise ConnectionLostError(f"no tensorshare greeting from {where} within {connect_timeout:g}s"
                                  f"{'' if tls else peers.silence_hint(speaks)}") from None
    except OSError as exc:
        raise ConnectionLostError(f"no tensorshare greeting from {where}: {exc}") from None


def _poller(sock: socket.socket, events: int) -> select.poll:
    poller = select.poll()
    poller.register(sock, events)
    return poller


def wait(poller: select.poll, deadline: float | None) -> None:
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
    """:func:`wait` for a sender: also raise ConnectionLostError after ``stall``
    seconds (None: no limit) without the socket becoming ready."""
    if stall is not None:
        limit = time.monotonic() + stall
        if deadline is None or limit < deadline:
            try:
                wait(poller, limit)
            except TimeoutError:
                raise ConnectionLostError(f"the server took no bytes for {stall:g}s") from None
            return
    wait(poller, deadline)


def _send_all_tls(sock: ssl.SSLSocket, ssl_lock: threading.Lock, readable: select.poll, writable: select.poll,
                  parts: list, deadline: float | None, stall: float | None = None) -> None:
    """Write every part through a non-blocking SSL socket (which has no sendmsg).

    After a want-write OpenSSL must be offered the same bytes again, so each part
    goes out in fixed slices, each retried until it is taken.
    """
    if len(parts) > 1 and sum(map(len, parts)) <= SMALL_FRAME:
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
    if len(parts) == 1 or sum(map(len, parts)) <= SMALL_FRAME:
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
