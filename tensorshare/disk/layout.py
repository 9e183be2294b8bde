"""The on-disk layout of a stored item: tensordict's memory-mapped layout, torch-free.

One directory per item.  Each array of the value is one raw ``*.memmap`` file
(C-contiguous, little-endian, exactly the array's bytes); a value that is a dict
gets tensordict's structure: nested dicts become subdirectories, and every level
has a ``meta.json`` with each tensor's dtype and shape, so that
``tensordict.TensorDict.load_memmap(item_dir)`` opens a stored dict of tensors.
Non-tensor leaves that JSON can carry appear there as tensordict ``NonTensorData``.

The source of truth is ``.tensorshare.msgpack`` (a name no key can take: keys that
become file names never start with a dot): the value's description blob exactly as
it travelled, its tag, its payload length and the relative path of every array's
file.  Arrays that have no clean dict path (inside lists, tuples, under keys that
are not safe file names, or a bare tensor) live in ``.arrays/<index>.memmap``.

Writing goes to a hidden temporary sibling directory that is renamed into place
last, so a reader (or a server restarted after a crash) sees a whole item or
nothing.  Keys are data, never paths: only keys matching :data:`_SAFE_KEY` become
file names, and every path read back is checked to stay inside the item directory.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack

from ..errors import ProtocolError
from ..wire.description import (
    DEFAULT_LIMITS, KIND_TORCH, Description, DecodeLimits, _ArrayRef, _TensorDictNode, _TupleNode,
    parse_description,
)
from ..wire.dtypes import TORCH_WIDTHS
from .files import copy_file, fsync_dir, write_file

__all__ = ["LayoutError", "Payload", "StoredItem", "write_item", "read_item", "write_bin_root", "array_paths",
           "mapped_parts", "RECORD", "BIN_RECORD", "FORMAT"]

RECORD = ".tensorshare.msgpack"
BIN_RECORD = ".tensorshare-bin.msgpack"  # marks a directory of items written by Client.save
FORMAT = 1
_FALLBACK_DIR = ".arrays"
# A key becomes a file or directory name only if it is short, starts with a letter,
# digit or underscore, and cannot collide with the layout's own names.
_SAFE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}")
_RESERVED_SUFFIXES = (".memmap", ".json", ".msgpack")
_TENSORDICT_TYPE = "<class 'tensordict._td.TensorDict'>"
_NON_TENSOR_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
# Payload size from which array files are written by several threads.  Measured here
# (2 cores): 25 MiB in 100 files took longer with 2-4 threads than with one; 400 MiB
# took 25% less with 4.
_PARALLEL_MIN = 64 << 20
_PARALLEL_THREADS = 4


class LayoutError(ProtocolError):
    """A directory that does not hold a whole, valid item (corrupt, foreign or partial)."""


@dataclass(frozen=True)
class StoredItem:
    """An item found on disk: its description, tag, and where each array's bytes are."""

    path: str
    description: bytes
    tag: int | None
    nbytes: int  # payload length
    files: tuple  # ((offset in the payload, byte count, absolute file path), ...) in payload order


def _safe_key(key: str) -> bool:
    return bool(_SAFE_KEY.fullmatch(key)) and not key.endswith(_RESERVED_SUFFIXES)


def array_paths(desc: Description) -> list[str]:
    """The relative file path of each array of ``desc`` (posix separators).

    An array reached first through a chain of safe dict keys from the root lives at
    ``key/key/.../key.memmap``; any other array at ``.arrays/<index>.memmap``.
    """
    paths: list[str | None] = [None] * len(desc.arrays)
    if _entries(desc.tree) is not None:
        stack = [("", _entries(desc.tree))]
        while stack:
            prefix, node = stack.pop()
            for key, child in node.items():
                if not _safe_key(key):
                    continue
                if isinstance(child, _ArrayRef) and paths[child.index] is None:
                    paths[child.index] = f"{prefix}{key}.memmap"
                elif _entries(child) is not None:
                    stack.append((f"{prefix}{key}/", _entries(child)))
    return [p if p is not None else f"{_FALLBACK_DIR}/{i}.memmap" for i, p in enumerate(paths)]


def _entries(node: Any) -> dict | None:
    """The str-keyed entries of a dict or TensorDict node (None for other nodes)."""
    if isinstance(node, dict):
        return node
    if type(node) is _TensorDictNode:
        return node.entries
    return None


def _json_leaf(node: Any) -> bool:
    """True if ``node`` holds no arrays, bytes or tuples and survives JSON unchanged."""
    if node is None or isinstance(node, (bool, str)):
        return True
    if isinstance(node, int):  # the record holds any int; JSON readers, 64-bit ones
        return -(1 << 63) <= node < 1 << 64
    if isinstance(node, float):
        return math.isfinite(node)
    if isinstance(node, list) and not isinstance(node, _TupleNode):
        return all(_json_leaf(x) for x in node)
    if isinstance(node, dict):
        return all(_json_leaf(x) for x in node.values())
    return False


def _metadata(desc: Description, paths: list[str]) -> dict[str, dict]:
    """``{relative dir: meta.json content}`` giving tensordict the structure of a dict value."""
    out: dict[str, dict] = {}
    if _entries(desc.tree) is not None:
        _level_metadata(desc, paths, "", desc.tree, out)
    return out


def _non_tensor_meta(data: Any) -> dict:
    return {"_type": _NON_TENSOR_TYPE, "data": data, "_metadata": None, "_is_non_tensor": True}


def _tensor_meta(shape: Sequence[int], dtype: str) -> dict:
    return {"device": "cpu", "shape": list(shape), "dtype": f"torch.{dtype}", "is_nested": False}


def write_bin_root(root: str, items: Sequence[StoredItem], *, fsync: bool = False) -> None:
    """Make ``root``, which holds the item directories ``items`` (named by number),
    a tensordict too: a ``meta.json`` with one entry per item tensordict can open
    (a dict or TensorDict: its directory; a lone tensor: a hard link to its file
    beside the directory; a JSON-able value: its directory's NonTensorData), and
    :data:`BIN_RECORD`, which marks the root as tensorshare's even when empty."""
    meta: dict[str, Any] = {}
    for item in items:
        name = os.path.basename(item.path)
        desc = parse_description(item.description, item.nbytes)
        tree = desc.tree
        if _entries(tree) is not None:
            meta[name] = {"type": "TensorDict"}
        elif _json_leaf(tree):  # the item's directory becomes a NonTensorData (only here: the
            # server's own item directories do without the extra file)
            _write_json(os.path.join(item.path, "meta.json"), _non_tensor_meta(tree), fsync)
            if fsync:
                fsync_dir(item.path)
            meta[name] = {"type": "NonTensorData"}
        elif isinstance(tree, _ArrayRef) and desc.arrays[0].kind == KIND_TORCH:
            spec, (_offset, _nbytes, file) = desc.arrays[0], item.files[0]
            try:
                os.link(file, os.path.join(root, f"{name}.memmap"))
            except OSError:  # no hard links on this file system: tensordict does without it
                continue
            meta[name] = _tensor_meta(spec.shape, spec.dtype)
    meta.update({"shape": [], "device": "cpu", "_type": _TENSORDICT_TYPE})
    _write_json(os.path.join(root, "meta.json"), meta, fsync)
    write_file(os.path.join(root, BIN_RECORD),
                [memoryview(msgpack.packb({"format": FORMAT, "items": len(items)}))], fsync)
    if fsync:
        fsync_dir(root)


def _write_json(path: str, doc: Any, fsync: bool) -> None:
    write_file(path, [memoryview(json.dumps(doc).encode())], fsync)


def _level_metadata(desc: Description, paths: list[str], prefix: str, node: Any, out: dict) -> None:
    """:func:`_metadata` of one dict or TensorDict level (``prefix``: its directory)
    and those below it; a TensorDict's batch size is the level's shape."""
    meta: dict[str, Any] = {}
    for key, child in _entries(node).items():
        if not _safe_key(key):
            continue
        if isinstance(child, _ArrayRef):
            spec = desc.arrays[child.index]
            if paths[child.index] == f"{prefix}{key}.memmap" and spec.dtype in TORCH_WIDTHS:
                meta[key] = _tensor_meta(spec.shape, spec.dtype)
        elif _entries(child) is not None:
            meta[key] = {"type": "TensorDict"}
            _level_metadata(desc, paths, f"{prefix}{key}/", child, out)
        elif _json_leaf(child):
            meta[key] = {"type": "NonTensorData"}
            out[f"{prefix}{key}/"] = _non_tensor_meta(child)
    shape = list(node.batch) if type(node) is _TensorDictNode else []
    meta.update({"shape": shape, "device": "cpu", "_type": _TENSORDICT_TYPE})
    out[prefix] = meta


class Payload:
    """Random access to a payload of ``nbytes`` given as a sequence of buffers (the
    received segments), or as a function that gives them, called only when the first
    bytes are asked for (by any of the writing threads).

    A segment may also stand for bytes in device memory (a
    :class:`~tensorshare.device.engine.DeviceSpan`, which says so with ``staged``):
    its slices are spans too, which :func:`.files.write_file` has the device engine write."""

    def __init__(self, segments: Sequence | Callable[[], Sequence], nbytes: int):
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._make = segments if callable(segments) else None
        if self._make is None:
            self._take(segments)

    def _take(self, segments: Sequence) -> None:
        segments = [s if getattr(s, "staged", False) else memoryview(s).cast("B") for s in segments]
        starts, pos = [], 0
        for s in segments:
            starts.append(pos)
            pos += s.nbytes
        if pos != self.nbytes:
            raise ValueError(f"segments hold {pos} bytes, not {self.nbytes}")
        self.starts, self.segments = starts, segments

    def views(self, start: int, length: int):
        """Memoryviews covering ``payload[start:start+length]``."""
        if self._make is not None:
            with self._lock:
                if self._make is not None:
                    self._take(self._make())
                    self._make = None
        end = start + length
        for seg_start, seg in zip(self.starts, self.segments):
            seg_end = seg_start + seg.nbytes
            if seg_end <= start or seg_start >= end:
                continue
            lo, hi = max(start, seg_start) - seg_start, min(end, seg_end) - seg_start
            yield seg[lo:hi] if type(seg) is memoryview else seg.slice(lo, hi - lo)


def write_item(path: str, description: bytes, segments: Sequence, nbytes: int, tag: int | None = None, *,
               fsync: bool = False, threads: int | None = None, make_parents: bool = True,
               sources: dict[int, str] | None = None, copies: dict[int, str] | None = None,
               fills: dict[int, str] | None = None, limits: DecodeLimits = DEFAULT_LIMITS) -> StoredItem:
    """Write one item into the new directory ``path``, whole or not at all; returns it.

    ``segments`` are buffers whose concatenation is the payload (or a function that
    returns them, called only if some array's bytes are to be written from them).  Files are written
    into a temporary sibling directory that is renamed to ``path`` last; with
    ``fsync`` the files and both directories are flushed to stable storage before
    the function returns.  ``threads`` writes array files in parallel (default:
    several threads for payloads of 64 MiB and more).  With ``make_parents=False``
    the parent directory must exist already (so that a writer racing with the
    parent's removal cannot re-create it).  ``sources`` maps array indexes to files
    on the same file system that already hold exactly those arrays' bytes: they are
    moved into the item (renamed, not copied; written from ``segments`` if that
    fails).  ``copies`` maps array indexes to files (regular files, not links)
    whose first bytes are those arrays': the kernel copies them into the item
    (``copy_file_range`` or ``sendfile``; written from ``segments`` where it cannot).
    ``fills`` maps array indexes to files of exactly those arrays' sizes made
    earlier (allocated, never referred to): they are moved into the item and the
    arrays written into their pages, which costs less than allocating new ones
    (in shared memory, see docs/design.md); a new file is written if the move
    fails.  Raises ``OSError`` (disk full, permissions...) after removing the
    temporary directory.
    """
    desc = parse_description(description, nbytes, limits)
    payload = Payload(segments, nbytes)
    paths = array_paths(desc)
    parent, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(parent, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    (os.makedirs if make_parents else os.mkdir)(tmp)
    try:
        dirs = {os.path.dirname(p) for p in paths} | {d.rstrip("/") for d in _metadata(desc, paths)}
        for d in sorted(dirs):
            if d:
                os.makedirs(os.path.join(tmp, d), exist_ok=True)
        sources, copies, fills = sources or {}, copies or {}, fills or {}
        jobs = [(os.path.join(tmp, p), spec.offset, spec.nbytes, sources.get(i), copies.get(i), fills.get(i))
                for i, (p, spec) in enumerate(zip(paths, desc.arrays))]

        def write(job) -> None:
            file, offset, length, source, copy, fill = job
            if source is not None:
                try:
                    os.rename(source, file)
                    return
                except OSError:
                    pass
            if copy is not None and copy_file(copy, file, length, fsync):
                return
            if fill is not None:
                try:
                    os.rename(fill, file)
                except OSError:
                    pass
                else:
                    write_file(file, payload.views(offset, length), fsync, length)
                    return
            write_file(file, payload.views(offset, length), fsync)

        if threads is None:
            threads = min(_PARALLEL_THREADS, len(jobs)) if nbytes >= _PARALLEL_MIN else 1
        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(write, jobs))
        else:
            for job in jobs:
                write(job)
        for d, meta in _metadata(desc, paths).items():
            with open(os.path.join(tmp, d, "meta.json"), "w") as f:
                json.dump(meta, f)
        record = {"format": FORMAT, "description": description, "tag": tag, "nbytes": nbytes, "files": paths}
        write_file(os.path.join(tmp, RECORD), [memoryview(msgpack.packb(record, use_bin_type=True))], fsync)
        if fsync:
            for d in sorted(dirs | {""}, reverse=True):
                fsync_dir(os.path.join(tmp, d))
        os.rename(tmp, path)
        if fsync:
            fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    path = os.path.join(parent, name)
    files = tuple((spec.offset, spec.nbytes, os.path.join(path, *p.split("/"))) for p, spec in zip(paths, desc.arrays))
    return StoredItem(path, description, tag, nbytes, files)


def rewrite_arrays(stored: StoredItem, segments: Sequence, nbytes: int) -> None:
    """Write a new payload of the same description into the array files of an item
    written before (by :func:`write_item`), in place: each file made writable by its
    owner again, opened without following symlinks, overwritten and closed.  For a
    value a reader copied out and left (a table insert through shared memory:
    PROTOCOL.md §10.4), whose pages cost less to write again than new ones; bytes
    in device memory are staged down as :func:`write_item` does.  Raises
    ``OSError`` (a file gone, replaced or resized) having written some files perhaps."""
    payload = Payload(segments, nbytes)
    for offset, length, file in stored.files:
        os.chmod(file, 0o600, follow_symlinks=False)
        write_file(file, payload.views(offset, length), False, length)


def _inside(root: str, relative: Any) -> str:
    """``root/relative``, refusing anything that is not a plain relative path below root."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise LayoutError(f"bad file entry {relative!r:.80}")
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise LayoutError(f"file entry {relative!r:.80} leaves the item directory")
    return os.path.join(root, *parts)


def read_item(path: str, limits: DecodeLimits = DEFAULT_LIMITS) -> StoredItem:
    """Read and check the item directory ``path`` (its record and its files' sizes).

    Reads only the small record and stats the files: the arrays' bytes stay on
    disk.  Raises :class:`LayoutError` for anything that is not a whole item
    written by :func:`write_item`.
    """
    record_path = os.path.join(path, RECORD)
    try:
        with open(record_path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size  # read(n) would allocate all n bytes first
            if size > limits.max_nodes + (64 << 20):
                raise LayoutError(f"{path}: its record takes {size} bytes")
            raw = f.read(size)
        record = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read its record: {exc}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise LayoutError(f"{path}: malformed record: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LayoutError(f"{path}: not a tensorshare item of format {FORMAT}")
    description, tag, nbytes, files = (record.get(k) for k in ("description", "tag", "nbytes", "files"))
    if not (isinstance(description, bytes) and type(nbytes) is int and isinstance(files, list)):
        raise LayoutError(f"{path}: record lacks description, nbytes or files")
    if tag is not None and type(tag) is not int:
        raise LayoutError(f"{path}: bad tag {tag!r:.40}")
    try:
        desc = parse_description(description, nbytes, limits)
    except ProtocolError as exc:
        raise LayoutError(f"{path}: bad description: {exc}") from None
    if len(files) != len(desc.arrays):
        raise LayoutError(f"{path}: {len(files)} files for {len(desc.arrays)} arrays")
    located = []
    for spec, relative in zip(desc.arrays, files):
        file = _inside(path, relative)
        try:
            size = os.stat(file).st_size
        except OSError as exc:
            raise LayoutError(f"{path}: missing array file {relative!r}: {exc}") from None
        if size != spec.nbytes:
            raise LayoutError(f"{path}: {relative!r} holds {size} bytes, the array has {spec.nbytes}")
        located.append((spec.offset, spec.nbytes, file))
    return StoredItem(path, description, tag, nbytes, tuple(located))


def mapped_parts(files: Sequence, nbytes: int) -> list:
    """A stored payload as buffers, without reading it: zero padding as ``bytes`` and
    each array's file as a read-only ``mmap`` (pages are read when touched).

    ``files`` is :attr:`StoredItem.files` (``(offset, byte count, path)`` in payload
    order) and ``nbytes`` the payload length.  Raises ``OSError`` if a file is gone.
    """
    parts, pos = [], 0
    for offset, length, file in files:
        if offset > pos:
            parts.append(bytes(offset - pos))
        if length:
            with open(file, "rb") as f:
                parts.append(mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ))
        pos = offset + length
    if nbytes > pos:
        parts.append(bytes(nbytes - pos))
    return parts
