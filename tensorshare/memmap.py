"""Values on local disk as memory-mapped files, in the layout the server's disk tier uses.

``save_memmap(value, path)`` writes one value (a state dict, say) as a directory of
raw ``*.memmap`` files plus metadata (:mod:`tensorshare.disk.layout`, tensordict's
layout); ``Client.save(bin, path)`` writes a bin's items the same way, one
numbered subdirectory per item, straight from the bytes the server sent.
``load_memmap(path)`` maps them back: tensors view the files, and pages are read
only when touched, so loading takes the same time for 1 MiB and 100 GiB.  Unlike
``torch.load``, nothing here can run code from the files.  The same-host zero-copy
client (:mod:`.zerocopy`) maps the server's items with :func:`load_item`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import stat
import uuid
from typing import Any, Sequence

import numpy as np

from .disk.tables import is_checkpoint
from .disk.layout import (
    BIN_RECORD, RECORD, LayoutError, StoredItem, mapped_parts, read_item, write_bin_root, write_item,
)
from .wire.codec import array_view, assemble, build, encode
from .wire.description import DEFAULT_LIMITS, DecodeLimits, parse_description

__all__ = ["save_memmap", "load_memmap", "save_items"]

_ITEM_DIGITS = 8


def save_memmap(value: Any, path: str | os.PathLike, *, fsync: bool = False, threads: int | None = None) -> None:
    """Write ``value`` to the new directory ``path`` (whole, or not at all).

    A dict of tensors can also be opened with ``tensordict.TensorDict.load_memmap``.
    Large values are written by several threads.
    """
    enc = encode(value)
    write_item(os.fspath(path), enc.description, enc.buffers, enc.nbytes, fsync=fsync, threads=threads)


def save_items(path: str | os.PathLike, items: Sequence[tuple[bytes, Any, int]], *, overwrite: bool = False,
               fsync: bool = False) -> None:
    """Write items given as ``(description, payload buffer, nbytes)`` to the new
    directory ``path``, as ``path/00000000``, ``path/00000001``...  A payload may
    also be a :class:`~tensorshare.disk.layout.StoredItem` of that description
    (another item directory, checked by ``read_item``): its array files are then
    copied by the kernel, file to file.

    The directory is also a tensordict: ``TensorDict.load_memmap(path)`` opens it
    with one entry per item that tensordict can hold (dicts, TensorDicts, tensors,
    JSON-able values).  The directory appears whole: it is written under a temporary name and renamed.
    An existing ``path`` is replaced only with ``overwrite=True``.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        written = [_save_item(os.path.join(tmp, f"{i:0{_ITEM_DIGITS}d}"), description, payload, nbytes, fsync)
                   for i, (description, payload, nbytes) in enumerate(items)]
        write_bin_root(tmp, written, fsync=fsync)
        if os.path.exists(path):
            old = os.path.join(parent, f".old-{name}-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_item(path: str, description: bytes, payload: Any, nbytes: int, fsync: bool) -> StoredItem:
    if not isinstance(payload, StoredItem):
        return write_item(path, description, [payload], nbytes, fsync=fsync)
    if payload.description != description or payload.nbytes != nbytes:
        raise ValueError(f"{payload.path} does not hold the item to save")
    # The mappings are only the fallback where the kernel cannot copy: made only then.
    copies = {i: file for i, (_offset, length, file) in enumerate(payload.files) if length}
    return write_item(path, description, lambda: mapped_parts(payload.files, nbytes), nbytes, fsync=fsync,
                      copies=copies)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # no C library to call (Windows): Python's mmap instead
        return None


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # 0x10 on Linux and macOS


class _Mapping:
    """A memory mapping made with the C library's mmap, unmapped when the last array
    over it goes.  Unlike Python's ``mmap``, it keeps no file descriptor open, so a
    process may hold many mapped tensors without running out of descriptors."""

    __slots__ = ("address", "size", "__array_interface__", "__weakref__")

    def __init__(self, fd: int, size: int, shared: bool, populate: bool = False):
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        protection = mmap.PROT_READ | mmap.PROT_WRITE
        if populate:  # the kernel maps every page now, far quicker than a fault per page on first read
            flags |= getattr(mmap, "MAP_POPULATE", 0)
            if not shared:  # read only: populating a private writable mapping copies every page (it breaks
                protection = mmap.PROT_READ  # copy-on-write ahead of writes), into anonymous memory
        address = _LIBC.mmap(None, size, protection, flags, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.address, self.size = address, size
        read_only = not protection & mmap.PROT_WRITE
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, read_only), "version": 3}

    def make_private(self, file: str) -> None:
        """Map ``file`` copy-on-write in place of this mapping, at the same address.

        For a shared mapping of ``file`` (same bytes): the arrays over it keep their
        content, but from now on writes copy the touched pages instead of changing
        the file, and the file is no longer open for writing anywhere here."""
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            address = _LIBC.mmap(self.address, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        finally:
            os.close(fd)
        if address != self.address:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def __del__(self) -> None:
        _LIBC.munmap(self.address, self.size)


def new_shared_file(path: str, nbytes: int) -> np.ndarray:
    """Create the file ``path`` of ``nbytes`` zero bytes and map it shared and writable:
    a uint8 array whose base is its :class:`_Mapping` (pages are allocated when touched)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return np.asarray(_Mapping(fd, nbytes, True))
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _map(file: str, nbytes: int, writable: bool, follow_symlinks: bool = True, populate: bool = False) -> np.ndarray:
    """The file's bytes as a uint8 array over a mapping: shared if ``writable``, else
    copy-on-write (private; writes stay in memory).  Pages are read when touched
    (all at once with ``populate``: the whole file is about to be read, and only read:
    a read-only array, unless ``writable``)."""
    if not nbytes:
        return np.empty(0, np.uint8)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(file, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes:
            raise LayoutError(f"{file} is not a regular file of at least {nbytes} bytes")
        if _LIBC is not None:
            return np.asarray(_Mapping(fd, nbytes, writable, populate))
        mapping = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8)


def load_item(stored: StoredItem, *, writable: bool = False, device: Any = None,
              limits: DecodeLimits = DEFAULT_LIMITS, follow_symlinks: bool = True, into: Any = None,
              caller: Any = None) -> Any:
    """The value of one item found by :func:`~tensorshare.disk.layout.read_item`, its arrays
    mapping the item's files (copy-on-write unless ``writable``).  On a ``device`` with
    a transfer engine (CUDA) the files are copied there through it in buckets
    (:meth:`~tensorshare.device.engine.Engine.upload`); ``into(description)`` may give
    destination tensors by array index, ``caller`` (a
    :class:`~tensorshare.device.payload.Caller`) the stream they are handed to."""
    desc = parse_description(stored.description, stored.nbytes, limits)
    if device is not None and not writable:
        value = _load_on_device(stored, desc, device, follow_symlinks, into, caller)
        if value is not None:
            return value
    arrays = [array_view(spec, _map(file, nbytes, writable, follow_symlinks), 0, device)
              for spec, (_offset, nbytes, file) in zip(desc.arrays, stored.files)]
    return assemble(desc, arrays)


def _load_on_device(stored: StoredItem, desc, device: Any, follow_symlinks: bool, into: Any, caller: Any) -> Any:
    """:func:`load_item` into device memory through the transfer engine; None where
    there is none for ``device`` (or an array it cannot hold: numpy's)."""
    from .device import engine_for
    from .device.payload import item_layout

    engine = engine_for(device)
    if engine is None:
        return None
    index = engine.streams.index(device)
    layout = item_layout(desc, 0, into(desc) if into is not None else {}, engine, index)
    if layout is None:
        return None
    arrays = [(offset, _map(file, nbytes, False, follow_symlinks, populate=True))
              for offset, nbytes, file in stored.files]
    targeted = any(target is not None for _o, _n, target in layout)
    return build(desc, engine.upload(arrays, stored.nbytes, index, layout if targeted else None, caller))


def load_memmap(path: str | os.PathLike, *, writable: bool = False, device: Any = None,
                limits: DecodeLimits = DEFAULT_LIMITS) -> Any:
    """Map back what :func:`save_memmap` or ``Client.save`` wrote.

    A directory written by ``save_memmap`` gives its value; one written by
    ``Client.save`` gives the list of the bin's items, as ``peek`` would (of a
    table: ``{column: tensor [rows, *shape]}``, copy-on-write whatever ``writable``).
    Tensors map the files copy-on-write: changing them changes memory, not the
    files, unless ``writable=True`` (then they write through to the files).
    ``device`` copies tensors there (reading them whole).  Raises
    :class:`~tensorshare.disk.layout.LayoutError` for a directory that holds no whole
    item, and for one neither wrote (a directory ``TensorDict.memmap()`` wrote, say:
    open that with ``TensorDict.load_memmap``).
    """
    path = os.fspath(path)
    if is_checkpoint(path):  # Client.save of a table: its columns, [rows, *shape] each
        from .table_copy import mapped_columns

        columns = mapped_columns(path)
        return columns if device is None else {k: v.to(device) for k, v in columns.items()}
    if os.path.exists(os.path.join(path, RECORD)):
        return load_item(read_item(path, limits), writable=writable, device=device, limits=limits)
    entries = sorted(e for e in os.listdir(path) if len(e) == _ITEM_DIGITS and e.isdigit())
    # A root written by Client.save has its own record (older ones only their numbered
    # items); anything else (a directory TensorDict.memmap() wrote, say) is not ours.
    if not entries and not os.path.exists(os.path.join(path, BIN_RECORD)):
        raise LayoutError(f"{path}: not written by save_memmap or Client.save (no {RECORD}, no {BIN_RECORD}, "
                          f"no numbered item directories)")
    return [load_item(read_item(os.path.join(path, e), limits), writable=writable, device=device, limits=limits)
            for e in entries]
