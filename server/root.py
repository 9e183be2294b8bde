"""The composition root: one server's shared parts, built from its configuration.

:func:`build_state` makes the store, the disk tiers (spill area, data directory,
shared-memory area) behind one :class:`~.bins.storage.Storage`, the listener
registry and the receive pool, and loads the data directory.  Sessions get the
resulting :class:`ServerState` and reach bins only through its ``storage``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tensorshare.disk.areas import new_token
from tensorshare.protocol.messages import COMMANDS
from tensorshare.wire.recycle import Recycler

from .bins.durable import DataDir
from .bins.shm import ShmArea
from .bins.spill import SpillArea
from .bins.jobs import InlineJobs, Jobs
from .bins.storage import Storage
from .bins.store import BinStore
from .config import ServerConfig
from .protocol.recvpool import chunk_pool
from .protocol.ephemeral import EphemeralBins
from .ops.counters import Counters
from .protocol.notify import ListenerRegistry
from .protocol.waits import Waits

log = logging.getLogger("tensorshare.server")


@dataclass
class ServerState:
    """What all sessions of one server share."""

    config: ServerConfig
    storage: Storage
    listeners: ListenerRegistry | None = None  # the storage's sink (None: take it from the storage)
    token: bytes | None = field(default=None, repr=False)  # clients must AUTH with it; None: no authentication
    connections: int = 0  # connections admitted and still open (max_connections)
    recv_pool: Recycler | None = None  # memory large payloads are received into (None: fresh memory)
    waits: Waits | None = None  # requests parked until their bin changes (protocol/waits.py)
    ephemeral: EphemeralBins = field(default_factory=EphemeralBins)  # bins that end with their connection
    counters: Counters | None = None  # what it counts for metrics and the status page (None: metrics off)
    handlers: dict = field(default_factory=dict)  # handlers that replace the usual ones (a relay's: server/relay/)
    relay: object = None  # server/relay/follower.Follower when this server relays another
    workers: object = None  # tensorshare.protocol.placement.WorkerMap of a multi-worker server's worker
    mapped: set = field(default_factory=set)  # bins same-host readers asked references to (protocol/shared.py)
    references: dict = field(default_factory=dict)  # (id, bin) -> publisher of a device reference (protocol/devices.py)

    def __post_init__(self) -> None:
        if self.listeners is None:
            self.listeners = self.storage.sink
        if not isinstance(self.listeners, ListenerRegistry) or self.storage.sink is not self.listeners:
            raise ValueError("the storage must publish its changes to the server's listeners: "
                             "Storage(..., sink=listeners)")
        if self.waits is None:
            self.waits = Waits(_NoClock())
        # Every change tests what waits on its bin: APPENDs with below, a table's inserts
        # and samples, reads that wait (each kind in a lane of its own).
        self.listeners.watch(self.waits.changed, self.waits.parked)

    @property
    def store(self):
        """The bin store under the storage, for tools and tests (sessions use ``storage``)."""
        return self.storage.store


class _NoClock:
    """The clock of a state built without one: a request that asks to wait is refused."""

    def callLater(self, delay, fn, *args):  # noqa: N802 - IReactorTime's name
        raise RuntimeError("this server state has no clock: requests cannot wait")


def build_state(config: ServerConfig, jobs: Jobs | None = None, clock=None) -> ServerState:
    """The state of a new server: its store and disk tiers, the data directory loaded.

    ``jobs`` runs the blocking file work (the server's disk threads; by default
    everything runs at once on the calling thread, as tests and tools want);
    ``clock`` (``IReactorTime``: the reactor, or a test's ``Clock``) times the
    requests that wait in the server."""
    store = BinStore(config.max_bins, config.max_items_per_bin, config.memory_limit)
    data_dir = DataDir(config.data_dir, config.fsync, config.decode_limits) if config.data_dir else None
    spill = SpillArea(config.spill_dir) if config.memory_limit is not None and data_dir is None else None
    shm = None
    if config.zero_copy:  # (with a data directory only for table rows: durable items are on disk, mapped there)
        try:
            shm = ShmArea(config.shm_dir)
        except OSError as exc:
            log.warning("zero-copy: no shared-memory area in %s (%s); values travel over TCP", config.shm_dir, exc)
    listeners = ListenerRegistry()
    storage = Storage(store, jobs or InlineJobs(), data_dir=data_dir, spill=spill, shm=shm, sink=listeners)
    storage.tables.bound(config.max_table_rows, config.max_outbound, config.max_reply_header)
    if config.zero_copy:
        storage.share(new_token())
    if data_dir is not None:
        try:
            count = storage.load()
        except BaseException:
            storage.close()  # (lets go of the directory's lock)
            raise
        log.info("data directory %s: %d items in %d bins", config.data_dir, count, len(store.listing()))
    pool = chunk_pool(config.recv_pool_bytes, config.recv_pool_idle)
    counters = Counters(COMMANDS) if config.metrics_port is not None else None
    return ServerState(config, storage, listeners, token=config.auth_token(), recv_pool=pool,
                       waits=Waits(clock if clock is not None else _NoClock()), counters=counters)
