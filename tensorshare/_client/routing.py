"""How a request travels: over TCP, or through the server's shared memory.

Written once for both clients.  :func:`route` decides for one call, given the
shared areas the connection verified (:mod:`.zerocopy`; None when it has none) and
the zero-copy role its command declares (``Command.zero_copy``):

* ``STORE`` (PUT, APPEND): a value large enough to gain is written into this
  connection's incoming directory, and the request names it instead of carrying
  its bytes.  If the server does not take it (425), the fallback sends the written
  copy over TCP (the caller may have changed the original since);
* ``READ`` and ``TAKE`` (PEEK, TREAD; GET, TSAMPLE): the request asks for
  references to the items' files (or to the stacked rows).  If those cannot be
  mapped (:class:`ZeroCopyError`), a ``READ`` is sent again over TCP; a ``TAKE``'s
  items were taken (its rows counted), so its error stands;
* anything else travels over TCP as it is.
"""

from __future__ import annotations

import logging

from ..errors import ZeroCopyError, ZeroCopyUnavailableError
from ..protocol.messages import Key, ZeroCopy
from ..wire.codec import encode
from .calls import Call
from .connection import NO_VALUE

log = logging.getLogger("tensorshare.client")


def route(call: Call, areas) -> None:
    """Set ``call``'s first attempt (its ``fields``, ``value``, ``fallback`` and
    ``cleanup``) for the connection's :class:`~.zerocopy.SharedAreas` ``areas``."""
    if areas is None:
        return
    role = call.command.zero_copy
    if role is ZeroCopy.STORE:
        if call.value is not NO_VALUE and areas.incoming is not None and not areas.too_small(call.value):
            _through_shared_memory(call, areas)
    elif role is not None:  # READ or TAKE
        fields = call.fields
        call.fields = {**fields, Key.REF: areas.usable} if fields else {Key.REF: areas.usable}
        if role is ZeroCopy.READ:
            call.fallback = _read_over_tcp


def next_attempt(call: Call, error: BaseException) -> bool:
    """Make ``call``'s next attempt the one ``error`` calls for; False if none does."""
    following = None if call.fallback is None else call.fallback(call, error)
    if following is None:
        return False
    call.fields, call.value = following
    call.fallback = None
    return True


def finish(call: Call) -> None:
    """The last attempt of ``call`` is over: clean up what the first one left."""
    cleanup, call.cleanup = call.cleanup, None
    if cleanup is not None:
        cleanup()


def _through_shared_memory(call: Call, areas) -> None:
    fields = call.fields
    enc = call.value = encode(call.value)
    try:
        name = areas.write(enc, fields.get(Key.TAG))
    except (OSError, ValueError) as exc:  # shared memory full, or a value its layout cannot hold
        log.info("cannot write a value to shared memory (%s): sending it over TCP", exc)
        name = None
    if name is None:  # too small to gain, or shared memory full
        return

    def over_tcp(call: Call, error: BaseException) -> tuple | None:
        if not isinstance(error, ZeroCopyUnavailableError):
            return None
        log.info("the server did not take a value through shared memory (%s): sending it over TCP", error)
        try:
            return fields, areas.written(name)
        except OSError:
            return None

    call.fields = {**fields, Key.VALUE: enc.description, Key.SHM: name, Key.SIZE: enc.nbytes}
    call.value = NO_VALUE
    call.fallback = over_tcp
    call.cleanup = lambda: areas.discard(name)


def _read_over_tcp(call: Call, error: BaseException) -> tuple | None:
    if not isinstance(error, ZeroCopyError):
        return None
    log.warning("cannot map what the server referred to (%s): reading it over TCP", error)
    return {key: value for key, value in call.fields.items() if key != Key.REF}, NO_VALUE
