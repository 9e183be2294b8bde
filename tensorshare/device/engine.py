"""The device transfer engine: device memory to the bytes the wire and shared memory carry, and back.

Both clients, the RL wrappers and tables move device tensors only through this
module.  An :class:`Engine` stages every transfer in *buckets* (:mod:`.buckets`):
a bucket's bytes are copied between device memory and one pinned host buffer
(:mod:`.pool`) on the engine's own stream, while the previous bucket is sent,
written or received, so the link and the device copy overlap and the host never
holds the whole value.

* **Out** (:meth:`Engine.pieces`): the parts of a frame, with device arrays
  (:class:`DeviceSpan`, which the codec puts in place of their bytes) staged:
  while one bucket is sent, the next ``depth - 1`` are being copied.  Small
  tensors share buckets, so a state dict of many tensors costs about what one
  tensor of the same bytes costs.  :meth:`Engine.write_fd` writes one array into a file (the server's
  shared memory) with a few writer threads.
* **In** (:class:`Incoming`): a payload received straight into pinned windows
  (the socket reads into them), each full window copied to device memory while the
  next fills; the result (:class:`~.payload.DevicePayload`) is handed to the caller's stream.
  A window's bytes may go straight into destination tensors (a model's own
  parameters) instead of new memory.
* **On the device** (:meth:`Engine.snapshot`): a whole payload copied into one new
  block of device memory (device to device), a version that training on cannot
  change, to send later or to share by CUDA IPC (:mod:`.ipc`).

Ordering, as CUDA requires it: the engine waits (on its stream, without blocking
the host) for the work queued on the caller's current stream before it reads a
tensor (:meth:`Engine.prepare` marks that point when the value is encoded), and the
caller's stream waits for the copies into memory it is handed
(:meth:`~.payload.DevicePayload.deliver`).  The CUDA calls themselves are
:class:`~.cuda.CudaStreams`'; everything here runs on the CPU with a stand-in
for them (``tests/devicesim.py``).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from .buckets import Bucket, Ranges, plan, windows
from .payload import Caller, DevicePayload
from .pool import Pool

DEFAULT_BUCKET = 16 << 20  # bytes per staging buffer: a copy of 0.3 ms at 55 GB/s, 4 ms of loopback TCP
DEFAULT_DEPTH = 3  # buckets in flight: the one being sent and those copied ahead of it
DEFAULT_KEEP = 8  # pinned buffers kept for reuse (DEFAULT_KEEP * DEFAULT_BUCKET bytes locked at most)
INLINE_MAX = 256 << 10  # a value with at most this many device bytes is staged at once, when encoded
WRITERS = 4  # threads writing one array's buckets into a file (Engine.write_fd)
ALIGN = 64  # array alignment in a compact device buffer (the payload's, PROTOCOL.md §3)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class DeviceSpan:
    """An array of a value being sent that lives in device memory: the codec puts one
    in an encoded value's buffers where the array's bytes would be.

    ``nbytes`` bytes from byte ``start`` of the tensor's contiguous bytes, on device
    ``index`` of ``engine``.  ``mark`` is the event after which the tensor may be
    read (the caller's stream at encoding, :meth:`Engine.prepare`)."""

    __slots__ = ("engine", "index", "start", "nbytes", "mark", "_source")
    staged = True  # what writers test for (tensorshare.disk.layout, which imports no torch)

    def __init__(self, tensor: torch.Tensor, engine: "Engine", index: int, start: int = 0,
                 nbytes: int | None = None, source: list | None = None):
        self.engine, self.index, self.start = engine, index, start
        self._source = source if source is not None else [tensor.detach(), None]
        self.nbytes = self._source[0].numel() * self._source[0].element_size() if nbytes is None else nbytes
        self.mark = None

    def __len__(self) -> int:
        return self.nbytes

    @property
    def tensor(self) -> torch.Tensor:
        return self._source[0]

    def slice(self, start: int, length: int) -> "DeviceSpan":
        """Bytes ``[start, start + length)`` of this span (same tensor, same mark)."""
        if start < 0 or length < 0 or start + length > self.nbytes:
            raise ValueError(f"bytes {start}..{start + length} outside a span of {self.nbytes}")
        part = DeviceSpan(self.tensor, self.engine, self.index, self.start + start, length, self._source)
        part.mark = self.mark
        return part

    def flat(self, side: Any, waited: set | None = None) -> torch.Tensor:
        """The tensor's bytes as a contiguous 1-D uint8 device tensor, for work about to
        be queued on ``side`` (an engine stream): a view when the tensor is laid out
        so, else made on an engine stream after the mark (``side`` then waits for
        it, when another thread's stream made it)."""
        source = self._source
        if source[1] is None:
            tensor = source[0]
            if tensor.is_contiguous() and tensor.numel() != 1 and not tensor.is_conj() and not tensor.is_neg():
                source[1] = (tensor.reshape(-1).view(torch.uint8), None, None)  # (no kernel: nothing to wait for)
            else:
                self.engine._wait_for_mark(self, side, waited)
                made = self.engine.streams.run(side, lambda: contiguous_bytes(tensor))
                source[1] = (made, side, None)
        flat, made_on, made = source[1]
        if made_on is not None and made_on is not side:
            if made is None:
                made = self.engine.streams.record(made_on)
                source[1] = (flat, made_on, made)
            self.engine.streams.wait(side, made)
        return flat


def contiguous_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a contiguous 1-D uint8 tensor (a view when already laid out so)."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    # A one-element tensor can be "contiguous" with any stride, which view() refuses.
    if tensor.numel() == 1:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    elif not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


class StagedParts(list):
    """The parts of a frame some of which are :class:`DeviceSpan`: senders send
    them through ``engine`` (:meth:`Engine.pieces`)."""

    __slots__ = ("engine",)

    def __init__(self, parts, engine: "Engine"):
        super().__init__(parts)
        self.engine = engine


class Engine:
    """Transfers between one kind of device memory and host bytes, through pinned
    buckets on the engine's streams (see the module docstring).

    ``streams`` is the device kind's calls (:class:`~.cuda.CudaStreams`); ``bucket``
    the staging buffer size; ``depth`` how many buckets are in flight (the one
    being sent and those copied ahead of it); ``keep`` how many pinned buffers are
    kept for reuse.
    ``register_host``: copy the server's mapped files to the device by registering
    them with the runtime (page-locking them in place) instead of staging them
    through pinned buffers (:meth:`upload`).  ``inline_max``: a value with at most
    that many device bytes is staged at once when encoded (:meth:`prepare`)."""

    def __init__(self, streams, *, bucket: int = DEFAULT_BUCKET, depth: int = DEFAULT_DEPTH,
                 keep: int = DEFAULT_KEEP, register_host: bool = False, inline_max: int = INLINE_MAX):
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.streams = streams
        self.bucket, self.depth = bucket, depth
        self.pool = Pool(streams, bucket, keep)
        self.register_host = register_host
        self.inline_max = inline_max
        self.registered_uploads = 0  # uploads made from registered pages (the runtime may refuse)

    # -- what the codec asks

    def span(self, tensor: torch.Tensor) -> DeviceSpan:
        """A :class:`DeviceSpan` of all of ``tensor``."""
        return DeviceSpan(tensor, self, self.streams.index(tensor.device))

    def prepare(self, parts: list) -> list:
        """Called once a value is encoded (``parts``: its payload buffers, some of them
        spans): mark, on the caller's current stream of each device, the point after
        which the engine may read the tensors.  A value with few device bytes is
        staged at once instead (its spans become host bytes: such a request then
        takes the paths of any small one); returns the parts to send."""
        marks: dict[int, Any] = {}
        staged = 0
        for part in parts:
            if type(part) is DeviceSpan:
                mark = marks.get(part.index)
                if mark is None:
                    mark = marks[part.index] = self.streams.mark(part.index)
                part.mark = mark
                staged += part.nbytes
        if staged <= self.inline_max:
            return self.materialize(parts)
        return parts

    def materialize(self, parts: list) -> list:
        """``parts`` with every span's bytes copied to the host now (new bytes objects)."""
        return [view if not staged else bytes(view) for view, staged in self.pieces(parts)]

    def _wait_for_mark(self, span: DeviceSpan, side: Any, waited: set | None) -> None:
        mark = span.mark
        if mark is None:
            return
        key = (id(side), id(mark))
        if waited is not None:
            if key in waited:
                return
            waited.add(key)
        self.streams.wait(side, mark)

    # -- out: device to host

    def pieces(self, parts: list) -> Iterator[tuple[Any, bool]]:
        """The bytes of ``parts`` in order, as ``(buffer, staged)``: host parts as they
        are, device bytes (and the small host parts between them) as views of pinned
        buckets.  A bucket's view is valid until the next one is asked for (its
        buffer is then reused): send or copy it before."""
        for step, buffer, view in self._buckets(parts):
            if buffer is None:
                yield view, False
                continue
            try:
                yield view, True
            finally:
                self.pool.give(buffer)

    def _buckets(self, parts: list) -> Iterator[tuple[Any, Any, Any]]:
        """``(step, pinned buffer or None, view)`` per step of :func:`~.buckets.plan`,
        the device copies of the next ``depth - 1`` buckets queued ahead; the caller
        gives each buffer back to the pool once it is done with the view."""
        streams = self.streams
        sizes = [len(p) if type(p) is DeviceSpan else memoryview(p).nbytes for p in parts]
        steps = plan(sizes, [type(p) is DeviceSpan for p in parts], self.bucket)
        queued = [i for i, step in enumerate(steps) if type(step) is Bucket]
        ahead: deque = deque()  # (buffer, events) of the next buckets, their copies queued
        waited: set = set()
        launched = 0
        try:
            for step in steps:
                while launched < len(queued) and len(ahead) < self.depth:
                    ahead.append(self._launch(steps[queued[launched]], parts, waited))
                    launched += 1
                if type(step) is not Bucket:
                    yield step, None, parts[step]
                    continue
                buffer, events = ahead.popleft()
                for event in events:
                    streams.synchronize(event)
                yield step, buffer, memoryview(buffer.numpy())[: step.nbytes]
        finally:  # stopped early (a send failed): the buckets queued ahead go back once copied
            for buffer, events in ahead:
                for event in events:
                    streams.synchronize(event)
                self.pool.give(buffer)

    def _launch(self, bucket: Bucket, parts: list, waited: set) -> tuple[Any, list]:
        """Queue the copies that fill one bucket; ``(buffer, events)``."""
        streams = self.streams
        buffer = self.pool.take()
        host = None
        sides: dict[int, Any] = {}
        try:
            for piece in bucket.pieces:
                part = parts[piece.part]
                if type(part) is DeviceSpan:
                    side = sides.get(part.index)
                    if side is None:
                        side = sides[part.index] = streams.side(part.index)
                    source = part.flat(side, waited)
                    self._wait_for_mark(part, side, waited)
                    begin = part.start + piece.start
                    streams.copy(buffer[piece.at : piece.at + piece.length], source[begin : begin + piece.length],
                                 side)
                else:
                    if host is None:
                        host = buffer.numpy()
                    host[piece.at : piece.at + piece.length] = np.frombuffer(part, np.uint8, piece.length,
                                                                             piece.start)
        except BaseException:
            self.pool.give(buffer, None)
            raise
        return buffer, [streams.record(side) for side in sides.values()]

    def write_fd(self, fd: int, span: DeviceSpan, writers: int = WRITERS) -> None:
        """Write ``span``'s bytes into file ``fd`` at its current position (and move
        past them): each bucket copied down while earlier ones are written by up to
        ``writers`` threads (one writing thread rarely keeps up with the device)."""
        position = os.lseek(fd, 0, os.SEEK_CUR)
        if span.nbytes <= self.bucket or writers <= 1:
            for step, buffer, view in self._buckets([span]):
                try:
                    _pwrite_all(fd, view, position)
                finally:
                    self.pool.give(buffer)
                position += step.nbytes
            os.lseek(fd, position, os.SEEK_SET)
            return
        pending: deque = deque()  # (future, buffer) of buckets being written
        threads = _writer_threads()
        try:
            for step, buffer, view in self._buckets([span]):
                if len(pending) >= writers:
                    future, done = pending.popleft()
                    try:
                        future.result()
                    finally:
                        self.pool.give(done)
                pending.append((threads.submit(_pwrite_all, fd, view, position), buffer))
                position += step.nbytes
        finally:  # (on an error too: no buffer goes back while a thread still reads it)
            while pending:
                future, done = pending.popleft()
                try:
                    future.result()
                finally:
                    self.pool.give(done)
        os.lseek(fd, position, os.SEEK_SET)

    # -- on the device

    def snapshot(self, parts: list, index: int) -> tuple[torch.Tensor, Any]:
        """``(flat, event)``: the payload ``parts`` make, in one new block of device
        memory on device ``index`` (device bytes copied device to device, host bytes
        copied up), complete at ``event``: a version that later changes to the
        tensors do not reach (the caller's streams run their later work after the
        copies).  The host does not wait, behind the caller's queued work or
        anything else: host parts up to a bucket (alignment padding, small CPU
        tensors) are gathered into one new pinned buffer, whose memory the runtime
        reuses only once the copies from it are done."""
        streams = self.streams
        side = streams.side(index)
        total = sum(len(p) if type(p) is DeviceSpan else memoryview(p).nbytes for p in parts)
        flat = streams.empty(total, index, side)
        waited: set = set()
        small = []  # (payload offset, host bytes) of the host parts gathered
        position = 0
        for part in parts:
            if type(part) is DeviceSpan:
                source = part.flat(streams.side(part.index), waited)
                if part.index != index:  # made on its own device's stream: done before this one reads it
                    streams.synchronize(streams.record(streams.side(part.index)))
                self._wait_for_mark(part, side, waited)
                streams.copy(flat[position : position + part.nbytes], source[part.start : part.start + part.nbytes],
                             side)
                position += part.nbytes
                continue
            view = memoryview(part).cast("B")
            if view.nbytes <= self.bucket:
                if view.nbytes:
                    small.append((position, view))
            else:
                self._snapshot_large(flat, position, view, side)
            position += view.nbytes
        if small:
            gathered = streams.host(sum(view.nbytes for _p, view in small))
            host, at = gathered.numpy(), 0
            for position, view in small:
                host[at : at + view.nbytes] = np.frombuffer(view, np.uint8)
                streams.copy(flat[position : position + view.nbytes], gathered[at : at + view.nbytes], side)
                at += view.nbytes
        event = streams.record(side)
        for source in {part.index for part in parts if type(part) is DeviceSpan}:
            streams.wait(streams.current(source), event)
        return flat, event

    def _snapshot_large(self, flat: torch.Tensor, position: int, view: memoryview, side: Any) -> None:
        """A host part larger than a bucket copied up into ``flat`` at ``position``,
        through a few pooled pinned buffers (a large CPU tensor in a device value: rare)."""
        streams = self.streams
        staging: list = []
        for start in range(0, view.nbytes, self.bucket):
            chunk = view[start : start + self.bucket]
            buffer = self.pool.take()
            buffer.numpy()[: chunk.nbytes] = np.frombuffer(chunk, np.uint8)
            streams.copy(flat[position + start : position + start + chunk.nbytes], buffer[: chunk.nbytes], side)
            staging.append(buffer)
            if len(staging) >= self.depth:  # bound the pinned memory it holds
                event = streams.record(side)
                for held in staging:
                    self.pool.give(held, event)
                staging = []
        event = streams.record(side)
        for held in staging:
            self.pool.give(held, event)

    def copy_in(self, source: torch.Tensor, nbytes: int, index: int, layout: list | None = None,
                caller: Caller | None = None) -> "DevicePayload":
        """A payload laid out in device memory (``source``, uint8: another process's
        block, opened by CUDA IPC, or a snapshot of this one) copied into memory of
        device ``index`` on this thread's engine stream, placed as :meth:`incoming`
        places one; the copies are queued (the host does not wait): keep ``source``
        until they are done (:meth:`on_side`)."""
        side = self.streams.side(index)
        places = _Places(self, nbytes, index, side, layout, caller)
        for key, offset, length, at in places.ranges.cut(0, nbytes):
            self.streams.copy(places.destination(key, offset, length), source[at : at + length], side)
        return places.payload(self.streams.record(side))

    def on_side(self, index: int, fn):
        """``fn()`` with this thread's engine stream of device ``index`` current (the
        torch ops it launches are queued after the engine's copies there)."""
        return self.streams.run(self.streams.side(index), fn)

    def caller(self, index: int, with_mark: bool = False) -> Caller:
        """The :class:`~.payload.Caller` of a receive into device ``index``, taken now (on
        the caller's thread); ``with_mark`` when it names destination tensors."""
        return Caller(self.streams, index, with_mark)

    # -- in: host to device

    def incoming(self, nbytes: int, index: int, layout: list | None = None,
                 caller: Caller | None = None) -> "Incoming":
        """A payload sink (:class:`~tensorshare.wire.frames.FrameDecoder`'s protocol) that
        puts ``nbytes`` arriving bytes into memory of device ``index``.  ``layout``:
        ``[(payload offset, length, destination or None), ...]`` for the arrays: a
        destination is a contiguous uint8 device tensor their bytes go into
        (bytes no array covers are dropped); None (no layout): one buffer laid out
        as the payload.  ``caller`` (:meth:`caller`, taken on the caller's thread):
        the stream the result is handed to, and the mark that writes into
        destinations wait for; None: the current stream of the thread that makes
        the sink."""
        return Incoming(self, nbytes, index, layout, caller)

    def upload(self, arrays: list, nbytes: int, index: int, layout: list | None = None,
               caller: Caller | None = None) -> "DevicePayload":
        """The payload made of host ``arrays`` (``(payload offset, uint8 array)``, in
        order; the gaps are padding), put into memory of device ``index`` as
        :meth:`incoming` would: the server's mapped files of an item, on its host.
        Staged through pinned buckets, or, with ``register_host``, copied straight
        from the registered pages."""
        if self.register_host:
            payload = self._upload_registered(arrays, nbytes, index, layout, caller)
            if payload is not None:
                return payload
        sink = self.incoming(nbytes, index, layout, caller)
        position = 0
        for offset, array in arrays:
            if offset > position:
                sink.skip(offset - position)
            sink.write(memoryview(array).cast("B") if array.size else b"")
            position = offset + array.size
        if nbytes > position:
            sink.skip(nbytes - position)
        return sink.finish()

    def _upload_registered(self, arrays: list, nbytes: int, index: int, layout: list | None, caller: Caller | None):
        """:meth:`upload` by page-locking the arrays where they are (None, having
        done nothing that lasts, where the runtime refuses one)."""
        streams = self.streams
        registered = []
        try:
            # Every array is registered before any copy is queued: pages are never
            # unregistered under a copy still in flight.
            for _offset, array in arrays:
                if not array.size:
                    continue
                address = array.__array_interface__["data"][0]
                length = -(-array.size // _PAGE) * _PAGE  # whole pages (a mapping's always are)
                if address % _PAGE or not streams.register(address, length, True):
                    return None
                registered.append(address)
            side = streams.side(index)
            places = _Places(self, nbytes, index, side, layout, caller)
            try:
                for offset, array in arrays:
                    if not array.size:
                        continue
                    host = _read_only_tensor(array)
                    for key, start, length, at in places.ranges.cut(offset, array.size):
                        streams.copy(places.destination(key, start, length), host[at : at + length], side)
            finally:
                event = streams.record(side)
                streams.synchronize(event)  # the pages are unlocked next: the copies must be done
            self.registered_uploads += 1
            return places.payload(event)
        finally:
            for address in registered:
                streams.unregister(address)


class _Places:
    """Where each byte of an incoming payload goes: the destinations of a layout, and
    one new device buffer for the rest (or for all of it, laid out as the payload)."""

    def __init__(self, engine: Engine, nbytes: int, index: int, side: Any, layout: list | None,
                 caller: Caller | None = None):
        streams = engine.streams
        self.streams, self.index, self.caller = streams, index, caller
        self.starts: dict[int, tuple] = {}  # payload offset of an array -> (flat tensor, offset, destination)
        if layout is None:
            self.buffer = streams.empty(nbytes, index, side)
            self.flats = [(self.buffer, 0)]
            self.ranges = Ranges([(0, nbytes, 0)])
            return
        position = 0
        entries = []
        for offset, length, target in layout:
            if not length:  # (an empty array: no bytes, no place; the next array may share its offset)
                continue
            if target is None:
                position = -(-position // ALIGN) * ALIGN
                entries.append((offset, length, None, position))
                position += length
            else:
                entries.append((offset, length, target, 0))
        if any(target is not None for _o, _n, target, _a in entries):
            # Destinations are the caller's tensors (a model's parameters): kernels it
            # queued before the call may still read or write them, so the engine's
            # stream waits for those before it writes there.
            mark = caller.mark if caller is not None else None
            streams.wait(side, mark if mark is not None else streams.mark(index))
        self.buffer = streams.empty(position, index, side) if position else None
        self.flats = []
        ranges = []
        for offset, length, target, at in entries:
            flat = self.buffer if target is None else target.reshape(-1).view(torch.uint8)
            self.starts[offset] = (flat, at, target)
            ranges.append((offset, length, len(self.flats)))
            self.flats.append((flat, at))
        self.ranges = Ranges(ranges)

    def destination(self, key: int, start: int, length: int) -> torch.Tensor:
        tensor, base = self.flats[key]
        return tensor[base + start : base + start + length]

    def payload(self, event: Any) -> "DevicePayload":
        return DevicePayload(self.streams, self.index, self.buffer, self.starts, event, self.caller)


class Incoming:
    """A payload arriving into device memory, a window at a time (see
    :meth:`Engine.incoming`).  The decoder lends the current window's free space to
    ``recv_into`` (:meth:`get_buffer`, :meth:`buffer_updated`) or hands over bytes
    (:meth:`write`); a full window is queued for the device and the next one is
    taken from the pool, whose oldest buffer is free again by then."""

    def __init__(self, engine: Engine, nbytes: int, index: int, layout: list | None, caller: Caller | None = None):
        self.engine = engine
        self.streams = engine.streams
        self.side = self.streams.side(index)
        self.places = _Places(engine, nbytes, index, self.side, layout, caller)
        if caller is not None:
            caller.receiving(self)
        self.windows = windows(nbytes, engine.bucket)
        self.k = 0
        self.filled = 0
        self.buffer = engine.pool.take() if self.windows else None
        self._host = None if self.buffer is None else self.buffer.numpy()
        self.shipped = 0  # windows queued for the device

    def get_buffer(self) -> memoryview:
        return memoryview(self._host)[self.filled : self.windows[self.k][1]]

    def buffer_updated(self, n: int) -> None:
        self.filled += n
        if self.filled == self.windows[self.k][1]:
            self._ship()

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            length = self.windows[self.k][1]
            take = min(view.nbytes, length - self.filled)
            self._host[self.filled : self.filled + take] = np.frombuffer(view[:take], np.uint8)
            self.filled += take
            view = view[take:]
            if self.filled == length:
                self._ship()

    def skip(self, n: int) -> None:
        """``n`` bytes that no array needs (padding between mapped files): zeros."""
        while n:
            length = self.windows[self.k][1]
            take = min(n, length - self.filled)
            self._host[self.filled : self.filled + take] = 0
            self.filled += take
            n -= take
            if self.filled == length:
                self._ship()

    def _ship(self) -> None:
        """Queue the full window's bytes for their places; take the next window."""
        start, length = self.windows[self.k]
        streams, places, buffer = self.streams, self.places, self.buffer
        for key, offset, size, at in places.ranges.cut(start, length):
            streams.copy(places.destination(key, offset, size), buffer[at : at + size], self.side)
        event = streams.record(self.side)
        self.shipped += 1
        self.k += 1
        self.filled = 0
        # The next window is taken before this one goes back: taken after, it would
        # be this very buffer, and the next bytes would wait for its copy.
        if self.k < len(self.windows):
            self.buffer = self.engine.pool.take()
            self._host = self.buffer.numpy()
        else:
            self.buffer = self._host = None
        self.engine.pool.give(buffer, event)

    def abandon(self) -> None:
        """The receive will not finish (its connection is gone): wait until the copies
        queued so far are done, so that nothing writes into the caller's tensors
        once the call has failed."""
        self.streams.synchronize(self.streams.record(self.side))

    def finish(self) -> "DevicePayload":
        """The payload in device memory (all of it has arrived)."""
        if self.k != len(self.windows):
            raise RuntimeError(f"payload incomplete: {self.k} of {len(self.windows)} windows")
        return self.places.payload(self.streams.record(self.side))


_writers: ThreadPoolExecutor | None = None


def _writer_threads() -> ThreadPoolExecutor:
    """The threads that write staged buckets into files (made on first use, shared)."""
    global _writers
    if _writers is None:
        _writers = ThreadPoolExecutor(WRITERS * 2, thread_name_prefix="tensorshare-device-write")
    return _writers


def _pwrite_all(fd: int, view: memoryview, position: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, position)
        view, position = view[n:], position + n


_WARNINGS = threading.Lock()  # catch_warnings swaps the process's filters: one thread at a time here


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` (a read-only mapping of the server's files) as a copy's
    source, without torch's warning about arrays it may not write (it never writes it).
    (Two uploads at once, unlocked, could restore each other's filters and leave the
    warning off for the whole process.)"""
    with _WARNINGS, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
