"""What a verb handler returns: its request's answer now, or how it will be answered later.

A handler (:mod:`.handlers`, :mod:`.tables`, ``server/relay/forward.py``) gets the
session and a checked request and returns one of these; the session carries it
out (:meth:`~.session.ServerSession.answer`), so a handler never writes to the
connection itself:

* a ``dict``: the reply, a frame that is only a header;
* ``bytes``: such a frame already made (the usual replies, from their message's
  prepared template: ``Message.head``);
* a ``list``: the reply's frame parts (the frame head first, then the payload);
* a ``tuple`` ``(parts, on_abandon, on_written)``: such a frame with what to run if
  the connection dies before it is written whole (a GET's items go back) and once
  it is (they are delivered); a tuple, not an object, on the request path;
* a :class:`Pending`: the request is answered later.  Until then the connection's
  later requests wait (replies keep request order) and its notifications are held
  (they follow the reply), except while it waits in a lane (below);
* None: no reply (the connection is gone).

A refusal is raised: the :class:`~tensorshare.errors.RemoteError` whose code is the
reply, from the handler or from a :class:`Pending`'s ``finish``.

A :class:`Pending` is the one way to answer later.  ``start(done)`` begins what it
waits for (a storage call that may wait for the disk, a request sent upstream);
whoever finishes it calls ``done(*result)``, and ``finish(*result)`` returns the
request's outcome, possibly another :class:`Pending` (a read that waited, then
reads from the disk).  With a ``lane`` it first waits in the server for its bin
(PROTOCOL.md §4.5; :mod:`.waits`, keyed by ``(bin, lane)``, the lanes each verb
declares): ``start`` runs once ``ready()`` holds, tested now and after every change
of the bin, in arrival order within the lane (unless its verb declares otherwise,
``waits_in_order``: then as soon as it is ready); or ``expire(done)`` runs when ``timeout`` seconds have passed.  Meanwhile
other connections are served and this one's notifications go out as usual; a
connection that closes drops its waiting request, unrun.  Without a lane, a
:class:`Pending` with ``cancel`` waits outside this server (a relay's request held
upstream): the connection is read meanwhile, as while one waits in a lane, so that
a peer that closes is seen at once, and ``cancel()`` then calls off what it waits
for (its ``done`` is ignored from then on).
"""

from __future__ import annotations

from typing import Any, Callable


class Pending:
    """A request answered later (see the module docstring)."""

    __slots__ = ("start", "finish", "key", "ready", "timeout", "expire", "ordered", "cancel")

    def __init__(self, start: Callable[[Callable], None], finish: Callable[..., Any], key: tuple | None = None,
                 ready: Callable[[], bool] | None = None, timeout: float = 0.0,
                 expire: Callable[[Callable], None] | None = None, ordered: bool = True,
                 cancel: Callable[[], None] | None = None):
        self.start, self.finish = start, finish
        self.key, self.ready, self.timeout, self.expire, self.ordered = key, ready, timeout, expire, ordered
        self.cancel = cancel


def later(start: Callable[[Callable], None], finish: Callable[..., Any],
          cancel: Callable[[], None] | None = None) -> Pending:
    """Answered with ``finish(*result)`` once ``start(done)`` calls ``done(*result)``;
    ``cancel()``, if given, calls it off should the connection close first."""
    return Pending(start, finish, cancel=cancel)


def in_lane(name: str, command, ready: Callable[[], bool], start: Callable[[Callable], None],
            finish: Callable[..., Any], timeout: float, expire: Callable[[Callable], None]) -> Pending:
    """As :func:`later`, once ``ready()`` holds for bin ``name`` in the lane ``command``
    declares, in the order it declares (or ``expire(done)`` instead after ``timeout`` seconds)."""
    return Pending(start, finish, (name, command.lane), ready, timeout, expire, command.waits_in_order)
