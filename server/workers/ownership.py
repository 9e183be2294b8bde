"""A worker serves only the bins it owns: the one check of every request that names a bin.

Clients route each request to the worker that owns its bin (PROTOCOL.md §14), so
a request for another worker's bin comes only from a client whose map of the
workers is out of date (the server restarted with other workers or ports) or one
that does not route at all.  Serving it here would make a second bin of that name,
so the session (``server/protocol/session.py``) refuses it with 427
(:class:`~tensorshare.errors.WrongWorkerError`) after the header's checks and before
its handler runs, for every verb whose declaration routes it to its bin's owner
(``Route.OWNER``): nothing changes, and the message names the owner.  It costs one
dictionary lookup per request (the map remembers the owners it computed), and
nothing on a one-process server.
"""

from __future__ import annotations

from tensorshare.errors import WrongWorkerError
from tensorshare.protocol.placement import WorkerMap


def check_owner(workers: WorkerMap, name: str) -> None:
    """Raise the 427 refusal of a request for bin ``name`` unless this worker owns it."""
    owner = workers.owner(name)
    if owner != workers.index:
        raise WrongWorkerError(f"worker {owner} of {workers.count} owns bin {name!r:.80}, not worker "
                               f"{workers.index}: map the workers again (greeting field 'workers')")


__all__ = ["check_owner"]
