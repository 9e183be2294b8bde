"""The express lane of a blocking client's connection: a lone small call in one send and one read.

Most calls of an actor's or a learner's loop are alike: a small tensor put, a bin
read, on a connection that nothing else is using at that moment.  The general
path serves every case (:mod:`.member`: the coalescer, the reader's role handed
between threads, the engine's decoder and events; :mod:`.values`: a
:class:`~.values.Call` planned, settled and decoded) and costs that call about
three times what its bytes need.  :class:`Express` takes such a call when the
connection is idle -- no call in flight, nothing held back or owed to the
server, no listen, no keepalive probe due, no thread reading or sending -- and
does only what it must: the request built by the same
:func:`~.connection.request_frame` (arguments checked, the value encoded: a lone
small CPU tensor, or none) -- or, for a call naming only a bin, from a head prepared
for its verb and bin (:func:`~.connection.bin_request`, the same checks) --, one ``send``, a wait for the reply (polling first
where :mod:`.spin` says it pays), one read into the engine's own buffer, the reply
parsed in one step (:func:`~tensorshare.wire.frames.whole_frames`), checked
against the command's declaration and decoded as the general path decodes it --
or, for the replies the server makes from a prepared template (a put's count, a
ping's, a read of one item: ``Message.head``, ``Message.lone``), read back with
that template: one ``struct.unpack``, no map decoded.

Everything else goes the general way.  Before anything is sent, the call is
declined (:data:`MISSED`) and the caller sends it as usual.  After, whatever is
not the plain success it expects -- an error reply, a reply that did not come
whole in that read, one referring to the server's files, a wait cut short by the
keepalive's next look -- is handed over where it stands: the call is made as the
general path would have made it, tracked by the engine, the bytes already read fed
to its decoder, and the member reads and settles the rest
(:meth:`~.member.Member.resume`), so errors, fallbacks and resets are decided in
one place; a call its caller leaves (a timeout, an interrupt) is given up as the
general path gives one up (a take resets the connection).  The send lock is held for the round trip: a request of another
thread waits behind it, so its reply is the next frame on the connection.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import TimeoutError
from ..protocol.engine import next_request_id
from ..protocol.items import item_table
from ..protocol.messages import ITEMS, Key, ZeroCopy
from ..protocol.prepared import ref_fields
from ..wire.build import lone_copy
from ..wire.codec import small_lone
from ..wire.frames import whole_frames
from .connection import NO_VALUE, bin_request, decode_items, reply_result, request_frame
from .routing import asking_references
from .sockets import IDLE_CHECK, wait

MISSED = object()  # what :meth:`Express.call` returns for a call it did not take (nothing was sent)


class Express:
    """The express lane of one :class:`~.member.Member` (see the module docstring);
    ``front`` is the client it serves (its value layer, and its way to settle a
    call handed over)."""

    __slots__ = ("member", "front", "values")

    def __init__(self, member, front):
        self.member, self.front, self.values = member, front, front.values

    def call(self, command, fields: dict | None, value: Any, deadline: float | None, areas) -> Any:
        """The result of ``command`` with ``fields`` and ``value`` (NO_VALUE: none), or
        :data:`MISSED` where the connection is not idle or the call is not one this
        lane takes (then nothing was sent); ``areas``: the connection's shared areas
        when zero-copy is on.  Raises as the general path would."""
        member, values = self.member, self.values
        link, engine = member.link, member.engine
        if (link is None or link.tls or engine.calls or engine.outbox or engine.listens or member.coalescer.frames
                or values.releases or values.device_calls or values.device is not None
                or (fields and (Key.WAIT in fields or Key.BELOW in fields))):
            return MISSED
        now = time.monotonic()
        if now - engine.last_heard > IDLE_CHECK and now - engine.last_sent > IDLE_CHECK:
            return MISSED  # (first read what the server sent meanwhile: member._before_request)
        until = deadline
        if engine.keepalive is not None:
            until = member.next_check
            if now >= until:
                return MISSED  # the keepalive's look is due
            if deadline is not None and deadline < until:
                until = deadline
        sent_fields, ref = fields, None
        if areas is not None:
            role = command.zero_copy
            if role is ZeroCopy.STORE:
                if value is not NO_VALUE and areas.incoming is not None and areas.may_take(value, fields.get(Key.BIN)):
                    return MISSED  # through shared memory: routing.route
            elif role is not None:
                sent_fields = asking_references(fields, areas)
                ref = tuple(sent_fields[Key.REF])
        if value is not NO_VALUE:
            if type(value) is not torch.Tensor:
                return MISSED  # (a value of many arrays, or not a tensor: the general encoder)
            value = small_lone(value)
            if value is None:
                return MISSED
        send_lock = member.send_lock
        if not send_lock.acquire(False):
            return MISSED
        lock = member.lock
        with lock:
            taken = (not member.reading and link is member.link and not engine.calls
                     and engine.decoder.between_frames)  # (not amid a frame nobody awaits: a keepalive probe's)
            if taken:
                member.reading = True
        if not taken:
            send_lock.release()
            return MISSED
        sent = False
        try:
            rid = next_request_id()
            if fields is not None and len(fields) == 1 and type(fields.get(Key.BIN)) is str:  # (the usual call)
                data = bin_request(rid, command, fields[Key.BIN], value, engine.greeting.get(Key.MAX_FRAME),
                                   ref_fields(ref))
            else:
                data = request_frame(rid, command, sent_fields, value, engine.greeting.get(Key.MAX_FRAME))
            data = data[0] if len(data) == 1 else b"".join(data)
            engine.last_sent = now
            sock = link.sock
            sent = True  # (from here on the server may answer it)
            try:
                written = sock.send(data)
            except BlockingIOError:
                written = 0
            except OSError as exc:
                raise member.lost(link, exc) from None
            if written < len(data):  # (a socket that cannot take a small frame at once: the general way)
                member.send_locked(link, [memoryview(data)[written:]], deadline)
            try:
                if member.spin.limit:
                    member.spin.wait(link.ready_now, link.readable, until)
                else:
                    wait(link.readable, until)
            except TimeoutError:
                if until is deadline:
                    raise
                n = 0  # the keepalive's look is due: the general way looks, and reads the reply
            else:
                buffer = engine.buffer()  # (the decoder's own: what is read is where a handover needs it)
                try:
                    n = sock.recv_into(buffer)
                except BlockingIOError:  # (nothing there after all: the general way waits again)
                    n = 0
                except (OSError, ValueError) as exc:
                    raise member.lost(link, exc) from None
                else:
                    if not n:
                        raise member.lost(link, ConnectionResetError("server closed the connection"))
                    engine.last_heard = now
                    success = command.success
                    head = success.head
                    if head is not None:  # a reply the server makes from its prepared template, read with it
                        ints = head.read(buffer[:n])
                        if ints is not None and ints[0] == rid:
                            sent = False
                            header = dict(zip(head.keys, ints))
                            header[Key.CODE] = success.code
                            return self._result(command, fields, header, None, 0, areas)
                    elif success.lone is not None:  # a read of one item, likewise
                        one = success.lone.read(buffer[:n], engine.decoder.limits)
                        if one is not None and one[0] == rid:
                            sent = False
                            return self._one_item(command, *one[:4], buffer[one[4]:n], areas)
                    frames, end = whole_frames(buffer[:n], engine.decoder.limits)
                    if end == n and len(frames) == 1:
                        header, payload, payload_len = frames[0]
                        if (header.get(Key.ID) == rid and header.get(Key.CODE) == success.code
                                and Key.REFS not in header and Key.CUDA not in header
                                and (values.exports is None or Key.FREED not in header)):
                            sent = False  # (read whole: the connection is clear, whatever happens next)
                            success.check(header)
                            return self._result(command, fields, header, payload, payload_len, areas)
        except BaseException as exc:
            if sent and link is member.link:  # given up while the server may answer: as the general path gives up
                member.gave_up(self._tracked(rid, command, fields, areas, now), link, exc)
            sent = False
            raise
        finally:
            if not sent:
                send_lock.release()
                member.stop_reading()
        return self._handed_over(rid, command, fields, areas, n, deadline, now)

    def _result(self, command, fields: dict | None, header: dict, payload, payload_len: int, areas) -> Any:
        """What the call returns, given its checked success ``header`` and ``payload``
        (a view of the read buffer): what :meth:`.values.Values.read_result` gives."""
        if command.success.code == ITEMS:
            table = item_table(header, payload_len)
            item = lone_copy(table[0][0], payload_len, payload) if len(table) == 1 and payload_len else None
            if item is not None:  # (one tensor, as before)
                return reply_result(command, header, [item])
            sink = self.member.engine.decoder.sink_factory(header, payload_len)  # (the general path's memory)
            if payload_len:
                sink.write(payload)
            return reply_result(command, header, decode_items(header, sink.finish(), payload_len, areas=areas))
        if areas is not None and command.zero_copy is ZeroCopy.STORE:
            areas.note_put(fields.get(Key.BIN), header)  # readers map the bin, or no longer
        return reply_result(command, header, None)

    def _one_item(self, command, rid: int, seq: int, blob: bytes, size: int, payload, areas) -> Any:
        """:meth:`_result` of the reply to ``rid`` carrying one item (``blob``, ``size``
        bytes in ``payload``) at ``seq``, read with its template."""
        header = {Key.CODE: command.success.code, Key.ID: rid, Key.SEQ: seq, Key.ITEMS: [blob], Key.SIZES: [size]}
        item = lone_copy(blob, size, payload) if size else None
        if item is not None:  # (the usual case: a tensor whose description was decoded before)
            return reply_result(command, header, [item])
        return self._result(command, None, header, payload, size, areas)

    def _tracked(self, rid: int, command, fields: dict | None, areas, now: float):
        """The call sent as request ``rid``, made as :meth:`Client._on` makes it, now
        tracked by the engine (its reply awaited the general way)."""
        call = self.values.call(rid, command, fields, NO_VALUE, areas)
        with self.member.lock:
            self.member.engine.track(call, now)
        return call

    def _handed_over(self, rid: int, command, fields: dict | None, areas, n: int, deadline: float | None,
                     now: float) -> Any:
        """Go on with the call sent as request ``rid`` the general way: made as
        :meth:`Client._on` makes it, tracked, the ``n`` bytes already read fed to the
        engine, read and settled there.  (The caller holds the send lock and the
        reader's role.)"""
        member = self.member
        try:
            call = self._tracked(rid, command, fields, areas, now)
        except BaseException:  # (the connection went meanwhile: nobody is to read for it)
            member.stop_reading()
            raise
        finally:
            member.send_lock.release()
        member.resume(call, n, deadline)
        return self.front._settled(member, call, deadline)
