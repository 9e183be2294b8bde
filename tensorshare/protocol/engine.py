"""One client connection's protocol life, without I/O: events in, actions out (as h11 does for HTTP).

Every client end drives the same :class:`Engine`: the blocking client over a plain
socket, the AsyncClient and a relay's upstream over Twisted.  The engine owns what
the protocol says about a connection and nothing about how bytes move:

* the opening (:class:`~.handshake.Handshake`: greeting, then AUTH when asked);
* the frames (:class:`~tensorshare.wire.frames.FrameDecoder`, with the sinks the
  driver gives: the engine never decides where a payload lands);
* the one table of calls in flight, by request id; each reply is checked against
  its call's :class:`~.schema.Command` as it arrives (``Command.check_reply``), and a
  lost connection fails every call at once (AMP's ``failAllOutgoing``);
* notifications, delivered to the listen handles of their bin, and the listens
  themselves: a handle becomes active when its LISTEN is answered (before any later
  frame is looked at), stops hearing when the request that ends it is answered, and
  every bin listened to is listened to again on the next connection, reported as a
  :class:`Restored` event;
* keepalive (:meth:`Engine.tick`: probe a silent server, give up on a dead one) and
  reconnection timing (:meth:`Engine.retry_delay`: the jittered backoff of
  :mod:`.retry`; none after a refused authentication, which is final);
* abandoning a call (:meth:`Engine.abandon`): a caller who leaves before the reply
  (a timeout, an interrupt) must not have items delivered to nobody, so a call the
  server may still be holding or that takes items resets the connection.

Events come back from :meth:`Engine.receive` / :meth:`Engine.received`: a
:class:`Call` whose reply arrived (``frame`` set, ``error`` set for an error reply),
a :class:`Notice`, a :class:`Restored`, or :data:`READY` when the opening is over.
Bytes the engine itself wants sent (AUTH, keepalive probes, listens restored) wait
in :attr:`Engine.outbox` for the driver to write.  Values are raw here: a request's
payload is already encoded (``description``, buffers, ``nbytes``) and a reply's
payload is whatever the sink made; the value codec is a layer above (the user
clients'), so the relay drives the engine without torch.  Torch-free: the server
imports it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

from ..errors import ConnectionLostError, ProtocolError, UsageError, WrongServerError
from ..wire.frames import MAGIC, Frame, FrameDecoder, FrameLimits, buffer_sink, frame_head
from . import peers
from .handshake import CLIENT_FRAME_LIMITS, Handshake
from .keepalive import DEAD, PROBE, Keepalive
from .messages import (
    KEEPALIVE, LISTEN, NOOP, NOTIFICATION, NOTIFY, UNAVAILABLE, UNLISTEN, Command, Key, ZeroCopy, reply_error,
)
from .prepared import bin_alone, bin_head
from .retry import Backoff

log = logging.getLogger("tensorshare.client")

_ids = itertools.count(1)


def next_request_id() -> int:
    """A process-wide unique request id (ids are never reused, across reconnections
    and connections alike)."""
    return next(_ids)


READY = "ready"  # the event of an opening that is over: requests may be sent


class Call:
    """One request in flight: its id, its command and header fields; once answered,
    the reply ``frame`` and, for an error reply (or a reply that breaks its
    declaration), ``error``.  ``handle`` is the listen handle a LISTEN activates or
    a stopping request ends; ``deadline``, when its caller gives up.  Drivers and the clients' value layer subclass it with
    what they need (slots only: thousands may be in flight, and every object per
    call is work for the garbage collector)."""

    __slots__ = ("rid", "command", "fields", "frame", "error", "handle", "deadline")

    def __init__(self, rid: int, command: Command, fields: dict | None):
        self.rid, self.command, self.fields = rid, command, fields
        self.frame: Frame | None = None
        self.error: BaseException | None = None
        self.handle: Any = None
        self.deadline: float | None = None  # when its caller gives up (a driver's clock)

    def __repr__(self) -> str:
        return f"<Call {self.command.verb} id={self.rid}>"


class Notice:
    """A notification: its bin, its checked header, the frame (a relay's ``INCOMING``
    carries a copy as payload) and the handles that hear it."""

    __slots__ = ("bin", "header", "frame", "handles")

    def __init__(self, name: str, header: dict, frame: Frame, handles: tuple):
        self.bin, self.header, self.frame, self.handles = name, header, frame, handles


class Restored:
    """A bin listened to again on a new connection: the LISTEN reply's checked header
    (the bin's state then), or the ``error`` that kept it from being restored, and
    the handles that listen to it."""

    __slots__ = ("bin", "header", "error", "handles")

    def __init__(self, name: str, header: dict | None, error: BaseException | None, handles: tuple):
        self.bin, self.header, self.error, self.handles = name, header, error, handles


class RawValue:
    """A request's value as it travels: its description blob, payload buffers and size."""

    __slots__ = ("description", "buffers", "nbytes")

    def __init__(self, description: bytes, buffers: list, nbytes: int):
        self.description, self.buffers, self.nbytes = description, buffers, nbytes


class Listens:
    """The listen handles of one connection's engine, by bin.  A handle is any object
    with ``bin``, ``every_append`` and ``stopping`` attributes (the clients'
    ``Listening``, a relay's mirror callback)."""

    def __init__(self):
        self._by_bin: dict[str, list] = {}

    def add(self, handle) -> None:
        self._by_bin.setdefault(handle.bin, []).append(handle)

    def stop(self, handle) -> bool | None:
        """Mark ``handle`` stopping (it still hears until :meth:`remove`): True if no
        other handle of its bin listens on, False if some do, None if it was not
        listening (or already stopping)."""
        handles = self._by_bin.get(handle.bin)
        if handles is None or handle not in handles or handle.stopping:
            return None
        handle.stopping = True
        return not self.active(handle.bin)

    def remove(self, handle) -> None:
        handles = self._by_bin.get(handle.bin)
        if handles is not None and handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_bin[handle.bin]

    def handles(self, name: str) -> tuple:
        """Every handle of bin ``name`` that hears its notifications (stopping ones too)."""
        return tuple(self._by_bin.get(name, ()))

    def active(self, name: str) -> list:
        return [h for h in self._by_bin.get(name, ()) if not h.stopping]

    def names(self) -> list[str]:
        """The bins some handle listens to (not only stopping ones)."""
        return [name for name in self._by_bin if self.active(name)]

    def first_append_only(self, name: str, adding=None) -> bool:
        """Whether the server may skip APPENDs to bin ``name`` that find it holding items:
        no handle of it (``adding`` included) wants every append."""
        handles = self.active(name)
        if adding is not None and adding.every_append:
            return False
        return (adding is not None or bool(handles)) and not any(h.every_append for h in handles)

    def take(self) -> list:
        """Every handle, forgotten here (they move to another connection's engine)."""
        handles = [h for hs in self._by_bin.values() for h in hs]
        self._by_bin.clear()
        return handles

    def clear(self) -> None:
        self._by_bin.clear()

    def __contains__(self, name: str) -> bool:
        return bool(self.active(name))

    def __bool__(self) -> bool:
        return bool(self._by_bin)


class Engine:
    """The protocol life of one client connection, and of the next ones (see the module
    docstring).  One engine serves one address for as long as its driver lives: the
    listens outlive each connection, the calls and the decoder do not.

    ``token``: the HMAC key to prove (:mod:`.auth`); ``where``: ``host:port`` for
    messages; ``sinks``: the decoder's payload sink factory (``sink(header,
    nbytes)``); ``keepalive``: seconds of silence before a probe (None: off);
    ``max_backoff``: the longest wait between attempts to connect.
    """

    def __init__(self, token: bytes | None = None, where: str = "the server", *, sinks: Callable = buffer_sink,
                 limits: FrameLimits = CLIENT_FRAME_LIMITS, keepalive: float | None = None,
                 max_backoff: float = 2.0):
        self.token, self.where = token, where
        self.sinks, self.limits = sinks, limits
        self.keepalive_interval = keepalive or None
        self.calls: dict[int, Call] = {}
        self.listens = Listens()
        self.outbox: list[bytes] = []  # frames the engine wants written (AUTH, probes, listens restored)
        self.failure: BaseException | None = None  # final (a refused authentication): no more connections
        self.closed = False
        self.backoff = Backoff(0.05, max_backoff)
        self.ever_ready = False
        self._reset()

    def use_sinks(self, sinks: Callable) -> None:
        """Let payloads land where ``sinks(header, nbytes)`` says, from the next frame on
        (this connection's decoder and the next ones')."""
        self.sinks = self.decoder.sink_factory = sinks

    def _reset(self) -> None:
        self.handshake = Handshake(self.token, next_request_id)
        self.decoder = FrameDecoder(self.sinks, self.limits)
        self.ready = False
        self.open = False
        self._first = b""  # the first bytes the server sent, until they showed its magic
        self._lent: memoryview | None = None  # the buffer lent for a read while opening
        self.keepalive = None if self.keepalive_interval is None else Keepalive(self.keepalive_interval)
        self.last_heard = self.last_sent = 0.0

    # -- a connection's life

    @property
    def greeting(self) -> dict | None:
        """The server's greeting on the current connection (with its same-host offer)."""
        return self.handshake.greeting

    def connected(self, now: float = 0.0) -> None:
        """A new connection is open: the opening starts (the server speaks first)."""
        if self.closed:
            raise UsageError("the client is closed")
        self._reset()
        self.open = True
        self.last_heard = self.last_sent = now

    def lost(self, error: BaseException) -> list[Call]:
        """The connection is gone: every call in flight, failed with ``error`` (their
        events); the listens stay, to be restored on the next connection."""
        calls = list(self.calls.values())
        self.calls = {}
        self.outbox = []
        self.ready = self.open = False
        for call in calls:
            call.error = error
        return calls

    def refused(self, error: BaseException) -> None:
        """The opening failed with ``error``: a refused authentication (or a server that
        cannot prove it knows the token) is final."""
        from ..errors import AuthenticationError

        self.open = False
        if isinstance(error, AuthenticationError):
            self.failure = error

    def retry_delay(self) -> float | None:
        """Seconds to wait before the next attempt to connect (growing, jittered); None
        when there is to be none (closed, or a final failure)."""
        if self.closed or self.failure is not None:
            return None
        return self.backoff.next()

    def close(self) -> list[Call]:
        """No more connections; the calls in flight, failed."""
        self.closed = True
        self.listens.clear()
        return self.lost(ConnectionLostError("client closed"))

    # -- incoming bytes

    def buffer(self) -> memoryview:
        """Where the next read goes (``recv_into``); then :meth:`received`."""
        buffer = self.decoder.get_buffer()
        if not self.ready:
            self._lent = buffer
        return buffer

    def received(self, n: int, now: float) -> list:
        """The events of ``n`` bytes read into :meth:`buffer` (as :meth:`receive`)."""
        self.last_heard = now
        if len(self._first) < len(MAGIC):
            self._check_peer(self._lent[:n])
        return self._events(self.decoder.buffer_updated(n))

    def receive(self, data: bytes, now: float) -> list:
        """The events of ``data`` received.  Raises :class:`WrongServerError` when the
        first bytes show that the peer is no tensorshare server, and
        :class:`ProtocolError` when the stream breaks the protocol (drop the
        connection: nothing it says can be trusted)."""
        self.last_heard = now
        if len(self._first) < len(MAGIC):
            self._check_peer(data)
        return self._events(self.decoder.feed(data))

    def _check_peer(self, data) -> None:
        self._first += bytes(data[:64])
        speaks = peers.recognise(self._first)
        if speaks != peers.TENSORSHARE:
            raise peers.wrong_server(self.where, self._first, speaks)

    def _events(self, frames: list[Frame]) -> list:
        if not self.ready:
            return self._opening(frames)
        events = []
        calls = self.calls
        for frame in frames:
            header = frame.header
            rid = header.get(Key.ID)
            if rid.__class__ is not int:
                raise ProtocolError(f"reply id must be an integer, got {rid!r:.40}")
            if rid:
                call = calls.pop(rid, None)
                if call is None:  # a keepalive probe's, or a call given up on
                    continue
                call.frame = frame
                success = call.command.success
                if header.get(Key.CODE) == success.code:
                    try:
                        success.check(header)
                    except ProtocolError as exc:
                        call.error = exc
                else:
                    call.error = reply_error(header, f"{call.command.verb} reply")
                if call.handle is not None:
                    event = self._listen_answered(call)
                    if event is None:
                        continue
                    call = event
                events.append(call)
                continue
            code = header.get(Key.CODE)
            if code == NOTIFY:
                NOTIFICATION.check(header)
                name = header[Key.BIN]
                handles = self.listens.handles(name)
                if handles:
                    events.append(Notice(name, header, frame, handles))
            elif code != KEEPALIVE:
                _report_unsolicited(header, self.where)
        return events

    def _opening(self, frames: list[Frame]) -> list:
        events: list = []
        for i, frame in enumerate(frames):
            if self.ready:
                events += self._events(frames[i:])
                break
            request = self.handshake.opening(frame)
            if request is not None:
                self.outbox.append(request)
            if self.handshake.ready:
                self.ready = self.ever_ready = True
                self.backoff.reset()  # it worked: after a later loss, the first attempts are quick again
                events.append(READY)
                self._restore()
        return events

    # -- requests

    def request(self, call: Call, value: RawValue | None = None, now: float | None = None) -> list:
        """Track ``call`` and return its frame's parts (:func:`frame_of`)."""
        self.track(call, now)
        return frame_of(call, value)

    def track(self, call: Call, now: float | None = None) -> None:
        """``call``'s frame is going out (built by the caller): its reply is awaited.
        (``now``: the keepalive counts silence from the last request too.)"""
        if not self.ready:
            raise ConnectionLostError(f"not connected to {self.where}")
        self.calls[call.rid] = call
        fields = call.fields
        if fields and self.keepalive is not None and now is not None:
            wait = fields.get(Key.WAIT)
            if wait:  # the server may hold it: silence until then is expected
                self.keepalive.hold(now + wait + 1.0)
        if now is not None:
            self.last_sent = now

    def sent(self, now: float) -> None:
        """Bytes went out (the keepalive counts silence from the last of them)."""
        self.last_sent = now

    def abandon(self, call: Call) -> bool:
        """The caller of ``call`` left before its reply (a timeout, an interrupt): its
        reply, when it comes, goes to nobody.  True when the connection must be reset
        for that: the server may still be holding the request (it asked to wait) or
        it takes items, which would otherwise be delivered to no one."""
        if self.calls.pop(call.rid, None) is None:
            return False
        command, fields = call.command, call.fields
        return bool(command.zero_copy is ZeroCopy.TAKE
                    or (fields and (fields.get(Key.WAIT) is not None
                                    or (command.taken_with and fields.get(command.taken_with)))))

    # -- listening

    def listen_fields(self, handle) -> dict:
        """The fields of the LISTEN that starts ``handle``; the call that sends them
        carries the handle (``call.handle``), which is active once the LISTEN is
        answered, before any later frame is looked at."""
        fields = {Key.BIN: handle.bin}
        if self.listens.first_append_only(handle.bin, handle):
            fields[Key.FIRST_APPEND] = True
        return fields

    def stop_listening(self, handle) -> tuple[Command, dict | None] | None:
        """``(command, fields)`` of the call that ends ``handle`` (which carries it): UNLISTEN
        if it was its bin's last, else a NOOP (it hears every notification the server
        sends before that is answered); None when nothing is to be sent (it was not
        listening, or no connection is up: it is forgotten at once)."""
        last = self.listens.stop(handle)
        if last is None or not self.ready:
            self.listens.remove(handle)
            return None
        return (UNLISTEN, {Key.BIN: handle.bin}) if last else (NOOP, None)

    def adopt(self, handle) -> None:
        """Listen with ``handle`` (moved here from another connection's engine): at once
        when its bin is new here and a connection is up (a LISTEN waits in
        :attr:`outbox`, its answer a :class:`Restored`), else from the next opening on."""
        first = handle.bin not in self.listens
        self.listens.add(handle)
        if first and self.ready:
            self._listen_again(handle.bin)

    def _listen_answered(self, call: Call) -> Any:
        """A call that carries a listen handle was answered: the event to report (None: none)."""
        handle = call.handle
        if call.command is LISTEN:
            restoring = handle is _RESTORING
            if restoring:
                name = call.fields[Key.BIN]
                return Restored(name, None if call.error else call.frame.header, call.error,
                                self.listens.handles(name))
            if call.error is None:
                self.listens.add(handle)
            return call
        self.listens.remove(handle)  # UNLISTEN or NOOP: every notification before it was heard
        return call

    def _restore(self) -> None:
        for name in self.listens.names():
            self._listen_again(name)

    def _listen_again(self, name: str) -> None:
        """Listen to ``name`` again (its handles hear a :class:`Restored`)."""
        fields = {Key.BIN: name}
        if self.listens.first_append_only(name):
            fields[Key.FIRST_APPEND] = True
        call = Call(next_request_id(), LISTEN, fields)
        call.handle = _RESTORING
        self.outbox.append(self.request(call)[0])

    # -- keepalive

    def hold(self, until: float) -> None:
        """A request that may wait in the server until ``until`` goes out."""
        if self.keepalive is not None:
            self.keepalive.hold(until)

    def tick(self, now: float, writing: bool = False) -> tuple[str | None, float | None]:
        """What the keepalive asks for now: ``(action, next_check)``, where action is
        None, :data:`PROBE` (a NOOP is in :attr:`outbox`) or :data:`DEAD` (drop the
        connection); ``next_check`` is None with keepalive off.  ``writing``: our own
        bytes are still going out, so silence is no sign of a dead server yet."""
        keepalive = self.keepalive
        if keepalive is None or not self.ready:
            return None, None
        if writing:
            return None, now + keepalive.interval
        action, wake = keepalive.due(now, self.last_heard, self.last_sent)
        if action == PROBE:
            self.outbox.append(frame_head(NOOP.request(next_request_id()), 0))  # its reply is dropped
            keepalive.probed(now)
            self.last_sent = now
        return action, wake

    def dead_error(self) -> ConnectionLostError:
        return ConnectionLostError(f"{self.where} sent nothing for {self.keepalive_interval:g}s after a keepalive "
                                   f"probe: connection presumed dead")

    def take_outbox(self) -> list[bytes]:
        out, self.outbox = self.outbox, []
        return out


def frame_of(call: Call, value: RawValue | None = None) -> list:
    """The parts of ``call``'s request frame: the header (``value``'s description in
    it), then the value's payload buffers as they are; the header from a prepared head
    for a request naming a bin alone (:mod:`.prepared`)."""
    alone = bin_alone(call.fields)
    if alone is not None:
        head = (bin_head(call.command, *alone) if value is None
                else bin_head(call.command, *alone, bytes(value.description), value.nbytes))
        if head is not None:
            return [head(call.rid)] if value is None else [head(call.rid), *value.buffers]
    header = call.command.request(call.rid, call.fields)
    if value is None:
        return [frame_head(header, 0)]
    header[Key.VALUE] = value.description
    return [frame_head(header, value.nbytes), *value.buffers]


_RESTORING = object()  # the handle of a LISTEN the engine sends to restore a bin's listens


def _report_unsolicited(header: dict, where: str) -> None:
    """Log an id-0 frame that is neither a notification nor a keepalive: an error the
    server could not tie to a request, or its 421 before it closes an idle
    connection (if the connection cannot go on, the server closes it next)."""
    error = reply_error(header, "unsolicited frame")
    level = logging.INFO if getattr(error, "code", None) == UNAVAILABLE else logging.WARNING
    log.log(level, "error reply from %s for no request: %s", where, error)


__all__ = ["Call", "DEAD", "Engine", "Listens", "Notice", "PROBE", "READY", "RawValue", "Restored", "frame_of",
           "next_request_id"]
