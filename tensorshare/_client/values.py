"""The value layer a user client adds on top of the engine: calls planned, encoded, settled and decoded.

The engine (:mod:`tensorshare.protocol.engine`) moves raw values; a user client
speaks in tensors.  :class:`Values` is that layer, one per client, handed to its
front: it makes a :class:`Call` (routing it over TCP or through the server's shared
memory, :mod:`.routing`; its reply's tensors bound for a device, :mod:`.devices`),
builds its frame (arguments checked, value encoded, the references the client is
done with released), settles each attempt (a reply checked and decoded, or an
error, with the fallback attempt a zero-copy refusal calls for) and gives the
caller its result.  What it keeps: the client's default device, the reply memory
it reuses, the replies whose shared files it may release, the snapshots it put by
device reference.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import DeviceError, TensorShareError, ZeroCopyError
from ..protocol.engine import Call as EngineCall, next_request_id
from ..protocol.items import item_table
from ..protocol.messages import ITEMS, MAX_RELEASE_IDS, Key, ZeroCopy
from ..protocol.placement import merged_header
from ..wire.frames import REUSE_MIN, BufferSink, buffer_sink
from .connection import NO_VALUE, Reply, decode_items, read_reply, reply_buffers, reply_result, request_frame
from .devices import DEVICE_MIN, as_into, caller_of, check_device, pinned
from .routing import finish, next_attempt, route

log = logging.getLogger("tensorshare.client")

SMALL_PAYLOAD = min(REUSE_MIN, DEVICE_MIN)  # smaller reply payloads go into a new array of their own


class Call(EngineCall):
    """One request of a user client: the engine's call (id, command, fields, reply)
    plus its current attempt's ``value`` (with the ``fallback`` a refusal calls for
    and the ``cleanup`` to run when it is over, :mod:`.routing`), what to do with the
    reply and where the outcome goes.

    ``callback(result, error)`` receives the reply mapped by ``then`` (by default the
    reply's result; with ``raw``, the :class:`~.connection.Reply` itself); without
    a callback a caller waits.  ``on_error(error)`` may handle an error (returning
    True: the result is then None).  ``device`` and ``into``: where the reply's
    tensors go (:mod:`.devices`); ``inline``: the callback is quick and safe on the
    reading thread; ``via``: the member (connection) it went on."""

    __slots__ = ("value", "fallback", "cleanup", "callback", "then", "on_error", "decode", "raw", "inline",
                 "device", "into", "caller", "areas", "via")

    def __init__(self, rid: int, command, fields: dict | None, value: Any = NO_VALUE):
        # (the engine's fields set here too: one __init__ per call, not two)
        self.rid, self.command, self.fields = rid, command, fields
        self.frame = self.error = self.handle = self.deadline = None
        self.value = value
        self.fallback = self.cleanup = self.callback = self.then = self.on_error = None
        self.decode, self.raw, self.inline = True, False, False
        self.device = self.into = self.caller = self.areas = self.via = None


def _located(areas, header: dict, payload_len: int) -> list:
    """Per item of an undecoded reply, where the server's files hold it (None: in the
    payload).  (Apart from :meth:`Values._read`: a comprehension there made a cell
    for ``areas`` on every call.)"""
    return [None if ref is None else areas.item(ref, blob, size) for blob, size, ref in item_table(header, payload_len)]


class Values:
    """The value layer of one client (see the module docstring)."""

    def __init__(self, device: Any, zero_copy: bool, reuse: int):
        self.device = check_device(device)  # (a device it cannot build on fails here, not at a take)
        self.zero_copy = zero_copy
        self.buffers = reply_buffers(reuse)  # arrays large replies were received into
        self.sink = buffer_sink if self.buffers is None else _ReusingSink(self.buffers)
        self.releases: list[int] = []  # 226 replies whose references we mapped: told to the server
        self.release_lock = threading.Lock()
        # Large replies go straight to device memory once a call may want a device (devices.py).
        self.device_calls = device is not None and has_engine(device)
        self.uuids: dict = {}  # device -> its UUID where it opens device references, else None
        self.exports = None  # exports.Exports: snapshots this client put by device reference

    # -- making a call

    def call(self, rid: int, command, fields: dict | None, value: Any, areas, device: Any = None,
             into: Any = None, asked: bool = True) -> Call:
        """A call of ``command``, routed for the connection's shared ``areas`` (None:
        over TCP; ``asked``: see :func:`~.routing.route`); its reply's tensors go to
        ``device`` (the client's if None), into ``into``'s tensors where given."""
        call = Call(rid, command, fields, value)
        if device is not None or into is not None:
            self.wants_device(call, device, into)
        if self.device_calls:
            call.device = pinned(self.device if call.device is None else call.device)
            call.caller = caller_of(call.device, call.into is not None)
        if areas is not None:
            call.areas = areas
            if command.zero_copy is not None:
                route(call, areas, self.device_uuid(call) if self.device_calls else None, asked)
        return call

    def wants_device(self, call: Call, device: Any, into: Any) -> None:
        call.device, call.into = check_device(device), as_into(into)
        if not self.device_calls and has_engine(device if device is not None else self.device):
            self.device_calls = True  # from now on: large replies are received through the engine

    def device_uuid(self, call: Call) -> str | None:
        """The UUID of the device ``call``'s reply goes to, if it opens device references."""
        device = self.device if call.device is None else call.device
        if device is None:
            return None
        try:
            return self.uuids[device]
        except (KeyError, TypeError):
            from ..device import engine_for
            from ..device.ipc import shares

            engine = engine_for(device)
            uuid = engine.streams.uuid(engine.streams.index(device)) if shares(engine) else None
            try:
                self.uuids[device] = uuid
            except TypeError:  # an unhashable device: asked each time
                pass
            return uuid

    def frame(self, call: Call, greeting: dict | None) -> list:
        """The frame of ``call``'s current attempt, telling the server which references it
        may release.  The call lets go of the value then: a call in flight must not keep
        its value alive (a fallback sends a copy of its own)."""
        fields = self._with_releases(call.fields) if self.releases else call.fields
        parts = request_frame(call.rid, call.command, fields, call.value,
                              max_payload=None if greeting is None else greeting.get(Key.MAX_FRAME))
        call.value = NO_VALUE
        return parts

    def _with_releases(self, fields: dict | None) -> dict | None:
        if not self.releases:
            return fields
        with self.release_lock:  # (the rest go with the next requests)
            ids, self.releases = self.releases[:MAX_RELEASE_IDS], self.releases[MAX_RELEASE_IDS:]
        return {**fields, Key.RELEASE: ids} if fields else {Key.RELEASE: ids}

    def release(self, rid: int) -> None:
        with self.release_lock:
            self.releases.append(rid)

    # -- its outcome

    def settle(self, call: Call, current_areas) -> tuple[Reply | None, BaseException | None] | None:
        """The end of one attempt of ``call``: ``(reply, None)`` or ``(None, error)``; None
        when the error calls for another attempt (``call`` then holds it, under a new
        request id: send it).  ``current_areas``: the areas of the connection now (a
        reply referring to files of a connection since replaced cannot be mapped)."""
        error = call.error
        if error is None:
            try:
                reply = self.read(call, current_areas)
            except TensorShareError as exc:
                error = exc
            else:
                finish(call)
                return reply, None
        if call.caller is not None:  # nothing may write into its tensors once it failed
            call.caller.abandon()
        if next_attempt(call, error):
            call.rid, call.frame, call.error = next_request_id(), None, None
            return None
        finish(call)
        return None, error

    def read(self, call: Call, current_areas) -> Reply:
        """The decoded reply of ``call`` (checked by the engine); items it refers to are
        mapped from the server's files (or, undecoded, located: ``Reply.stored``,
        released after ``then``)."""
        read = self._read(call, current_areas)
        return read if type(read) is Reply else Reply(call.command, call.frame.header, read, call.frame)

    def read_result(self, call: Call, current_areas) -> Any:
        """``read(call, current_areas).result`` without making the :class:`Reply` (a
        blocking call's usual ending)."""
        read = self._read(call, current_areas)
        if type(read) is Reply:
            return read.result
        return reply_result(call.command, call.frame.header, read)

    def _read(self, call: Call, current_areas) -> Reply | list | None:
        """:meth:`read`'s work: the decoded items (None: the reply carries none), or the
        whole :class:`Reply` of an undecoded reply that refers to stored items."""
        frame = call.frame
        header = frame.header
        areas = call.areas
        if self.exports is not None:
            freed = header.get(Key.FREED)
            if freed:  # snapshots this client put by device reference that the server holds no more
                self.exports.freed(freed)
        refs = areas is not None and (header.get(Key.REFS) or header.get(Key.CUDA)) and areas is current_areas
        if not call.decode and header.get(Key.REFS) and not refs:  # a connection since replaced
            raise ZeroCopyError("the reply refers to files of a connection that is gone")
        device = self.device if call.device is None else call.device
        if refs and not call.decode:
            try:
                reply = read_reply(call.command, frame, device, decode=False)
                reply.stored = _located(areas, reply.header, frame.payload_len)
            except BaseException:
                self.release(header[Key.ID])
                raise
            reply.held = header[Key.ID]
            return reply
        if areas is not None and call.command.zero_copy is ZeroCopy.STORE:
            areas.note_put(call.fields.get(Key.BIN), header)  # readers map the bin, or no longer
        try:  # (checked against its declaration by the engine already)
            if call.decode and header.get(Key.CODE) == ITEMS:
                return decode_items(header, frame.payload, frame.payload_len, device, areas=areas, into=call.into,
                                    caller=call.caller)
            return None
        except TensorShareError:
            raise
        except Exception as exc:  # torch could not put the values on the device (out of its memory, say)
            if device is None or not call.decode:
                raise
            raise _unplaced(call, areas, device, exc) from exc
        finally:
            if refs:  # mapped (or failed): the server may let the files go
                self.release(header[Key.ID])

    def result(self, call: Call, reply: Reply | None, error: BaseException | None) -> tuple[Any, BaseException | None]:
        """What the caller of a settled call gets: ``(result, None)`` or ``(None, error)``."""
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
                self.release(reply.held)

    # -- where replies land

    def sinks(self, engine) -> Callable:
        """The payload sinks of ``engine``'s connections: large replies to calls that
        want a device go there as they arrive."""
        plain = self.sink

        def sink(header: dict, nbytes: int):
            if not nbytes:  # most replies: one shared sink, no object per frame
                return _NO_PAYLOAD
            if nbytes < SMALL_PAYLOAD:  # (neither reused memory nor a device's: a new array, directly)
                return BufferSink(nbytes)
            if nbytes >= DEVICE_MIN and self.device_calls:
                from .devices import device_sink

                try:
                    made = device_sink(engine.calls.get(header.get(Key.ID)), self.device, header, nbytes)
                except RuntimeError as exc:  # no room on the device: received in host memory (a take loses nothing)
                    log.warning("a reply of %d bytes is received in host memory: %s", nbytes, exc)
                    made = None
                if made is not None:
                    return made
            return plain(header, nbytes)

        return sink

    def exported(self):
        """This client's :class:`~.exports.Exports` (made on first use)."""
        if self.exports is None:
            from .exports import Exports

            self.exports = Exports()
        return self.exports

    def close(self) -> None:
        if self.exports is not None:
            self.exports.close()
        if self.buffers is not None:
            self.buffers.clear()


def same_reply(reply: Reply) -> Reply:
    """``then`` that keeps a call's whole reply (to merge it with others)."""
    return reply


def merged_result(command, replies: list[Reply], then: Callable | None) -> Any:
    """What a ``MERGE`` call returns, given its workers' ``replies``: ``then`` of the one
    reply of the whole server (:func:`~tensorshare.protocol.placement.merged_header`),
    or its result."""
    reply = Reply(command, merged_header(command.result, [reply.header for reply in replies]), None,
                  replies[0].frame)
    return reply.result if then is None else then(reply)


def _unplaced(call: Call, areas, device: Any, exc: Exception) -> DeviceError:
    """The error of a reply whose values could not be put on ``device``: it holds them,
    built in host memory, so that items a take removed from the server are not lost."""
    try:
        items = read_reply(call.command, call.frame, None, areas=areas).values
    except Exception as again:  # (not even on the host: the reply itself is bad)
        return DeviceError(f"the reply's values could not be built on {device!r} ({exc}), nor in host memory "
                           f"({again})")
    return DeviceError(f"the reply's {len(items or ())} values could not be built on {device!r}: {exc}; they are in "
                       f"this error's .items, in host memory", items)


class _NoPayload:
    """The sink of every frame without a payload (its payload: the one shared empty array)."""

    __slots__ = ("array",)

    def __init__(self):
        self.array = None

    def finish(self):
        if self.array is None:
            self.array = buffer_sink({}, 0).finish()
        return self.array


_NO_PAYLOAD = _NoPayload()


class _ReusingSink:
    """buffer_sink with a recycler of reply arrays (one bound method, no partial per frame)."""

    __slots__ = ("reuse",)

    def __init__(self, reuse):
        self.reuse = reuse

    def __call__(self, header: dict, nbytes: int):
        return buffer_sink(header, nbytes, self.reuse)


def has_engine(device: Any) -> bool:
    """Whether replies can go straight to ``device`` (a transfer engine serves it)."""
    if device is None:
        return False
    from ..device import engine_for

    return engine_for(device) is not None


__all__ = ["Call", "Values", "has_engine", "merged_result", "same_reply"]
