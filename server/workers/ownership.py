"""A worker serves only the bins it owns: every verb that names a bin is checked first.

Clients route each request to the worker that owns its bin (PROTOCOL.md §14), so
a request for another worker's bin comes only from a client whose map of the
workers is out of date (the server restarted with other workers or ports) or one
that does not route at all.  Serving it here would make a second bin of that name,
so it is refused with 427 (:class:`~tensorshare.errors.WrongWorkerError`) before its
handler runs: nothing changes, and the message names the owner.  The check is a
wrapper in the state's handler table (``ServerState.handlers``), so the session
and the handlers stay as one-process servers run them; it costs one dictionary
lookup per request (the map remembers owners it computed).
"""

from __future__ import annotations

from typing import Callable

from tensorshare.errors import RemoteError
from tensorshare.protocol.messages import COMMANDS, WRONG_WORKER
from tensorshare.protocol.placement import WorkerMap

from ..protocol.registry import HANDLERS


def own_bins_only(state, workers: WorkerMap) -> None:
    """Make ``state`` (one worker's) serve only the bins ``workers`` says it owns, and
    name its workers in its greeting."""
    state.workers = workers
    for command in COMMANDS.values():
        if command.takes_bin:
            handler = state.handlers.get(command) or HANDLERS[command]
            state.handlers[command] = _owned(handler, workers)


def _owned(handler: Callable, workers: WorkerMap) -> Callable:
    owner, me = workers.owner, workers.index

    def handle_owned(session, request) -> None:
        if owner(request.bin) != me:
            raise RemoteError(f"worker {owner(request.bin)} of {workers.count} owns bin {request.bin!r:.80}, "
                              f"not worker {me}: map the workers again (greeting field 'workers')", WRONG_WORKER)
        return handler(session, request)

    return handle_owned
