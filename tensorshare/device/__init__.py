"""The device transfer engine: how tensors in GPU memory travel (docs/design.md, "GPU data path").

One engine per kind of device memory moves bytes between the device and what
the wire and the server's shared memory carry: bucketed copies on its own
streams through a small pool of pinned host buffers (:mod:`.engine`), planned by
:mod:`.buckets`, over the device's calls (:mod:`.cuda`), received into
:mod:`.payload`'s device payloads; on one host, CUDA
memory is also shared by reference (:mod:`.ipc`).  The codec hands it CUDA
tensors; the clients, the RL wrappers and tables all move device memory through
it.  Nothing here is imported until a device tensor is sent or a device is asked
for, and CPU tensors never pass through it.
"""

from __future__ import annotations

import threading
from typing import Any

_ENGINES: dict[str, Any] = {}  # device type -> Engine (made on first use)
_CUDA: list = [None]  # whether a CUDA device is there (asked once)
_lock = threading.Lock()


def engine_for(device: Any):
    """The :class:`~.engine.Engine` that receives into ``device`` (a torch device or its
    name), or None when none does (the CPU, or CUDA where this torch has none)."""
    if device is None:
        return None
    import torch

    try:
        kind = torch.device(device).type
    except (TypeError, RuntimeError, ValueError):
        return None
    engine = _ENGINES.get(kind)
    if engine is None and kind == "cuda" and _cuda_present():
        engine = _cuda_engine()
    return engine


def engine_of(tensor: Any):
    """The engine that sends ``tensor`` (a CUDA tensor, or another kind of device
    memory an engine was installed for)."""
    engine = _ENGINES.get(tensor.device.type)
    return engine if engine is not None else _cuda_engine()


def _cuda_present() -> bool:
    """Whether this torch sees a CUDA device, asked without initialising CUDA where
    it can be (NVML): a parent that asks and forks later keeps usable children
    (``torch.cuda.is_available()`` initialises the driver).  Remembered."""
    if _CUDA[0] is None:
        import torch

        _CUDA[0] = torch.cuda.is_initialized() or (torch.cuda._is_compiled() and torch.cuda.device_count() > 0)
    return _CUDA[0]


def _cuda_engine():
    with _lock:
        engine = _ENGINES.get("cuda")
        if engine is None:
            from .cuda import streams
            from .engine import Engine

            engine = _ENGINES["cuda"] = Engine(streams())
        return engine


__all__ = ["engine_for", "engine_of"]
