"""Where each request goes: the worker map, one member per worker, dispatch by ``Command.route``, a new map.

A server started with ``--workers N`` names its workers in its greeting (PROTOCOL.md
§14, :class:`~.placement.WorkerMap`); one started without names none, and one
process serves every bin.  A :class:`Router` holds what a client end knows of
that: the map (None for one process) and a *member* per worker, one connection's
driver each (the blocking client's, the AsyncClient's, a relay upstream's), made by
the driver's factory when first needed.  Every client end routes the same way:

* ``OWNER`` (every verb that names a bin or table): to the member of the worker that
  owns it (:meth:`Router.owner`), so requests about one bin travel on one
  connection, in order, as with one server;
* ``MERGE`` (LIST): to every member, their replies' result maps merged
  (:meth:`Router.merged`: each bin is on one worker);
* ``EVERY`` (NOOP): to every member made so far, answered once all are;
* ``CONNECTION`` (AUTH): each connection's own, sent while it opens.

The map goes out of date only when the whole server restarts with other workers or
on other ports.  A request refused with 427, a member that cannot reach its worker
and one greeted by another worker than it was made for tell the driver to look at
the server's public address again; what it finds there it gives to
:meth:`Router.learn`, which replaces the members and moves every listen to its
bin's new owner (redis-py's cluster client keeps the same in its ``NodesManager``:
a MOVED marks the slots stale and they are fetched again).  The I/O of that is the
driver's; the decisions are here, torch-free, with no reactor, socket or thread.

A member may also be asked for beside its worker's routing member
(:meth:`Router.companion`): a second connection to the worker that owns a bin, for
traffic that must not queue behind that bin's requests (the bytes of a put by
device reference, which a read on the first connection may be waiting for).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import ProtocolError
from .messages import Command, Key, Route
from .placement import WorkerMap, merged_header, routes_differently

log = logging.getLogger("tensorshare.client")


class Router:
    """The members of one client end and the map that routes to them (see the module
    docstring).

    ``make(index, port, opened)`` makes the member of worker ``index`` (None: the one
    process of a server that runs no workers) on ``port``; ``opened`` is a
    connection already open there that it takes over (None: it connects itself).
    A member has ``engine`` (its :class:`~.engine.Engine`, whose listens move on a
    new map), ``adopt(handle)`` (listen with a handle moved to it) and ``close()``.
    Routing takes no lock: members are made once and replaced only by a new map,
    under :attr:`lock` (made by whoever needs it first)."""

    def __init__(self, make: Callable[[int | None, int, Any], Any], port: int):
        self.make = make
        self.port = port  # the public address's
        self.map: WorkerMap | None = None
        self.members: list = []
        self.home: Any = None  # the member the first connection became
        self.companions: dict = {}  # index -> a second member of that worker
        self.lock = threading.Lock()

    # -- the first connection

    def start(self, greeting: dict, opened: Any) -> Any:
        """Route by what the first connection's ``greeting`` names (``opened``, that
        connection, becomes its worker's member, the home member); the home member.
        A malformed map is a :class:`ProtocolError`."""
        fresh = WorkerMap.of(greeting)
        self._use(fresh, opened)
        return self.home

    def _use(self, fresh: WorkerMap | None, opened: Any) -> list:
        old = self.members + list(self.companions.values())
        self.map = fresh
        self.companions = {}
        if fresh is None:
            self.members = [self.make(None, self.port, opened)]
            self.home = self.members[0]
        else:
            self.members = [None] * fresh.count
            self.home = self.members[fresh.index] = self.make(fresh.index, self.port_of(fresh.index), opened)
        return [m for m in old if m is not None]

    def port_of(self, index: int | None) -> int:
        """The port of worker ``index`` (the public one while no workers are named)."""
        return self.port if index is None or self.map is None or not self.map.id else self.map.ports[index]

    # -- routing

    @property
    def count(self) -> int:
        """How many workers the server runs."""
        return 1 if self.map is None else self.map.count

    def owner(self, name: Any) -> Any:
        """The member a request about bin ``name`` goes to (made if need be); the home
        member for none (or a bad one, which its checks refuse)."""
        workers = self.map
        if workers is None or type(name) is not str:
            return self.home
        index = workers.owner(name)
        member = self.members[index]
        return member if member is not None else self._member(index)

    def owner_of(self, fields: dict | None) -> Any:
        """The member a request with header ``fields`` goes to (:meth:`owner` of its bin)."""
        if self.map is None:
            return self.home
        return self.owner(fields.get(Key.BIN) if fields else None)

    def targets(self, command: Command) -> list:
        """The members a request of ``command`` goes to when its route names more than
        its bin's owner: every member (``MERGE``), every member made so far
        (``EVERY``), the home member (``CONNECTION``)."""
        route = command.route
        if route is Route.MERGE:
            return self.all()
        if route is Route.EVERY:
            return self.made()
        return [self.home]

    def all(self) -> list:
        """Every member (making those not made yet), in worker order."""
        return [m if m is not None else self._member(k) for k, m in enumerate(self.members)]

    def made(self) -> list:
        """The members made so far."""
        return [m for m in self.members if m is not None]

    def everyone(self) -> list:
        """Every member made, companions included (to close them, say)."""
        return self.made() + list(self.companions.values())

    @staticmethod
    def merged(command: Command, headers: list[dict]) -> dict:
        """The whole server's reply header to a ``MERGE`` verb from its workers' ``headers``."""
        return merged_header(command.result, headers)

    def companion(self, name: str) -> Any:
        """A second member of the worker that owns bin ``name`` (made once, kept until
        the map changes): traffic for that worker that must not wait behind its bins'
        requests."""
        index = None if self.map is None else self.map.owner(name)
        member = self.companions.get(index)
        if member is None:
            made = self.make(index, self.port_of(index), None)
            with self.lock:
                member = self.companions.setdefault(index, made)
            if member is not made:
                made.close()
        return member

    def _member(self, index: int) -> Any:
        members = self.members
        made = self.make(index, self.port_of(index), None)  # (connecting: not under the lock, which a new map takes)
        with self.lock:
            if self.members is members and members[index] is None:
                members[index] = made
                return made
        made.close()  # another thread made it first, or the map changed meanwhile
        member = self.members[index] if index < len(self.members) else None
        return member if member is not None else self.home

    # -- when the server's workers change

    def fits(self, index: int | None, greeting: dict) -> bool:
        """Whether a member of worker ``index`` greeted with ``greeting`` on (re)connecting
        found the workers this map names (else the server restarted with others)."""
        if self.map is None or not self.map.id:
            try:
                return WorkerMap.of(greeting) is None
            except ProtocolError:
                return False
        return index is not None and self.map.greeted_by(index, greeting)

    def stale(self, seen: WorkerMap | None) -> bool:
        """Whether the map changed since ``seen`` (another caller mapped the workers again)."""
        return self.map is not seen

    def learn(self, greeting: dict | None, opened: Any = None) -> list | None:
        """The public address greeted with ``greeting`` (None: it could not be reached).
        If the server routes differently now, route by it from now on: new members
        (``opened``, the connection that brought the greeting, becomes its worker's),
        every listen moved to its bin's new owner; returns the old members, for the
        caller to close.  None when nothing changed (``opened`` is then not used)."""
        if greeting is None:
            return None
        try:
            fresh = WorkerMap.of(greeting)
        except ProtocolError as exc:
            log.warning("%s", exc)
            return None
        if not routes_differently(self.map, fresh):
            return None
        log.info("the server runs other workers now: %s", fresh)
        with self.lock:
            old = self._use(fresh, opened)
        for member in old:
            for handle in member.engine.listens.take():
                self.owner(handle.bin).adopt(handle)
        return old


__all__ = ["Router"]
