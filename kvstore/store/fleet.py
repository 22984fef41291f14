"""``Fleet``: everything the store does with the tiers it shares with other hosts, behind one object.

A store coordinates local tiers (``Tier``: they pin) and shared ones (``kvstore.tiers.shared.SharedTier``: they
cannot). What a shared tier takes part in, the store asks of its ``Fleet``, which is empty without one (every call
then does nothing), so the store has no special case per tier::

    store     -> wrote(tier, record, kv)       a new chunk is written through (write policy "through")
              -> stored(tokens, keys, ...)     its runs are published to the fleet directory
    eviction  -> spilled(record, kv)           the last local tier's victim goes to the shared tier ("evict")
              -> evicted(chunks)               the disk's victims, as stored ("evict")
    lookup    -> knows(key)                    a chunk only a shared tier holds is planned there, unpinned
    retrieve  -> reads(plan, landed)           the plan's shared chunks no prefetch landed, a group per round trip
    background   DirectorySync                 other hosts' runs into the content catalog

Today the one shared tier is the remote tier (Valkey); its directory (publishing and reading runs) is what makes it
a fleet's, so this module opens it from the store's config and owns the directory's reader and ``RecentRuns``.

Threads: the store's callers, the disk writer thread (``evicted``) and the directory reader; the tiers and the
directory reader guard their own state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.content.catalog import ContentCatalog
from kvstore.content.index import DEFAULT_FINGERPRINT_BITS
from kvstore.keys import PrefixKey, TokenArray
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, Segment
from kvstore.remote_address import parse_remote_url
from kvstore.stats import RemoteStats
from kvstore.store.borrowed_writes import write_borrowing
from kvstore.store.fleet_publish import RecentRuns, publish_records, publish_span, records_in_runs
from kvstore.store.fleet_sync import DEFAULT_SYNC_INTERVAL_S, DirectorySync
from kvstore.store.remote_reads import RemoteReads
from kvstore.tiers.base import ChunkRecord, Tier, TierName, TierStats
from kvstore.tiers.frames.evicted import EvictedChunk
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames
from kvstore.tiers.remote.tier import RemoteTier
from kvstore.tiers.shared import SharedTier

__all__ = ["Fleet"]


class Fleet:
    """The store's shared tiers (none, or the remote tier) and the fleet directory (see the module docstring).

    Args:
        remote: the remote tier, or ``None`` for a store without shared tiers.
        catalog: the store's content catalog (published runs carry content hashes of its bits; ``None``: keys only).
        write_on_eviction: chunks reach the remote only as the local tiers evict them (``remote_write="evict"``).
        sync_interval_s: pause between reads of the fleet directory.
    """

    def __init__(
        self,
        remote: RemoteTier | None,
        catalog: ContentCatalog | None,
        *,
        write_on_eviction: bool = False,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
    ) -> None:
        self._remote = remote
        self.tiers: tuple[SharedTier[Any], ...] = (remote,) if remote is not None else ()
        self.writes_on_eviction = remote is not None and write_on_eviction
        self._fingerprint_bits = catalog.index.fingerprint_bits if catalog is not None else DEFAULT_FINGERPRINT_BITS
        self._recent_runs = RecentRuns()  # the evict policy's runs, to continue them (fleet_publish)
        self._directory_sync = (
            DirectorySync(remote, catalog, interval_s=sync_interval_s) if remote is not None else None
        )

    @classmethod
    def open(cls, config: StoreConfig, layout: KVLayout, catalog: ContentCatalog | None) -> Fleet:
        """The fleet a store's config asks for: the remote tier when ``config.tiers`` names it, else none."""
        if TierName.REMOTE not in config.tiers:
            return cls(None, catalog)
        assert config.remote_url is not None, "StoreConfig checks that the remote tier has a URL"
        link = RemoteLink(
            parse_remote_url(config.remote_url, password=config.remote_password),
            timeout_s=config.remote_timeout_ms / 1000,
        )
        remote = RemoteTier(
            link,
            RemoteNames.for_layout(config.remote_namespace, layout, config.chunk_size, chunking=config.chunking),
            layout,
            config.chunk_size,
            host_id=int.from_bytes(os.urandom(8), "little"),
            zstd_level=config.disk_zstd_level,
            max_queued_bytes=config.remote_max_queued_bytes,
        )
        return cls(remote, catalog, write_on_eviction=config.remote_write == "evict")

    # -- what the shared tiers hold -----------------------------------------------------------------------------

    def knows(self, key: PrefixKey) -> TierName | None:
        """The first shared tier believed to hold the chunk, or ``None``."""
        return next((tier.name for tier in self.tiers if tier.knows(key)), None)

    # -- writes -------------------------------------------------------------------------------------------------

    def wrote(self, tier: Tier, record: ChunkRecord, kv: torch.Tensor) -> None:
        """A new chunk landed in a local tier: write it through (borrowing its cpu slot when it has one)."""
        if self.writes_on_eviction:
            return
        for shared in self.tiers:
            if not shared.knows(record.key):
                write_borrowing(tier, record, kv, put=shared.put, put_borrowed=shared.put_borrowed)

    def stored(
        self, tokens: TokenArray, keys: Sequence[PrefixKey], bounds: Sequence[int], new_indexes: Sequence[int]
    ) -> None:
        """Publish each run of consecutive new chunks of a store to the fleet directory, behind their writes."""
        remote = self._remote
        if remote is None or self.writes_on_eviction or not new_indexes:
            return
        run_start = 0
        for position in range(1, len(new_indexes) + 1):
            if position < len(new_indexes) and new_indexes[position] == new_indexes[position - 1] + 1:
                continue
            first, last = new_indexes[run_start], new_indexes[position - 1]
            publish_span(remote, tokens, keys[first : last + 1], bounds[first : last + 2], self._fingerprint_bits)
            run_start = position

    def spilled(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        """The last local tier's victim (a store without a disk tier), under the ``evict`` policy."""
        remote = self._remote
        if remote is not None and self.writes_on_eviction and remote.put(record, kv):
            self._publish(remote, [record])

    def evicted(self, chunks: Sequence[EvictedChunk]) -> None:
        """The disk's capacity victims, as stored (on the disk writer thread: only queues work)."""
        remote = self._remote
        if remote is not None:
            self._publish(remote, remote.put_evicted(chunks))

    def _publish(self, remote: RemoteTier, records: Sequence[ChunkRecord]) -> None:
        """Publish chunks that reached the remote one by one, as runs wherever parent links join them."""
        for run in records_in_runs(records):
            publish_records(remote, run, self._fingerprint_bits, self._recent_runs)

    # -- reads --------------------------------------------------------------------------------------------------

    def reads(self, plan: LookupPlan, landed: set[PrefixKey]) -> RemoteReads | None:
        """The reads of a plan's shared segments that no prefetch landed, in plan order (``None``: there are none)."""
        remote = self._remote
        if remote is None:
            return None
        keys = [segment.key for segment in plan.segments if segment.tier is remote.name and segment.key not in landed]
        return RemoteReads(remote, keys) if keys else None

    def count_inconsistent(self, segment: Segment) -> None:
        """A shared segment's chunk (landed by a prefetch) held another length than planned."""
        for tier in self.tiers:
            if tier.name is segment.tier:
                tier.count_inconsistent(segment.key)

    # -- admin --------------------------------------------------------------------------------------------------

    def sync_now(self) -> int:
        """Read the fleet directory now; the runs read (0 without a shared tier)."""
        return self._directory_sync.sync_now() if self._directory_sync is not None else 0

    def flush(self) -> None:
        """Wait until every chunk and directory record queued for the shared tiers was sent (or dropped)."""
        for tier in self.tiers:
            tier.flush()

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def remote_stats(self) -> RemoteStats | None:
        """The remote link's and directory's counters, or ``None`` without a remote tier."""
        if self._remote is None:
            return None
        available, outages, resets, failed, skipped, queued, records, bad = self._remote.link_stats()
        return RemoteStats(
            available=available,
            outages=outages,
            resets=resets,
            failed_calls=failed,
            skipped_calls=skipped,
            queued_bytes=queued,
            directory_records=records,
            directory_bad_records=bad,
        )

    def stop_reading(self) -> None:
        """Stop the directory reader (first at close: it writes into the catalog)."""
        if self._directory_sync is not None:
            self._directory_sync.stop()

    def close(self) -> None:
        """Send what is queued and stop the shared tiers (before the cpu tier closes: writes may borrow its slots)."""
        for tier in self.tiers:
            tier.close()
