"""The CUDA calls of the device transfer engine, and nothing else.

:class:`CudaStreams` is what :class:`~.engine.Engine` asks of a device: side
streams, events, copies that do not block the host, pinned host memory, and the
hand-over of finished memory to the caller's stream.  Every CUDA call of the
engine is a method here, each a line or two of PyTorch's public API (torch 2.1 to
2.x): :class:`torch.cuda.Stream` and :class:`torch.cuda.Event`,
``Tensor.copy_(..., non_blocking=True)``, ``torch.empty(..., pin_memory=True)``,
``Tensor.record_stream`` and, for :meth:`register`, the runtime's
``cudaHostRegister`` through ``torch.cuda.cudart()``; CUDA IPC (:meth:`share`,
:meth:`open_shared`) uses what ``torch.multiprocessing`` uses to pass CUDA tensors
between processes (``UntypedStorage._share_cuda_`` and ``_new_shared_cuda``),
without its pickling.  The rest of the engine is
plain Python over these calls, so that the tests run it on the CPU with a stand-in
that keeps CUDA's ordering rules (``tests/devicesim.py``).

Importing this module imports no CUDA state; the first call initialises CUDA.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not the current one's
_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (CUDA 11.1+): pages the device only reads
_IPC_HANDLE = 64  # bytes of a cudaIpcMemHandle_t (torch >= 2.5 puts a version and a kind byte before it)
_NO_COUNTER = b"/tensorshare/no-counter"  # shm_open refuses a name with a second slash (EINVAL)


class CudaStreams:
    """CUDA's streams and events, as the engine uses them (see the module docstring)."""

    kind = "cuda"

    def __init__(self):
        self._local = threading.local()

    # -- what lives where

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in this kind of device memory."""
        return tensor.is_cuda

    def index(self, device: Any) -> int | None:
        """The device index ``device`` names (a ``torch.device``, ``"cuda"``, ``"cuda:1"``,
        or a tensor's ``.device``), or None when it names no CUDA device."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return torch.cuda.current_device() if device.index is None else device.index

    # -- streams and events

    def side(self, index: int) -> torch.cuda.Stream:
        """The calling thread's own engine stream on device ``index`` (made once per
        thread, from torch's pool of streams): one thread's transfers never queue
        behind another's."""
        streams = getattr(self._local, "side", None)
        if streams is None:
            streams = self._local.side = {}
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(device=index)
        return stream

    def current(self, index: int) -> torch.cuda.Stream:
        """The calling thread's current stream of device ``index`` (the caller's)."""
        return torch.cuda.current_stream(index)

    def mark(self, index: int) -> torch.cuda.Event:
        """An event at the end of the work queued so far on the caller's current stream
        of device ``index``: what the engine must wait for before it reads tensors."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` (the host does not wait)."""
        stream.wait_event(event)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def happened(self, event: torch.cuda.Event) -> bool:
        """Whether the work before ``event`` is done (the host does not wait)."""
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        """The host waits until ``event`` has happened."""
        event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; the host does not wait (pinned or device memory)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def run(self, stream: torch.cuda.Stream, fn):
        """``fn()`` with ``stream`` current: the torch ops it launches are queued there."""
        with torch.cuda.stream(stream):
            return fn()

    def hand_over(self, event: torch.cuda.Event, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """``stream`` (the caller's) waits for ``event`` before it uses ``tensor``, and
        the caching allocator will not reuse ``tensor``'s memory before that stream is
        done with it (it was allocated on the engine's stream)."""
        stream.wait_event(event)
        tensor.record_stream(stream)

    # -- memory

    def host(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory: copies to and from it run at the link's speed and
        do not block the host."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, nbytes: int, index: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """Device memory for the engine's stream to fill."""
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))

    def register(self, address: int, nbytes: int, read_only: bool) -> bool:
        """Page-lock ``nbytes`` of host memory at ``address`` (a mapping of the server's
        files) so the device copies it directly; False where the runtime refuses.

        A refusal (``cudaHostRegisterReadOnly`` needs a device attribute that some
        hosts lack) also stays as the thread's "last CUDA error", which torch reads
        after its next kernel launch and raises there; torch binds no
        ``cudaGetLastError``, so one tiny kernel, whose launch check reads (and so
        clears) it, takes it."""
        cudart = torch.cuda.cudart()
        flags = _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
        error = cudart.cudaHostRegister(address, nbytes, flags)
        if int(error) == 0:
            return True
        try:
            torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))  # (a fill kernel, not a memset)
        except RuntimeError:  # the refusal, read and cleared by the launch check
            pass
        return False

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    # -- CUDA IPC

    def uuid(self, index: int) -> str:
        """The UUID of device ``index``: it names one GPU in every process of the host,
        whatever ``CUDA_VISIBLE_DEVICES`` numbers it (its PCI address where this torch
        tells no UUID)."""
        properties = torch.cuda.get_device_properties(index)
        uuid = getattr(properties, "uuid", None)
        if uuid is not None:
            return str(uuid)
        return "pci-{}:{}:{}".format(*(getattr(properties, f"pci_{k}_id", "?") for k in ("domain", "bus", "device")))

    def total_memory(self, index: int) -> int:
        """The bytes of device ``index``'s memory: no IPC block lies beyond them."""
        return torch.cuda.get_device_properties(index).total_memory

    def local_index(self, uuid: str) -> int | None:
        """This process's index of the device with ``uuid`` (None if it sees none)."""
        for index in range(torch.cuda.device_count()):
            if self.uuid(index) == uuid:
                return index
        return None

    def share(self, flat: torch.Tensor) -> list:
        """The CUDA IPC fields of ``flat`` (the storage of a whole snapshot; torch gives
        the handle of the caching allocator's block that holds it and the storage's
        offset there) for another process of this host to open.  ``flat`` must be
        complete: readers do not wait for the event torch records here.

        torch counts the opens of a shared block to keep it from being freed under a
        reader; the server keeps that count here (PROTOCOL.md §13.3), and a block
        that no reader ever opens would stay allocated after this process let it
        go, so the count torch starts (1) is given back at once, and readers never
        touch it (:meth:`open_shared`)."""
        fields = list(flat.untyped_storage()._share_cuda_())
        if fields[4]:  # (a storage of no bytes has no counter)
            torch.UntypedStorage._release_ipc_counter_cuda(fields[4], fields[5])
        fields[6] = fields[6] or b""  # (no event when torch had none left to give)
        fields[7] = bool(fields[7])
        return fields

    def open_shared(self, fields: list, index: int) -> torch.Tensor:
        """The block another process shared (:meth:`share`'s fields), mapped into this
        one on device ``index``, as a 1-D uint8 tensor: read it and let it go.

        Opened without the publisher's counter and event.  torch's reader takes one
        off the counter when it lets the mapping go, and :meth:`share` already gave
        the only count back: below zero, read as unsigned (torch keeps it in a
        uint64), the publisher would keep the block in torch's IPC limbo for good,
        a snapshot's worth of GPU memory lost per version read.  A name no shared-memory file
        can have (a second slash) makes that decrement fail, which torch ignores
        (as it does for a publisher that is gone).  The event is not needed (the
        publisher waits for its snapshot before sharing it), and opening it would
        make torch wait on this thread's current stream and leak one event handle
        per read."""
        handle = fields[1]
        if type(handle) is not bytes or len(handle) < _IPC_HANDLE:  # torch would read past its end
            raise ValueError(f"a CUDA IPC handle has at least {_IPC_HANDLE} bytes, not {len(handle)}")
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(index, handle, fields[2], fields[3], _NO_COUNTER, 0,
                                                        b"", False)
        flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        return flat.set_(storage, 0, (storage.nbytes(),), (1,))


_streams: CudaStreams | None = None
_streams_lock = threading.Lock()


def streams() -> CudaStreams:
    """The process's :class:`CudaStreams`."""
    global _streams
    if _streams is None:
        with _streams_lock:
            if _streams is None:
                _streams = CudaStreams()
    return _streams
