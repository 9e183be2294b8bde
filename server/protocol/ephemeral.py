"""Ephemeral bins: bins that live only as long as the connection that last put them.

A PUT with ``ephemeral: true`` (PROTOCOL.md §4.6) makes its bin ephemeral and its
connection the owner.  When the owner's connection ends (closed, killed, or found
dead by the keepalive), the server deletes the bin and its listeners get a DELETE
notification: presence without polling, as ZooKeeper's ephemeral nodes give it.
The RL wrappers register each worker this way.

Rules, so that an ephemeral bin is never half lasting:

* an ephemeral bin takes only ephemeral PUTs (from any connection: the latest
  putter owns it, so a worker that rejoins under the same name is not deleted when
  its dead predecessor's connection is finally noticed); an APPEND or a plain PUT
  is refused (501), and so is an ephemeral PUT to a bin that exists and is not
  ephemeral;
* its items are never written to the data directory (a restarted server has no
  connections, so it has no ephemeral bins either);
* DELETE by anyone ends it; a DELETE with ``owner`` only while the bin's latest
  ephemeral PUT came from this connection with that ``owner`` (a relay puts ephemeral
  bins upstream for many clients over one connection, each with an owner value of
  its own, and deletes one when its client ends without deleting a bin another
  client has put since).
"""

from __future__ import annotations

from tensorshare.errors import RemoteError
from tensorshare.protocol.messages import BAD_ARGS


class EphemeralBins:
    """Which bins are ephemeral, and which session owns each."""

    def __init__(self) -> None:
        # bin -> owning session; read as ``owners`` on the request path: while it is
        # empty (the usual case) no store needs checking
        self._owners = self.owners = {}
        self._values: dict[str, bytes | None] = {}  # the owner value each was put with (PUT's ``owner``)

    def __contains__(self, name: str) -> bool:
        return name in self._owners

    def __len__(self) -> int:
        return len(self._owners)

    def check_store(self, name: str, ephemeral: bool, exists: bool) -> None:
        """501 for a store that would mix an ephemeral bin with lasting items."""
        if name in self._owners:
            if not ephemeral:
                raise RemoteError(f"bin {name!r} is ephemeral: only an ephemeral PUT may replace its item",
                                  BAD_ARGS)
        elif ephemeral and exists:
            raise RemoteError(f"bin {name!r} exists and is not ephemeral; delete it first", BAD_ARGS)

    def claim(self, name: str, session, owner: bytes | None = None) -> None:
        """``session`` stored the bin's item (for its client ``owner``, if given): it
        owns the bin from now on."""
        previous = self._owners.get(name)
        if previous is not None and previous is not session:
            previous.owned.discard(name)
        self._owners[name] = session
        self._values[name] = owner
        session.owned.add(name)

    def owns(self, name: str, session, owner: bytes | None) -> bool:
        """Whether ``session`` owns ephemeral bin ``name`` with the value ``owner``."""
        return self._owners.get(name) is session and self._values.get(name) == owner

    def forget(self, name: str) -> None:
        """The bin was deleted."""
        owner = self._owners.pop(name, None)
        self._values.pop(name, None)
        if owner is not None:
            owner.owned.discard(name)

    def release(self, session, state) -> None:
        """``session``'s connection ended: delete every bin it owns (``state``: the
        server's ``ServerState``); their listeners are told."""
        owned, session.owned = session.owned, set()
        for name in owned:
            if self._owners.get(name) is session:
                del self._owners[name]
                _delete(state, name, self._values.pop(name, None))


def _delete(state, name: str, owner: bytes | None) -> None:
    relay = state.relay
    if relay is not None and relay.follows(name):  # a relay's: the bin lives upstream, for this client
        relay.delete_upstream(name, owner)
        return

    try:
        state.storage.delete(name, lambda change, error: None)  # (its listeners are told by the storage)
    except RemoteError:  # already gone
        pass
