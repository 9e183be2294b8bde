"""The table engine: replay buffers and datasets held by the server (issue #19).

Pure and synchronous, as the bin store is: no Twisted, no I/O but the column memory,
no torch.  The server's storage layer wraps a :class:`Table` per table name and
parks the requests it refuses for now.

Modules, one job each:

* :mod:`.table`       -- :class:`Table`: insert, write, sample, read, priorities, removal, info
* :mod:`.rows`        -- what its operations hand back (rows read or sampled, written, removed)
* :mod:`.slots`       -- slot occupancy and per-row state; how keys and slot indices relate
* :mod:`.columns`     -- column specs, :class:`RawArray` (values in and out as bytes)
* :mod:`.backing`     -- column memory: in RAM, or memory-mapped files in tensordict's layout
* :mod:`.rowreads`    -- wide rows read from those files, all asked of the disk at once
* :mod:`.selectors`   -- the samplers and removers
* :mod:`.sumtree`     -- batched sum tree (prioritized sampling)
* :mod:`.mintree`     -- batched argmin tree (fifo/lifo order, the removers)
* :mod:`.ratelimiter` -- Reverb's rate limiter, as decisions
* :mod:`.compiled`    -- the hot loops (tree searches and refreshes, checks, counts) in C
                         (``_loops.c``) where a C compiler was at install, else None
* :mod:`.errors`      -- the exceptions, each with its reply code
"""

from .backing import Backing, MemmapBacking, MemoryBacking, tensordict_metadata
from .columns import ColumnSpec, RawArray, numpy_dtype
from .errors import (
    BadArgumentError, BatchTooLargeError, ColumnMismatchError, EmptySlotError, EmptyTableError, NotFlushedError,
    PriorityError, RowsNotReadError, RowsNotWrittenError, SlotIndexError, TableError, TableFullError, TableSpecError,
    WouldBlockError,
)
from .ratelimiter import RateLimiter
from .selectors import REMOVERS, SAMPLERS
from .rows import Removed, Rows, Sample, Written
from .table import Table, state_bytes

__all__ = [
    "Table", "state_bytes", "Sample", "Rows", "Written", "Removed", "RateLimiter", "ColumnSpec", "RawArray", "numpy_dtype",
    "Backing", "MemoryBacking", "MemmapBacking", "tensordict_metadata", "SAMPLERS", "REMOVERS",
    "TableError", "TableSpecError", "BadArgumentError", "ColumnMismatchError", "SlotIndexError", "EmptySlotError",
    "PriorityError", "TableFullError", "BatchTooLargeError", "EmptyTableError", "WouldBlockError",
    "RowsNotReadError", "RowsNotWrittenError", "NotFlushedError",
]
