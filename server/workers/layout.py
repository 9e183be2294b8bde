"""One data directory, one directory per worker: which worker's directory each bin and table is in.

A server of N workers keeps worker k's bins and tables under
``<data-dir>/worker-k/`` (each in the layout of ``server/bins/durable.py`` and
``server/bins/tablestore.py``, whose names for it this module uses); a server of one process keeps them in
``<data-dir>/`` itself.  :func:`place` runs before any worker loads anything,
under the data directory's lock: it moves every bin and table that is not in the
directory of the worker that owns it now into that directory, so the same data
directory can be served by 1, 2 or 16 workers in turn, and a server grown from n
to n+1 workers moves only the bins the new worker wins (rendezvous hashing,
``tensorshare/protocol/placement.py``).  Each move is one ``rename`` of a bin's
(or table's) directory within the data directory's file system, so a server killed
in the middle restarts into a state where every bin is whole in one directory; the
next start finishes the moves.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

from tensorshare.disk.tables import TABLE_RECORD
from tensorshare.protocol.placement import rendezvous, worker_keys

from ..bins.durable import BIN_RECORD, BINS_DIR, HALF_MADE, SWAP_PREFIX
from ..bins.tablestore import TABLES_DIR

log = logging.getLogger("tensorshare.server")

_WORKER_DIR = re.compile(r"worker-(\d+)")


def worker_dir(root: str, index: int) -> str:
    """The directory of worker ``index`` in data directory ``root``."""
    return os.path.join(root, f"worker-{index}")


def _worker_dirs(root: str) -> list[str]:
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(root, e) for e in entries
                  if _WORKER_DIR.fullmatch(e) and os.path.isdir(os.path.join(root, e)))


def _named(directory: str, record: str) -> str | None:
    """The bin or table name recorded in ``directory/record`` (None if unreadable)."""
    try:
        with open(os.path.join(directory, record)) as f:
            name = json.load(f).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def place(root: str, count: int) -> int:
    """Move every bin and table of data directory ``root`` into the directory of the
    worker of ``count`` that owns it (``root`` itself for one); returns how many moved.

    Cheap when nothing has to move and the server has one process: it then only
    looks for ``worker-*`` directories."""
    sources = _worker_dirs(root)
    if count == 1:
        if not sources:
            return 0
        targets = [root]
    else:
        sources.append(root)  # bins a one-process server left
        targets = [worker_dir(root, k) for k in range(count)]
    keys = worker_keys(count)
    moved = 0
    for source in sources:
        for kind, record in ((BINS_DIR, BIN_RECORD), (TABLES_DIR, TABLE_RECORD)):
            moved += _move_kind(source, kind, record, targets, keys)
    for source in sources:
        if source not in targets and source != root:
            _remove_if_spent(source)
    if moved:
        log.warning("data directory %s: moved %d bins and tables to the directories of the %d worker(s) "
                    "that own them now", root, moved, count)
    return moved


def _move_kind(source: str, kind: str, record: str, targets: list[str], keys: list[str]) -> int:
    directory = os.path.join(source, kind)
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return 0
    moved = 0
    for entry in entries:
        if entry.startswith(HALF_MADE):
            continue  # half made: the loader removes it
        swapping = entry.startswith(SWAP_PREFIX)  # a bin being rewritten: it moves with its bin
        key = entry[len(SWAP_PREFIX):] if swapping else entry
        path = os.path.join(directory, entry)
        name = _named(path, record)
        if name is None and swapping:
            name = _named(os.path.join(directory, key), record)
        if name is None:
            continue  # not ours to judge: the loader reports it
        target = targets[rendezvous(name, keys)] if len(targets) > 1 else targets[0]
        if os.path.abspath(target) == os.path.abspath(source):
            continue
        destination = os.path.join(target, kind, entry)
        if os.path.exists(destination):
            log.error("data directory: %s %r is in two worker directories (%s and %s); keeping %s, "
                      "leaving the other where it is", kind[:-1], name, source, target, destination)
            continue
        os.makedirs(os.path.join(target, kind), mode=0o700, exist_ok=True)
        os.rename(path, destination)
        moved += 1
    return moved


def _remove_if_spent(directory: str) -> None:
    """Remove the directory of a worker the server no longer has, once it holds no bin
    or table (its trash and its taken items were the old worker's to clean up)."""
    for kind in (BINS_DIR, TABLES_DIR):
        path = os.path.join(directory, kind)
        if os.path.isdir(path) and any(not e.startswith(HALF_MADE) for e in os.listdir(path)):
            return  # something could not be moved: keep it for a person to see
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["place", "worker_dir"]
