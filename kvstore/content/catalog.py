"""The store's content side: fingerprint index, async registration, two-strike eviction and dedup aliases.

``TieredStore`` owns one ``ContentCatalog`` when blending is enabled and talks to it at three points:

- **store**: ``dedup_targets`` (before writing: which new chunks' content is already stored under another key),
  then ``register`` (after the commit: queue the committed runs for the worker; the shields the store took on
  them are dropped when the worker is done);
- **lookup**: ``sync`` (see every registration submitted before the lookup), ``match`` (the match leg, with the
  strike rules applied to what the tiers report), ``partial_matches`` (the stretches of stored chunks around what the
  legs planned, compared against the tokens the store reads from the tiers) and ``resolve_alias`` (the prefix leg's
  dedup aliases);
- **fleet**: ``add_published`` (runs other hosts published to the fleet directory, read by ``fleet_sync``);
- **open**: ``start_rebuild`` (fed batches of the disk's chunk records by the disk tier's own recovery pass), so
  a restart keeps the content index: sequences are relinked through their parent keys (``relink``) and registered
  in one call (``catalog_rebuild``).

The catalog never touches a tier: the store passes what it needs as callables (``ResidencyCheck``), keeping data
flowing one way (store -> catalog, store -> tiers).

Threads: safe to share; each part guards itself (index, worker, strike book, alias table).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvstore.content.aliases import AliasTable, AliasTarget
from kvstore.content.catalog_rebuild import ContentRebuild, SequenceBatch
from kvstore.content.index import ChunkContents, FingerprintIndex, Match, RegistrationResult
from kvstore.content.partials import MIN_PARTIAL_TOKENS, Anchor, PartialMatch
from kvstore.content.registration import RegistrationJob, RegistrationWorker
from kvstore.content.strikes import StrikeBook, Verdict
from kvstore.keys import PrefixKey, TokenArray
from kvstore.stats import CatalogStats

__all__ = ["ContentCatalog", "ContentRebuild", "ResidencyCheck", "SequenceBatch"]

logger = logging.getLogger(__name__)

_Pinned = TypeVar("_Pinned")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyCheck:
    """What the catalog may ask the store about a chunk.

    Args:
        is_resident: some tier holds the chunk.
        in_transit: a tier is moving the chunk to make room (a capacity miss, never a strike).
        stored_tokens: the chunk's token ids, from its record in a local tier (``None``: not held there, or
            unknown); partial matches compare against them. Default: none known (no partial matches).
    """

    is_resident: Callable[[PrefixKey], bool]
    in_transit: Callable[[PrefixKey], bool]
    stored_tokens: Callable[[PrefixKey], TokenArray | None] = lambda _key: None


class ContentCatalog:
    """Content fingerprints of the store's chunks and the rules that keep them honest.

    Args:
        chunk_size: tokens per chunk.
        residency: the store's view of where chunks are.
        dedup_content: record chunks whose content is already stored as aliases instead of writing them.
    """

    def __init__(self, chunk_size: int, residency: ResidencyCheck, *, dedup_content: bool = False) -> None:
        self.chunk_size = chunk_size
        self.dedup_content = dedup_content
        self._residency = residency
        self.index = FingerprintIndex()
        self._strikes = StrikeBook()
        self._aliases = AliasTable()
        self._worker = RegistrationWorker(self.index, chunk_size)

    # -- store path -------------------------------------------------------------------------------------------

    def dedup_targets(self, tokens: TokenArray, chunk_ends: Sequence[int]) -> list[Match | None]:
        """For each chunk of a sequence (ending at ``chunk_ends``), a resident stored copy of its content under any
        key, when dedup is on."""
        if not self.dedup_content:
            return []
        self.sync()  # content stored just before must be seen, or it is written twice
        hits = self.index.find_contents(tokens, self.chunk_size, chunk_ends=chunk_ends)
        return [hit if hit is not None and self._residency.is_resident(hit.key) else None for hit in hits]

    def add_alias(self, alias: PrefixKey, target: Match) -> None:
        self._aliases.add(
            alias, AliasTarget(key=target.key, source_start=target.source_start, num_tokens=target.num_tokens)
        )

    def is_alias(self, key: PrefixKey) -> bool:
        return self._aliases.get(key) is not None

    def register(
        self,
        tokens: TokenArray,
        keys: Sequence[PrefixKey],
        source_start: int,
        on_done: Callable[[], None],
        *,
        chunk_ends: Sequence[int] | None = None,
    ) -> None:
        """Queue a run of committed chunks (each ending at ``chunk_ends`` in ``tokens``, or every ``chunk_size``
        tokens); ``on_done`` runs on the worker after it (drop the store's shields)."""
        for key in keys:
            self._strikes.clear(key)

        def finish(result: RegistrationResult | None) -> None:
            try:
                if result is not None and result.aliases:
                    self._replace_stale_copies(tokens, keys, chunk_ends, source_start, result)
            finally:
                on_done()

        self._worker.submit(
            RegistrationJob(tokens=tokens, keys=keys, chunk_ends=chunk_ends, source_start=source_start, on_done=finish)
        )

    def _replace_stale_copies(
        self,
        tokens: TokenArray,
        keys: Sequence[PrefixKey],
        chunk_ends: Sequence[int] | None,
        source_start: int,
        result: RegistrationResult,
    ) -> None:
        """Content indexed under a key whose chunk is gone: index the fresh copy instead (worker thread)."""
        stale = [alias.existing_key for alias in result.aliases if not self._residency.is_resident(alias.existing_key)]
        if stale:
            self.index.remove(stale)
            self.index.register(tokens, keys, self.chunk_size, source_start, chunk_ends=chunk_ends)

    # -- lookup path ------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every registration submitted so far has run (a lookup sees what was stored before it)."""
        self._worker.wait_submitted()

    def match(
        self,
        tokens: TokenArray,
        *,
        grid_bounds: Sequence[int] = (),
        scan_windows: bool = True,
        skip: Callable[[Match], bool],
        pin: Callable[[PrefixKey], _Pinned | None],
        on_gone: Callable[[Match, bool], None] | None = None,
    ) -> list[tuple[Match, _Pinned]]:
        """The match leg: content matches in ``tokens`` that ``pin`` could pin, strikes applied to the rest.

        Args:
            tokens: the prompt.
            grid_bounds: the prompt's chunk bounds, when its chunks are probed by content too
                (``FingerprintIndex.match``: a separator's runs, content-defined chunks).
            scan_windows: probe every window of ``chunk_size`` tokens (``FingerprintIndex.match``).
            skip: matches the store does not want (e.g. overlapping an exact segment); neither pinned nor judged.
            pin: the store's "pin this chunk for the plan"; returns where it pinned it, or ``None``.
            on_gone: told of each match whose chunk had left every tier and got a strike, and whether that strike
                removed its entry (what a miss's reason is made of).

        Returns:
            Each kept match with what ``pin`` returned for it.
        """
        kept: list[tuple[Match, _Pinned]] = []
        gone: list[PrefixKey] = []
        for found in self.index.match(tokens, self.chunk_size, grid_bounds=grid_bounds, scan_windows=scan_windows):
            if skip(found):
                continue
            pinned = pin(found.key)
            if pinned is not None:
                self._strikes.clear(found.key)
                kept.append((found, pinned))
                continue
            verdict = self._judge_missing(found.key)
            if verdict is Verdict.REMOVE:
                gone.append(found.key)
            if on_gone is not None and verdict in (Verdict.STRUCK, Verdict.REMOVE):
                on_gone(found, verdict is Verdict.REMOVE)
        if gone:
            self.index.remove(gone)
            logger.debug("removed %d index entries after their second strike", len(gone))
        return kept

    def partial_matches(
        self,
        tokens: TokenArray,
        anchors: Sequence[Anchor],
        pin: Callable[[PrefixKey], _Pinned | None],
        *,
        min_tokens: int = MIN_PARTIAL_TOKENS,
    ) -> list[tuple[PartialMatch, _Pinned]]:
        """The stretches of stored chunks around ``anchors`` (what the lookup's legs planned, sorted) that the
        prompt holds token for token (``FingerprintIndex.partial_matches``), each with what ``pin`` returned for its
        chunk; one ``pin`` could not place is left out (its tokens were read from a tier a moment before: no strike).
        """
        kept: list[tuple[PartialMatch, _Pinned]] = []
        for found in self.index.partial_matches(tokens, anchors, self._residency.stored_tokens, min_tokens=min_tokens):
            pinned = pin(found.key)
            if pinned is not None:
                kept.append((found, pinned))
        return kept

    def resolve_alias(
        self, key: PrefixKey, pin: Callable[[PrefixKey], _Pinned | None]
    ) -> tuple[AliasTarget, _Pinned] | None:
        """The stored copy an alias stands for, pinned by ``pin``; an alias whose copy is gone gets strikes."""
        target = self._aliases.get(key)
        if target is None:
            return None
        pinned = pin(target.key)
        if pinned is not None:
            self._strikes.clear(key)
            return target, pinned
        if self._judge_missing(target.key, strike_key=key) is Verdict.REMOVE:
            self._aliases.remove(key)
        return None

    def _judge_missing(self, key: PrefixKey, *, strike_key: PrefixKey | None = None) -> Verdict:
        resident = self._residency.is_resident(key)
        return self._strikes.judge(
            strike_key or key,
            resident=resident,
            pending=self._worker.is_pending(key),
            in_transit=not resident and self._residency.in_transit(key),
        )

    def add_published(
        self,
        contents: ChunkContents,
        keys: Sequence[PrefixKey],
        source_starts: npt.NDArray[np.int64],
        run_offsets: npt.NDArray[np.int64],
    ) -> int:
        """Index runs other hosts published to the fleet directory (``FingerprintIndex.register_runs``' arguments).

        Their chunks are resident in the remote tier, so they are found by content like local ones; a run whose
        content this index already holds under another key is not indexed twice (first writer wins). Returns the
        chunks newly indexed; contents of other fingerprint bits are refused with one warning and return 0.
        """
        if contents.fingerprint_bits != self.index.fingerprint_bits:
            logger.warning(
                "fleet directory: runs hashed with %d-bit fingerprints cannot join this %d-bit index; skipped",
                contents.fingerprint_bits,
                self.index.fingerprint_bits,
            )
            return 0
        for key in keys:
            self._strikes.clear(key)
        return self.index.register_runs(contents, keys, source_starts, run_offsets, self.chunk_size).num_added

    def strikes(self, key: PrefixKey) -> int:
        return self._strikes.strikes(key)

    # -- open / close -----------------------------------------------------------------------------------------

    def start_rebuild(self) -> ContentRebuild:
        """A rebuild to feed batches of chunk records into (``add``) and ``finish`` once: what lets the disk tier's
        recovery at open feed the index from its own pass over the records (``DiskTier(content_records=...)``)."""
        return ContentRebuild(self.index, self.chunk_size)

    def stats(self) -> CatalogStats:
        return CatalogStats(
            num_entries=len(self.index),
            index_bytes=self.index.memory_bytes,
            num_aliases=len(self._aliases),
            num_strikes=self._strikes.num_strikes,
            num_struck_out=self._strikes.num_removals,
            registration=self._worker.stats(),
        )

    def close(self) -> None:
        """Finish queued registrations (their completions drop the store's shields), then stop the worker."""
        self._worker.close()
