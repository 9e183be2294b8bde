"""How a request travels: over TCP, or through the server's shared memory.

Written once for both clients.  :func:`plan` decides for one request, given the
shared areas the connection verified (:mod:`.zerocopy`; None when it has none):

* a PUT/APPEND of a value large enough to gain is written into this connection's
  incoming directory, and the request names it instead of carrying its bytes.  If
  the server does not take it (425), the fallback sends the written copy over TCP
  (the caller may have changed the original since);
* a GET/PEEK asks for references to the items' files.  If those cannot be mapped
  (:class:`ZeroCopyError`), a PEEK is sent again over TCP; a GET's items were
  taken, so its error stands;
* anything else travels over TCP as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import ZeroCopyError, ZeroCopyUnavailableError
from ..protocol.messages import APPEND, GET, PEEK, PUT, Command, Key
from ..wire.codec import encode
from .connection import NO_VALUE

log = logging.getLogger("tensorshare.client")


class Plan:
    """One attempt at a request: its header ``fields`` and ``value``; ``fallback(error)``
    gives the next attempt after ``error`` (or None: the error stands), and
    ``cleanup()`` runs once the last attempt is over."""

    __slots__ = ("fields", "value", "fallback", "cleanup")

    def __init__(self, fields: dict | None, value: Any = NO_VALUE, fallback: Callable | None = None,
                 cleanup: Callable | None = None):
        self.fields, self.value, self.fallback, self.cleanup = fields, value, fallback, cleanup

    def next(self, error: BaseException) -> "Plan | None":
        """The attempt to make after ``error``, which takes over this one's cleanup."""
        following = None if self.fallback is None else self.fallback(error)
        if following is not None:
            following.cleanup, self.cleanup = self.cleanup, None
        return following

    def finish(self) -> None:
        if self.cleanup is not None:
            self.cleanup()


def plan(command: Command, fields: dict | None, value: Any, areas) -> Plan:
    """The first attempt of ``command`` with ``fields`` and ``value`` (see the module
    docstring); ``areas`` is the connection's :class:`~.zerocopy.SharedAreas` or None."""
    if areas is None:
        return Plan(fields, value)
    if command is PUT or command is APPEND:
        if value is NO_VALUE or areas.incoming is None:
            return Plan(fields, value)
        return _through_shared_memory(fields, value, areas)
    if command is GET or command is PEEK:
        with_refs = {**fields, Key.REF: areas.usable} if fields else {Key.REF: areas.usable}
        fallback = _peek_over_tcp(fields) if command is PEEK else None
        return Plan(with_refs, NO_VALUE, fallback)
    return Plan(fields, value)


def _through_shared_memory(fields: dict, value: Any, areas) -> Plan:
    enc = encode(value)
    try:
        name = areas.write(enc, fields.get(Key.TAG))
    except OSError as exc:
        log.info("cannot write a value to shared memory (%s): sending it over TCP", exc)
        name = None
    if name is None:  # too small to gain, or shared memory full
        return Plan(fields, enc)

    def over_tcp(error: BaseException) -> Plan | None:
        if not isinstance(error, ZeroCopyUnavailableError):
            return None
        log.info("the server did not take a value through shared memory (%s): sending it over TCP", error)
        try:
            return Plan(fields, areas.written(name))
        except OSError:
            return None

    named = {**fields, Key.VALUE: enc.description, Key.SHM: name, Key.SIZE: enc.nbytes}
    return Plan(named, NO_VALUE, over_tcp, lambda: areas.discard(name))


def _peek_over_tcp(fields: dict | None) -> Callable:
    def fallback(error: BaseException) -> Plan | None:
        if not isinstance(error, ZeroCopyError):
            return None
        log.warning("cannot map what the server referred to (%s): reading it over TCP", error)
        return Plan(fields)
    return fallback
