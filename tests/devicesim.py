"""CUDA's streams and events on the CPU, strictly: the device engine's logic tested without a GPU.

:class:`DeferredStreams` offers what :class:`tensorshare.device.cuda.CudaStreams`
offers, over CPU tensors.  It keeps CUDA's ordering rules more strictly than a GPU
does: work queued on a stream (a copy, a wait for another stream's event) runs
only when something waits for it (an event's ``synchronize``, a hand-over to the
caller, or work that must follow it).  So a wait the engine forgets shows as wrong
bytes every time, not once in a hundred runs: a copy it did not wait for has not
run, a buffer it reused too early is read after it changed, and memory it never
wrote holds poison.

A test plays the caller's side with :meth:`DeferredStreams.using` (a current stream
other than the immediate one) and :meth:`DeferredStreams.later` (a "kernel" queued
there, such as a write to a tensor just before ``put``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from typing import Callable

import torch

POISON = 0xA5  # what new device memory and new pinned buffers hold until written
SHARED: dict = {}  # handle -> block, for blocks "shared" by IPC (a publisher "dies" when its handles go)


class Stream:
    """An ordered queue of work; ``done`` counts the operations that ran."""

    def __init__(self, name: str, immediate: bool = False):
        self.name, self.immediate = name, immediate
        self.queue: deque = deque()
        self.queued = 0
        self.done = 0

    def __repr__(self) -> str:
        return f"<Stream {self.name} {self.done}/{self.queued}>"


class Event:
    def __init__(self, stream: Stream, position: int):
        self.stream, self.position = stream, position

    @property
    def happened(self) -> bool:
        return self.stream.done >= self.position


class DeferredStreams:
    """The stand-in (see the module docstring).  Counters tell tests what the engine did."""

    kind = "standin"

    def __init__(self):
        self._lock = threading.RLock()
        self._local = threading.local()
        self.immediate = Stream("host", immediate=True)
        self._side: dict[int, Stream] = {}
        self.copies = 0  # copies queued
        self.syncs = 0  # host waits for an event
        self.hosts = 0  # pinned buffers allocated
        self.devices = 0  # device buffers allocated
        self.registered: dict[int, int] = {}  # address -> bytes, while registered
        self.register_ok = True  # what register() answers
        self.register_limit: int | None = None  # registrations accepted before it refuses (None: no limit)
        self.handed: list = []  # tensors handed over to the caller
        self.opened = 0  # shared blocks opened
        self.share_ok = True  # whether share() can share (torch cannot share every block: RuntimeError)

    # -- the caller's side

    def current(self) -> Stream:
        return getattr(self._local, "stream", self.immediate)

    @contextlib.contextmanager
    def using(self, stream: Stream):
        """Make ``stream`` this thread's current stream (as ``torch.cuda.stream(s)``)."""
        old = self.current()
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = old

    def later(self, stream: Stream, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (a kernel) on ``stream``."""
        self._push(stream, fn)

    def flush(self, stream: Stream) -> None:
        with self._lock:
            self._run(stream, stream.queued)

    # -- what the engine asks (CudaStreams' methods)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def index(self, device) -> int | None:
        return 0 if torch.device(device).type == "cpu" else None

    def side(self, index: int) -> Stream:
        with self._lock:
            stream = self._side.get(index)
            if stream is None:
                stream = self._side[index] = Stream(f"side{index}")
            return stream

    def mark(self, index: int) -> Event:
        return self.record(self.current())

    def wait(self, stream: Stream, event: Event) -> None:
        self._push(stream, lambda: self._run(event.stream, event.position))

    def record(self, stream: Stream) -> Event:
        with self._lock:
            return Event(stream, stream.queued)

    def synchronize(self, event: Event) -> None:
        with self._lock:
            self.syncs += 1
            self._run(event.stream, event.position)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        if dst.shape != src.shape:
            raise RuntimeError(f"copy of {tuple(src.shape)} into {tuple(dst.shape)}")
        self.copies += 1
        self._push(stream, lambda: dst.copy_(src))

    def run(self, stream: Stream, fn):
        with self._lock:  # what fn does comes after what is queued on the stream
            self._run(stream, stream.queued)
        return fn()

    def caller_waits(self, index: int, event: Event) -> None:
        current = self.current()
        if current.immediate:  # the host is the caller: what it does next comes after
            self.synchronize(event)
        else:
            self.wait(current, event)

    def hand_over(self, event: Event, tensor: torch.Tensor) -> None:
        self.handed.append(tensor)
        self.synchronize(event)  # the caller here is the host: it reads at once

    def host(self, nbytes: int) -> torch.Tensor:
        self.hosts += 1
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def empty(self, nbytes: int, index: int, stream: Stream) -> torch.Tensor:
        self.devices += 1
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def register(self, address: int, nbytes: int, read_only: bool) -> bool:
        ok = self.register_ok and (self.register_limit is None or len(self.registered) < self.register_limit)
        if ok:
            self.registered[address] = nbytes
        return ok

    def unregister(self, address: int) -> None:
        if self.pending():  # a copy from the pages may still be in flight: CUDA does not wait for it
            raise AssertionError("pages unregistered while copies are queued")
        del self.registered[address]

    # -- CUDA IPC: blocks "shared" through a registry of this process

    def uuid(self, index: int) -> str:
        return f"standin-{index}"

    def local_index(self, uuid: str) -> int | None:
        return int(uuid.rsplit("-", 1)[1]) if uuid.startswith("standin-") else None

    def share(self, flat: torch.Tensor) -> list:
        if not self.share_ok:
            raise RuntimeError("Tensors allocated with expandable_segments:True cannot be shared between processes")
        handle = os.urandom(16)
        SHARED[handle] = flat
        return [0, handle, flat.numel(), 0, b"counter", 0, b"", False]

    def open_shared(self, fields: list, index: int) -> torch.Tensor:
        flat = SHARED.get(fields[1])
        if flat is None:
            raise RuntimeError("invalid resource handle (the publisher is gone)")
        self.opened += 1
        return flat

    # -- internals

    def _push(self, stream: Stream, op: Callable[[], None]) -> None:
        with self._lock:
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
        """Operations queued on the side streams and not run yet."""
        with self._lock:
            return sum(s.queued - s.done for s in self._side.values())
