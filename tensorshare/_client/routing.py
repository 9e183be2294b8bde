"""How a request travels: over TCP, or through the server's shared memory.

Written once for both clients.  :func:`route` decides for one call, given the
shared areas the connection verified (:mod:`.zerocopy`; None when it has none) and
the zero-copy role its command declares (``Command.zero_copy``):

* ``STORE`` (PUT, APPEND, TINSERT): a value holding :meth:`~.zerocopy.SharedAreas.shared`
  tensors (their pages are handed over), or a large value of a bin that readers on
  this host map (the server says so in its replies, ``mapped``: a value over TCP
  would reach them inline first), is written into this connection's incoming
  directory, and the request names it instead of carrying its bytes; any other
  value goes over TCP, which is faster than writing it into new shared-memory
  pages.  A table's rows (TINSERT) go that way when they are large enough and the
  caller asks (``insert(..., shared=True)``) or, by default, the server said so in
  its replies to inserts into that table (``mapped``: a table in files takes them
  from the writer's files as they are): both sides are spared the socket's copies.
  The writer writes its next rows into the same files.  If the server does not
  take it (425), the fallback sends the written copy over TCP (the caller may
  have changed the original since);
* ``READ`` and ``TAKE`` (PEEK, TREAD; GET, TSAMPLE): the request asks for
  references to the items' files (or to the stacked rows).  If those cannot be
  mapped (:class:`ZeroCopyError`), a ``READ`` is sent again over TCP; a ``TAKE``'s
  items were taken (its rows counted), so its error stands, as does that of a read
  that counts its rows (TREAD with ``sample``: ``Command.taken_with``);
* a read whose verb takes devices (``cuda``: PEEK) and whose tensors go to a CUDA
  device also names that device: items put by device reference come as
  references, copied device to device (PROTOCOL.md §13).  If one cannot be read
  (:class:`DeviceReferenceError`), the read is sent again for the bytes;
* anything else travels over TCP as it is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import DeviceReferenceError, ZeroCopyError, ZeroCopyUnavailableError
from ..protocol.messages import Key, ZeroCopy
from ..protocol.schema import Payload
from ..wire.codec import Encoded, encode
from .connection import NO_VALUE

if TYPE_CHECKING:
    from .values import Call

log = logging.getLogger("tensorshare.client")


def route(call: Call, areas, device_uuid: str | None = None, asked: bool = True) -> None:
    """Set ``call``'s first attempt (its ``fields``, ``value``, ``fallback`` and
    ``cleanup``) for the connection's :class:`~.zerocopy.SharedAreas` ``areas``;
    ``device_uuid``: the device the reply's tensors go to, where it can open
    device references; ``asked``: the caller asked for shared memory (False: only
    where the server said it pays, :meth:`~.zerocopy.SharedAreas.may_take`)."""
    if areas is None:
        return
    role = call.command.zero_copy
    if role is ZeroCopy.STORE:
        copied = call.command.payload is Payload.ROWS  # (a table's rows: copied into its columns)
        if call.value is not NO_VALUE and areas.incoming is not None and areas.may_take(
                call.value, call.fields.get(Key.BIN), copied, asked):
            _through_shared_memory(call, areas, copied)
    elif role is not None:  # READ or TAKE
        fields = call.fields
        call.fields = asking_references(fields, areas)
        taken_with = call.command.taken_with
        if role is ZeroCopy.READ and not (taken_with and fields and fields.get(taken_with)):
            call.fallback = _read_over_tcp
        if device_uuid is not None and Key.CUDA in call.command.keys:
            call.fields[Key.CUDA] = [device_uuid]


def asking_references(fields: dict | None, areas) -> dict:
    """``fields`` of a read that asks for references to the items' files in the
    connection's shared ``areas`` instead of their bytes (PROTOCOL.md §10.3)."""
    return {**fields, Key.REF: areas.usable} if fields else {Key.REF: areas.usable}


def next_attempt(call: Call, error: BaseException) -> bool:
    """Make ``call``'s next attempt the one ``error`` calls for; False if none does.
    (A fallback may set the one after it.)"""
    fallback, call.fallback = call.fallback, None
    following = None if fallback is None else fallback(call, error)
    if following is None:
        return False
    call.fields, call.value = following
    return True


def finish(call: Call) -> None:
    """The last attempt of ``call`` is over: clean up what the first one left."""
    cleanup, call.cleanup = call.cleanup, None
    if cleanup is not None:
        cleanup()


def _through_shared_memory(call: Call, areas, copied: bool = False) -> None:
    fields = call.fields
    enc = call.value = call.value if type(call.value) is Encoded else encode(call.value, views=True)
    try:
        name = areas.write(enc, fields.get(Key.TAG), copied or fields.get(Key.BIN) in areas.mapped, copied)
    except (OSError, ValueError) as exc:  # shared memory full, or a value its layout cannot hold
        log.info("cannot write a value to shared memory (%s): sending it over TCP", exc)
        name = None
    if name is None:  # too small to gain, or shared memory full
        return

    def over_tcp(call: Call, error: BaseException) -> tuple | None:
        if not isinstance(error, ZeroCopyUnavailableError):
            return None
        log.info("the server did not take a value through shared memory (%s): sending it over TCP", error)
        if copied:  # (not to be written into again: the server would refuse it again)
            areas.not_kept(name)
        try:
            return fields, areas.written(name)
        except OSError:
            return None

    call.fields = {**fields, Key.VALUE: enc.description, Key.SHM: name, Key.SIZE: enc.nbytes}
    call.value = NO_VALUE
    call.fallback = over_tcp
    if copied:  # answered: the server is done with the files (unanswered: it may still read them)
        call.cleanup = lambda: areas.reuse(name) if call.frame is not None else areas.discard(name)
    else:
        call.cleanup = lambda: areas.discard(name)


def _read_over_tcp(call: Call, error: BaseException) -> tuple | None:
    if not isinstance(error, ZeroCopyError):
        return None
    if isinstance(error, DeviceReferenceError) and Key.CUDA in call.fields:
        log.info("cannot read an item by device reference (%s): reading its bytes", error)
        call.fallback = _read_over_tcp  # (mapping them may fail in turn)
        return {key: value for key, value in call.fields.items() if key != Key.CUDA}, NO_VALUE
    log.warning("cannot map what the server referred to (%s): reading it over TCP", error)
    return {key: value for key, value in call.fields.items() if key != Key.REF and key != Key.CUDA}, NO_VALUE
