"""Background copies of disk-resident chunks into the cpu tier, started by a lookup, awaited by its retrieve.

Reading a chunk from disk costs milliseconds of zstd and I/O; a lookup should not. For every segment of a plan
that only the disk holds, the lookup starts a prefetch: a pool thread decodes the chunk straight into a cpu slot
(``ArenaTier.put_with``), pins it there and hands the pin to the plan (``PinLedger.add_pin``). The lookup returns
at once with one future per prefetch; the caller may poll ``plan.ready`` or let ``retrieve`` wait.

A prefetch that cannot land (the cpu tier is pinned full, the chunk failed its checksum) resolves to ``False``:
the retrieve then reads the disk directly, or finds the chunk gone. A plan released before its prefetch lands
gets nothing: the prefetcher drops its own pin.

Threads: ``Prefetcher`` is shared; its pool runs copies in parallel with each other and with the caller.
"""

from __future__ import annotations

import concurrent.futures
import logging

from kvstore.keys import PrefixKey
from kvstore.sessions import PinLedger
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk.tier import DiskTier

__all__ = ["DEFAULT_PREFETCH_THREADS", "Prefetcher"]

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH_THREADS = 2
"""Chunks a store reads from disk at once: while one reader decodes, the other can wait for the disk (one reader
alone leaves the disk idle during its decode). ``kvstore bench tiers`` measures one reader (``get_cold``) and this
many (``get_cold_prefetch``): faster on the 16-core H200 host, no faster on 2 cores (measured:
docs/design-notes.md#prefetch)."""


class Prefetcher:
    """Copies disk chunks into the cpu tier on a small thread pool.

    Args:
        disk: where the chunks are.
        cpu: where they land.
        ledger: the pins of open plans (a landed chunk's cpu pin is added to its plan).
        num_threads: parallel copies (each decodes with the disk tier's codec threads too).
    """

    def __init__(
        self, disk: DiskTier, cpu: CpuTier, ledger: PinLedger, *, num_threads: int = DEFAULT_PREFETCH_THREADS
    ) -> None:
        self._disk = disk
        self._cpu = cpu
        self._ledger = ledger
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvstore-prefetch")

    def start(self, plan_id: int, key: PrefixKey) -> concurrent.futures.Future[bool]:
        """Begin landing ``key`` in the cpu tier for plan ``plan_id``; the future says whether it landed."""
        return self._pool.submit(self._land, plan_id, key)

    def _land(self, plan_id: int, key: PrefixKey) -> bool:
        record = self._disk.record(key)
        if record is None:
            return False
        disk = self._disk
        if not self._cpu.put_with(record, lambda view: disk.get_into(key, view)) or not self._cpu.pin(key):
            return False
        if not self._ledger.add_pin(plan_id, (self._cpu, key)):
            self._cpu.unpin(key)  # the plan was released while we copied
        return True

    def shutdown(self) -> None:
        """Cancel queued copies and wait for running ones (store close)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
