"""Which handler answers each declared verb: the handler modules register, the session looks up.

:mod:`.handlers` registers the bin verbs and :mod:`.tables` the table verbs, each
with :func:`handles`; a relay's handlers replace some of them per server
(``ServerState.handlers``, ``server/relay/forward.py``).  A handler returns an
outcome (:mod:`.outcome`).
"""

from __future__ import annotations

from typing import Callable

from tensorshare.protocol.messages import Command

HANDLERS: dict[Command, Callable] = {}


def handles(*commands: Command) -> Callable:
    """Register the decorated function as the handler of ``commands``."""
    def register(handler: Callable) -> Callable:
        for command in commands:
            HANDLERS[command] = handler
        return handler
    return register
