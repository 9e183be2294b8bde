"""A relay's upstream as it runs: one server process, or one connection per worker of a multi-worker server.

:class:`Upstreams` is what the follower talks to (:meth:`~Upstreams.call`,
:meth:`~Upstreams.listen` and the hooks of :class:`~.upstream.Upstream`).  It
first connects to the upstream's address with one :class:`~.upstream.Upstream`.
If that greeting names workers (PROTOCOL.md §14), the relay opens one connection
per worker on the worker's own port instead and sends each request where its
verb's declaration routes it (``Command.route``), as the clients do: to the worker
that owns its bin (a listen lives on that connection), or, for LIST (``MERGE``),
to every worker with their bins merged.  A copy arriving on any connection goes to
the follower's ``arriving``; a connection lost loses only the copies of its own
bins.  Torch-free, and without the client library, as every server process is.

The workers can change only when the upstream restarts with others.  A connection
greeted by another worker than it was opened for (or, to one process, by a
worker), a worker that cannot be reached, and a request refused with 427 make the
relay map the workers again from the upstream's address (one mapping at a time):
listens move to their bins' new owners, which listen again once connected (the
follower then fetches each bin afresh, as after any reconnection), and a request
refused with 427 is sent once more, to its owner (nothing changed on a 427).
"""

from __future__ import annotations

import logging
from typing import Callable

from twisted.internet import defer

from tensorshare.errors import ProtocolError, WrongWorkerError
from tensorshare.protocol.messages import Command, Key, Route
from tensorshare.protocol.placement import WorkerMap, merged_header, routes_differently
from tensorshare.protocol.tls import TLSSettings

from .upstream import Reply, Upstream

log = logging.getLogger("tensorshare.server.relay")


class Upstreams:
    """The relay's connections to its upstream (see the module docstring).

    Hooks the relay sets: ``on_ready()`` once every connection is up (the first time
    and each time again), ``on_lost(reason, serves)`` when one drops (``serves(bin)``:
    whether that bin's copies travelled on it), ``on_refused(error)`` when the
    upstream refuses the relay, ``arriving(bin, header, nbytes)`` for the sink of a
    copy of a bin."""

    def __init__(self, reactor, host: str, port: int, *, token: bytes | None = None, tls: TLSSettings | None = None,
                 connect_timeout: float = 10.0, keepalive: float | None = 15.0, max_backoff: float = 2.0):
        self.reactor, self.host, self.port = reactor, host, port
        self._options = dict(token=token, tls=tls, connect_timeout=connect_timeout, keepalive=keepalive,
                             max_backoff=max_backoff)
        self.on_ready: Callable[[], None] | None = None
        self.on_lost: Callable[[str, Callable[[str], bool]], None] | None = None
        self.on_refused: Callable[[BaseException], None] | None = None
        self.arriving: Callable | None = None
        self.map: WorkerMap | None = None  # the upstream's workers (None: one process serves every bin)
        self.links: list[Upstream] = [self._link(port, None)]
        self._waiting: list | None = None  # while the workers are mapped again: who waits, and since which map
        self._closed = False

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return all(link.connected for link in self.links)

    def start(self) -> None:
        """Connect (and keep connecting whenever a connection drops)."""
        for link in self.links:
            link.start()

    def close(self) -> None:
        self._closed = True
        for link in self.links:
            link.close()

    # -- requests, where their declarations route them

    def call(self, command: Command, fields: dict, value: tuple | None = None,
             timeout: float | None = None) -> defer.Deferred:
        """As :meth:`.upstream.Upstream.call`, on the connection(s) ``command``'s route names."""
        if self.map is None:
            return self.links[0].call(command, fields, value, timeout)
        if command.route is Route.OWNER:
            seen = self.map
            d = self._owner(fields[Key.BIN]).call(command, fields, value, timeout)
            return d.addErrback(self._wrong_worker, seen, command, fields, value, timeout)
        links = self.links if command.route is Route.MERGE else self.links[:1]  # (EVERY: the relay sends none)
        d = defer.gatherResults([link.call(command, fields, value, timeout) for link in links], consumeErrors=True)
        d.addCallback(lambda replies: Reply(merged_header(command.result, [reply.header for reply in replies]),
                                            replies[0].frame) if command.route is Route.MERGE else replies[-1])
        return d.addErrback(lambda failure: failure.value.subFailure
                            if isinstance(failure.value, defer.FirstError) else failure)

    def _wrong_worker(self, failure, seen: WorkerMap, command: Command, fields: dict, value, timeout):
        """A 427: the workers changed since ``seen``; map them again and send the request
        once more, to its owner then."""
        failure.trap(WrongWorkerError)

        def again(changed: bool):
            if not changed:
                return failure
            return self._owner(fields[Key.BIN]).call(command, fields, value, timeout)

        return self._remap(failure.getErrorMessage(), seen).addCallback(again)

    def listen(self, name: str, callback: Callable[[dict, object], None]) -> defer.Deferred:
        return self._owner(name).listen(name, callback)

    def unlisten(self, name: str) -> None:
        self._owner(name).unlisten(name)

    def listening(self, name: str) -> bool:
        return self._owner(name).listening(name)

    def _owner(self, name: str) -> Upstream:
        """The connection to the worker that owns bin ``name``."""
        return self.links[0] if self.map is None else self.links[self.map.owner(name)]

    # -- connections

    def _link(self, port: int, index: int | None) -> Upstream:
        """A connection to ``port``: the upstream's own (``index`` None, while it runs one
        process), or worker ``index``'s."""
        link = Upstream(self.reactor, self.host, port, **self._options)
        link.on_ready = self._ready
        link.on_lost = lambda reason: self._lost(link, reason)
        link.on_refused = self._refused
        link.arriving = lambda *args: None if self.arriving is None else self.arriving(*args)
        link.fits = lambda greeting: self._fits(link, index, greeting)
        if index is not None:
            link.on_unreached = lambda: self._remap(f"worker {index} at {link.where} unreachable")
        return link

    def _refused(self, error: BaseException) -> None:
        if self.on_refused is not None:
            self.on_refused(error)

    def _ready(self) -> None:
        if self.connected and self.on_ready is not None:
            self.on_ready()

    def _lost(self, link: Upstream, reason: str) -> None:
        if self.on_lost is not None:
            self.on_lost(reason, lambda name: link not in self.links or self._owner(name) is link)

    def _fits(self, link: Upstream, index: int | None, greeting: dict) -> bool:
        """Whether ``link``'s greeting comes from what it was opened for; if not, map
        the workers again (from this greeting, when it came from the upstream's own
        address)."""
        if link not in self.links:
            return False  # (replaced meanwhile)
        if index is not None:
            if self.map.greeted_by(index, greeting):
                return True
            self._remap(f"{link.where} greeted as another worker than {index}")
            return False
        try:
            fresh = WorkerMap.of(greeting)
        except ProtocolError as exc:
            log.warning("relay: upstream %s: %s", self.where, exc)
            return False
        if fresh is None:
            return True
        self._use(fresh)
        return False

    # -- the workers mapped again

    def _remap(self, why: str, seen: WorkerMap | None = None) -> defer.Deferred:
        """Map the workers again from the upstream's address (one mapping at a time);
        a Deferred of whether the relay routes differently now than by ``seen``
        (default: the map now)."""
        d = defer.Deferred()
        first = self._waiting is None
        if first:
            self._waiting = []
        self._waiting.append((d, self.map if seen is None else seen))
        if first:
            probe = Upstream(self.reactor, self.host, self.port, **self._options)
            probe.greeting_once().addCallbacks(self._mapped, self._unmapped, (why,), None, (why,))
        return d

    def _mapped(self, greeting: dict, why: str) -> None:
        try:
            fresh = WorkerMap.of(greeting)
        except ProtocolError as exc:
            log.warning("relay: upstream %s: %s", self.where, exc)
            fresh = self.map
        if not self._closed and routes_differently(self.map, fresh):
            log.warning("relay: upstream %s runs other workers now (%s): mapping them again", self.where, why)
            self._use(fresh)
        self._answer()

    def _unmapped(self, failure, why: str) -> None:
        log.info("relay: cannot map the workers of %s again (%s): %s", self.where, why, failure.getErrorMessage())
        self._answer()

    def _answer(self) -> None:
        waiting, self._waiting = self._waiting, None
        for d, seen in waiting:
            d.callback(routes_differently(seen, self.map))

    def _use(self, fresh: WorkerMap | None) -> None:
        """Route by ``fresh`` from now on (None: one process): new connections, the
        listens moved to their bins' new owners, the old connections closed."""
        old = self.links
        self.map = fresh
        if fresh is None:
            self.links = [self._link(self.port, None)]
        else:
            self.links = [self._link(port, k) for k, port in enumerate(fresh.ports)]
        for link in old:
            for name, callback in link.taken_listens().items():
                self._owner(name).adopt_listen(name, callback)
        for link in old:
            link.close()  # (calls in flight on it fail: ConnectionLostError, the relay answers 421)
        if not self._closed:
            self.start()


__all__ = ["Upstreams"]
