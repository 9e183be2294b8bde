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

Held reads wait in the lanes their verbs declare (``take``, ``peek``), apart from
the other kinds of request waiting on a bin (a waiting GET never holds back an
APPEND waiting for room, nor the other way round), in the order their verbs
declare (``Command.waits_in_order``): takes in the order they came, peeks each as
soon as its own bin has moved on.
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import RemoteError

from .outcome import Pending, in_lane


def enough_items(session, request) -> bool:
    """Whether a GET need not wait: its bin holds at least ``least`` (default 1) items."""
    return session.storage.count(request.bin) >= (request.least or 1)


def moved_on(session, request) -> bool:
    """Whether a PEEK need not wait: its bin is no longer at the seq it names."""
    return request.since is None or session.storage.seq(request.bin) != request.since


def _now(done: Callable) -> None:
    done()


def hold(session, request, ready: Callable, answer: Callable, timeout: float | None = None,
         refusal: Callable[[], RemoteError] | None = None) -> Pending:
    """Answered with ``answer(session, request)`` (an outcome) once ``ready(session,
    request)`` holds, or when its ``wait`` runs out, whichever comes first.
    ``timeout`` (instead of ``wait``) with ``refusal``: what runs out refuses the
    request with ``refusal()`` instead of answering it."""
    def expire(done: Callable) -> None:
        if refusal is not None:
            raise refusal()
        done()

    return in_lane(request.bin, request.command, lambda: ready(session, request), _now,
                   lambda: answer(session, request), request.wait if timeout is None else timeout, expire)
