"""The counters a store reports: per tier (``TierStats``, in ``kvstore.tiers.base``), its content catalog, the whole
store.

Values only, so the client, the wire and the CLI can read a store's counters without importing the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers.base import TierName, TierStats

__all__ = ["CatalogStats", "LookupTotals", "RegistrationStats", "RemoteStats", "StoreStats"]


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
class RemoteStats:
    """The remote tier's link and fleet directory (its chunk counters are its ``TierStats``).

    Attributes:
        available: no outage is open.
        outages: outages since the store opened (each logged once, with its recovery).
        resets: times the remote was found emptied (restarted without persistence, flushed) and forgotten.
        failed_calls: remote calls that failed (network, timeout, refused), skipped ones included.
        skipped_calls: calls answered locally without a round trip during an outage.
        queued_bytes: chunk bytes waiting for the writer.
        directory_records: directory records read from other hosts.
        directory_bad_records: records that failed their checks (skipped).
    """

    available: bool
    outages: int
    resets: int
    failed_calls: int
    skipped_calls: int
    queued_bytes: int
    directory_records: int
    directory_bad_records: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupTotals:
    """Tokens looked up since the store opened, and the missed ones by reason (``kvstore.misses``).

    ``missed_tokens`` counts each lookup's gaps under their reasons, and each retrieve's planned segments it could
    not serve (``checksum``, ``remote_unavailable``, ...) under theirs: so for a lookup whose plan is retrieved, its
    tokens served are its tokens looked up less its missed ones. Reasons are strings, so a client reads the
    reasons of a newer server.
    """

    looked_up_tokens: int = 0
    missed_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """Counters of the store, each of its tiers (fastest first), with blending on its content catalog, and with a
    remote tier its link and directory."""

    tiers: tuple[TierStats, ...]
    num_open_plans: int
    num_sessions: int
    catalog: CatalogStats | None = None
    remote: RemoteStats | None = None
    lookups: LookupTotals = field(default_factory=LookupTotals)

    def tier(self, name: TierName) -> TierStats | None:
        return next((stats for stats in self.tiers if stats.tier is name), None)
