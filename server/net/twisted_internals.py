"""Every use of Twisted's undocumented internals, in one place.

The server goes past Twisted's public API in three places, each for speed:

* **Direct sends** (``server/net/writer.py``, :func:`send_now`): a small reply is sent with one
  ``send()`` on the socket when the transport holds nothing unsent, instead of
  waiting a reactor turn for ``transport.write``; a large stored chunk is sent from
  its own memory, since ``transport.write`` takes only ``bytes``.  That needs to
  see the transport's write buffers (``dataBuffer``, ``offset``,
  ``_tempDataBuffer``) and to ask for a writable event (``producerPaused``,
  ``startWriting``).
* **Reads into lent memory** (:class:`ReceivingServer`): ``doRead`` is
  overridden to ``recv_into`` the receive pool's chunks, and to read again in the
  same event while a frame is incomplete.
* **Event dispatch** (:func:`dispatch_directly`): the epoll reactor's ``doPoll``
  is replaced by one that calls each ready connection's handler without Twisted's
  per-event logging context (``callWithLogger``), and its ``mainLoop`` by one
  that runs the timed calls only when one is due (:func:`_main_loop`), a server
  process only.
* **Sizes**: ``SEND_LIMIT`` (bytes per ``send()``) and ``bufferSize`` (bytes per
  ``recv()``), and the unsent byte count the stall check compares.

:func:`check` says what of this is missing from the installed Twisted; the server
logs it and then takes Twisted's public paths only (``direct_socket`` returns None,
the port is a plain ``tcp.Port``).  A test runs :func:`check` against a real
connection, so an incompatible Twisted fails loudly in CI.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys

from twisted.internet import main, reactor, tcp, unix
from twisted.python import log as twisted_log

log = logging.getLogger("tensorshare.server")

try:  # SIOCOUTQ: unsent bytes of a TCP socket (Linux); elsewhere only Twisted's buffer is watched
    import fcntl
    import termios

    _OUTQ = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except ImportError:
    _OUTQ = None

_BUFFERS = ("dataBuffer", "offset", "_tempDataBuffer", "_tempDataLen", "socket", "protocol")  # per connection
_WRITING = ("producerPaused", "startWriting", "connected", "disconnecting")
_SIZES = ("SEND_LIMIT", "bufferSize")
_READING = ("doRead",)
_READABLE = select.EPOLLIN if hasattr(select, "EPOLLIN") else None  # (an epoll event: bytes to read, nothing else)


def check(transport=None) -> list[str]:
    """The internals missing from ``transport`` (a connected ``tcp.Server``; default:
    the class), or from Twisted itself; empty when everything the server uses is there."""
    target = transport if transport is not None else tcp.Server
    missing = [name for name in (*_WRITING, *_SIZES, *_READING) if not hasattr(target, name)]
    if transport is not None:
        missing += [name for name in _BUFFERS if not hasattr(transport, name)]
    for name in ("CONNECTION_LOST", "CONNECTION_DONE"):
        if not hasattr(main, name):
            missing.append(f"twisted.internet.main.{name}")
    return missing


COMPATIBLE = not check()
if not COMPATIBLE:  # pragma: no cover - depends on the installed Twisted
    log.warning("this Twisted lacks %s: the server uses its public write and read paths only", check())


def dispatch_directly(target=reactor) -> bool:
    """Make an epoll reactor dispatch each ready descriptor to its handler directly;
    False (and nothing changed) for any other reactor.

    Twisted's ``doPoll`` wraps every event in ``log.callWithLogger``, which asks the
    connection for its log prefix and pushes a context dict for Twisted's legacy
    log, a dozen Python calls per event: a few per cent of the server's time per
    small request (docs/design.md).  The server logs through :mod:`logging` and
    never reads that context.  Errors are handled as before: ``_doReadOrWrite``
    logs and disconnects a connection whose handler raised, and what escapes it is
    logged here.  For a process that is a server and nothing else: other code on
    the same reactor would lose the context of its Twisted log lines."""
    names = ("_poller", "_selectables", "_doReadOrWrite", "_disconnectSelectable", "doPoll", *_LOOP)
    if not COMPATIBLE or type(target).__name__ != "EPollReactor" or any(not hasattr(target, n) for n in names):
        return False
    selectables, dispatch, disconnect = target._selectables, target._doReadOrWrite, target._disconnectSelectable

    def do_poll(timeout):
        try:
            events = target._poller.poll(-1 if timeout is None else timeout, len(selectables))
        except InterruptedError:
            return
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            try:
                if event == _READABLE:  # the usual event, handled as _doReadOrWrite would, a call shorter
                    try:
                        why = selectable.doRead()
                    except BaseException:
                        why = sys.exc_info()[1]
                        twisted_log.err()
                    if why:
                        disconnect(selectable, why, True)
                else:
                    dispatch(selectable, fd, event)
            except Exception:
                twisted_log.err(None, "dispatching a reactor event failed")

    target.doPoll = target.doIteration = do_poll
    target.mainLoop = _main_loop(target)
    return True


# What Twisted's mainLoop, runUntilCurrent and timeout read of a reactor.
_LOOP = ("mainLoop", "_started", "running", "threadCallQueue", "_newTimedCalls", "_pendingTimedCalls",
         "_justStopped", "runUntilCurrent", "timeout", "seconds")
_LONGEST_WAIT = 2147483  # seconds: what epoll_wait's timeout can hold in milliseconds (Twisted's limit too)


def _main_loop(target):
    """Twisted's ``mainLoop`` that calls ``runUntilCurrent`` and ``timeout`` only when
    they have work: a call from a thread, a new or a due timed call, or a stop.

    Twisted calls both every turn: with a timed call pending (the server's clock
    always is) that is a few thousand instructions a turn, a turn per request from
    a lone client.  Here a turn with nothing due only compares the earliest timed
    call with the clock, and waits for I/O until it is due, as ``timeout`` would:
    the same calls run at the same turns (cancelled ones are dropped from the heap
    when a call is due, not every turn)."""
    seconds = target.seconds

    def main_loop() -> None:
        while target._started:
            try:
                while target._started:
                    pending = target._pendingTimedCalls
                    if pending:
                        due = pending[0].time - seconds()
                    if (target.threadCallQueue or target._newTimedCalls or target._justStopped
                            or (pending and due <= 0)):
                        target.runUntilCurrent()
                        timeout = target.timeout()
                    else:
                        # (not min(): a builtin call costlier than the rest of this turn's test)
                        timeout = (due if due < _LONGEST_WAIT else _LONGEST_WAIT) if pending else None
                    target.doIteration(target.running and timeout)
            except BaseException:
                twisted_log.err(None, "Unexpected error in main loop")
        log.debug("the reactor's main loop ended")

    return main_loop


def direct_socket(transport):
    """The socket under ``transport`` if the writer may send on it directly (a plain
    TCP connection whose buffers look as expected), else None.

    A TLS connection's transport is a TLSMemoryBIOProtocol, which is no
    tcp.Connection (hasattr alone would not do: it forwards unknown attributes to
    the TCP transport beneath, and a direct send there would bypass encryption)."""
    if not COMPATIBLE or not isinstance(transport, tcp.Connection):
        return None
    if any(not hasattr(transport, name) for name in _BUFFERS):
        return None
    return transport.getHandle()


def transport_idle(transport) -> bool:
    """True when the transport holds no unsent bytes (so a direct send keeps order)."""
    t = transport
    return (t.connected and not t.disconnecting and not getattr(t, "_aborting", False)
            and not t._tempDataBuffer and t.offset == len(t.dataBuffer))


def send_now(transport, sock, data: bytes) -> None:
    """Send ``data`` with one ``send()`` on ``sock`` (:func:`direct_socket`'s) when
    the transport holds no unsent bytes (:func:`transport_idle`, inline: one call per
    small reply); Twisted's buffer takes what the kernel does not, or all of it after
    bytes it still holds, so order is kept."""
    t = transport
    if (t.connected and not t.disconnecting and not getattr(t, "_aborting", False)
            and not t._tempDataBuffer and t.offset == len(t.dataBuffer)):
        try:
            sent = sock.send(data)
        except OSError:  # EAGAIN, or a dead socket: Twisted's own write path deals with it
            sent = 0
        if sent < len(data):
            t.write(data[sent:])
    else:
        t.write(data)


def wake_when_writable(transport) -> None:
    """Ask for a writable event; Twisted's ``doWrite`` then writes what it holds and,
    its buffer empty and its producer marked paused, calls ``resumeProducing``."""
    transport.producerPaused = True
    transport.startWriting()


def set_send_limit(transport, nbytes: int) -> None:
    """Bytes Twisted hands to one ``send()`` (its default, 128 KiB, costs a reactor
    turn per 128 KiB of a large reply)."""
    transport.SEND_LIMIT = nbytes


def set_read_size(transport, nbytes: int) -> None:
    """Bytes Twisted asks of one ``recv()``."""
    transport.bufferSize = nbytes


def unsent(transport) -> tuple | None:
    """What the Twisted socket transport under ``transport`` (a TLS transport wraps
    one) still holds: bytes in its buffer and, where the OS tells (Linux), in the
    kernel's send queue, which shrinks with every byte the peer acknowledges.  None
    if there is nothing to look at.  Only compared with an earlier value."""
    for _ in range(4):
        if all(hasattr(transport, name) for name in ("dataBuffer", "offset", "_tempDataLen")):
            buffered = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
            return buffered, _kernel_unsent(transport)
        transport = getattr(transport, "transport", None)
        if transport is None:
            break
    return None


def _kernel_unsent(transport) -> int | None:
    if _OUTQ is None:
        return None
    try:
        raw = fcntl.ioctl(transport.getHandle().fileno(), _OUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return None
    return int.from_bytes(raw, sys.byteorder, signed=True)


READS_PER_EVENT = 4  # most reads of one connection per readable event while a frame is incomplete


class ReceivingServer(tcp.Server):
    """Twisted's TCP server transport, reading straight into lent memory when the
    protocol lends some, and reading again at once while a frame is incomplete.

    Twisted's ``doRead`` reads into a new ``bytes`` per ``recv()``.  While a large
    payload arrives into the receive pool (``server/protocol/recvpool.py``), the session
    lends the pool chunk it fills instead, and this reads into it with
    ``recv_into``: no fresh memory and no copy.  Everything else (headers, small
    payloads, TLS, which a TLS protocol wraps and this does not see) is read as
    Twisted's own ``doRead`` does.

    Twisted reads once per readable event.  A request a little larger than one
    read (a 64 KiB tensor and its header) would then take two reactor turns, one
    ``epoll_wait`` each; while the protocol is in the middle of a frame, this reads
    again in the same event, up to ``READS_PER_EVENT`` reads, and stops at the
    first that finds nothing.

    The protocol's side (``server/net/service.py``): ``receiving``, payload bytes
    still to come (0 between frames, the usual read: then nothing more is asked of
    it); while any, ``receive_buffer()`` (memory to read into, or None) and
    ``read_more()`` (nothing holds reading back); ``received_into(n)`` after a read
    into lent memory.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        protocol = self.protocol
        # The protocol's side of it (server/net/service.py); None: Twisted's own doRead.
        self._lend = getattr(protocol, "receive_buffer", None)
        self._more = getattr(protocol, "read_more", None)

    def doRead(self):
        lend, more = self._lend, self._more
        if lend is None or more is None:
            return super().doRead()
        protocol, sock = self.protocol, self.socket
        left = READS_PER_EVENT  # (a count, not a range(): the usual event reads once)
        while left:
            left -= 1
            # Between frames (the usual read: whole small requests) nothing is lent.
            buf = lend() if protocol.receiving else None
            try:
                if buf is None:
                    data = sock.recv(self.bufferSize)
                else:
                    n = sock.recv_into(buf)
            except BlockingIOError:
                return None
            except OSError:
                return main.CONNECTION_LOST
            if buf is None:
                if not data:
                    return main.CONNECTION_DONE
                protocol.dataReceived(data)
            else:
                if not n:
                    return main.CONNECTION_DONE
                protocol.received_into(n)
            if not protocol.receiving or not self.connected or self.disconnecting or not more():
                return None
        return None


class ReceivingPort(tcp.Port):
    """A TCP port whose connections are :class:`ReceivingServer` transports."""

    transport = ReceivingServer


def listen_tcp(port: int, factory, interface: str):
    """``reactor.listenTCP``, with :class:`ReceivingServer` transports where this
    Twisted allows."""
    if not COMPATIBLE:  # pragma: no cover
        return reactor.listenTCP(port, factory, interface=interface)
    listening = ReceivingPort(port, factory, interface=interface, reactor=reactor)
    listening.startListening()
    return listening


# Connections a Unix socket queues before they are accepted (a full queue refuses at
# once, where TCP retries: a job's workers starting together would fall back to TCP).
UNIX_BACKLOG = 1024


class ReceivingUnixServer(ReceivingServer, unix.Server):
    """A same-host connection over a Unix socket, read as :class:`ReceivingServer` reads."""


class ReceivingUnixPort(unix.Port):
    """A Unix socket whose connections are :class:`ReceivingUnixServer` transports."""

    transport = ReceivingUnixServer

    def connectionLost(self, reason):
        try:
            super().connectionLost(reason)
        except FileNotFoundError:  # its directory (the shared-memory area) went first at shutdown
            tcp.Port.connectionLost(self, reason)


def listen_unix(path: str, factory):
    """``reactor.listenUNIX`` on ``path`` (readable and writable by this user only),
    with :class:`ReceivingUnixServer` transports where this Twisted allows."""
    if not COMPATIBLE:  # pragma: no cover
        return reactor.listenUNIX(path, factory, backlog=UNIX_BACKLOG, mode=0o600)
    listening = ReceivingUnixPort(path, factory, backlog=UNIX_BACKLOG, mode=0o600, reactor=reactor)
    listening.startListening()
    return listening


def adopt_tcp(fd: int, factory):
    """``reactor.adoptStreamPort`` of the listening TCP socket ``fd`` (inherited from a
    multi-worker server's parent, ``server/workers/``), with :class:`ReceivingServer`
    transports where this Twisted allows.  The socket is duplicated: ``fd`` stays
    open, so a worker that stops listening leaves it to its parent."""
    with socket.socket(fileno=os.dup(fd)) as probe:  # (a duplicate: it learns the family, then closes)
        family = probe.family
    if not COMPATIBLE:  # pragma: no cover
        return reactor.adoptStreamPort(fd, family, factory)
    os.set_blocking(fd, False)
    listening = ReceivingPort._fromListeningDescriptor(reactor, fd, family, factory)
    listening.startListening()
    return listening
