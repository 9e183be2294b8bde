"""Sizes and roles as people read them, for what both ends show (the status page, the CLI)."""

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


def rl_roles(client: dict) -> str:
    """What a status-page client row (``/status.json``'s ``clients``) is in each RL
    experiment: ``"corridor: worker actor-3 at v5 (1 behind)"``, ``"corridor: trainer
    at v6"``; ``"-"`` for none."""
    versions, roles, lag = client.get("versions", {}), client.get("roles", {}), client.get("lag", {})
    parts = []
    for experiment in sorted({*versions, *roles}):
        role = roles.get(experiment)
        text = f"{experiment or '(default)'}:"
        if role is not None:
            text += " trainer" if role == "trainer" else f" worker {role}"
        if experiment in versions:
            text += f" at v{versions[experiment]}"
            if lag.get(experiment):
                text += f" ({lag[experiment]} behind)"
        parts.append(text)
    return ", ".join(parts) or "-"
