"""A client's options checked before anything is sent, and the connect timeout a call's timeout bounds.

Every client (``Client``, ``AsyncClient``, ``connect``, ``TensorShare``, the RL
peers) checks its address and timeouts here, so a port out of range or a negative
timeout is a :class:`~tensorshare.errors.UsageError` naming the option, not a
refused connection later.  A timeout the caller gives bounds what it names: one
who says ``timeout=3`` and no ``connect_timeout`` waits at most 3 s to connect too.
"""

from __future__ import annotations

import enum
import math
from typing import Literal, Union

from ..errors import UsageError


class Default(enum.Enum):
    """A method's ``timeout`` when not given: the client's own ``timeout``.  (An enum,
    so that type checkers can tell it from a number and signatures show its name.)"""

    DEFAULT = "the client's timeout"

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = Default.DEFAULT
# What a method's ``timeout`` takes: seconds, None (no limit), or DEFAULT.
Timeout = Union[float, None, Literal[Default.DEFAULT]]
DEFAULT_CONNECT_TIMEOUT = 10.0  # seconds to open one connection, unless the call timeout is shorter
DEFAULT_RETRY_FOR = 30.0  # seconds connect() keeps trying a server that is not up yet, likewise


def check_address(host: object, port: object) -> None:
    """Raise UsageError unless ``host`` is a non-empty string and ``port`` a TCP port (1-65535)."""
    if not isinstance(host, str) or not host:
        raise UsageError(f"host must be a host name or address, not {host!r}")
    if isinstance(port, str) and port.strip().isdigit():
        raise UsageError(f"port must be an int, not the str {port!r}: pass int({port!r})")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"port must be a TCP port, 1 to 65535, not {port!r}")


def check_timeout(name: str, value: object, *, optional: bool = True) -> None:
    """Raise UsageError unless ``value`` is a positive number of seconds (or None, if ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        allowed = "a positive number of seconds" + (" or None (no limit)" if optional else "")
        raise UsageError(f"{name} must be {allowed}, not {value!r}")


def connect_timeout_for(given: float | None, timeout: float | None, default: float) -> float:
    """The connect timeout to use: ``given`` if the caller gave one, else ``default``
    bounded by the caller's ``timeout`` (None: no bound)."""
    if given is not None:
        check_timeout("connect_timeout", given, optional=False)
        return float(given)
    check_timeout("timeout", timeout)
    return default if timeout is None else min(default, float(timeout))
