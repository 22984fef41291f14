"""The counters a store reports: per tier (``TierStats``, in ``kvstore.tiers.base``), its content catalog, the whole
store.

Values only, so the client, the wire and the CLI can read a store's counters without importing the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tiers.base import TierName, TierStats

__all__ = ["CatalogStats", "RegistrationStats", "StoreStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationStats:
    """Counters of the content index's registration thread (jobs are stored sequences)."""

    num_jobs: int
    num_chunks_registered: int
    num_failed_jobs: int
    num_pending_jobs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogStats:
    """Counters of the store's content catalog: index entries and bytes, dedup aliases, two-strike state."""

    num_entries: int
    index_bytes: int
    num_aliases: int
    num_strikes: int
    num_struck_out: int
    registration: RegistrationStats


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """Counters of the store, each of its tiers (fastest first) and, with blending on, its content catalog."""

    tiers: tuple[TierStats, ...]
    num_open_plans: int
    num_sessions: int
    catalog: CatalogStats | None = None

    def tier(self, name: TierName) -> TierStats | None:
        return next((stats for stats in self.tiers if stats.tier is name), None)
