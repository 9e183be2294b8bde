"""What a server counts while it serves: plain integers, updated on the request path.

:class:`Counters` (one per server, ``ServerState.counters``; None when metrics are
off) holds totals by verb, a request-latency histogram per verb, refusals by reply
code, authentication failures, slow readers, and per RL experiment the rollouts
received.  :class:`ConnStats` (one per connection, always kept: logging uses it)
holds a connection's id, bytes, requests and the parameter versions it was seen
to hold.  Updates are integer additions and list/dict item increments, so that
counting costs well under a microsecond per request (docs/design.md has the A/B).
Everything else is computed from the store when someone asks (:mod:`.status`).
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left

# Upper bounds (seconds) of the latency histogram's buckets: 10 us to 1 s, then +Inf.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0)
MAX_EXPERIMENTS = 1000  # RL experiments tracked (names come from clients: bounded)
MAX_VERSIONS_PER_CONNECTION = 64
PARAMETERS, ROLLOUTS = "parameters", "rollouts"  # an RL experiment's bins (tensorshare/rl/peer.py: bin_names)
TRAINER = "trainer"  # the role of a connection that publishes an experiment's parameters

_connection_ids = itertools.count(1)


def next_connection_id() -> int:
    """A number naming one connection in logs, metrics and the status page (per process)."""
    return next(_connection_ids)


def experiment_of(name: str, kind: str) -> str | None:
    """The experiment whose ``kind`` bin (``parameters`` or ``rollouts``) is ``name``
    (``""``: the default experiment, whose bins have no prefix), else None."""
    if name == kind:
        return ""
    if name.endswith(kind) and name[-len(kind) - 1] == "/":
        return name[: -len(kind) - 1]
    return None


def worker_of(name: str) -> tuple[str, str] | None:
    """``(experiment, worker id)`` of a worker's presence bin ``<experiment>/workers/<id>``
    (whose tag is the version the worker holds, tensorshare/rl/members.py), else None."""
    if name.startswith("workers/"):
        return "", name[len("workers/"):]
    i = name.rfind("/workers/")
    return (name[:i], name[i + len("/workers/"):]) if i > 0 else None


class VerbStats:
    """Requests of one verb: how many, their payload bytes in and out, and how long
    handling each took (a histogram over :data:`LATENCY_BUCKETS`)."""

    __slots__ = ("requests", "bytes_in", "bytes_out", "buckets", "seconds")

    def __init__(self):
        self.requests = 0
        self.bytes_in = 0  # request payload bytes
        self.bytes_out = 0  # reply payload bytes (GET/PEEK items)
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, not cumulative; last is +Inf
        self.seconds = 0.0  # sum of the latencies


class ExperimentStats:
    """What the server saw of one RL experiment (tensorshare/rl/: its parameters and rollouts bins)."""

    __slots__ = ("published", "rollouts", "stale")

    def __init__(self):
        self.published = -1  # the latest version put to its parameters bin (tag)
        self.rollouts = 0  # appended to its rollouts bin
        self.stale = 0  # of which stamped with a version older than the latest published


class ConnStats:
    """One connection's numbers (kept for every connection: logs and the status page use them)."""

    __slots__ = ("id", "peer", "opened", "bytes_in", "requests", "authenticated", "versions", "roles")

    def __init__(self, peer: str):
        self.id = next_connection_id()
        self.peer = peer
        self.opened = time.time()
        self.bytes_in = 0  # every byte received
        self.requests = 0  # requests handled (counted with metrics on)
        self.authenticated = False
        self.versions: dict[str, int] = {}  # experiment -> version of the parameters it was seen with
        # experiment -> what this connection is in it: TRAINER (it publishes the
        # parameters) or the id of the worker whose presence bin it put
        self.roles: dict[str, str] = {}

    def saw_version(self, experiment: str, version: int) -> None:
        versions = self.versions
        if experiment in versions or len(versions) < MAX_VERSIONS_PER_CONNECTION:
            versions[experiment] = version

    def saw_role(self, experiment: str, role: str) -> None:
        roles = self.roles
        if experiment in roles or len(roles) < MAX_VERSIONS_PER_CONNECTION:
            roles[experiment] = role


class Counters:
    """A server's totals (see the module docstring)."""

    def __init__(self, verbs=()):
        self.started = time.time()
        # Every declared verb (the session counts into these directly; a request of
        # an undeclared verb is refused before it is counted).
        self.verbs: dict[str, VerbStats] = {verb: VerbStats() for verb in verbs}
        self.refused: dict[int, int] = {}  # error replies by code (452: memory or disk full...)
        self.accepted = 0  # connections admitted
        self.turned_away = 0  # connections refused (max_connections)
        self.auth_failures = 0
        self.slow_readers_dropped = 0  # disconnected: took no byte of their replies for the stall timeout
        self.sendfile_bytes = 0  # reply bytes the kernel sent from stored files (server/net/sendfile.py)
        self.closed_coalesced = 0  # notifications coalesced on connections now closed
        self.closed_bytes_in = 0  # bytes received on connections now closed
        self.closed_bytes_out = 0
        self.live: dict[int, object] = {}  # connection id -> its ServerSession, while open
        self.experiments: dict[str, ExperimentStats] = {}

    def verb(self, verb: str) -> VerbStats:
        stats = self.verbs.get(verb)
        if stats is None:
            stats = self.verbs[verb] = VerbStats()
        return stats

    def handled(self, verb: str, payload: int, seconds: float) -> None:
        """One request of ``verb`` with ``payload`` bytes, handled in ``seconds``."""
        stats = self.verbs.get(verb) or self.verb(verb)
        stats.requests += 1
        stats.bytes_in += payload
        stats.seconds += seconds
        stats.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def refusal(self, code: int) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1

    # -- RL experiments (called only for requests that carry or return a tag)

    def _experiment(self, name: str) -> ExperimentStats | None:
        stats = self.experiments.get(name)
        if stats is None and len(self.experiments) < MAX_EXPERIMENTS:
            stats = self.experiments[name] = ExperimentStats()
        return stats

    def stored(self, conn: ConnStats, verb: str, bin_name: str, tag: int) -> None:
        """A PUT/APPEND with ``tag`` was stored in ``bin_name``."""
        if verb == "APPEND":
            experiment = experiment_of(bin_name, ROLLOUTS)
            if experiment is None:
                return
            stats = self._experiment(experiment)
            if stats is not None:
                stats.rollouts += 1
                if tag < stats.published:
                    stats.stale += 1
            conn.saw_version(experiment, tag)
        else:
            experiment = experiment_of(bin_name, PARAMETERS)
            if experiment is None:
                worker = worker_of(bin_name)  # a worker saying who it is and which version it holds
                if worker is not None:
                    conn.saw_version(worker[0], tag)
                    conn.saw_role(*worker)
                return
            stats = self._experiment(experiment)
            if stats is not None:
                stats.published = tag
            conn.saw_version(experiment, tag)
            conn.saw_role(experiment, TRAINER)

    def read(self, conn: ConnStats, bin_name: str, tag: int) -> None:
        """A GET/PEEK returned ``bin_name``'s items, the last tagged ``tag``."""
        experiment = experiment_of(bin_name, PARAMETERS)
        if experiment is not None:
            conn.saw_version(experiment, tag)

    # -- connections

    def opened(self, session) -> None:
        self.accepted += 1
        self.live[session.stats.id] = session

    def closed(self, session) -> None:
        if self.live.pop(session.stats.id, None) is not None:
            self.closed_coalesced += session.notifier.coalesced
            self.closed_bytes_in += session.stats.bytes_in
            self.closed_bytes_out += bytes_out(session)

    def totals(self) -> tuple[int, int, int]:
        """(bytes in, bytes out, requests) since the server started."""
        live = list(self.live.values())
        bytes_in = self.closed_bytes_in + sum(s.stats.bytes_in for s in live)
        bytes_out_ = self.closed_bytes_out + sum(bytes_out(s) for s in live)
        return bytes_in, bytes_out_, sum(v.requests for v in self.verbs.values())

    def coalesced(self) -> int:
        return self.closed_coalesced + sum(s.notifier.coalesced for s in self.live.values())


def bytes_out(session) -> int:
    """Bytes a session's connection has written (its writer counts them)."""
    return getattr(session.outbox, "written", 0)
