"""How often a connection is tried again: exponential backoff with jitter (both clients, ``connect`` and relays).

The one retry policy of every end that reconnects: the clients, ``connect``, and a
relay reaching its upstream.  After a server restart every worker of a job (every
relay of a tree) loses its connection at the same moment; retrying on a fixed
schedule would bring them back in lockstep, all at once, again and again.  Each
delay is drawn at random from its upper half ("equal jitter"), so the retries
spread out while still backing off.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays for successive retries: ``initial``, doubling up to ``maximum``, each
    drawn uniformly from ``[bound / 2, bound]``.  :meth:`reset` after a success."""

    def __init__(self, initial: float = 0.05, maximum: float = 2.0, rng: random.Random | None = None):
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial, self.maximum = initial, maximum
        self._bound = initial
        self._random = rng or random.Random()

    def next(self) -> float:
        """The delay before the next attempt (and the bound grows for the one after)."""
        bound = self._bound
        self._bound = min(bound * 2, self.maximum)
        return bound / 2 + self._random.random() * bound / 2

    def reset(self) -> None:
        self._bound = self.initial
