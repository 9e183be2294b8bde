"""Same-host zero-copy, client side: the server's shared areas as one connection sees them.

A server's greeting may offer its shared areas (PROTOCOL.md §10).  :meth:`SharedAreas.of`
trusts an area only after :func:`tensorshare.disk.areas.verify_area` found this
host's directory of that name to be the server's (the token check), so a server
on another host, in another container, or one restarted since, is never trusted.
Then:

* a value to PUT/APPEND is written into this connection's incoming directory in
  the server's shared-memory area (:meth:`SharedAreas.write`, the layout of
  :mod:`tensorshare.disk.layout`), and the request names it instead of carrying bytes;
  the server adopts the directory without copying;
* a GET/PEEK reply may refer to items' files instead of carrying their bytes:
  :meth:`SharedAreas.load` checks the reference and maps the files copy-on-write
  (:func:`tensorshare.memmap.load_item`), so changing a tensor never changes what
  the server stores or what other readers see;
* :meth:`SharedAreas.shared` makes tensors that live in the incoming directory
  from the start (*drafts*): a put of such a value moves their files into the item
  instead of writing them, and remaps the tensors copy-on-write, so the put copies
  nothing and later changes to the tensors still do not reach the server.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import stat
import threading
import uuid
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ..disk.areas import AreaError, inside, verify_area, worth_sharing
from ..errors import ZeroCopyError
from ..disk.layout import LayoutError, Payload, StoredItem, mapped_parts, read_item, rewrite_arrays, write_item
from ..memmap import load_item, new_shared_file
from ..wire.codec import TORCH_NAMES, Encoded
from ..wire.description import DEFAULT_LIMITS, DecodeLimits, parse_description

log = logging.getLogger("tensorshare.client")

__all__ = ["SharedAreas", "shared_copy"]

_MAX_AREAS = 8
DEFAULT_MIN_BYTES = 128 << 10
# Writing a value costs more per file than mapping one (both sides create, check and
# rename files): a value goes through shared memory from this many times the bar of
# a reference (docs/design.md).
PUT_FACTOR = 4
_SPARE_MIN = 1 << 20  # arrays from this size get files prepared for the next put (SharedAreas.prepare_bytes)
_MAX_MAPPED = 10_000  # bins remembered as read by reference (then it starts afresh)


class SharedAreas:
    """The areas of one connection's greeting that this client verified.

    ``roots[i]`` is area ``i``'s directory, or None if it failed the check;
    ``incoming`` is this connection's incoming directory (None: puts go over TCP);
    ``min_bytes`` the server's bar for references (:func:`~tensorshare.disk.areas.worth_sharing`).

    Once two values in a row had arrays of the same sizes, files of those sizes are
    prepared (allocated) in the incoming directory on a background thread of the
    lowest priority, and the next value with arrays of those sizes is written into
    them (``write_item``'s ``fills``): writing into allocated pages of shared memory
    costs less than allocating them on the way (8-20% of a 256 MiB fan-out, measured in
    docs/design.md), and an RL trainer publishes the same shapes again and again.
    At most ``prepare_bytes`` (one value's worth) are kept prepared, these files and
    the directories kept for table rows (:meth:`reuse`) together; 0 turns both off.
    They live in the connection's incoming directory, which the server removes with
    the connection.
    """

    prepare_bytes = 1 << 30

    def __init__(self, roots: list[str | None], incoming: str | None, min_bytes: int, device_refs: bool = False):
        self.roots = roots
        self.device_refs = device_refs  # the server stores values by device reference (CUDA IPC, §13)
        self.usable = [i for i, root in enumerate(roots) if root is not None]
        self.incoming = incoming
        self.min_bytes = min_bytes
        self._spares: dict[int, list[str]] = {}  # array bytes -> prepared files in the incoming directory
        self._spare_bytes = 0  # their bytes, and those of files being made (within prepare_bytes, with _kept_bytes)
        self._spare_lock = threading.Lock()
        self._preparing = False
        self._last_sizes: list[int] | None = None  # the array sizes of the value written last
        self.mapped: set[str] = set()  # bins the server said same-host readers map (PUT reply's ``mapped``)
        self.takes_values = True  # False: the incoming directory takes table rows only (offer's ``values``)
        self._copied: dict[str, StoredItem] = {}  # written for a server that copies them out: name -> item
        self._kept: dict[bytes, list[StoredItem]] = {}  # those answered, by description, to write into again
        self._kept_bytes = 0
        self._maps: dict[str, list] = {}  # a kept directory's path -> its array files, mapped (None: empty)

    @classmethod
    def of(cls, greeting: dict) -> "SharedAreas | None":
        """The verified areas a greeting offers, or None (not offered, or none is this host's)."""
        offer = greeting.get("shm")
        if not isinstance(offer, dict):
            return None
        token, roots = offer.get("token"), offer.get("areas")
        if not isinstance(roots, list) or not roots or len(roots) > _MAX_AREAS:
            return None
        verified = []
        for root in roots:
            problem = verify_area(root, token)
            if problem is not None:
                log.info("zero-copy: not using %r: %s", root, problem)
            verified.append(None if problem else root)
        if not any(verified):
            return None
        incoming = offer.get("incoming")
        if incoming is not None:
            incoming = _private_dir(verified[0], incoming)
        min_bytes = offer.get("min_bytes")
        if type(min_bytes) is not int or min_bytes < 0:
            min_bytes = DEFAULT_MIN_BYTES
        areas = cls(verified, incoming, min_bytes, offer.get("cuda") is True)
        areas.takes_values = offer.get("values") is not False
        return areas

    # -- PUT / APPEND

    def may_take(self, value: Any, name: str | None, copied: bool = False, asked: bool = True) -> bool:
        """Whether a put of ``value`` into bin ``name`` may go through shared memory
        (:meth:`write` decides once it is encoded): when it may hold drafts, whose
        pages are handed over, or when readers on this host map the bin and it is not a
        lone tensor too small to gain.  An ordinary value of a bin nobody maps goes
        over TCP: writing it into new shared-memory pages costs more than loopback
        TCP into the server's reused memory (docs/design.md).

        ``copied``: the server copies the value out of the files into its own (a
        table's columns, TINSERT: PROTOCOL.md §10.4), so it gains by size alone,
        sparing both sides the socket's copies; only a map of columns can be rows,
        and unless the caller ``asked``, only for a table whose inserts the server
        answered with ``mapped`` (it takes the rows from the files as they are)."""
        if copied:
            return type(value) is dict and (asked or name in self.mapped)
        if not self.takes_values:  # (its incoming directory takes table rows only)
            return False
        if _drafts:
            return True
        if name not in self.mapped:
            return False
        kind = type(value)
        return not ((kind is torch.Tensor or kind is np.ndarray) and value.nbytes < self.min_bytes * PUT_FACTOR)

    def note_put(self, name: object, reply: dict) -> None:
        """A PUT/APPEND of bin ``name`` was answered with ``reply``: remember whether
        same-host readers map the bin (PROTOCOL.md §10.4)."""
        if reply.get("mapped"):
            if name not in self.mapped:
                if len(self.mapped) >= _MAX_MAPPED:
                    self.mapped.clear()
                self.mapped.add(name)
        elif self.mapped:
            self.mapped.discard(name)

    def write(self, enc: Encoded, tag: int | None = None, mapped: bool = True, copied: bool = False) -> str | None:
        """Write an encoded value into the incoming directory; returns the name to send,
        or None if it is better sent over TCP: it holds no draft and is too small to be
        faster this way, or nobody maps it (``mapped`` False).

        Arrays that are drafts (:meth:`shared`) are moved in, not written, and their
        tensors turn copy-on-write.  ``copied``: the server copies the value out and
        leaves the directory (a table insert): once the request is answered,
        :meth:`reuse` keeps it for the next value of the same description, which is
        written into its pages in place.  Raises ``OSError`` (shared memory full,
        directory gone...) having left nothing."""
        drafts = _drafts_in(enc) if _drafts else {}
        if not drafts and not (mapped and worth_sharing(enc.nbytes, enc.arrays, self.min_bytes * PUT_FACTOR)):
            return None
        if copied and not drafts:
            return self._write_copied(enc)
        name = uuid.uuid4().hex
        sizes = [spec.nbytes for spec in parse_description(enc.description, enc.nbytes).arrays]
        fills = self._take_spares(sizes, drafts)
        try:
            stored = write_item(os.path.join(self.incoming, name), enc.description, enc.buffers, enc.nbytes, tag,
                                make_parents=False, sources={i: draft[0] for i, draft in drafts.items()},
                                fills=fills)
        finally:
            for path in fills.values():  # those not moved into the item (it failed)
                _unlink(path)
        if sizes == self._last_sizes:  # the same shapes again (parameters): the next one will be too
            self._prepare(sizes, drafts)
        self._last_sizes = sizes
        for i, (_path, mapping) in drafts.items():
            with _drafts_lock:
                _drafts.pop(mapping.address, None)
            try:  # from now on the caller's writes copy pages instead of changing the item
                mapping.make_private(stored.files[i][2])
            except OSError as exc:  # then the server finds the file still open for writing: 425, TCP
                log.warning("could not make a handed-over tensor copy-on-write: %s", exc)
        return name

    def _write_copied(self, enc: Encoded) -> str:
        """:meth:`write` of a value the server copies out: into a directory it left
        after copying a value of the same description, else a new one."""
        with self._spare_lock:
            kept = self._kept.get(enc.description)
            stored = kept.pop() if kept else None
            if stored is not None:
                self._kept_bytes -= stored.nbytes
        if stored is not None:
            try:
                self._rewrite(stored, enc)
            except (OSError, ValueError) as exc:  # (gone with the connection, or tampered with: a new one)
                log.debug("zero-copy: cannot write into a directory used before: %s", exc)
                self._unmap(stored.path)
                shutil.rmtree(stored.path, ignore_errors=True)
            else:
                name = os.path.basename(stored.path)
                self._copied[name] = stored
                return name
        name = uuid.uuid4().hex
        stored = write_item(os.path.join(self.incoming, name), enc.description, enc.buffers, enc.nbytes,
                            make_parents=False)
        self._copied[name] = stored
        return name

    def _rewrite(self, stored: StoredItem, enc: Encoded) -> None:
        """Write ``enc`` into the array files of ``stored`` (a directory kept for rows
        of its description), through mappings of them made the first time: a memcpy
        into pages already there, where writing the files cost a system call and a
        page-cache lookup a page.  Bytes in device memory are staged by
        :func:`rewrite_arrays` instead."""
        if any(getattr(segment, "staged", False) for segment in enc.buffers):
            self._unmap(stored.path)
            rewrite_arrays(stored, enc.buffers, enc.nbytes)
            return
        maps = self._maps.get(stored.path)
        if maps is None:
            maps = self._maps[stored.path] = [_map_for_writing(file, length) for _offset, length, file in stored.files]
        payload = Payload(enc.buffers, enc.nbytes)
        for (offset, length, _file), mapping in zip(stored.files, maps):
            at = 0
            for view in payload.views(offset, length):
                mapping[at:at + view.nbytes] = view
                at += view.nbytes

    def _unmap(self, path: str) -> None:
        for mapping in self._maps.pop(path, ()):
            if mapping is not None:
                mapping.close()

    def reuse(self, name: str) -> None:
        """The request naming ``name`` (written with ``copied``) is answered: keep its
        directory for the next value of its description (at most ``prepare_bytes`` of
        them are kept), or remove it."""
        stored = self._copied.pop(name, None)
        if stored is None or not os.path.isdir(stored.path):
            self.discard(name)
            return
        with self._spare_lock:
            keep = self._kept_bytes + self._spare_bytes + stored.nbytes <= self.prepare_bytes
            if keep:
                self._kept.setdefault(stored.description, []).append(stored)
                self._kept_bytes += stored.nbytes
        if not keep:
            self.discard(name)

    def not_kept(self, name: str) -> None:
        """The server did not take ``name`` (written with ``copied``) from the files:
        once answered it is removed, not kept (the server would refuse it again)."""
        stored = self._copied.pop(name, None)
        if stored is not None:
            self._unmap(stored.path)

    def _take_spares(self, sizes: list[int], drafts: dict) -> dict[int, str]:
        """Prepared files for the arrays of ``sizes`` (not drafts), taken: ``{index: path}``."""
        if not self._spares:
            return {}
        fills = {}
        with self._spare_lock:
            for i, size in enumerate(sizes):
                spares = self._spares.get(size)
                if spares and i not in drafts:
                    fills[i] = spares.pop()
                    self._spare_bytes -= size
        return fills

    def _prepare(self, sizes: list[int], drafts: dict) -> None:
        """Prepare files for a next value like the one just written, on a background thread."""
        want: dict[int, int] = {}
        for i, size in enumerate(sizes):
            if size >= _SPARE_MIN and i not in drafts:
                want[size] = want.get(size, 0) + 1
        if (not want or sum(size * n for size, n in want.items()) > self.prepare_bytes
                or not hasattr(os, "posix_fallocate")):
            return
        with self._spare_lock:
            if self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._make_spares, args=(want,), name="tensorshare-prepare", daemon=True).start()

    def _make_spares(self, want: dict[int, int]) -> None:
        try:  # lowest priority (Linux: per thread): it must not slow the readers of what was just put
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        try:
            with self._spare_lock:  # those of sizes no longer written go
                unwanted = [p for size, paths in self._spares.items() if size not in want for p in paths]
                self._spare_bytes -= sum(size * len(paths) for size, paths in self._spares.items() if size not in want)
                self._spares = {size: paths for size, paths in self._spares.items() if size in want}
            for path in unwanted:
                _unlink(path)
            for size, count in want.items():
                with self._spare_lock:
                    missing = count - len(self._spares.get(size, ()))
                for _ in range(missing):
                    with self._spare_lock:  # (its bytes reserved first: the budget is shared with reuse())
                        if self._kept_bytes + self._spare_bytes + size > self.prepare_bytes:
                            return
                        self._spare_bytes += size
                    path = os.path.join(self.incoming, f"spare-{uuid.uuid4().hex}")
                    try:
                        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                        try:
                            os.posix_fallocate(fd, 0, size)
                        finally:
                            os.close(fd)
                    except BaseException:
                        _unlink(path)
                        with self._spare_lock:
                            self._spare_bytes -= size
                        raise
                    with self._spare_lock:
                        self._spares.setdefault(size, []).append(path)
        except OSError as exc:  # shared memory full, or the connection (and its directory) gone
            log.debug("zero-copy: preparing files for the next value stopped: %s", exc)
        finally:
            with self._spare_lock:
                self._preparing = False

    def shared(self, value: Any) -> Any:
        """``value`` with its tensors and arrays copied into drafts in the incoming directory."""
        return shared_copy(value, self._draft)

    def _draft(self, nbytes: int) -> np.ndarray:
        path = os.path.join(self.incoming, f"draft-{uuid.uuid4().hex}")
        memory = new_shared_file(path, nbytes)
        mapping = memory.base
        with _drafts_lock:
            _drafts[mapping.address] = (path, weakref.ref(mapping), nbytes)
        weakref.finalize(mapping, _forget_draft, mapping.address, path)
        return memory

    def written(self, name: str) -> Encoded:
        """A value :meth:`write` wrote, as an encoded value over its mapped files (to send
        it over TCP after all, even if the caller changed the original since)."""
        stored = read_item(os.path.join(self.incoming, name))
        return Encoded(stored.description, mapped_parts(stored.files, stored.nbytes), stored.nbytes,
                       len(stored.files))

    def discard(self, name: str) -> None:
        """Remove what :meth:`write` wrote, if the server did not take it."""
        self._copied.pop(name, None)  # (one the server was to copy out: not kept for the next either)
        path = os.path.join(self.incoming, name)
        self._unmap(path)
        shutil.rmtree(path, ignore_errors=True)

    # -- GET / PEEK

    def load(self, ref: Any, description: bytes, size: int, device: Any = None,
             limits: DecodeLimits = DEFAULT_LIMITS, into: Any = None, caller: Any = None) -> Any:
        """The value of an item a 226 reply refers to (``[area, path]``), mapped copy-on-write
        (on a ``device``: copied there, into the tensors ``into`` gives, handed to
        ``caller``'s stream, see :func:`~tensorshare.memmap.load_item`).

        Raises :class:`ZeroCopyError` if the reference is malformed, names an area
        not verified, leaves its area, or finds no whole item with exactly that
        description and size."""
        stored = self.item(ref, description, size, limits)
        try:
            return load_item(stored, device=device, limits=limits, follow_symlinks=False, into=into, caller=caller)
        except LayoutError as exc:
            raise ZeroCopyError(f"cannot map a referenced item: {exc}") from None
        except OSError as exc:
            raise ZeroCopyError(f"cannot map a referenced item: {exc.strerror or exc}") from None

    def item(self, ref: Any, description: bytes, size: int, limits: DecodeLimits = DEFAULT_LIMITS) -> StoredItem:
        """Where the files of an item a 226 reply refers to are (checked as :meth:`load`
        checks them), to copy them (``Client.save``)."""
        if not (type(ref) is list and len(ref) == 2 and type(ref[0]) is int and 0 <= ref[0] < len(self.roots)):
            raise ZeroCopyError(f"malformed item reference {ref!r:.80}")
        root = self.roots[ref[0]]
        if root is None:
            raise ZeroCopyError(f"reference into area {ref[0]}, which this client could not verify")
        try:
            stored = read_item(inside(root, ref[1]), limits)
        except (AreaError, LayoutError) as exc:
            raise ZeroCopyError(f"cannot map a referenced item: {exc}") from None
        except OSError as exc:
            raise ZeroCopyError(f"cannot map a referenced item: {exc.strerror or exc}") from None
        if stored.description != description or stored.nbytes != size:
            raise ZeroCopyError(f"{stored.path} does not hold the item the reply describes")
        return stored


# Drafts not yet handed over: address of their mapping -> (file, weak mapping, bytes).
_drafts: dict[int, tuple] = {}
_drafts_lock = threading.Lock()


def _map_for_writing(path: str, length: int) -> mmap.mmap | None:
    """A shared writable mapping of the array file ``path`` of a kept directory,
    which must be a regular file of ``length`` bytes (the server made it read-only
    when it checked it: writable again for its owner); None for an empty one, which
    nothing is written into."""
    os.chmod(path, 0o600, follow_symlinks=False)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != length:
            raise ValueError(f"{path} is not a regular file of {length} bytes")
        return mmap.mmap(fd, length) if length else None
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _forget_draft(address: int, path: str) -> None:
    """A draft's tensors are gone: so is its file (unless a put moved it away)."""
    with _drafts_lock:
        if _drafts.get(address, ("",))[0] == path:  # not a newer draft mapped at the same address
            del _drafts[address]
    try:
        os.unlink(path)
    except OSError:
        pass


def _drafts_in(enc: Encoded) -> dict[int, tuple]:
    """``{array index: (draft file, mapping)}`` for the arrays of ``enc`` that are whole drafts."""
    starts, pos = {}, 0
    for buffer in enc.buffers:
        if getattr(buffer, "staged", False):  # in device memory: never a draft
            pos += buffer.nbytes
            continue
        size = memoryview(buffer).nbytes
        if type(buffer) is not bytes and size:  # bytes are padding; arrays are views
            starts[pos] = buffer
        pos += size
    found: dict[int, tuple] = {}
    taken = set()
    for i, spec in enumerate(parse_description(enc.description, enc.nbytes).arrays):
        buffer = starts.get(spec.offset)
        if buffer is None or not spec.nbytes:
            continue
        address = np.frombuffer(buffer, np.uint8).ctypes.data
        with _drafts_lock:
            entry = _drafts.get(address)
        mapping = entry[1]() if entry is not None else None
        if mapping is not None and entry[2] == spec.nbytes and address not in taken:
            found[i] = (entry[0], mapping)
            taken.add(address)
    return found


def shared_copy(value: Any, draft: Callable[[int], np.ndarray] | None) -> Any:
    """``value`` rebuilt with each tensor and array copied into ``draft(nbytes)`` (a new
    shared uint8 array); tensors on the ``meta`` device become zeros of their shape and
    dtype, nothing copied.  With ``draft=None`` only the meta tensors are replaced
    (by ordinary zero tensors)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.dtype not in TORCH_NAMES:
            return value  # no wire form: a put will say so
        meta = value.device.type == "meta"
        nbytes = value.numel() * value.element_size()
        if draft is None or not nbytes:
            return torch.zeros(value.shape, dtype=value.dtype) if meta or draft is not None else value
        out = torch.from_numpy(draft(nbytes)).view(value.dtype).reshape(value.shape)
        if not meta:
            out.copy_(value.detach())
        return out
    if isinstance(value, np.ndarray):
        if draft is None or not value.nbytes:
            return value
        dtype = value.dtype.newbyteorder("=") if value.dtype.byteorder == ">" else value.dtype
        out = draft(value.nbytes).view(dtype).reshape(value.shape)
        out[...] = value
        return out
    # Plain recursion (a nested closure calling itself would be a reference cycle,
    # kept until the cyclic garbage collector runs).
    if isinstance(value, dict):
        return {k: shared_copy(v, draft) for k, v in value.items()}
    if isinstance(value, list):
        return [shared_copy(x, draft) for x in value]
    if isinstance(value, tuple):
        return tuple(shared_copy(x, draft) for x in value)
    return value


def _private_dir(root: str | None, relative: Any) -> str | None:
    """``root/relative`` if it is a directory of this user inside ``root``, else None."""
    if root is None:
        return None
    try:
        path = inside(root, relative)
        st = os.lstat(path)
    except (AreaError, OSError):
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return path
