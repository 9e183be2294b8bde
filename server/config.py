"""The server's settings: where it listens and the limits it enforces, with safe defaults."""

from __future__ import annotations

from dataclasses import dataclass

from tensorshare.protocol import MAX_BIN_NAME
from tensorshare.wire.description import DecodeLimits
from tensorshare.wire.frames import FrameLimits


@dataclass
class ServerConfig:
    """Everything ``tensorshare-server`` can be told on its command line."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_header: int = 16 << 20  # bytes of one request header
    max_reply_header: int = 256 << 20  # bytes of a GET/PEEK reply header (clients accept 1 GiB)
    max_frame: int = 16 << 30  # payload bytes of one request
    max_bin_name: int = MAX_BIN_NAME
    max_bins: int = 100_000
    max_items_per_bin: int = 1_000_000
    max_listens: int = 10_000  # per connection
    max_depth: int = 64  # nesting of a stored value
    max_nodes: int = 1_000_000  # nodes of a stored value's structure
    # The disk tier (server/storage.py).
    memory_limit: int | None = None  # payload bytes kept in RAM; past it items spill to disk
    spill_dir: str | None = None  # where spilled items go (None: a private temporary directory)
    data_dir: str | None = None  # durable storage: every acknowledged item is on disk here
    fsync: bool = False  # flush each change to stable storage before acknowledging it
    disk_threads: int = 4
    # Same-host zero-copy (server/shm.py, PROTOCOL.md §10).
    zero_copy: bool = True  # offer shared memory to clients on this host
    shm_dir: str = "/dev/shm"  # where the shared-memory area is made (a tmpfs)
    zero_copy_min: int = 128 << 10  # payload bytes from which an item is referred to (areas.worth_sharing)

    @property
    def frame_limits(self) -> FrameLimits:
        return FrameLimits(max_header=self.max_header, max_payload=self.max_frame)

    @property
    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(max_depth=self.max_depth, max_nodes=self.max_nodes)
