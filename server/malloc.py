"""How the server asks glibc's allocator for memory: the settings it starts with, and
a scope in which large temporaries come from the heap.

The server fixes glibc's mmap threshold at 128 KiB, so that every large block (a
payload chunk of 64 KiB-4 MiB) has its own mapping and goes back to the system when
freed: with glibc's sliding threshold, later chunks came from the heap, and a server
that once held 1 GiB kept most of it.  But a table's insert of 16,384 rows makes
numpy temporaries of 128 KiB and more, each then a new mapping whose pages are
faulted in and zeroed, and unmapped again when freed: 192 page faults an insert,
where first touching memory is dear (this virtual machine: 0.48 GB/s for fresh
pages, 6.2 GB/s for pages touched before).  In :func:`heap_temporaries` they come
from the heap and stay with the process for the next one (an insert of 1 MiB into a
table of 2x10^7 rows: 1.12 ms of CPU, 0.71 ms so).  The heap keeps up to
:data:`TRIM` bytes free at its top for that; what it holds is used by any block
later, a payload's too, before new mappings are made (so the process keeps at most
its tables' largest temporaries, each under :data:`SCOPED_MMAP`).
"""

from __future__ import annotations

import contextlib
import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP = 128 << 10  # blocks from this size on have their own mapping
TRIM = 8 << 20  # free bytes at the heap's top it keeps (past them it shrinks): a batch of 16,384 rows needs 4 MiB
SCOPED_MMAP = 4 << 20  # in heap_temporaries: blocks under this size come from the heap (batches to 512 Ki rows)

try:
    _mallopt = ctypes.CDLL("libc.so.6").mallopt
except (OSError, AttributeError):  # not glibc: nothing to tune
    _mallopt = None


def tune() -> None:
    """The server's settings (fixing the threshold also stops its sliding)."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP)
        _mallopt(M_TRIM_THRESHOLD, TRIM)


@contextlib.contextmanager
def heap_temporaries():
    """Within: blocks under :data:`SCOPED_MMAP` come from the heap (a table's work on
    a batch of rows; payloads are not allocated here)."""
    if _mallopt is None:
        yield
        return
    _mallopt(M_MMAP_THRESHOLD, SCOPED_MMAP)
    try:
        yield
    finally:
        _mallopt(M_MMAP_THRESHOLD, MMAP)
