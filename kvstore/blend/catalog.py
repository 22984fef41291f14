"""The store's content side: fingerprint index, async registration, two-strike eviction and dedup aliases.

``TieredStore`` owns one ``ContentCatalog`` when blending is enabled and talks to it at three points:

- **store**: ``dedup_targets`` (before writing: which new chunks' content is already stored under another key),
  then ``register`` (after the commit: queue the committed runs for the worker; the shields the store took on
  them are dropped when the worker is done);
- **lookup**: ``sync`` (see every registration submitted before the lookup), ``match`` (the match leg, with the
  strike rules applied to what the tiers report) and ``resolve_alias`` (the prefix leg's dedup aliases);
- **open**: ``rebuild`` (one object per chunk) or ``rebuild_batches`` (batches of records, no object per chunk)
  from the disk tier's chunk records, so a restart keeps the content index: sequences are relinked through their
  parent keys (``relink``) and registered in one call.

The catalog never touches a tier: the store passes what it needs as callables (``Residency``), keeping data
flowing one way (store -> catalog, store -> tiers).

Threads: safe to share; each part guards itself (index, worker, strike book, alias table).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvstore.blend.aliases import AliasTable, AliasTarget
from kvstore.blend.index import ChunkContents, FingerprintIndex, Match, RegistrationResult
from kvstore.blend.registration import RegistrationJob, RegistrationStats, RegistrationWorker
from kvstore.blend.relink import sequence_runs_of_words
from kvstore.blend.strikes import StrikeBook, Verdict
from kvstore.errors import InvalidInputError
from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray

__all__ = ["CatalogStats", "ContentCatalog", "Residency", "SequenceBatch", "SequenceChunk"]

logger = logging.getLogger(__name__)

_Pinned = TypeVar("_Pinned")
# Chunks the rebuild holds at once while it hashes them. Few enough to die young: batches of 8192 reached the oldest
# generation of the garbage collector and cost full collections over the whole heap (1M chunks: seconds).
_REBUILD_BATCH_CHUNKS = 256
_MAX_POSITION = 2**32 - 1  # the index keeps source starts as u32
_NO_KEY = bytes(KEY_BYTES)  # a parent key of zeros means "none known", as on disk


@dataclass(frozen=True, slots=True, kw_only=True)
class Residency:
    """What the catalog may ask the store about a chunk.

    Args:
        is_resident: some tier holds the chunk.
        in_transit: a tier is moving the chunk to make room (a capacity miss, never a strike).
    """

    is_resident: Callable[[PrefixKey], bool]
    in_transit: Callable[[PrefixKey], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceChunk:
    """One chunk of a stored sequence as the disk records it (for ``rebuild``)."""

    key: PrefixKey
    parent_key: PrefixKey | None
    source_start: int
    tokens: TokenArray


class SequenceBatch(Protocol):
    """Many chunks of stored sequences as the disk records them (for ``rebuild_batches``), without an object per
    chunk: chunk ``i`` has key ``keys[i]``, also as two little-endian u64 words ``key_words[i]``, parent key
    ``parent_words[i]`` in the same form (``[0, 0]``: none known), source start ``source_starts[i]`` and tokens
    ``tokens[token_starts[i]:token_ends[i]]`` (spans may skip data between them, e.g. record headers).

    The disk tier's ``ContentRecords`` is one (the catalog never imports a tier; the shape is the contract).
    """

    @property
    def keys(self) -> Sequence[PrefixKey]: ...

    @property
    def key_words(self) -> npt.NDArray[np.uint64]: ...

    @property
    def parent_words(self) -> npt.NDArray[np.uint64]: ...

    @property
    def source_starts(self) -> npt.NDArray[np.uint64]: ...

    @property
    def tokens(self) -> TokenArray: ...

    @property
    def token_starts(self) -> npt.NDArray[np.int64]: ...

    @property
    def token_ends(self) -> npt.NDArray[np.int64]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class _ChunkBatch:
    """A ``SequenceBatch`` built from ``SequenceChunk`` objects (``rebuild``)."""

    keys: Sequence[PrefixKey]
    key_words: npt.NDArray[np.uint64]
    parent_words: npt.NDArray[np.uint64]
    source_starts: npt.NDArray[np.uint64]
    tokens: TokenArray
    token_starts: npt.NDArray[np.int64]
    token_ends: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogStats:
    num_entries: int
    index_bytes: int
    num_aliases: int
    num_strikes: int
    num_struck_out: int
    registration: RegistrationStats


class ContentCatalog:
    """Content fingerprints of the store's chunks and the rules that keep them honest.

    Args:
        chunk_size: tokens per chunk.
        residency: the store's view of where chunks are.
        dedup_content: record chunks whose content is already stored as aliases instead of writing them.
    """

    def __init__(self, chunk_size: int, residency: Residency, *, dedup_content: bool = False) -> None:
        self.chunk_size = chunk_size
        self.dedup_content = dedup_content
        self._residency = residency
        self.index = FingerprintIndex()
        self._strikes = StrikeBook()
        self._aliases = AliasTable()
        self._worker = RegistrationWorker(self.index, chunk_size)

    # -- store path -------------------------------------------------------------------------------------------

    def dedup_targets(self, tokens: TokenArray) -> list[Match | None]:
        """For each chunk of a sequence, a resident stored copy of its content under any key, when dedup is on."""
        if not self.dedup_content:
            return []
        self.sync()  # content stored just before must be seen, or it is written twice
        hits = self.index.find_contents(tokens, self.chunk_size)
        return [hit if hit is not None and self._residency.is_resident(hit.key) else None for hit in hits]

    def add_alias(self, alias: PrefixKey, target: Match) -> None:
        self._aliases.add(
            alias, AliasTarget(key=target.key, source_start=target.source_start, num_tokens=target.num_tokens)
        )

    def is_alias(self, key: PrefixKey) -> bool:
        return self._aliases.get(key) is not None

    def register(
        self, tokens: TokenArray, keys: Sequence[PrefixKey], source_start: int, on_done: Callable[[], None]
    ) -> None:
        """Queue a run of committed chunks; ``on_done`` runs on the worker after it (drop the store's shields)."""
        for key in keys:
            self._strikes.clear(key)

        def finish(result: RegistrationResult | None) -> None:
            try:
                if result is not None and result.aliases:
                    self._replace_stale_copies(tokens, keys, source_start, result)
            finally:
                on_done()

        self._worker.submit(RegistrationJob(tokens=tokens, keys=keys, source_start=source_start, on_done=finish))

    def _replace_stale_copies(
        self, tokens: TokenArray, keys: Sequence[PrefixKey], source_start: int, result: RegistrationResult
    ) -> None:
        """Content indexed under a key whose chunk is gone: index the fresh copy instead (worker thread)."""
        stale = [alias.existing_key for alias in result.aliases if not self._residency.is_resident(alias.existing_key)]
        if stale:
            self.index.remove(stale)
            self.index.register(tokens, keys, self.chunk_size, source_start)

    # -- lookup path ------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every registration submitted so far has run (a lookup sees what was stored before it)."""
        self._worker.wait_submitted()

    def match(
        self, tokens: TokenArray, *, skip: Callable[[Match], bool], pin: Callable[[PrefixKey], _Pinned | None]
    ) -> list[tuple[Match, _Pinned]]:
        """The match leg: content matches in ``tokens`` that ``pin`` could pin, strikes applied to the rest.

        Args:
            tokens: the prompt.
            skip: matches the store does not want (e.g. overlapping an exact segment); neither pinned nor judged.
            pin: the store's "pin this chunk for the plan"; returns where it pinned it, or ``None``.

        Returns:
            Each kept match with what ``pin`` returned for it.
        """
        kept: list[tuple[Match, _Pinned]] = []
        gone: list[PrefixKey] = []
        for found in self.index.match(tokens, self.chunk_size):
            if skip(found):
                continue
            pinned = pin(found.key)
            if pinned is not None:
                self._strikes.clear(found.key)
                kept.append((found, pinned))
            elif self._judge_missing(found.key) is Verdict.REMOVE:
                gone.append(found.key)
        if gone:
            self.index.remove(gone)
            logger.debug("removed %d index entries after their second strike", len(gone))
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

    def strikes(self, key: PrefixKey) -> int:
        return self._strikes.strikes(key)

    # -- open / close -----------------------------------------------------------------------------------------

    def rebuild(self, chunks: Iterable[SequenceChunk]) -> int:
        """Index chunks recorded on disk, relinking each stored sequence through its parent keys.

        The same as ``rebuild_batches``, from one object per chunk (a few hundred are held at a time).

        Returns:
            Chunks indexed.
        """
        iterator = iter(chunks)
        return self.rebuild_batches(
            _as_batch(batch) for batch in iter(lambda: list(itertools.islice(iterator, _REBUILD_BATCH_CHUNKS)), [])
        )

    def rebuild_batches(self, batches: Iterable[SequenceBatch]) -> int:
        """Index chunks recorded on disk, a batch at a time, relinking each stored sequence through its parent keys.

        One pass keeps each chunk's key, parent key and position and hashes its tokens (which are then dropped);
        then every sequence is registered in one call (``FingerprintIndex.register_runs``), its chunks in order
        (``relink.sequence_runs_of_words``): a chunk with no known parent (chunk 0, a parent evicted, a meta v1 record)
        starts a run, so every chunk is indexed; only a next link may be lost. Chunks of no tokens, more than
        ``chunk_size`` tokens or a source start past 2**32 are skipped and counted in a warning.

        Returns:
            Chunks indexed.
        """
        keys: list[PrefixKey] = []
        key_words: list[npt.NDArray[np.uint64]] = []
        parent_words: list[npt.NDArray[np.uint64]] = []
        source_starts: list[npt.NDArray[np.uint64]] = []
        contents: list[ChunkContents] = []
        num_skipped = 0
        for batch in batches:
            lengths = batch.token_ends - batch.token_starts
            starts = batch.source_starts.astype(np.uint64)
            in_range = starts <= np.uint64(_MAX_POSITION)  # then the int64 view below cannot wrap
            ends = np.where(in_range, starts, 0).astype(np.int64) + lengths
            usable = in_range & (lengths >= 1) & (lengths <= self.chunk_size) & (ends <= _MAX_POSITION)
            if bool(usable.all()):
                keys += batch.keys
            else:
                num_skipped += int((~usable).sum())
                keys += [key for key, use in zip(batch.keys, usable.tolist(), strict=True) if use]
            if bool(usable.any()):
                key_words.append(batch.key_words[usable])
                parent_words.append(batch.parent_words[usable])
                source_starts.append(starts[usable])
                contents.append(
                    self.index.chunk_contents(batch.tokens, batch.token_starts[usable], batch.token_ends[usable])
                )
        if num_skipped:
            logger.warning("rebuild: skipped %d chunks of no tokens, over chunk_size=%d tokens or past position 2**32",
                           num_skipped, self.chunk_size)  # fmt: skip
        if not keys:
            return 0
        hashed = ChunkContents.concatenate(contents, self.index.fingerprint_bits)
        runs = sequence_runs_of_words(
            np.concatenate(key_words), np.concatenate(parent_words), hashed.lengths == self.chunk_size
        )
        self.index.register_runs(
            hashed.take(runs.order),
            list(map(keys.__getitem__, runs.order.tolist())),
            np.concatenate(source_starts)[runs.order].astype(np.int64),
            runs.run_offsets,
            self.chunk_size,
        )
        return int(runs.order.shape[0])

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


def _as_batch(chunks: Sequence[SequenceChunk]) -> _ChunkBatch:
    """Chunks as one batch (their tokens concatenated).

    Raises:
        InvalidInputError: a key or parent key that is not 16 bytes.
    """
    ends = np.cumsum([chunk.tokens.shape[0] for chunk in chunks], dtype=np.int64)
    return _ChunkBatch(
        keys=[chunk.key for chunk in chunks],
        key_words=_words([chunk.key for chunk in chunks]),
        parent_words=_words([chunk.parent_key or _NO_KEY for chunk in chunks]),
        source_starts=np.array([chunk.source_start for chunk in chunks], dtype=np.uint64),
        tokens=np.concatenate([chunk.tokens for chunk in chunks]),
        token_starts=np.concatenate([[0], ends[:-1]]).astype(np.int64),
        token_ends=ends,
    )


def _words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Keys as rows of two little-endian u64 words."""
    if any(len(key) != KEY_BYTES for key in keys):
        raise InvalidInputError(f"every key and parent key must be {KEY_BYTES} bytes (kvstore.keys.PrefixKey)")
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
