"""The blocking Client as the front of a multi-worker server: members, routed calls, a new map.

:class:`Front` is the part of :class:`~tensorshare.Client` that serves a server
started with ``--workers N`` (PROTOCOL.md §14; what is shared with the AsyncClient
is :mod:`.workers`).  When the first connection's greeting names workers, the
client becomes a front (:meth:`Front._become_front`): that connection goes to the
member of the worker that greeted, and every call goes where its verb's
declaration routes it (:meth:`Front._routed_call`, ``Command.route``).  A member is
a ``Client`` of the same options on its worker's own port, made when a call first
needs it, whose callbacks run on the front's dispatcher thread.

A request refused with 427, a member that cannot reach its worker, or one greeted
by another worker than it was made for, makes the front map the workers again
from the public address (:meth:`Front._remap`, one thread at a time); a refused
request, and one not sent because the map was stale, is sent once more to its
owner in the new map (nothing changed on either).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import ConnectionLostError, ProtocolError, TensorShareError, WrongWorkerError
from ..protocol.messages import Command, Key, Route
from ..protocol.placement import WorkerMap
from .sockets import Link, open_link
from .workers import StaleMapError, Workers, finish_merged, same_reply

log = logging.getLogger("tensorshare.client")


class Front:
    """What the blocking client does as a multi-worker server's front (see the module docstring)."""

    _front = None  # the client this one is a member of (it routes to us)
    _worker_index = 0  # a member's worker
    _map: WorkerMap | None = None  # the map a member was made by

    def _become_front(self, link: Link) -> None:
        """Route from now on if the greeting on ``link`` (this client's first connection)
        names workers: ``link`` becomes the home member's."""
        try:
            workers = WorkerMap.of(link.conn.greeting)
        except ProtocolError as exc:
            error = ConnectionLostError(f"bad greeting from {self._where}: {exc}")
            self._drop_connection(link, error)
            raise error from None
        if workers is not None:  # several workers: route each call by its declaration
            with self._cond:
                self._link = None  # the home member's from now on
            self._workers = Workers(self, workers)
            self._workers.members[workers.index] = self._workers.home = self._worker_client(workers.index, link)

    # -- calls

    def _routed_call(self, command: Command, fields: dict | None, value: Any, options: dict,
                     error: BaseException | None = None, seen: WorkerMap | None = None) -> Any:
        """A blocking call sent where ``command``'s declaration routes it.  An ``OWNER``
        call goes to its bin's owner; ``error``: the first attempt (by the map ``seen``)
        was not sent because the map was stale, or was refused with 427 (nothing was
        done either way): it goes once more if the workers were mapped again."""
        workers = self._workers
        if command.route is Route.OWNER:
            if error is None:
                seen = workers.map
                try:
                    return workers.owner(fields)._call(command, fields, value, **options)
                except (StaleMapError, WrongWorkerError) as exc:
                    error = exc
            if isinstance(error, WrongWorkerError) and not self._remap(error, seen):
                raise error
            return self._workers.owner(fields)._call(command, fields, value, **options)
        members = workers.targets(command)
        if command.route is Route.MERGE:
            then = options.pop("then")
            options.pop("progress", None)
            replies = [member._call(command, fields, value, then=same_reply, **options) for member in members]
            return finish_merged(workers.merged(command, replies), then)
        for member in members[:-1]:  # EVERY: each connection in use answers it, in turn
            member._call(command, fields, value, **options)
        return members[-1]._call(command, fields, value, **options)

    def _routed_submit(self, command: Command, fields: dict | None, value: Any, callback: Callable,
                       options: dict) -> None:
        """A call whose ``callback(result, error)`` hears of it, sent where ``command``'s
        declaration routes it; one that goes to several members is made in turn on
        the dispatcher thread."""
        if command.route is Route.OWNER:
            self._workers.owner(fields)._submit(command, fields, value, callback, **options)
            return
        calling = {key: options[key] for key in ("timeout", "then", "on_error", "on_reply", "decode", "zero_copy")
                   if key in options}
        if options.get("raw"):
            calling["then"] = same_reply

        def fanned_out() -> None:
            try:
                result, error = self._routed_call(command, fields, value, calling), None
            except TensorShareError as exc:
                result, error = None, exc
            callback(result, error)

        self._later(fanned_out)

    # -- members

    def _worker_client(self, index: int, link: Link | None = None):
        """The member of worker ``index``: a client like this one on that worker's port,
        taking ``link`` (already open to that worker) or connecting."""
        workers = self._workers
        member = type(self).__new__(type(self))
        port = self.port if not workers.map.id else workers.map.ports[index]
        member._configure(self.host, port, **self._options)
        member._options = self._options
        member._front, member._worker_index, member._map = self, index, workers.map
        member._callbacks = self._callbacks  # one dispatcher thread runs every member's callbacks, in order
        if link is None:
            member._connect()
        else:
            member._take(link)
        return member

    def _member_unreachable(self, error: ConnectionLostError) -> None:
        """A member could not connect: raise :class:`StaleMapError` if the server runs
        other workers now (the front mapped them again)."""
        if self._front is not None and self._front._remap(error, self._map):
            raise StaleMapError(str(error)) from None

    def _check_greeting(self, link: Link) -> None:
        """Refuse ``link`` if its greeting is not the one this client expects: a member's
        must come from its worker of the map it was made by (else the front maps the
        workers again, :class:`StaleMapError`)."""
        front = self._front
        if front is None:
            if self._workers is None and self._ever_connected and Key.WORKERS in link.conn.greeting:
                log.warning("%s runs several workers since this client connected: it keeps to the one it reached "
                            "(requests for other workers' bins get 427); make a new client to use them all",
                            self._where)
        elif not front._workers.fits(self._worker_index, link.conn.greeting):
            link.close()
            front._remap(ConnectionLostError(f"{self._where} greeted as another worker"), self._map)
            raise StaleMapError(f"{front._where} now runs other workers than this client mapped")

    # -- a new map

    def _remap(self, error: BaseException, seen=None) -> bool:
        """Map the workers again from the public address; True if the map changed
        (since ``seen``, the map the caller routed by, if given: one thread at a time
        maps, and the others find the new map in place)."""
        with self._remap_lock:
            if seen is not None and self._workers.map is not seen:
                return True
            workers = self._workers
            try:
                link = open_link(self.host, self.port, self.connect_timeout, self._tls, self._ssl_context,
                                 self._new_connection())
            except TensorShareError as exc:
                log.info("cannot map the workers of %s again (%s): %s", self._where, error, exc)
                return False
            try:
                fresh = WorkerMap.of(link.conn.greeting)
            except ProtocolError:
                fresh = None
            if not workers.changed(fresh):
                link.close()  # the same workers: the members reconnect by themselves
                return False
            workers.replace(fresh, lambda index: self._worker_client(index, link), error)
            return True


__all__ = ["Front"]
