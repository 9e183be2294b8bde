"""The element types that may cross the wire: wire name -> bytes per element.

Plain tables, no torch or numpy import: the server validates descriptions with them.
:mod:`.codec` maps the names to the torch and numpy dtypes of the running process.
"""

from __future__ import annotations

# Arrays of kind 0 (torch.Tensor): every fixed-width torch dtype.
TORCH_WIDTHS: dict[str, int] = {
    "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

# Arrays of kind 1 (numpy.ndarray): numpy's fixed-width numeric dtypes.
NUMPY_WIDTHS: dict[str, int] = {
    "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
}


def itemsize(name: str, is_numpy: bool) -> int | None:
    """Bytes per element of the wire dtype ``name``, or None if it is unknown."""
    return (NUMPY_WIDTHS if is_numpy else TORCH_WIDTHS).get(name)
