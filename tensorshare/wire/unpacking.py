"""msgpack decoding whose memory stays a small multiple of the bytes decoded.

msgpack's own limits bound each container's *length* by the size of the input,
not how many containers there are: a one-byte empty map becomes an 80-byte dict,
so a 16 MiB header of empty maps costs over a GiB to decode.  Every document a
peer sends (frame headers, value descriptions) is decoded here, under one rule:

    a document of ``n`` bytes holds at most ``max(1024, n // 8)`` containers
    (maps and arrays, those inside extensions included), and the extensions it
    decodes recursively (a value description's tuples, maps with other keys, sets,
    sizes and TensorDicts) copy out at most ``max(64 KiB, 4 * n)`` bytes in all
    (msgpack hands each one its bytes as a new ``bytes``, so nesting copies the
    inner ones once per level).  The description's fixed-size extensions that
    become objects (numpy scalars, dtypes, complex numbers, sizes) count as
    containers too.

A document of 1 KiB or less cannot break the rule (a container takes at least one
byte), so it is decoded without counting, which keeps the small headers of the
hot path as fast as msgpack makes them; a larger one is counted as it is built and
refused the moment it has too many, before it costs more than about 11 bytes of
containers per byte.  Honest documents stay under it: a request header is one
map, a value description two per array (its table entry and shape, 9 bytes or more
with the array's reference in the tree).

Scalars cannot be counted as msgpack builds them (a 3-byte string becomes a
50-byte object: a document of short strings costs up to ~25x while it is
decoded).  What a decoder *keeps* can be measured afterwards:
:meth:`ContainerBudget.held_bytes` is the memory a decoded document holds, which a
server compares with the document's size before it keeps a request waiting.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import msgpack

from ..errors import ProtocolError

FREE_CONTAINERS = 1024  # containers any document may hold
BYTES_PER_CONTAINER = 8  # past that, one more per this many bytes
FREE_COPIES = 64 << 10  # bytes any document's extensions may copy out
COPIES_PER_BYTE = 4  # past that, this many per byte of the document


def container_limit(size: int) -> int:
    """How many containers a document of ``size`` bytes may hold."""
    return max(FREE_CONTAINERS, size // BYTES_PER_CONTAINER)


class ContainerBudget:
    """Counts the containers msgpack builds (as its ``object_hook`` and ``list_hook``)
    and stops the decoding once there are too many.  One budget may span several
    ``unpackb`` calls: a value description decodes its tuples' contents separately."""

    __slots__ = ("left", "limit", "copies_left", "what", "containers")

    def __init__(self, size: int, what: str, *, measure: bool = False):
        self.limit = self.left = container_limit(size)
        self.copies_left = max(FREE_COPIES, COPIES_PER_BYTE * size)
        self.what = what
        self.containers: list | None = [] if measure else None  # for held_bytes()

    def copied(self, data: bytes) -> None:
        """Count the bytes of an extension about to be decoded on its own."""
        self.copies_left -= len(data)
        if self.copies_left < 0:
            raise ProtocolError(f"{self.what} nests extensions that copy out more than "
                                f"{COPIES_PER_BYTE} times its size")

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(
                f"{self.what} holds more than {self.limit} maps and arrays "
                f"(at most one per {BYTES_PER_CONTAINER} bytes past the first {FREE_CONTAINERS})")
        if self.containers is not None:
            self.containers.append(container)
        return container

    def held_bytes(self, root: Any) -> int:
        """The memory the decoded document ``root`` holds (made with ``measure=True``):
        every object once, as an element of its container, plus each container's
        garbage-collector header.  Shared objects (None, small ints) are counted as
        if they were not, so this errs high; it runs at C speed (``map``), a few
        tens of nanoseconds per element."""
        total = sys.getsizeof(root)
        for container in self.containers:
            if type(container) is dict:
                total += 16 + sum(map(sys.getsizeof, container.keys())) + sum(map(sys.getsizeof, container.values()))
            else:
                total += 16 + sum(map(sys.getsizeof, container))
        return total


UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException, RecursionError)  # what msgpack raises


def unpack_bounded(data: bytes | memoryview, what: str, *, budget: ContainerBudget | None = None,
                   ext_hook: Callable[[int, bytes], Any] | None = None) -> Any:
    """Decode one msgpack document (str map keys, lists for arrays) within the
    container rule; any failure is a :class:`ProtocolError` naming ``what``.

    ``budget`` carries the count over from an enclosing document; ``ext_hook``
    decodes extension types (none are allowed without one).
    """
    size = len(data)
    try:
        if budget is None and size > FREE_CONTAINERS:
            budget = ContainerBudget(size, what)
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=size, max_bin_len=size, max_array_len=size, max_map_len=size,
            max_ext_len=size if ext_hook is not None else 0,
            object_hook=budget, list_hook=budget, ext_hook=ext_hook or _no_ext,
        )
    except ProtocolError:
        raise
    except UNPACK_ERRORS as exc:
        raise ProtocolError(f"malformed {what}: {exc or type(exc).__name__}") from None


def _no_ext(code: int, data: bytes) -> Any:
    """msgpack's own extension decoding (for the header check to refuse)."""
    return msgpack.ExtType(code, data)
