"""Where a bin lives: rendezvous hashing, and the worker map of a multi-worker server.

Both ends use it (torch-free).  :func:`rendezvous` picks, for a bin name, the key
it hashes highest with (keyed BLAKE2b): every party given the same keys picks
the same one with no coordinator, and adding a key to a list of n moves only the
names that now hash highest to it (about 1/(n+1) of them).  It places bins on the
servers of a :class:`~tensorshare.ShardedClient` (keyed by address) and on the
workers of one server started with ``--workers N`` (keyed by worker number,
:class:`WorkerMap`: PROTOCOL.md §14).
"""

from __future__ import annotations

import hashlib

from ..errors import ProtocolError

MAX_WORKERS = 256  # workers one server may run (and a greeting may name)
_CACHE_LIMIT = 1 << 16  # names whose owner a map remembers before it starts afresh


def rendezvous(name: str, keys: list[str]) -> int:
    """Index of the key that ``name`` hashes highest with (rendezvous hashing)."""
    encoded = name.encode("utf-8", "surrogatepass")
    best, best_index = b"", 0
    for index, key in enumerate(keys):
        weight = hashlib.blake2b(encoded, digest_size=8, key=_hash_key(key)).digest()
        if weight > best:
            best, best_index = weight, index
    return best_index


def _hash_key(key: str) -> bytes:
    """``key`` as a BLAKE2b key (at most 64 bytes): as it is up to 64 bytes (the workers'
    keys, and so every placement made before), else its own 64-byte digest (cut to 64
    bytes, the addresses of servers that share a long host name were one key: every
    bin went to the first of them)."""
    raw = key.encode("utf-8", "surrogatepass")
    return raw if len(raw) <= 64 else hashlib.blake2b(raw, digest_size=64).digest()


def worker_keys(count: int) -> list[str]:
    """The hash keys of ``count`` workers: by number only, so that a restarted worker
    (on any port) owns the same bins, and a server grown from n to n+1 workers moves
    only the bins the new worker now wins."""
    return [f"worker-{k}" for k in range(count)]


class WorkerMap:
    """The workers of one server, as its greeting names them: which worker owns a bin
    (:meth:`owner`), the port each one also listens on (``ports``), which one sent
    the greeting (``index``) and the server's ``id`` (new each time it starts, so
    a client can tell a restarted server, whose ports may differ, from the one it
    mapped)."""

    __slots__ = ("ports", "index", "id", "keys", "_owners")

    def __init__(self, ports: list[int], index: int, server_id: str):
        self.ports = list(ports)
        self.index = index
        self.id = server_id
        self.keys = worker_keys(len(self.ports))
        self._owners: dict[str, int] = {}

    @property
    def count(self) -> int:
        return len(self.ports)

    def owner(self, name: str) -> int:
        """The number of the worker that owns bin (or table) ``name``."""
        owners = self._owners
        index = owners.get(name)
        if index is None:
            if len(owners) >= _CACHE_LIMIT:
                owners.clear()
            index = owners[name] = rendezvous(name, self.keys)
        return index

    def field(self, index: int | None = None) -> dict:
        """The greeting's ``workers`` field, as worker ``index`` (default: this map's) sends it."""
        return {"ports": list(self.ports), "index": self.index if index is None else index, "id": self.id}

    def greeted_by(self, index: int, greeting: dict) -> bool:
        """Whether ``greeting``, on a connection opened to worker ``index``'s port, came
        from that worker of these workers (else the server runs others now, §14.2)."""
        try:
            found = WorkerMap.of(greeting)
        except ProtocolError:
            return False
        return found is not None and found.index == index and found.ports == self.ports

    @classmethod
    def of(cls, greeting: dict) -> "WorkerMap | None":
        """The map a greeting carries; None if it names no workers (one process serves
        every bin).  A malformed one is a :class:`ProtocolError`."""
        field = greeting.get("workers")
        if field is None:
            return None
        if type(field) is not dict:
            raise ProtocolError(f"the greeting's workers must be a map, not {field!r:.60}")
        ports, index, server_id = field.get("ports"), field.get("index"), field.get("id")
        if (type(ports) is not list or not 1 <= len(ports) <= MAX_WORKERS
                or not all(type(p) is int and 0 < p < 65536 for p in ports)):
            raise ProtocolError(f"the greeting's worker ports are not 1 to {MAX_WORKERS} TCP ports: {ports!r:.80}")
        if type(index) is not int or not 0 <= index < len(ports):
            raise ProtocolError(f"the greeting's worker index {index!r:.20} is not one of its {len(ports)} workers")
        if type(server_id) is not str or not server_id:
            raise ProtocolError("the greeting's workers carry no server id")
        return cls(ports, index, server_id)

    def __repr__(self) -> str:
        return f"<WorkerMap {self.id} worker {self.index} of {self.count}, ports {self.ports}>"


def routes_differently(old: WorkerMap | None, fresh: WorkerMap | None) -> bool:
    """Whether a client routing by ``old`` must route by ``fresh`` instead (None: one
    process serves every bin on the public port): other workers, or other ports."""
    if old is None or fresh is None:
        return old is not fresh
    return fresh.ports != old.ports


def merged_header(result: str, headers: list[dict]) -> dict:
    """The whole server's reply to a verb its declaration routes to every worker and
    merges (``Route.MERGE``: LIST), from the workers' reply ``headers``: the maps in
    their ``result`` field together (each bin is on one worker), the rest of the first."""
    header = dict(headers[0])
    merged: dict = {}
    for each in headers:
        merged.update(each.get(result) or {})
    header[result] = merged
    return header


__all__ = ["MAX_WORKERS", "WorkerMap", "merged_header", "rendezvous", "routes_differently", "worker_keys"]
