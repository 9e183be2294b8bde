"""Wire dtype names <-> torch and numpy dtypes, for the names this torch build and numpy have."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .dtypes import NUMPY_WIDTHS, TORCH_WIDTHS

# Wire name <-> dtype, for the names this torch build and numpy have.
TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in TORCH_WIDTHS if hasattr(torch, n)}
TORCH_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
NUMPY_DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in NUMPY_WIDTHS}
NUMPY_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


def _buffer_dtypes() -> dict:
    """Torch dtypes whose CPU tensors export a buffer (``Tensor.numpy()``) that
    ``memoryview.cast("B")`` accepts, mapped to that buffer's numpy dtype.

    For these the encoder takes a contiguous tensor's bytes in one step and the
    decoder builds tensors through numpy, both several times cheaper per array
    than chains of torch view ops (each a dispatcher round trip).
    """
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        for dtype in TORCH_DTYPES.values():
            try:
                array = torch.zeros(2, dtype=dtype).numpy()
                memoryview(array).cast("B")
            except (TypeError, RuntimeError):  # no numpy twin (bfloat16, float8...)
                continue
            found[dtype] = array.dtype
    return found




BUFFER_DTYPES = _buffer_dtypes()
