"""The table of element types that may cross the wire, by their wire names."""

from __future__ import annotations

import numpy as np
import torch

# Wire name -> torch dtype, for every fixed-width dtype this torch build has.
_TORCH_NAMES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _TORCH_NAMES if hasattr(torch, name)
}
TORCH_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}

# Wire name -> numpy dtype (native byte order, which the wire requires to be little).
_NUMPY_NAMES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
)
NUMPY_DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in _NUMPY_NAMES}
NUMPY_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


def itemsize(name: str, is_numpy: bool) -> int | None:
    """Bytes per element of the wire dtype ``name``, or None if it is unknown."""
    if is_numpy:
        dtype = NUMPY_DTYPES.get(name)
        return None if dtype is None else dtype.itemsize
    dtype = TORCH_DTYPES.get(name)
    return None if dtype is None else dtype.itemsize
