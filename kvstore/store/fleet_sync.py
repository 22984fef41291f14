"""Keeping a store's view of the fleet directory fresh: a background reader and the glue into the content catalog.

The remote tier's ``read_directory`` returns the runs other hosts published since the last call and learns their
keys (prefix lookups find them from then on). ``DirectorySync`` calls it every ``interval_s`` on its own thread and
hands the runs to the content catalog (``ContentCatalog.add_published``), so blend lookups find other hosts'
chunks by content too. A lookup never waits for it: what was published in the last interval is simply not known yet
(``sync_now`` reads at once, for tests and benchmarks). During an outage the reads fail fast and the cursors stay,
so the runs published meanwhile arrive once the remote is back.

Threads: one reader thread per store; ``_sync_lock`` serialises it with ``sync_now``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvstore.content.catalog import ContentCatalog
from kvstore.content.index import ChunkContents
from kvstore.tiers.remote.directory import DirectoryRun
from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["DEFAULT_SYNC_INTERVAL_S", "DirectorySync"]

logger = logging.getLogger(__name__)

DEFAULT_SYNC_INTERVAL_S = 0.05


class DirectorySync:
    """Reads the fleet directory into a store.

    Args:
        remote: the store's remote tier.
        catalog: the store's content catalog (``None`` without blending: only keys are learnt).
        interval_s: pause between reads.
    """

    def __init__(self, remote: RemoteTier, catalog: ContentCatalog | None, *, interval_s: float) -> None:
        self._remote = remote
        self._catalog = catalog
        self._interval_s = interval_s
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self.num_runs = 0
        self.num_indexed = 0
        self._thread = threading.Thread(target=self._loop, name="kvstore-directory-sync", daemon=True)
        self._thread.start()

    def sync_now(self) -> int:
        """Read and apply what was published since the last read; returns the runs read."""
        with self._sync_lock:
            self._remote.check_epoch()
            runs = self._remote.read_directory()
            if not runs:
                return 0
            self.num_runs += len(runs)
            if self._catalog is not None:
                self.num_indexed += _index_runs(self._catalog, runs)
            return len(runs)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                drained = False
                while not drained and not self._stop.is_set():  # a host catching up reads until nothing is left
                    drained = self.sync_now() == 0
            except Exception:  # keep syncing: one bad batch must not blind the host for good
                logger.exception("fleet directory sync failed; retrying")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _index_runs(catalog: ContentCatalog, runs: Sequence[DirectoryRun]) -> int:
    """Register the runs that carry content hashes of the catalog's bits in one ``add_published`` per bit width."""
    by_bits: dict[int, list[DirectoryRun]] = {}
    chunk_size = catalog.chunk_size
    for run in runs:
        if run.has_contents and _well_formed(run, chunk_size):
            by_bits.setdefault(run.fingerprint_bits, []).append(run)
    indexed = 0
    for bits, group in by_bits.items():
        lengths = np.concatenate([run.lengths for run in group])
        contents = ChunkContents(
            fingerprints=np.concatenate([run.fingerprints for run in group]),
            verifications=np.concatenate([run.verifications for run in group]),
            lengths=lengths,
            fingerprint_bits=bits,
        )
        keys = [key for run in group for key in run.keys]
        source_starts = np.concatenate([_chunk_starts(run) for run in group])
        run_offsets = np.concatenate(([0], np.cumsum([len(run.keys) for run in group]))).astype(np.int64)
        indexed += catalog.add_published(contents, keys, source_starts, run_offsets)
    return indexed


def _chunk_starts(run: DirectoryRun) -> npt.NDArray[np.int64]:
    """Where each chunk of a run starts in its stored sequence: chunks follow each other, each as long as its length
    says (a separator's or a content-defined cut makes chunks shorter than ``chunk_size`` mid-run)."""
    lengths = run.lengths.astype(np.int64)
    return run.source_start + np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.int64)


def _well_formed(run: DirectoryRun, chunk_size: int) -> bool:
    """A run the index can take: every chunk of 1 to ``chunk_size`` tokens, positions within the index's 32 bits."""
    lengths = run.lengths.astype(np.int64)
    return (
        len(lengths) == len(run.keys)
        and len(lengths) > 0
        and int(lengths.min()) >= 1
        and int(lengths.max()) <= chunk_size
        and run.source_start + int(lengths.sum()) < 2**32
    )
