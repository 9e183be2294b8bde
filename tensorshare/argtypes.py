"""Command-line argument types both commands share (``tensorshare``, ``tensorshare-server``).

Each turns the text of an option into its value or raises
:class:`argparse.ArgumentTypeError` with words a user can act on, which argparse
prints as a usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def whole_number(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """A type for a whole number from ``low`` to ``high`` (None: no bound), said to be ``what``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
        return value
    parse.__name__ = what  # argparse names a type by it in some messages
    return parse


port_number = whole_number(1, 65535, "a TCP port (1 to 65535)")  # to connect to
listen_port = whole_number(0, 65535, "a TCP port (0 to 65535)")  # to listen on (0: any free one)
count = whole_number(1, None, "a count of 1 or more")
count_or_zero = whole_number(0, None, "a count of 0 (no limit) or more")


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    """0 (never, no limit) or a positive, finite number of seconds."""
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"not a number of seconds, 0 or more: {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan
