"""The one table of requests in flight, shared by blocking and non-blocking calls.

Every request a client sends is a :class:`Call` in its :class:`CallTable`, under
its request id, until the reply arrives, the caller gives up, or the connection
is lost (:meth:`CallTable.take_all`, which fails them all, as Twisted AMP's
``failAllOutgoing`` does).  A blocking call is a call with no ``callback``: its
caller waits for ``outcome``; a non-blocking one has its ``callback`` run with
the result.  The table does no locking: each client guards it with its own lock.

A call is one object with slots, nothing more: thousands may be in flight at once
(pipelined small requests), and every extra object each keeps alive (a closure, a
cell, a plan) is work for the cyclic garbage collector, which then runs more often
and walks more.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..protocol.messages import Command

DEFAULT = object()  # a method's timeout argument when not given: "use the client's timeout"


class Call:
    """One request: its command and its current attempt (header ``fields`` and
    ``value``, with the ``fallback`` a refusal calls for and the ``cleanup`` to run
    when it is over, see :mod:`.routing`), what to do with the reply, and where the
    outcome goes.

    ``callback(result, error)`` receives the reply mapped by ``then`` (by default
    the reply's result; with ``raw``, the :class:`~.connection.Reply` itself);
    without a callback a caller waits for ``outcome``.  ``on_error(error)`` may
    handle an error (returning True: the result is then None).  ``device`` and
    ``into``: where the reply's tensors go (:mod:`.devices`)."""

    __slots__ = ("rid", "command", "fields", "value", "fallback", "cleanup", "callback", "then", "on_error",
                 "on_reply", "outcome", "deadline", "decode", "raw", "inline", "device", "into",
                 "caller")

    def __init__(self, rid: int, command: Command, fields: dict | None, value: Any, callback: Callable | None = None,
                 then: Callable | None = None, on_error: Callable | None = None, on_reply: Callable | None = None,
                 deadline: float | None = None, decode: bool = True, raw: bool = False):
        self.rid = rid
        self.command = command
        self.fields, self.value = fields, value  # the current attempt
        self.fallback: Callable | None = None  # fallback(call, error) -> (fields, value) of the next attempt, or None
        self.cleanup: Callable | None = None  # run once the last attempt is over
        self.callback = callback
        self.then, self.on_error = then, on_error
        self.on_reply = on_reply  # run with the reply frame on the reading thread, before any later frame
        self.outcome: Any = None  # the reply frame, or the exception that ended the call
        self.deadline = deadline
        self.decode = decode  # decode the values an items reply carries
        self.raw = raw  # the callback wants the Reply, not the result
        self.inline = False  # the callback is quick and safe on the reading thread (blocking client)
        self.device = None  # where the reply's tensors go (None: the client's device)
        self.into = None  # destination tensors of the reply's arrays (_client/devices.py)
        self.caller = None  # device.payload.Caller: the caller's stream at the call (gets the reply's tensors)

    def __repr__(self) -> str:
        return f"<Call {self.command.verb} id={self.rid}>"


class CallTable:
    """Requests in flight by id, in the order they were sent."""

    def __init__(self):
        self._calls: dict[int, Call] = {}
        self.callbacks = 0  # non-blocking calls in flight: they need someone to read their replies

    def add(self, call: Call) -> None:
        self._calls[call.rid] = call
        if call.callback is not None:
            self.callbacks += 1

    def pop(self, rid: int) -> Call | None:
        call = self._calls.pop(rid, None)
        if call is not None and call.callback is not None:
            self.callbacks -= 1
        return call

    def get(self, rid: int) -> Call | None:
        """The call in flight with id ``rid``, left in the table (None if none)."""
        return self._calls.get(rid)

    def take_all(self) -> list[Call]:
        """Every call in flight, removed (the connection they were sent on is gone)."""
        calls, self._calls, self.callbacks = list(self._calls.values()), {}, 0
        return calls

    def __contains__(self, rid: int) -> bool:
        return rid in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(self._calls.values())
