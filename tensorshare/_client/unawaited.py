"""Requests the blocking client sends without waiting for their replies.

``Client.update_priorities_nowait``: a learner's loop of sample, train, update
priorities, sample... need not wait for the update's reply before going on.  The
request goes out at once; its reply comes back before the reply to anything sent
after it on the same connection (the server answers in request order), so the next
call reads it on the way, with no thread started for it and no round trip of its
own.  The server applies it before anything sent after it (a sample drawn next
sees the new priorities).  On plain TCP its bytes wait in the kernel for the next
request (:meth:`~.member.Member.send`): both reach the server in one segment.

Its outcome is settled (read if need be, and its error raised) by the next
:meth:`~tensorshare.Client.update_priorities` or :meth:`~tensorshare.Client.flush`:
so at most one such request per thread is unanswered, and a failure is never lost
silently, only reported a call late.  A client closed before that drops the outcome
(the server applies the request all the same, PROTOCOL.md §8.3).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import TensorShareError, WrongWorkerError
from ..protocol.engine import next_request_id
from .connection import NO_VALUE
from .member import StaleMapError


class Unawaited:
    """The requests of one client sent without waiting, until they are settled."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sent: list = []  # (member, call, the worker map it was routed by)

    def __bool__(self) -> bool:
        return bool(self._sent)

    def send(self, client, command, fields: dict, deadline: float | None) -> None:
        """Send ``command`` on the connection its declaration routes it to, and return."""
        router = client.router
        seen = router.map
        member = router.home if seen is None else router.owner_of(fields)
        values = client.values
        call = values.call(next_request_id(), command, fields, NO_VALUE, None)
        try:
            member.send(call, values.frame(call, member.engine.greeting), deadline)
        except StaleMapError as exc:  # nothing was sent: the workers were mapped again
            if not client._remap(exc, seen):
                raise
            seen = router.map
            member = router.owner_of(fields)
            member.send(call, values.frame(call, member.engine.greeting), deadline)
        with self._lock:
            self._sent.append((member, call, seen))

    def settle(self, client, deadline: float | None) -> None:
        """Wait for the outcome of every request sent so far (each has its reply by the
        time a later call on its connection has), and raise the first error."""
        with self._lock:
            sent, self._sent = self._sent, []
        first = None
        for member, call, seen in sent:
            try:
                _settle(client, member, call, seen, deadline)
            except TensorShareError as exc:
                first = first or exc
        if first is not None:
            raise first


def _settle(client, member, call, seen, deadline: float | None) -> Any:
    """The result of ``call``, once it has its reply (its error raised)."""
    member.wait_for(call, deadline)
    if call.error is not None:
        raise call.error
    try:
        return client.values.read_result(call, member.areas)
    except (StaleMapError, WrongWorkerError) as exc:  # refused, nothing done: to its owner in the new map
        if not client._remap(exc, seen):
            raise
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return client._call(call.command, call.fields, timeout=timeout)
