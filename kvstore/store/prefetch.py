"""Background copies of disk- or remote-resident chunks into the cpu tier, started by a lookup, awaited by its retrieve.

Reading a chunk from disk costs milliseconds of zstd and I/O; a lookup should not. For every segment of a plan
that only the disk holds, the lookup starts a prefetch: a pool thread decodes the chunk straight into a cpu slot
(``ArenaTier.put_with``), pins it there and hands the pin to the plan (``PinLedger.add_pin``). The lookup returns
at once with one future per prefetch; the caller may poll ``plan.ready`` or let ``retrieve`` wait. Chunks only a
shared tier (the remote) holds are fetched in groups (``start_shared``: one round trip per group), then decoded the
same way.

A prefetch that cannot land (the cpu tier is pinned full, the chunk failed its checksum, the remote lost it or is
down) resolves to ``False``: the retrieve then reads the disk or the remote directly, or finds the chunk
gone. A plan released before its prefetch lands gets nothing: the prefetcher drops its own pin.

Threads: ``Prefetcher`` is shared; its pool runs copies in parallel with each other and with the caller.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Sequence
from typing import Any

from kvstore.keys import PrefixKey
from kvstore.misses import MissReason
from kvstore.store.pins import PinLedger
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import Tier
from kvstore.tiers.shared import SharedTier

__all__ = ["DEFAULT_PREFETCH_THREADS", "REMOTE_FETCH_GROUP", "Prefetcher"]

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH_THREADS = 2
"""Chunks a store reads from disk at once: while one reader decodes, the other can wait for the disk (one reader
alone leaves the disk idle during its decode). ``kvstore bench tiers`` measures one reader (``get_cold``) and this
many (``get_cold_prefetch``): faster on the 16-core H200 host, no faster on 2 cores (measured:
docs/design-notes.md#prefetch)."""

REMOTE_FETCH_GROUP = 8
"""Chunks fetched from the remote in one round trip: few enough that a group's values (compressed KV, up to tens of
MiB each on a large model) stay a bounded amount of memory, enough that a round trip carries several chunks."""


class Prefetcher:
    """Copies disk (or shared-tier) chunks into the cpu tier on a small thread pool.

    Args:
        cpu: where chunks land (the cpu tier: a memory tier that can take a chunk written in place).
        ledger: the pins of open plans (a landed chunk's cpu pin is added to its plan).
        disk: the tier ``start`` reads (the disk tier), when there is one.
        num_threads: parallel copies (each decodes with the disk tier's codec threads too).
    """

    def __init__(
        self,
        cpu: ArenaTier,
        ledger: PinLedger,
        *,
        disk: Tier | None = None,
        num_threads: int = DEFAULT_PREFETCH_THREADS,
    ) -> None:
        self._disk = disk
        self._cpu = cpu
        self._ledger = ledger
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvstore-prefetch")

    def start(self, plan_id: int, key: PrefixKey) -> concurrent.futures.Future[bool]:
        """Begin landing ``key`` in the cpu tier for plan ``plan_id``; the future says whether it landed."""
        return self._pool.submit(self._land, plan_id, key)

    def start_shared(
        self, plan_id: int, shared: SharedTier[Any], keys: Sequence[PrefixKey]
    ) -> list[concurrent.futures.Future[bool]]:
        """Begin landing a shared tier's chunks in the cpu tier, ``REMOTE_FETCH_GROUP`` per round trip; one future
        per group says whether all of its chunks landed."""
        return [
            self._pool.submit(self._land_shared, plan_id, shared, keys[start : start + REMOTE_FETCH_GROUP])
            for start in range(0, len(keys), REMOTE_FETCH_GROUP)
        ]

    def _land(self, plan_id: int, key: PrefixKey) -> bool:
        disk = self._disk
        assert disk is not None, "Prefetcher.start without a disk tier: the store's wiring"
        record = disk.record(key)
        if record is None:
            return False
        if not self._cpu.put_with(record, lambda view: disk.get_into(key, view)):
            return False
        return self._hand_to_plan(plan_id, key)

    def _land_shared(self, plan_id: int, shared: SharedTier[Any], keys: Sequence[PrefixKey]) -> bool:
        landed = 0
        for chunk in shared.fetch(keys):
            if isinstance(chunk, MissReason):
                continue
            if self._cpu.put_with(chunk.record, functools.partial(shared.decode_into, chunk)):
                landed += self._hand_to_plan(plan_id, chunk.record.key)
        return landed == len(keys)

    def _hand_to_plan(self, plan_id: int, key: PrefixKey) -> bool:
        """Pin a landed chunk for the plan (dropping the pin again if the plan is gone)."""
        if not self._cpu.pin(key):
            return False
        if not self._ledger.add_pin(plan_id, (self._cpu, key)):
            self._cpu.unpin(key)  # the plan was released while we copied
        return True

    def shutdown(self) -> None:
        """Cancel queued copies and wait for running ones (store close)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
