"""Rarely changed knobs of the disk tier, with the reason behind each default.

A frozen value, created by the caller and read once when a ``DiskTier`` opens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["DiskTuning"]

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTuning:
    """Settings most deployments leave alone.

    Args:
        staging_bytes: host memory for copies of queued ``put`` chunks (at least two chunks); puts block while
            all of it is in flight.
        preallocate_staging: allocate and touch all of ``staging_bytes`` when a writable tier opens, so puts
            never meet a fresh page (first touches cost the put's caller a noticeable share of the put's CPU;
            measured: docs/design-notes.md#tiers-disk-tuning). ``TieredStore`` turns it off when it has a cpu tier: its
            write-through lends cpu slots (``put_borrowed``) and staging then serves only rare spills.
        max_group_bytes: KV bytes one group commit takes at most; the next group encodes while this one
            commits, so smaller groups overlap better (measured: docs/design-notes.md#tiers-disk-tuning).
        max_transaction_bytes: encoded frame bytes one LMDB write transaction holds at most (one frame at
            least): LMDB mallocs a buffer per multi-MiB value and frees them at commit, so 16 frames of 4 MiB
            per transaction cost several times the CPU of one (commit); chunks stay whole or absent through
            intent records.
        queue_depth: queued jobs before ``put``/``put_borrowed`` block.
        writeback_bytes: the writer starts the disk's writeback (without waiting) after this many stored
            bytes, so the disk writes while the next groups encode and a ``flush`` waits only for the tail
            (0: the disk writes everything at the next ``flush``).
        map_size_bytes: initial LMDB map; default ``1.5 * capacity + 64 MiB`` (room for B-tree pages and pages
            freed by recent commits that LMDB cannot reuse yet).
        max_map_bytes: the map grows on demand up to this; default ``3 * capacity + 256 MiB``.
        max_readers: concurrent read transactions (one per ``get_into`` in flight).
        tune_malloc: raise glibc's malloc thresholds when a writable tier opens: LMDB mallocs a buffer per
            multi-MiB value and glibc would hand them back to the kernel after every commit (much slower group
            commits; see ``environment.tune_malloc_for_large_values``).
    """

    staging_bytes: int = 256 * _MIB
    preallocate_staging: bool = True
    max_group_bytes: int = 32 * _MIB
    max_transaction_bytes: int = 4 * _MIB
    queue_depth: int = 64
    writeback_bytes: int = 64 * _MIB
    map_size_bytes: int | None = None
    max_map_bytes: int | None = None
    max_readers: int = 256
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "max_group_bytes", "max_transaction_bytes", "queue_depth", "max_readers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"DiskTuning.{name}={getattr(self, name)} must be positive")
        if self.writeback_bytes < 0:
            raise ConfigError(f"DiskTuning.writeback_bytes={self.writeback_bytes} must be 0 (off) or positive")

    def initial_map_bytes(self, capacity_bytes: int) -> int:
        return self.map_size_bytes or capacity_bytes + capacity_bytes // 2 + 64 * _MIB

    def map_limit_bytes(self, capacity_bytes: int) -> int:
        limit = self.max_map_bytes or 3 * capacity_bytes + 256 * _MIB
        return max(limit, self.initial_map_bytes(capacity_bytes))
