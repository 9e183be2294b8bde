"""A client of a multi-worker server: one connection per worker, each call sent to its bin's owner.

A server started with ``--workers N`` names its workers in its greeting
(PROTOCOL.md §14, :class:`~tensorshare.protocol.placement.WorkerMap`).  A client
whose first connection brings such a greeting routes from then on: the object the
user holds (the *front*) keeps no connection of its own; each worker gets a
*member*, a client of the same class and options connected to that worker's own
port, and each call goes where its verb's declaration routes it
(``Command.route``, :meth:`Workers.targets`):

* ``OWNER`` (every verb that names a bin or table): to the member of the worker
  that owns it.  Requests about one bin therefore travel on one connection, in
  order, as with one server;
* ``MERGE`` (LIST): to every member, their replies' result maps merged into one
  (:meth:`Workers.merged`: each bin is on one worker);
* ``EVERY`` (NOOP): to every member made so far, answered once all are (a ping
  after calls returns once each of their connections has answered them);
* ``CONNECTION`` (AUTH): each connection's own, sent while it opens; a call of
  such a verb would go to the *home* member, the one the first connection became.

Listens are the owner member's (its reconnections listen again to its own bins
only); callbacks of all members run on the front's one dispatcher thread, in
order, as with one connection.  The blocking client's side of this is
:mod:`.front`; the AsyncClient's is in ``tensorshare/async_client.py``.

The map can go out of date only when the whole server restarts with other
workers or on other ports.  A member that finds another map in its worker's
greeting, or cannot reach its worker at all, and a request refused with 427 (a
worker that does not own the bin), make the front map the workers again from the
public address (the front's ``_remap``); listens move to their bins' new owners,
and a refused request is sent once more, to its owner (nothing changed on the 427).

Routing a call costs one dictionary lookup (the map remembers each bin's owner)
and one method call: :class:`Workers` holds no lock on that path.  The blocking
client creates members when a call first needs them; the AsyncClient connects all
of them before ``connect`` fires.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import ConnectionLostError, ProtocolError
from ..protocol.messages import Command, Key, Route
from ..protocol.placement import WorkerMap, merged_header, routes_differently
from .connection import Reply

log = logging.getLogger("tensorshare.client")


class StaleMapError(ConnectionLostError):
    """A member could not reach its worker, or found other workers there, and the
    front mapped the workers again: the request was not sent (the front sends it
    once more, to its bin's owner in the new map)."""


class Workers:
    """The members of one front client and the map that routes to them."""

    def __init__(self, front, workers: WorkerMap):
        self.front = front
        self.map = workers
        self.members: list = [None] * workers.count
        self.home = None  # the member the first connection became (set by the front)
        self._lock = threading.Lock()  # creating and replacing members (never held while routing)

    # -- routing (no lock: members are created once and replaced only by a new map)

    def owner(self, fields: dict | None):
        """The member a request with header ``fields`` goes to (created if need be):
        its bin's owner, or the home member for a request about no bin."""
        name = fields.get(Key.BIN) if fields else None
        if type(name) is not str:  # (none, or a bad one the member's checks refuse)
            return self.home
        index = self.map.owner(name)
        member = self.members[index]
        return member if member is not None else self._member(index)

    def member_of(self, name: str):
        """The member of the worker that owns bin ``name``."""
        index = self.map.owner(name)
        member = self.members[index]
        return member if member is not None else self._member(index)

    def targets(self, command: Command) -> list:
        """The members a request of ``command`` goes to when its declaration routes it to
        more than its bin's owner (:meth:`owner` is that one): every member for
        ``MERGE``, every member made so far for ``EVERY``, the home member for
        ``CONNECTION``."""
        route = command.route
        if route is Route.MERGE:
            return self.all()
        if route is Route.EVERY:
            return self.made()
        return [self.home]

    def all(self) -> list:
        """Every member (creating those not made yet), in worker order."""
        return [m if m is not None else self._member(k) for k, m in enumerate(self.members)]

    def made(self) -> list:
        """The members made so far."""
        return [m for m in self.members if m is not None]

    def _member(self, index: int):
        with self._lock:
            members = self.members
        member = members[index]
        if member is not None:
            return member
        made = self.front._worker_client(index)  # (connecting: not under the lock, which a new map takes)
        with self._lock:
            if self.members is members and members[index] is None:
                members[index] = made
                return made
        made.close()  # another thread made it first, or the map changed meanwhile
        return self.member_of_index(index)

    def member_of_index(self, index: int):
        member = self.members[index] if index < len(self.members) else None
        return member if member is not None else self.home

    # -- when the server's workers change

    def fits(self, index: int, greeting: dict) -> bool:
        """Whether a member of worker ``index`` that got ``greeting`` on (re)connecting
        found the workers this map names (else the server restarted with others)."""
        if not self.map.id:  # the server runs one process now (see replace)
            try:
                return WorkerMap.of(greeting) is None
            except ProtocolError:
                return False
        return self.map.greeted_by(index, greeting)

    def changed(self, fresh: WorkerMap | None) -> bool:
        """Whether ``fresh`` (None: one process) routes differently from this map."""
        return routes_differently(self.map if self.map.id else None, fresh)

    def replace(self, fresh: WorkerMap | None, make_home: Callable[[int], Any], why: BaseException) -> None:
        """Route by ``fresh`` from now on (None: the server runs one process, served on
        its public port); ``make_home(index)`` makes the member of the worker the new
        map came from.  The old members are closed; their listens go to their bins'
        new owners, which listen again."""
        with self._lock:
            log.warning("%s runs other workers now (%s): mapping them again", self.front._where, why)
            old = self.members
            self.map = fresh if fresh is not None else WorkerMap([self.front.port], 0, "")
            self.members = [None] * self.map.count
            moved = [handle for member in old if member is not None for handle in member._listens_taken()]
            self.members[self.map.index] = self.home = make_home(self.map.index)
        for member in old:
            if member is not None:
                member.close()
        for handle in moved:
            self.member_of(handle.bin)._adopt_listen(handle)

    # -- verbs over every bin

    @staticmethod
    def merged(command: Command, replies: list[Reply]) -> Reply:
        """One reply of the whole server to a ``MERGE`` verb from its workers' replies
        (:func:`~tensorshare.protocol.placement.merged_header`)."""
        header = merged_header(command.result, [reply.header for reply in replies])
        return Reply(command, header, None, replies[0].frame)

    def close(self) -> None:
        for member in self.made():
            member.close()


def same_reply(reply: Reply) -> Reply:
    """``then`` that keeps a call's whole reply (to merge it with others)."""
    return reply


def finish_merged(reply: Reply, then: Callable | None) -> Any:
    """What a fanned-out call returns: ``then`` of the merged reply, or its result."""
    return reply.result if then is None else then(reply)


__all__ = ["StaleMapError", "Workers", "finish_merged", "same_reply"]
