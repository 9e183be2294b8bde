"""Reads that wait in the server for their bin: a GET until items come, a PEEK until the bin changes.

A consumer that would otherwise listen for "the bin is no longer empty" and then
send a GET (a notification, a wake-up of the client's thread, a round trip) can
send the GET with ``wait`` once: the server holds it while the bin holds fewer
than ``least`` items and answers it as soon as enough are there.  Likewise a PEEK
with ``since`` (a seq the reader saw) and ``wait`` is held while the bin is still
at that seq: the reader gets the next version in the reply itself, a long poll
(PROTOCOL.md §4.5).  When ``wait`` runs out the request is answered as it stands
then (fewer items; for the PEEK, no items, as nothing changed): waiting for data
is not an error.

Held reads are parked with :class:`~.waits.Waits` under keys of their own, one
per bin and kind (so a waiting GET never holds back an APPEND waiting for room,
nor the other way round): takes go on in the order they came, peeks each as soon
as its own bin has moved on.  The registry's watcher (``Waits.watcher(*LANES)``)
tests them after every change.
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import RemoteError

LANES = _TAKES, _PEEKS = "\x00take", "\x00peek"  # bin names hold no control characters: no bin has these keys


def enough_items(session, request) -> bool:
    """Whether a GET need not wait: its bin holds at least ``least`` (default 1) items."""
    return session.storage.count(request.bin) >= (request.least or 1)


def moved_on(session, request) -> bool:
    """Whether a PEEK need not wait: its bin is no longer at the seq it names."""
    return request.since is None or session.storage.seq(request.bin) != request.since


def hold(session, request, ready: Callable, answer: Callable) -> None:
    """Answer ``request`` with ``answer(session, request, done)`` once ``ready(session,
    request)`` holds, or when its ``wait`` runs out, whichever comes first.

    ``answer`` queues the reply (or raises the :class:`RemoteError` to refuse with)
    and calls ``done()`` once it has; meanwhile the connection's later requests
    wait behind this one, as for every request that waits (replies keep order)."""
    waits, takes = session.state.waits, request.command.verb == "GET"
    key = request.bin + (_TAKES if takes else _PEEKS)

    def start(done: Callable) -> None:
        def run(settle: bool) -> None:
            def answered() -> None:
                if settle:
                    waits.settled(key)  # the next take in line is tested with this one's result
                done()
            try:
                answer(session, request, answered)
            except RemoteError as exc:
                session.refuse(request.id, exc)
                answered()

        session.park(key, lambda: ready(session, request), lambda: run(True), request.wait,
                     lambda: run(False), ordered=takes)

    session.wait_for(start, lambda: None)
