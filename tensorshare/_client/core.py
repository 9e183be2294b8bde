"""What both clients do the same way, whatever carries their bytes.

:class:`ClientCore` holds a client's options and its transport-free state: the
one table of calls in flight (:mod:`.calls`), its listens (:mod:`.listens`), the
replies whose shared-memory references it may release, and the reply memory it
reuses.  It plans each request (:mod:`.routing`: over TCP or through shared
memory), settles each attempt (a reply checked and decoded, or an error, with the
fallback attempt a zero-copy refusal calls for), sorts incoming frames into
replies and notifications, and listens again after a reconnection.

A subclass supplies the transport: :meth:`_call` (a call as the client's style
wants it: blocking, or a Deferred), :meth:`_submit` (a call whose outcome goes to a
callback) and the current connection (:meth:`_connection`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import DeviceError, TensorShareError, ProtocolError, ZeroCopyError
from ..protocol.auth import resolve_token
from ..protocol.messages import COMMANDS, LISTEN, MAX_RELEASE_IDS, UNLISTEN, Command, Key, ZeroCopy
from ..protocol.tls import TLSSettings
from ..wire.frames import Frame
from .calls import Call, CallTable
from ..protocol.items import item_table
from .connection import (
    NO_VALUE, ClientConnection, ListenSnapshot, Reply, next_request_id, notification_of,
    read_reply, reply_buffers, report_unsolicited, request_frame,
)
from .devices import as_into, caller_of, check_device, pinned, receive_on_device
from .listens import Subscriptions
from .methods import DEFAULT, ClientMethods, bin_fields
from .routing import finish, next_attempt, route

log = logging.getLogger("tensorshare.client")


class ClientCore(ClientMethods):
    """The transport-free part of a client (see the module docstring)."""

    _workers = None  # _client/workers.Workers when the server runs several workers: calls go to members

    def _init_core(self, host: str, port: int, *, timeout: float | None, device: Any, zero_copy: bool,
                   reuse: int, token, tls: TLSSettings | None, keepalive: float | None, lock) -> None:
        self.host, self.port = host, port
        self.timeout = timeout
        self.device = check_device(device)  # (a device it cannot build on fails here, not at a take)
        self.zero_copy = zero_copy
        self.keepalive = keepalive or None
        self._token = resolve_token(token)
        self._tls = tls
        self._buffers = reply_buffers(reuse)  # arrays large replies were received into
        self._lock = lock  # guards the call table, the listens and the releases
        self._calls = CallTable()
        self._listens = Subscriptions()
        self._releases: list[int] = []  # 226 replies whose references we mapped: told to the server
        self._release_lock = threading.Lock()
        self._closed = False
        # Large replies go straight to device memory once a call may want a device (devices.py).
        self._device_calls = device is not None and _has_engine(device)
        self._uuids: dict = {}  # device -> its UUID where it opens device references, else None
        self._exports = None  # exports.Exports: snapshots this client put by device reference

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _new_connection(self) -> ClientConnection:
        conn = ClientConnection(token=self._token, reuse=self._buffers, where=self._where)
        if self._device_calls:
            receive_on_device(conn, self)
        return conn

    def _connection(self) -> ClientConnection | None:
        """The protocol state of the current connection (None while disconnected)."""
        raise NotImplementedError

    def _submit(self, command: Command, fields: dict | None, value: Any, callback: Callable, *,
                zero_copy: bool = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, on_reply: Callable | None = None, decode: bool = True,
                raw: bool = False) -> None:
        """Send a call whose ``callback(result, error)`` runs when it is settled
        (``then``, ``on_error``, ``on_reply``, ``decode``, ``raw``: see
        :class:`~.calls.Call`)."""
        raise NotImplementedError

    # -- calls

    def _new_call(self, command: Command, fields: dict | None, value: Any, areas, callback: Callable | None = None,
                  then: Callable | None = None, on_error: Callable | None = None, on_reply: Callable | None = None,
                  deadline: float | None = None, decode: bool = True, raw: bool = False, device: Any = None,
                  into: Any = None) -> Call:
        """A call of ``command``, routed for ``areas`` (see :mod:`.routing`); its reply's
        tensors go to ``device`` (the client's if None), into ``into``'s tensors where
        given (:mod:`.devices`).  (Its arguments are checked as its frame is built; a
        value routed through shared memory is removed again if they are wrong.)"""
        if fields and Key.WAIT in fields:  # the server may hold it: silence until then is expected
            self._server_holds(fields[Key.WAIT])
        call = Call(next_request_id(), command, fields, value, callback, then, on_error, on_reply, deadline, decode,
                    raw)
        if device is not None or into is not None:
            self._wants_device(call, device, into)
        if self._device_calls:
            call.device = pinned(self.device if call.device is None else call.device)
            call.caller = caller_of(call.device, call.into is not None)
        if areas is not None:
            route(call, areas, self._device_uuid(call) if self._device_calls else None)
        return call

    def _device_uuid(self, call: Call) -> str | None:
        """The UUID of the device ``call``'s reply goes to, if that device opens device
        references (CUDA IPC), else None."""
        device = self.device if call.device is None else call.device
        if device is None:
            return None
        try:
            return self._uuids[device]
        except (KeyError, TypeError):
            from ..device import engine_for
            from ..device.ipc import shares

            engine = engine_for(device)
            uuid = engine.streams.uuid(engine.streams.index(device)) if shares(engine) else None
            try:
                self._uuids[device] = uuid
            except TypeError:  # an unhashable device: asked each time
                pass
            return uuid

    def _exported(self):
        """This client's :class:`~.exports.Exports` (made on first use)."""
        if self._exports is None:
            from .exports import Exports

            self._exports = Exports()
        return self._exports

    def _wants_device(self, call: Call, device: Any, into: Any) -> None:
        call.device, call.into = check_device(device), as_into(into)
        if not self._device_calls and _has_engine(device if device is not None else self.device):
            self._device_calls = True  # from now on, and on later connections
            conn = self._connection()
            if conn is not None:
                receive_on_device(conn, self)

    def _server_holds(self, wait: float) -> None:
        """A request that asks the server to hold it up to ``wait`` seconds is about
        to go: the keepalive (if any) expects silence meanwhile."""

    def _request_parts(self, call: Call) -> list:
        """The frame of ``call``'s current attempt, telling the server which
        references it may release.  The call lets go of the value then: a call in
        flight must not keep its value alive (a fallback sends a copy of its own)."""
        fields = self._with_releases(call.fields) if self._releases else call.fields
        conn = self._connection()
        greeting = None if conn is None else conn.greeting
        parts = request_frame(call.rid, call.command, fields, call.value,
                              max_payload=None if greeting is None else greeting.get(Key.MAX_FRAME))
        call.value = NO_VALUE
        return parts

    def _settle(self, call: Call, outcome: Frame | BaseException) -> tuple[Reply | None, BaseException | None] | None:
        """The end of one attempt of ``call``: ``(reply, None)`` or ``(None, error)``;
        None when the error calls for another attempt (``call`` then holds it, under
        a new request id: send it)."""
        if isinstance(outcome, BaseException):
            error = outcome
        else:
            try:
                reply = self._read(call, outcome)
            except TensorShareError as exc:
                error = exc
            else:
                finish(call)
                return reply, None
        if call.caller is not None:  # nothing may write into its tensors once it failed
            call.caller.abandon()
        if next_attempt(call, error):
            call.rid, call.outcome = next_request_id(), None
            return None
        finish(call)
        return None, error

    def _result(self, call: Call, reply: Reply | None, error: BaseException | None) -> tuple[Any, BaseException | None]:
        """What the caller of a settled call gets: ``(result, None)`` or ``(None, error)``
        (``then`` maps the reply; ``on_error`` may handle the error)."""
        if error is not None:
            if call.on_error is not None and call.on_error(error):
                return None, None
            return None, error
        if call.raw:
            return reply, None
        try:
            return (reply.result if call.then is None else call.then(reply)), None
        except TensorShareError as exc:
            return None, exc
        finally:
            if reply.held is not None:  # done with the files it refers to: the server may let them go
                with self._release_lock:
                    self._releases.append(reply.held)

    def _call_back(self, call: Call, reply: Reply | None, error: BaseException | None) -> None:
        """Run a settled non-blocking call's callback."""
        call.callback(*self._result(call, reply, error))

    def _read(self, call: Call, frame: Frame) -> Reply:
        """The checked reply; items it refers to are mapped from the server's files
        (or, undecoded, located: :attr:`Reply.stored`, released after ``then``)."""
        conn = frame.origin
        areas = conn.areas if conn is not None else None
        if self._exports is not None:
            freed = frame.header.get(Key.FREED)
            if freed:  # snapshots this client put by device reference that the server holds no more
                self._exports.freed(freed)
        refs = (areas is not None and (frame.header.get(Key.REFS) or frame.header.get(Key.CUDA))
                and conn is self._connection())
        if not call.decode and frame.header.get(Key.REFS) and not refs:  # a connection since replaced
            raise ZeroCopyError("the reply refers to files of a connection that is gone")
        device = self.device if call.device is None else call.device
        if refs and not call.decode:
            try:
                reply = read_reply(call.command, frame, device, decode=False)
                reply.stored = [None if ref is None else areas.item(ref, blob, size)
                                for blob, size, ref in item_table(reply.header, frame.payload_len)]
            except BaseException:
                with self._release_lock:
                    self._releases.append(frame.header[Key.ID])
                raise
            reply.held = frame.header[Key.ID]
            return reply
        if areas is not None and call.command.zero_copy is ZeroCopy.STORE:
            areas.note_put(call.fields.get(Key.BIN), frame.header)  # readers map the bin, or no longer
        try:
            return read_reply(call.command, frame, device, areas=areas if call.decode else None,
                              decode=call.decode, into=call.into, caller=call.caller)
        except TensorShareError:
            raise
        except Exception as exc:  # torch could not put the values on the device (out of its memory, say)
            if device is None or not call.decode:
                raise
            raise _unplaced(call, frame, areas, device, exc) from exc
        finally:
            if refs:
                with self._release_lock:  # mapped (or failed): the server may let the files go
                    self._releases.append(frame.header[Key.ID])

    def _with_releases(self, fields: dict | None) -> dict | None:
        """``fields`` plus the ids of replies whose references we no longer need."""
        if not self._releases:
            return fields
        with self._release_lock:  # (the rest go with the next requests)
            ids, self._releases = self._releases[:MAX_RELEASE_IDS], self._releases[MAX_RELEASE_IDS:]
        return {**fields, Key.RELEASE: ids} if fields else {Key.RELEASE: ids}

    def _shared_areas(self):
        conn = self._connection()
        return conn.areas if conn is not None else None

    # -- incoming frames

    def _sort(self, frame: Frame, conn: ClientConnection, jobs: list) -> Call | None:
        """Sort one incoming frame (under the client's lock): the call it answers, taken
        out of the table with its ``on_reply`` run (None if nobody waits for it any
        more); or, for a notification, its listeners' callbacks added to ``jobs``."""
        frame.origin = conn  # replies refer to what this connection's greeting offered
        rid = frame.header.get(Key.ID)
        if type(rid) is not int:
            raise ProtocolError(f"reply id must be an integer, got {rid!r:.40}")
        if rid:
            call = self._calls.pop(rid)
            if call is not None and call.on_reply is not None:
                call.on_reply(frame)
            return call
        note = notification_of(frame)
        if note is not None:
            jobs.extend((handle.callback, (note,)) for handle in self._listens.handles(note.bin))
        else:
            report_unsolicited(frame, self._where)
        return None

    # -- listening again after a reconnection

    def _relisten(self, only: list[str] | None = None) -> None:
        """Listen again, on a new connection, to the bins that have handles (``only``
        those named)."""
        with self._lock:
            names = [(name, self._listens.first_append_only(name)) for name in only or self._listens.names()]
        for name, first_append_only in names:
            fields = bin_fields(name)
            if first_append_only:
                fields[Key.FIRST_APPEND] = True
            self._submit(LISTEN, fields, NO_VALUE, self._relistened(name), raw=True)

    def _relistened(self, name: str) -> Callable:
        def deliver(reply: Reply | None, error: BaseException | None) -> None:
            if error is not None:
                log.warning("could not listen to %r again after reconnecting: %s", name, error)
                return
            note = ListenSnapshot.of(reply.header).as_notification(name)
            with self._lock:
                handles = self._listens.handles(name)
            for handle in handles:
                handle.callback(note)
        return deliver

    # -- a multi-worker server's members (_client/workers.py)

    def _owner_of(self, name: str) -> "ClientCore":
        """The client that serves bin ``name``: this one, or the member of its worker."""
        workers = self._workers
        return self if workers is None else workers.member_of(name)

    def _listens_taken(self) -> list:
        """Every listen handle of this client, forgotten here (they move to another)."""
        with self._lock:
            handles = [handle for name in self._listens.names() for handle in self._listens.handles(name)]
            self._listens.clear()
        return handles

    def _adopt_listen(self, handle) -> None:
        """Make ``handle`` (of another client that served its bin) one of this client's,
        and listen to its bin here."""
        handle.client = self
        with self._lock:
            first = handle.bin not in self._listens
            self._listens.add(handle)
        if first:
            self._relisten([handle.bin])
        self._listening(handle)

    def _forget_listen(self, name: str) -> None:
        try:
            self._submit(UNLISTEN, bin_fields(name), NO_VALUE, _ignore)
        except TensorShareError:
            pass


def _ignore(reply: Any, error: Any) -> None:
    pass


def _unplaced(call: Call, frame: Frame, areas, device: Any, exc: Exception) -> DeviceError:
    """The error of a reply whose values could not be put on ``device``: it holds them,
    built in host memory, so that items a take removed from the server are not lost."""
    try:
        items = read_reply(call.command, frame, None, areas=areas).values
    except Exception as again:  # (not even on the host: the reply itself is bad)
        return DeviceError(f"the reply's values could not be built on {device!r} ({exc}), nor in host memory "
                           f"({again})")
    return DeviceError(f"the reply's {len(items or ())} values could not be built on {device!r}: {exc}; they are in "
                       f"this error's .items, in host memory", items)


def _has_engine(device: Any) -> bool:
    """Whether replies can go straight to ``device`` (a transfer engine serves it)."""
    if device is None:
        return False
    from ..device import engine_for

    return engine_for(device) is not None


__all__ = ["ClientCore"]
