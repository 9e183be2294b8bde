"""CUDA's streams, events, memory and IPC on the CPU, strictly: the device engine tested without a GPU.

:class:`DeferredStreams` offers what :class:`tensorshare.device.cuda.CudaStreams`
offers, over CPU memory, and refuses what CUDA refuses, so that a suite passing
here does not pass over code that fails on the first GPU:

* **Device memory is not host memory.**  It is a :class:`DeviceTensor` (made by
  :func:`to_device`, or by the engine through :meth:`DeferredStreams.empty`): a
  tensor that says ``is_cuda`` and refuses ``.numpy()``, as a CUDA tensor does.  So
  the codec's and the RL wrappers' device branches run here as on a GPU, and code
  that reads device memory as host bytes fails.
* **Work queued on a stream runs only when something waits for it** (an event's
  ``synchronize``, a stream waiting for another's event, work that must follow it).
  A wait the engine forgets shows as wrong bytes every time, not once in a hundred
  runs: a copy it did not wait for has not run, a buffer reused too early is read
  after it changed, memory it never wrote holds poison.
* **A hand-over is a wait of the receiving stream**, not of the host: memory handed
  to a caller whose current stream is not the host's holds its bytes only once that
  stream runs (:meth:`DeferredStreams.flush`).  Handed to the wrong stream, it
  never gets them.
* **A copy between device memory and pageable host memory synchronises** (CUDA
  stages it through its own buffer): it runs at once, after what the stream
  queued, and counts as a host wait (:attr:`DeferredStreams.syncs`); only pinned
  buffers (:meth:`~DeferredStreams.host`) and registered pages copy without one.
* **Allocations belong to a stream** (the caching allocator's rule): a block freed
  while another stream that was not recorded on it still has work queued on it is
  a use after free (the allocator hands it to the next allocation of its own
  stream); the work raises when it runs, and :attr:`DeferredStreams.violations`
  says so.
* **CUDA IPC opens only another process's memory.**  Device blocks live in memfd
  files: :meth:`~DeferredStreams.share` gives a handle (process, descriptor, inode)
  that another process opens through ``/proc`` while the exporter lives and keeps
  the block; opening it in the exporting process raises, as
  ``cudaIpcOpenMemHandle`` does.  Dropping an opened mapping synchronises the
  dropping thread's current stream, as torch's deleter does.

A test plays the caller's side with :meth:`DeferredStreams.using` (a current stream
other than the host's) and :meth:`DeferredStreams.later` (a "kernel" queued there,
such as a write to a tensor just before ``put``).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import threading
import weakref
from collections import deque
from typing import Callable

import numpy as np
import torch

POISON = 0xA5  # what new device memory and new pinned buffers hold until written
DEVICE_MEMORY = 1 << 40  # the stand-in device's memory (bounds what an IPC handle may name)
_HANDLE = struct.Struct("<8sqqqq")  # magic, exporting pid, descriptor, inode, block bytes
_MAGIC = b"standin\x00"
_HANDLE_BYTES = 66  # as torch >= 2.5's: a version and a kind byte before a 64-byte cudaIpcMemHandle_t


class DeviceTensor(torch.Tensor):
    """Memory of the stand-in device: what torch ops make from it stays on it."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_cpu(self) -> bool:
        return False

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def cpu(self, *args, **kwargs) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


class Stream:
    """An ordered queue of work; ``done`` counts the operations that ran."""

    def __init__(self, name: str, immediate: bool = False):
        self.name, self.immediate = name, immediate
        self.queue: deque = deque()
        self.queued = 0
        self.done = 0

    def __repr__(self) -> str:
        return f"<Stream {self.name} {self.done}/{self.queued}>"


HOST = Stream("host", immediate=True)  # the default stream: what the host does runs at once


class Event:
    def __init__(self, stream: Stream, position: int):
        self.stream, self.position = stream, position

    @property
    def happened(self) -> bool:
        return self.stream.done >= self.position


class _Block:
    """One device allocation: a memfd file mapped here, the stream it belongs to."""

    __slots__ = ("fd", "mm", "nbytes", "owner", "recorded", "freed", "inode", "mapping", "__weakref__")

    def __init__(self, nbytes: int, owner: Stream):
        self.fd = os.memfd_create("tensorshare-standin", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.mm = mmap.mmap(self.fd, max(nbytes, 1))
        self.nbytes, self.owner = nbytes, owner
        self.recorded: set = set()  # streams record_stream'ed on it
        self.freed = False
        self.inode = os.fstat(self.fd).st_ino
        self.mapping = False


_BLOCKS: dict[int, tuple] = {}  # address of a tensor's storage -> (block, its offset there), while it lives
_lock = threading.RLock()


def _tensor_of(block: _Block, nbytes: int, offset: int = 0, on_free: Callable | None = None) -> DeviceTensor:
    array = np.frombuffer(block.mm, np.uint8, nbytes, offset)
    address = array.ctypes.data
    with _lock:
        _BLOCKS[address] = (block, offset)
    weakref.finalize(array, _freed, block, address, on_free)
    return torch.from_numpy(array).as_subclass(DeviceTensor)


def _freed(block: _Block, address: int, on_free: Callable | None) -> None:
    with _lock:
        if _BLOCKS.get(address, (None,))[0] is block:
            del _BLOCKS[address]
        block.freed = True
    if on_free is not None:
        on_free()
    if block.fd >= 0:
        os.close(block.fd)  # exported handles open no more
        block.fd = -1


def to_device(value, owner: Stream = HOST):
    """``value`` (a tensor, or dicts, lists and tuples of them) copied into stand-in
    device memory (allocated on ``owner``, the default stream unless given)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DeviceTensor):
        source = value.detach()
        nbytes = source.numel() * source.element_size()
        flat = _tensor_of(_Block(nbytes, owner), nbytes)
        out = flat.view(source.dtype).view(source.shape) if source.dim() else flat.view(source.dtype)[0]
        if nbytes:
            out.copy_(source)
        return out
    if isinstance(value, dict):
        return {k: to_device(v, owner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, owner) for v in value)
    return value


def module_to_device(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its parameters and buffers in stand-in device memory (as ``.cuda()``)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(to_device(param.detach()), param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = to_device(buffer)
    return module


def host_copy(value):
    """``value`` with its device tensors copied to plain CPU tensors (as ``.cpu()``)."""
    if isinstance(value, DeviceTensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


class DeferredStreams:
    """The stand-in (see the module docstring).  Counters tell tests what the engine did."""

    kind = "standin"

    def __init__(self):
        self._local = threading.local()
        self.immediate = HOST
        self._side: dict[int, Stream] = {}
        self._names = itertools.count()
        self.copies = 0  # copies queued
        self.syncs = 0  # host waits: for an event, or a copy from or to pageable memory
        self.pageable = 0  # of which copies from or to pageable memory
        self.hosts = 0  # pinned buffers allocated
        self.devices = 0  # device buffers allocated
        self.registered: dict[int, int] = {}  # address -> bytes, while registered
        self.register_ok = True  # what register() answers
        self.register_limit: int | None = None  # registrations accepted before it refuses (None: no limit)
        self.handed: list = []  # (tensor, stream) handed over to a caller
        self.opened = 0  # shared blocks opened
        self.unmapped: list = []  # the stream synchronised when each opened block was let go
        self.share_ok = True  # whether share() can share (torch cannot share every block: RuntimeError)
        self.violations: list[str] = []  # uses after free, as they ran
        self.memory_full = False  # allocations fail, as on a device out of memory
        self._pinned: dict[int, int] = {}  # address -> bytes of live pinned buffers
        self._held: dict[str, threading.Event] = {}  # thread name prefix -> released (see hold)

    # -- the caller's side

    def current(self, index: int | None = None) -> Stream:
        """This thread's current stream (``torch.cuda.current_stream()``)."""
        return getattr(self._local, "stream", HOST)

    @contextlib.contextmanager
    def using(self, stream: Stream):
        """Make ``stream`` this thread's current stream (as ``torch.cuda.stream(s)``)."""
        old = self.current()
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = old

    def stream(self, name: str = "caller") -> Stream:
        """A new stream (``torch.cuda.Stream()``)."""
        return Stream(f"{name}{next(self._names)}")

    def later(self, stream: Stream, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (a kernel) on ``stream``."""
        self._push(stream, fn)

    def flush(self, stream: Stream) -> None:
        with _lock:
            self._run(stream, stream.queued)

    # -- what the engine asks (CudaStreams' methods)

    def owns(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, DeviceTensor)

    def index(self, device) -> int | None:
        return 0 if torch.device(device).type == "cpu" else None

    def side(self, index: int) -> Stream:
        """The calling thread's own stream of the engine (one per thread, as CudaStreams)."""
        streams = getattr(self._local, "side", None)
        if streams is None:
            streams = self._local.side = {}
        stream = streams.get(index)
        if stream is None:
            with _lock:
                stream = streams[index] = Stream(f"side{len(self._side)}")
                self._side[len(self._side)] = stream
        return stream

    def mark(self, index: int) -> Event:
        return self.record(self.current())

    def wait(self, stream: Stream, event: Event) -> None:
        self._push(stream, lambda: self._run(event.stream, event.position))

    def record(self, stream: Stream) -> Event:
        with _lock:
            return Event(stream, stream.queued)

    def happened(self, event: Event) -> bool:
        return event.happened

    @contextlib.contextmanager
    def hold(self, thread_prefix: str):
        """While in the block, host waits of threads whose name starts with
        ``thread_prefix`` do not return (their copies take that long)."""
        released = self._held[thread_prefix] = threading.Event()
        try:
            yield
        finally:
            released.set()
            del self._held[thread_prefix]

    def synchronize(self, event: Event) -> None:
        name = threading.current_thread().name
        for prefix, released in list(self._held.items()):
            if name.startswith(prefix):
                released.wait(60)
        with _lock:
            self._waited()
            self._run(event.stream, event.position)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        if dst.shape != src.shape:
            raise RuntimeError(f"copy of {tuple(src.shape)} into {tuple(dst.shape)}")
        self.copies += 1
        target, source = self._hold(dst), self._hold(src)
        op = lambda: self._view(target, stream).copy_(self._view(source, stream))  # noqa: E731
        if self._pageable(dst) or self._pageable(src):  # staged by CUDA: after the stream's work, the host waiting
            with _lock:
                self._waited()
                self.pageable += 1
                self._run(stream, stream.queued)
                stream.queued += 1
                stream.done += 1
                op()
            return
        self._push(stream, op)

    def run(self, stream: Stream, fn):
        with _lock:  # what fn does comes after what is queued on the stream
            self._run(stream, stream.queued)
        with self.using(stream):
            return fn()

    def caller_waits(self, stream: Stream, event: Event) -> None:
        self.wait(stream, event)

    def hand_over(self, event: Event, tensor: torch.Tensor, stream: Stream | None = None) -> None:
        """``stream`` (the caller's; None: this thread's current one) waits for ``event``
        before it uses ``tensor``, and is recorded on its block (``record_stream``)."""
        stream = self.current() if stream is None else stream
        self.handed.append((tensor, stream))
        found = _BLOCKS.get(tensor.untyped_storage().data_ptr())
        if found is not None:
            found[0].recorded.add(stream)
        self.wait(stream, event)

    def host(self, nbytes: int) -> torch.Tensor:
        self.hosts += 1
        buffer = torch.full((nbytes,), POISON, dtype=torch.uint8)
        address = buffer.untyped_storage().data_ptr()
        self._pinned[address] = nbytes
        weakref.finalize(buffer.untyped_storage(), self._pinned.pop, address, None)
        return buffer

    def empty(self, nbytes: int, index: int, stream: Stream) -> torch.Tensor:
        if self.memory_full:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        self.devices += 1
        tensor = _tensor_of(_Block(nbytes, stream), nbytes)
        tensor.fill_(POISON)
        return tensor

    def register(self, address: int, nbytes: int, read_only: bool) -> bool:
        ok = self.register_ok and (self.register_limit is None or len(self.registered) < self.register_limit)
        if ok:
            self.registered[address] = nbytes
        return ok

    def unregister(self, address: int) -> None:
        if self.pending():  # a copy from the pages may still be in flight: CUDA does not wait for it
            raise AssertionError("pages unregistered while copies are queued")
        del self.registered[address]

    # -- CUDA IPC: memfd blocks opened by other processes

    def uuid(self, index: int) -> str:
        return f"standin-{index}"

    def local_index(self, uuid: str) -> int | None:
        return int(uuid.rsplit("-", 1)[1]) if uuid.startswith("standin-") else None

    def total_memory(self, index: int) -> int:
        return DEVICE_MEMORY

    def share(self, flat: torch.Tensor) -> list:
        if not self.share_ok:
            raise RuntimeError("Tensors allocated with expandable_segments:True cannot be shared between processes")
        base = flat.untyped_storage().data_ptr()
        block, offset = _BLOCKS.get(base, (None, 0))
        if block is None or block.fd < 0:
            raise RuntimeError("only memory the device allocated can be shared")
        handle = _HANDLE.pack(_MAGIC, os.getpid(), block.fd, block.inode, block.nbytes).ljust(_HANDLE_BYTES, b"\0")
        return [0, handle, flat.untyped_storage().nbytes(), offset, b"counter", 0, b"", False]

    def open_shared(self, fields: list, index: int) -> torch.Tensor:
        handle = fields[1]
        if type(handle) is not bytes or len(handle) < _HANDLE.size:
            raise RuntimeError("CUDA error: invalid argument (not an IPC handle)")
        magic, pid, fd, inode, nbytes = _HANDLE.unpack_from(handle)
        if magic != _MAGIC:
            raise RuntimeError("CUDA error: invalid argument (not an IPC handle)")
        if pid == os.getpid():
            raise RuntimeError("CUDA error: invalid device context (cudaIpcOpenMemHandle of memory this process "
                               "exported)")
        size, offset = fields[2], fields[3]
        if not 0 <= offset <= offset + size <= DEVICE_MEMORY:  # torch maps what it is told: a fault, later
            problem = f"illegal memory access: an IPC block of {size} bytes at {offset} was mapped"
            self.violations.append(problem)
            raise RuntimeError(f"CUDA error: {problem}")
        try:
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise RuntimeError(f"CUDA error: invalid resource handle (the publisher is gone: {exc})") from None
        try:
            if os.fstat(opened).st_ino != inode:
                raise RuntimeError("CUDA error: invalid resource handle (the block was freed)")
            if offset + size > nbytes:  # torch does not check: a read past the block is a fault on a GPU
                problem = f"illegal memory access: {size} bytes at {offset} of a block of {nbytes}"
                self.violations.append(problem)
                raise RuntimeError(f"CUDA error: {problem}")
            block = _Block.__new__(_Block)
            block.fd, block.mm = -1, mmap.mmap(opened, max(nbytes, 1))
            block.nbytes, block.owner, block.recorded, block.freed = nbytes, None, set(), False
            block.inode, block.mapping = inode, True
        finally:
            os.close(opened)
        self.opened += 1
        return _tensor_of(block, size, offset, on_free=self._unmapped)

    def _unmapped(self) -> None:
        """torch's deleter of a received block synchronises the dropping thread's current stream."""
        stream = self.current()
        self.unmapped.append(stream)
        with _lock:
            self._run(stream, stream.queued)

    def waits_here(self) -> int:
        """Host waits of the calling thread so far."""
        return getattr(self._local, "syncs", 0)

    # -- internals

    def _waited(self) -> None:
        self.syncs += 1
        self._local.syncs = getattr(self._local, "syncs", 0) + 1

    def _pageable(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DeviceTensor):
            return False
        address = tensor.untyped_storage().data_ptr()
        if address in self._pinned:
            return False
        where = tensor.data_ptr()
        return not any(start <= where < start + n for start, n in self.registered.items())

    def _hold(self, tensor: torch.Tensor):
        """What queued work keeps of ``tensor``: its block and place (device memory the
        program may free meanwhile, as on a GPU), or the tensor itself."""
        if isinstance(tensor, DeviceTensor):
            base = tensor.untyped_storage().data_ptr()
            found = _BLOCKS.get(base)
            if found is not None and tensor.is_contiguous():
                block, offset = found
                return block, offset + tensor.data_ptr() - base, tensor.numel() * tensor.element_size()
        return tensor

    def _view(self, held, stream: Stream) -> torch.Tensor:
        if type(held) is not tuple:
            return held.as_subclass(torch.Tensor) if isinstance(held, DeviceTensor) else held
        block, start, nbytes = held
        if block.freed and stream is not block.owner and stream not in block.recorded:
            problem = (f"use after free: a block of {block.owner or 'an IPC mapping'} was freed while {stream} "
                       f"still had work queued on it")
            self.violations.append(problem)
            raise AssertionError(problem)
        return torch.frombuffer(block.mm, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else \
            torch.empty(0, dtype=torch.uint8)

    def _push(self, stream: Stream, op: Callable[[], None]) -> None:
        with _lock:
            if stream.immediate:
                stream.queued += 1
                stream.done += 1
                op()
                return
            stream.queue.append(op)
            stream.queued += 1

    def _run(self, stream: Stream, position: int) -> None:
        while stream.done < position:
            op = stream.queue.popleft()
            stream.done += 1
            op()

    def pending(self) -> int:
        """Operations queued on the engine's streams and not run yet."""
        with _lock:
            return sum(s.queued - s.done for s in self._side.values())
