"""The tensorshare wire format: whole-message helpers over the frame and value codecs.

``dumps(obj)`` gives the bytes of one self-contained frame carrying ``obj``;
``loads(data)`` turns such bytes back into the value.  The network path uses the same
pieces incrementally: :mod:`.frames` (framing, sans-IO decoder), :mod:`.description`
(validating value descriptions; no torch needed) and :mod:`.codec` (values to and
from descriptions and payloads).  torch is imported only when values are encoded or
built, so the server, which only forwards payloads, never loads it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from .description import DEFAULT_LIMITS, DecodeLimits, parse_description
from .frames import (
    DEFAULT_FRAME_LIMITS, PREFIX, PREFIX_SIZE, Frame, FrameDecoder, FrameLimits, discard_sink, frame_head,
)

__all__ = ["dumps", "loads", "DecodeLimits", "FrameLimits", "FrameDecoder", "Frame"]


def dumps(obj: Any) -> bytes:
    """Encode ``obj`` as one whole frame (header ``{"value": description}``)."""
    from .codec import encode

    enc = encode(obj)
    # One copy of the payload, straight into the result.
    return b"".join([frame_head({"value": enc.description}, enc.nbytes), *enc.buffers])


def loads(
    data: bytes | bytearray | memoryview,
    *,
    device: Any = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
    frame_limits: FrameLimits = DEFAULT_FRAME_LIMITS,
) -> Any:
    """Decode one whole frame made by :func:`dumps`.

    Arrays view one buffer: ``data`` itself if it is writable and aligned, else one
    aligned copy of the payload.  Raises :class:`ProtocolError` on any malformed
    input, including a truncated frame or bytes after its end.
    """
    from .codec import as_payload_tensor, build

    view = memoryview(data).cast("B")
    frames = FrameDecoder(discard_sink, frame_limits).feed(view)
    if not frames:
        raise ProtocolError(f"truncated frame: {view.nbytes} bytes do not hold a whole frame")
    frame = frames[0]
    consumed = _frame_size(view)
    if len(frames) > 1 or consumed != view.nbytes:
        raise ProtocolError(f"{view.nbytes - consumed} bytes of trailing data after the frame")
    blob = frame.header.get("value")
    if not isinstance(blob, bytes):
        raise ProtocolError("frame carries no value description")
    desc = parse_description(blob, frame.payload_len, limits)
    # The decoder only validated the frame; the arrays view the caller's bytes.
    payload = as_payload_tensor(view[consumed - frame.payload_len : consumed])
    return build(desc, payload, device=device)


def _frame_size(view: memoryview) -> int:
    _, _, _, _, header_len, payload_len = PREFIX.unpack(view[:PREFIX_SIZE])
    return PREFIX_SIZE + header_len + payload_len
