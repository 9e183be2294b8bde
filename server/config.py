"""The server's settings: where it listens and the limits it enforces, with safe defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorshare.protocol.auth import resolve_token
from tensorshare.protocol.messages import MAX_BIN_NAME, MAX_REPLY_HEADER
from tensorshare.protocol.placement import MAX_WORKERS
from tensorshare.wire.description import DecodeLimits
from tensorshare.wire.frames import FrameLimits


HEADER_MEMORY = 8  # bytes of objects a decoded request header may hold per byte


@dataclass
class ServerConfig:
    """Everything ``tensorshare-server`` can be told on its command line."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_header: int = 16 << 20  # bytes of one request header
    max_reply_header: int = MAX_REPLY_HEADER  # bytes of a GET/PEEK reply header (no more than clients accept)
    max_frame: int = 16 << 30  # payload bytes of one request
    max_bin_name: int = MAX_BIN_NAME
    max_bins: int = 100_000
    max_items_per_bin: int = 1_000_000
    max_listens: int = 10_000  # per connection
    max_depth: int = 64  # nesting of a stored value
    # slots of all tables together (each keeps at most 24 bytes of state in memory);
    # None: as many as the memory budget holds (--memory-limit, else the machine's memory)
    max_table_rows: int | None = None
    max_nodes: int = 1_000_000  # nodes of a stored value's structure
    # The disk tier (server/bins/storage.py).
    memory_limit: int | None = None  # payload bytes kept in RAM; past it items spill to disk
    spill_dir: str | None = None  # where spilled items go (None: a private temporary directory)
    data_dir: str | None = None  # durable storage: every acknowledged item is on disk here
    fsync: bool = False  # flush each change to stable storage before acknowledging it
    disk_threads: int = 4
    sendfile: bool = True  # send stored files' bytes with os.sendfile on threads (server/net/sendfile.py)
    # Same-host zero-copy (server/bins/shm.py, PROTOCOL.md §10).
    zero_copy: bool = True  # offer shared memory to clients on this host
    shm_dir: str = "/dev/shm"  # where the shared-memory area is made (a tmpfs)
    zero_copy_min: int = 128 << 10  # payload bytes from which an item is referred to (areas.worth_sharing)

    # Outbound flow control (server/net/flow.py): a connection whose unsent frames keep
    # more than max_outbound bytes alive is read no further and its notifications
    # are coalesced per bin; if it then takes no byte for outbound_stall_timeout
    # seconds it is disconnected.
    max_outbound: int = 64 << 20
    outbound_stall_timeout: float = 60.0
    # Seconds the reactor keeps polling after a request before it sleeps
    # (server/net/busypoll.py): a quicker reply to the next request, for CPU.  Off
    # here (an embedded server shares its process); run_server turns it on.
    busy_poll: float = 0.0
    # Bytes of memory that payloads of 64 KiB or more are received into, reused once
    # the items in it are gone (server/protocol/recvpool.py; at most a quarter of
    # memory_limit when that is set); 0: every payload into fresh memory.
    recv_pool: int = 1 << 30
    recv_pool_idle: float = 10.0  # seconds a free chunk stays in the pool before it goes back to the system

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
                raise ValueError(f"{name} must be a TCP port, 0 (any free one) to 65535, not {port!r}")
        if not 0 < self.max_reply_header <= MAX_REPLY_HEADER:
            raise ValueError(f"max_reply_header must be 1 byte to {MAX_REPLY_HEADER >> 20} MiB (what clients accept)")
        if self.max_outbound < 1:
            raise ValueError("max_outbound must be at least 1 byte")
        if self.recv_pool < 0:
            raise ValueError("recv_pool must be 0 (off) or more bytes")
        if not 0 < self.recv_pool_idle < float("inf"):
            raise ValueError("recv_pool_idle must be a positive number of seconds")
        if not 0 <= self.busy_poll <= 0.1:
            raise ValueError("busy_poll must be 0 (off) to 0.1 seconds")
        if not self.outbound_stall_timeout > 0:
            raise ValueError("outbound_stall_timeout must be a positive number of seconds")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1 to {MAX_WORKERS}")
        if self.workers > 1 and self.follow:
            raise ValueError("a relay runs in one process: --follow takes no --workers")
        if self.worker_ports is not None and not 0 < self.worker_ports <= 65536 - self.workers:
            raise ValueError("worker_ports must leave room for one port per worker below 65536")

    # -- security (issue #7): authentication, TLS, connection and time limits
    token: str | bytes | None = field(default=None, repr=False)  # clients must prove they know it (AUTH)
    token_file: str | None = None  # read the token from this file (when ``token`` is None)
    tls_cert: str | None = None  # PEM certificate (chain, leaf first): serve TLS only
    tls_key: str | None = None  # PEM private key (default: read from tls_cert)
    max_connections: int = 1024  # open at once; more get 421 and are closed (0: no limit)
    idle_timeout: float = 300.0  # seconds of silence before 421 and close, or a keepalive if listening (0: never)
    auth_timeout: float = 10.0  # seconds a connection may take to authenticate (0: no limit)

    # -- operations (issue #21): Prometheus /metrics, /status.json and a status page
    # on their own HTTP port (server/ops/); None: off, and nothing is counted.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # -- relaying (issue #20, server/relay/): mirror another server's bins, forward writes to it
    follow: str | None = None  # HOST:PORT of the upstream server (None: not a relay)
    follow_bins: str = "*"  # glob of the bin names mirrored and forwarded; others live on the relay itself
    follow_token_file: str | None = None  # token proved upstream (default: this server's own token)
    follow_tls: bool = False  # TLS upstream, trusting the system's CAs (follow_tls_ca/_fingerprint imply it)
    follow_tls_ca: str | None = None
    follow_tls_fingerprint: str | None = None
    follow_timeout: float = 30.0  # seconds a read or forwarded write waits for the upstream
    # -- workers (issue #32, server/workers/): processes that share nothing, each serving
    # the bins whose names hash to it (PROTOCOL.md §13); 1: this process serves them all.
    workers: int = 1
    worker_ports: int | None = None  # the first of the workers' own ports (None: free ones)

    def auth_token(self) -> bytes | None:
        """The token clients must prove: ``token``, else ``token_file``'s contents, else
        the ``TENSORSHARE_TOKEN`` environment variable, else None (no authentication)."""
        return resolve_token(self.token, self.token_file)

    @property
    def tick_interval(self) -> float:
        """How often the time limits are checked: a quarter of the shortest of them
        (the idle, authentication and stall timeouts, and a closing connection's
        one-second grace), within 0.05-1 s."""
        limits = [t for t in (self.idle_timeout, self.auth_timeout, self.outbound_stall_timeout, 1.0) if t > 0]
        return min(max(min(limits) / 4, 0.05), 1.0)

    @property
    def recv_pool_bytes(self) -> int:
        """The receive pool's bound: ``recv_pool``, within a quarter of ``memory_limit``."""
        if self.memory_limit is None:
            return self.recv_pool
        return min(self.recv_pool, self.memory_limit // 4)

    @property
    def frame_limits(self) -> FrameLimits:
        # A request may wait, decoded, while its connection is congested: what it
        # holds then is at most 8 times its bytes (tensorshare/wire/unpacking.py).
        return FrameLimits(max_header=self.max_header, max_payload=self.max_frame, header_memory=HEADER_MEMORY)

    @property
    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(max_depth=self.max_depth, max_nodes=self.max_nodes)
