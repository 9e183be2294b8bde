"""Sizes as people read them, for what both ends show (the status page, the CLI)."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 MiB"``...; ``"-"`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
