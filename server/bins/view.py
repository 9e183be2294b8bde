"""A read-only view of a server's bins and tables: what the operations pages may read.

The status page, ``/status.json`` and ``/metrics`` (``server/ops/status.py``) see
the storage through :class:`StorageView` (``Storage.view``): summaries made when
they ask, on the reactor thread, never the store's items, the tables' entries or
their accounting fields themselves.  Nothing here walks the items: a bin's counts by
tier are kept by the store as items come, go and move (``_Bin.placed``), so a scrape
costs the reactor time per bin and per table, not per item (walking the items took
about a second per million, a stall for every client at each scrape).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple


class BinSummary(NamedTuple):
    """One bin as the operations pages show it."""

    name: str
    items: int
    bytes: int
    seq: int
    tag: int | None  # its last item's
    tiers: dict  # tier -> payload bytes there
    tier_items: dict  # tier -> items there


class StorageView:
    """Summaries of one :class:`~.storage.Storage`, read when asked (see the module docstring)."""

    def __init__(self, storage):
        self._storage = storage

    def bins(self) -> Iterator[BinSummary]:
        """Every bin, with its payload bytes by tier."""
        for name, items, nbytes, seq, tiers in self._storage.store.walk():
            yield BinSummary(name, len(items), nbytes, seq, items[-1].tag if items else None,
                             {tier: b for tier, (_, b) in tiers.items()}, {tier: n for tier, (n, _) in tiers.items()})

    def names(self) -> list[str]:
        """The bins' names."""
        return list(self._storage.store.listing())

    def tag(self, name: str) -> int | None:
        """The tag of bin ``name``'s last item (None if none)."""
        return self._storage.state(name).tag

    def memory(self) -> dict[str, int]:
        """Payload bytes in memory and in all, descriptions, and replies not yet read."""
        store = self._storage.store
        return {"payload_in_memory": store.resident_bytes, "payload": store.nbytes,
                "descriptions": store.description_bytes, "replies_in_flight": store.in_flight_bytes}

    def table_counts(self) -> dict[str, tuple[int, int]]:
        """``{table: (rows inserted, rows sampled)}`` so far."""
        return {entry.name: (entry.table.inserts, entry.table.samples) for entry in self._storage.table_entries()}

    def tables(self) -> list[dict]:
        """Per table: rows and capacity, sampler and remover, bytes, where its rows
        live, rows inserted, sampled and removed, seconds requests waited for its
        rate limiter and the limiter's settings."""
        rows = []
        for entry in self._storage.table_entries():
            table, limiter = entry.table, entry.table.info()["rate_limiter"]
            rows.append({
                "name": entry.name, "size": table.size, "capacity": table.capacity, "sampler": table.sampler,
                "remover": table.remover, "columns": len(table.columns), "bytes": entry.nbytes,
                "where": "files" if entry.directory is not None else "memory" if table.columns else "items",
                "inserts": table.inserts, "samples": table.samples, "removals": table.removals,
                "blocked_seconds": dict(entry.blocked),
                "samples_per_insert": limiter["samples_per_insert"],
                "min_size_to_sample": limiter["min_size_to_sample"],
            })
        return rows
