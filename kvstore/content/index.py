"""Content fingerprint index: finds stored chunks by their tokens at any offset of a new prompt.

A stored sequence is registered chunk by chunk (chunked from position 0; the last chunk may be partial). Each
chunk becomes one entry: its fingerprint (``kvstore.content.rolling_hash``), an independent xxh3_64 of its token
bytes (the verification hash), its prefix key, its source start, its length and links to the entries of the
sequence's next and previous chunks. ``match`` rolls the fingerprint over every window of the query inside numba,
plans the leftmost-first matches, follows ``next`` links so a document is covered to its end (including its partial last
chunk, which a fixed-size window never finds), then proves every planned chunk with the verification hash::

    query:  | system | doc A c0 | c1 | ... | c10 | A last | sep | doc B c0 | ... | question |
              window hit ^ ------- next links -------------^      ^ window hit

Invariants:

* Never loses an entry: buckets are chains over numpy arrays (``kvstore.content.fingerprint_table``), so entries
  sharing a fingerprint bucket coexist; the table grows (ids stay stable) and removed ids are reused.
* Zero false positives: a chunk is returned only if the query tokens' xxh3_64 equals the entry's. A 64-bit
  fingerprint collision (or any planned chunk failing verification) sends ``match`` down its exact path, which
  verifies candidates one by one: it costs time, never a wrong or missed match.
* One entry per key, and dedup-content: at most one entry per content (fingerprint, verification, length); the
  first writer wins and later keys with that content are reported as aliases in ``RegistrationResult``, not
  indexed. A next link belongs to the first writer's sequence: an alias's own continuation is found by its
  windows, but its partial last chunk only if the first writer's sequence continues the same way.
* Tokens are never kept: 54 bytes per entry row (rows grow by 1/16), plus fingerprint heads, key heads and presence bits
  (bytes per chunk measured: docs/design-notes.md#content-index).

Partial matches (``partial_matches``, ``kvstore.content.partials``): around the query's planned ranges, the stretch of
a neighbouring stored chunk (``next``: a TAIL, ``prev``: a HEAD) the query holds token for token, compared against
the chunk's tokens its caller reads where the chunk is stored (the index keeps none).

Bulk registration: ``chunk_contents`` hashes many chunks wherever they lie and ``register_runs`` registers many
sequences in one numba call, exactly as one ``register`` per sequence would (the content-index rebuild at open).

The chunk hashes live in ``kvstore.content.chunk_contents`` and the values the index answers with in
``kvstore.content.matches``; both are re-exported here, where callers import them.

Threads: ``FingerprintIndex`` is safe to share; ``_index_lock`` guards every array and counter (mutations and
``match`` alike, since growth replaces the arrays). The numba kernels release the GIL but run under the lock.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.content import fingerprint_table as table
from kvstore.content.chunk_contents import (
    DEFAULT_FINGERPRINT_BITS,
    ChunkContents,
    check_chunk_size,
    hash_chunks,
    sequence_chunk_ends,
)
from kvstore.content.match_scan import scan_and_plan
from kvstore.content.matches import (
    Alias,
    Match,
    MatchCoverage,
    RegistrationResult,
    leftmost_without_overlap,
    match_at,
)
from kvstore.content.partials import (
    MIN_PARTIAL_TOKENS,
    Anchor,
    Neighbour,
    PartialMatch,
    StoredTokens,
    plan_partials,
)
from kvstore.content.rolling_hash import window_base_power
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray, as_token_array, chained_key, key_words

__all__ = [
    "DEFAULT_FINGERPRINT_BITS",
    "MIN_PARTIAL_TOKENS",
    "Alias",
    "Anchor",
    "ChunkContents",
    "FingerprintIndex",
    "Match",
    "Neighbour",
    "PartialMatch",
    "RegistrationResult",
    "StoredTokens",
    "hash_chunks",
]

logger = logging.getLogger(__name__)

_MAX_ENTRIES = 2**31 - 1  # entry ids are int32
_MAX_POSITION = 2**32 - 1  # source_start is a u32 column
_ENTRY_GROWTH_RATIO = 0.0625  # grow rows by 1/16: bounds the slack that counts against bytes per chunk
_FINGERPRINT_LOAD = 2  # entries per fingerprint bucket before the heads double
_KEY_LOAD = 4  # entries per key bucket before the heads double
_PRESENCE_BITS_PER_BUCKET = 32


class FingerprintIndex:
    """Index of stored chunks by content, probed at every token offset of a query.

    Args:
        initial_capacity: entries to allocate up front; the table grows past it by 1/16 at a time.
        fingerprint_bits: bits of the fingerprint kept (64 in production). Tests lower it to force collisions.
    """

    def __init__(self, *, initial_capacity: int = 1024, fingerprint_bits: int = DEFAULT_FINGERPRINT_BITS) -> None:
        if not 1 <= fingerprint_bits <= 64:
            raise ConfigError(f"fingerprint_bits={fingerprint_bits} must lie in [1, 64]; use 64 outside tests")
        if not 1 <= initial_capacity <= _MAX_ENTRIES:
            raise ConfigError(f"initial_capacity={initial_capacity} must lie in [1, 2**31), e.g. 1024")
        self._index_lock = threading.Lock()
        self.fingerprint_bits = fingerprint_bits
        self._fingerprint_mask = np.uint64((1 << fingerprint_bits) - 1)
        self._state = np.array([-1, 0, 0], dtype=np.int64)  # free_head, high_water, num_live
        self._fingerprint = np.zeros(initial_capacity, dtype=np.uint64)
        self._verification = np.zeros(initial_capacity, dtype=np.uint64)
        self._key_low = np.zeros(initial_capacity, dtype=np.uint64)
        self._key_high = np.zeros(initial_capacity, dtype=np.uint64)
        self._source_start = np.zeros(initial_capacity, dtype=np.uint32)
        self._length = np.zeros(initial_capacity, dtype=np.uint16)
        self._next = np.full(initial_capacity, -1, dtype=np.int32)
        self._prev = np.full(initial_capacity, -1, dtype=np.int32)
        self._fingerprint_link = np.full(initial_capacity, -1, dtype=np.int32)
        self._key_link = np.full(initial_capacity, -1, dtype=np.int32)
        self._resize_heads(fingerprint_log2=4, key_log2=4)

    # --- public API -------------------------------------------------------------------------------------------

    def register(
        self,
        tokens: TokenArray,
        keys: Sequence[PrefixKey],
        chunk_size: int,
        source_start: int = 0,
        *,
        chunk_ends: Sequence[int] | None = None,
    ) -> RegistrationResult:
        """Index every chunk of a stored sequence.

        Args:
            tokens: the sequence's token ids, chunked from position 0 by ``chunk_size`` (last chunk may be partial).
            keys: the prefix key of each chunk, one per chunk.
            chunk_size: tokens per chunk, in [1, 65535].
            source_start: token position of ``tokens[0]`` in the stored sequence (added to each entry's start).
            chunk_ends: where each chunk ends in ``tokens`` when the store cuts them at a separator as well
                (``kvstore.keys.chunk_bounds`` without its leading 0); ``None``: every ``chunk_size`` tokens.

        Returns:
            How many chunks were added, already indexed, or aliases of content indexed under another key.

        Raises:
            InvalidInputError: bad token ids, a key count that does not match the chunks, or a key not 16 bytes.
            ConfigError: ``chunk_size`` or ``source_start`` out of range.
        """
        tokens = as_token_array(tokens)
        check_chunk_size(chunk_size)
        ends = sequence_chunk_ends(tokens.shape[0], chunk_size, chunk_ends)
        count = ends.shape[0]
        if len(keys) != count:
            raise InvalidInputError(
                f"got {len(keys)} keys for {tokens.shape[0]} tokens in chunks of {chunk_size}; expected {count}, "
                "one per chunk (kvstore.keys.prefix_keys)"
            )
        if source_start < 0 or source_start + tokens.shape[0] > _MAX_POSITION:
            raise ConfigError(f"source_start={source_start} must lie in [0, 2**32 - len(tokens))")
        if count == 0:
            return RegistrationResult(num_added=0, num_already_indexed=0, aliases=())
        key_bytes = b"".join(keys)
        if len(key_bytes) != KEY_BYTES * count or any(len(key) != KEY_BYTES for key in keys):
            raise InvalidInputError(f"every prefix key must be {KEY_BYTES} bytes (kvstore.keys.PrefixKey)")
        key_halves = np.frombuffer(key_bytes, dtype="<u8").reshape(count, 2)
        fingerprints, verifications, lengths = self._chunk_contents(tokens, ends)
        source_starts = (source_start + ends - lengths.astype(np.int64)).astype(np.uint32)
        entries = np.empty(count, dtype=np.int32)
        is_new = np.empty(count, dtype=np.bool_)
        with self._index_lock:
            self._reserve(int(self._state[2]) + count)
            table.insert_chunks(
                fingerprints, verifications, lengths, key_halves[:, 0].copy(), key_halves[:, 1].copy(),
                source_starts, self._fingerprint, self._verification, self._key_low, self._key_high,
                self._source_start, self._length, self._next, self._prev, self._fingerprint_link, self._key_link,
                self._fingerprint_heads, self._fingerprint_shift, self._key_heads, self._key_shift,
                self._presence_bits, self._presence_shift, self._state, entries, is_new,
            )  # fmt: skip
            return self._registration_result(keys, entries, is_new)

    def chunk_contents(
        self, tokens: TokenArray, chunk_starts: npt.NDArray[np.int64], chunk_ends: npt.NDArray[np.int64]
    ) -> ChunkContents:
        """``hash_chunks`` with this index's fingerprint bits: what ``register_runs`` of this index accepts."""
        return hash_chunks(tokens, chunk_starts, chunk_ends, self.fingerprint_bits)

    def register_runs(
        self,
        contents: ChunkContents,
        keys: Sequence[PrefixKey],
        source_starts: npt.NDArray[np.int64],
        run_offsets: npt.NDArray[np.int64],
        chunk_size: int,
    ) -> RegistrationResult:
        """Index many stored sequences at once: the same as one ``register`` per run, in order, in one call.

        Rebuilding the index of a reopened data dir registers every stored sequence this way.

        Args:
            contents: every chunk's hashes (``chunk_contents``), runs one after the other.
            keys: every chunk's prefix key, in the same order.
            source_starts: every chunk's token position in its stored sequence.
            run_offsets: ``num_runs + 1`` increasing chunk offsets, from 0 to ``len(contents)``; a run is one
                sequence's consecutive chunks (next links join them), each of at most ``chunk_size`` tokens (a short
                one ends the sequence or a separator's run).
            chunk_size: tokens per chunk, in [1, 65535].

        Raises:
            InvalidInputError: arrays of different lengths, run offsets that do not cut the chunks into runs, a
                chunk longer than ``chunk_size``, or a key not 16 bytes.
            ConfigError: ``chunk_size`` or a source start out of range, or contents of another ``fingerprint_bits``.
        """
        check_chunk_size(chunk_size)
        if contents.fingerprint_bits != self.fingerprint_bits:
            raise ConfigError(
                f"contents hashed with fingerprint_bits={contents.fingerprint_bits} cannot be registered in an "
                f"index of {self.fingerprint_bits}; hash them with this index's chunk_contents"
            )
        count = len(contents)
        runs = np.asarray(run_offsets, dtype=np.int64)
        starts = np.asarray(source_starts, dtype=np.int64)
        lengths = contents.lengths.astype(np.int64)
        if len(keys) != count or starts.shape != (count,) or runs.ndim != 1 or runs.shape[0] == 0:
            raise InvalidInputError(
                f"got {len(keys)} keys and {starts.shape[0]} source starts for {count} chunks; give one of each "
                "per chunk, and run_offsets from 0 to the chunk count"
            )
        if runs[0] != 0 or runs[-1] != count or (runs.shape[0] > 1 and int(np.diff(runs).min()) < 1):
            raise InvalidInputError(f"run_offsets must rise from 0 to {count} chunks, each run one chunk or more")
        if count and int(lengths.max()) > chunk_size:
            raise InvalidInputError(f"a chunk has {int(lengths.max())} tokens, over chunk_size={chunk_size}")
        if count and (int(starts.min()) < 0 or int((starts + lengths).max()) > _MAX_POSITION):
            raise ConfigError("every source start must lie in [0, 2**32 - its chunk's tokens)")
        if count and set(map(len, keys)) != {KEY_BYTES}:
            raise InvalidInputError(f"every prefix key must be {KEY_BYTES} bytes (kvstore.keys.PrefixKey)")
        key_halves = key_words(keys)
        entries = np.empty(count, dtype=np.int32)
        is_new = np.empty(count, dtype=np.bool_)
        with self._index_lock:
            self._reserve(int(self._state[2]) + count)
            table.insert_runs(
                runs, contents.fingerprints, contents.verifications, contents.lengths, key_halves[:, 0].copy(),
                key_halves[:, 1].copy(), starts.astype(np.uint32), self._fingerprint, self._verification,
                self._key_low, self._key_high, self._source_start, self._length, self._next, self._prev,
                self._fingerprint_link, self._key_link, self._fingerprint_heads, self._fingerprint_shift,
                self._key_heads, self._key_shift, self._presence_bits, self._presence_shift, self._state,
                entries, is_new,
            )  # fmt: skip
            return self._registration_result(keys, entries, is_new)

    def _registration_result(
        self, keys: Sequence[PrefixKey], entries: npt.NDArray[np.int32], is_new: npt.NDArray[np.bool_]
    ) -> RegistrationResult:
        """Sort the chunks that found an entry already there into re-registrations and aliases (lock held)."""
        aliases: list[Alias] = []
        num_already_indexed = 0
        for chunk in np.flatnonzero(~is_new).tolist():
            existing_key = self._key_of(int(entries[chunk]))
            if existing_key == keys[chunk]:
                num_already_indexed += 1
            else:
                aliases.append(Alias(key=keys[chunk], existing_key=existing_key))
        return RegistrationResult(
            num_added=int(is_new.sum()), num_already_indexed=num_already_indexed, aliases=tuple(aliases)
        )

    def find_contents(
        self, tokens: TokenArray, chunk_size: int, *, chunk_ends: Sequence[int] | None = None
    ) -> list[Match | None]:
        """For each chunk of ``tokens`` (chunked from position 0, or ending at ``chunk_ends`` as in ``register``),
        the indexed chunk with the same content, if any.

        The store asks this before writing a chunk when dedup-content is on: equal content under another key is
        recorded as an alias instead of a second payload. The lookup asks it for the first chunk of every
        separator's run, which a window of ``chunk_size`` tokens misses when the run is shorter.

        Returns:
            One item per chunk: a ``Match`` whose ``query_start`` is the chunk's position in ``tokens`` and whose
            ``key``/``source_start`` are the indexed copy's, or ``None``.
        """
        tokens = as_token_array(tokens)
        check_chunk_size(chunk_size)
        if tokens.shape[0] == 0:
            return []
        ends = sequence_chunk_ends(tokens.shape[0], chunk_size, chunk_ends)
        fingerprints, verifications, lengths = self._chunk_contents(tokens, ends)
        entries = np.empty(fingerprints.shape[0], dtype=np.int32)
        with self._index_lock:
            table.find_contents(
                fingerprints, verifications, lengths, self._fingerprint, self._verification, self._length,
                self._fingerprint_link, self._fingerprint_heads, self._fingerprint_shift, entries,
            )  # fmt: skip
            found = entries[entries >= 0]
            key_bytes = self._keys_bytes(found)
            source_starts = self._source_start[found].tolist()
        hits: list[Match | None] = []
        position = 0
        for chunk, entry in enumerate(entries.tolist()):
            if entry < 0:
                hits.append(None)
                continue
            chunk_start = int(ends[chunk]) - int(lengths[chunk])
            hits.append(match_at(key_bytes, position, chunk_start, int(lengths[chunk]), source_starts[position]))
            position += 1
        return hits

    def _chunk_contents(
        self, tokens: TokenArray, ends: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint16]]:
        """Fingerprint, verification hash and length of each chunk of ``tokens`` ending at ``ends``."""
        contents = hash_chunks(tokens, np.concatenate(([0], ends[:-1])), ends, self.fingerprint_bits)
        return contents.fingerprints, contents.verifications, contents.lengths

    def match(
        self, query: TokenArray, chunk_size: int, *, grid_bounds: Sequence[int] = (), scan_windows: bool = True
    ) -> list[Match]:
        """Find stored chunks in ``query``: verified, non-overlapping, leftmost first, sorted by query start.

        Every window of ``chunk_size`` tokens is probed (``scan_windows``); after a verified hit the entry's ``next``
        link is followed, so the rest of the document, partial last chunk included, is matched where it continues.

        Args:
            query: token ids of the new prompt.
            chunk_size: window length in tokens; only entries of exactly this length start a window's match.
            grid_bounds: the query's own chunk bounds as the store cuts it (``kvstore.keys.chunk_bounds``), when its
                chunks may be shorter than ``chunk_size`` or off the window's reach: every chunk of it that no match
                covers is looked up by its exact content too, and its chain followed like a window's. With a
                separator this finds a stored run shorter than ``chunk_size`` (a short document) and a run's partial
                last chunk after a chain that stopped before it; under content-defined chunking every stored chunk
                past a document's first few tokens is a chunk of the query's own cut.
            scan_windows: probe every window of ``chunk_size`` tokens; off under content-defined chunking, where
                the grid finds what the windows would (the cut follows the tokens) at a fraction of the cost.

        Returns:
            Matches in increasing ``query_start``; no two overlap.
        """
        query = as_token_array(query)
        check_chunk_size(chunk_size)
        matches = self._match_windows(query, chunk_size) if scan_windows else []
        if len(grid_bounds) > 1:
            matches = self._add_grid_matches(query, grid_bounds, matches)
        return matches

    def _match_windows(self, query: TokenArray, chunk_size: int) -> list[Match]:
        """``match`` by windows of ``chunk_size`` tokens and the chains they start."""
        data = memoryview(query.data).cast("B")
        digest = xxhash.xxh3_64_intdigest
        matches: list[Match] = []
        with self._index_lock:
            planned_starts, planned_entries = scan_and_plan(
                query, chunk_size, window_base_power(chunk_size), self._fingerprint_mask,
                self._fingerprint, self._length, self._fingerprint_link, self._next,
                self._fingerprint_heads, self._fingerprint_shift, self._presence_bits, self._presence_shift,
            )  # fmt: skip
            lengths = self._length[planned_entries].tolist()
            verifications = self._verification[planned_entries].tolist()
            source_starts = self._source_start[planned_entries].tolist()
            key_bytes = self._keys_bytes(planned_entries)
            planned = zip(planned_starts.tolist(), lengths, verifications, source_starts, strict=True)
            for position, (start, length, verification, source_start) in enumerate(planned):
                if digest(data[4 * start : 4 * (start + length)]) != verification:
                    logger.debug("fingerprint collision at query token %d; matching exactly", start)
                    starts, entries = table.probe_windows(
                        query, chunk_size, window_base_power(chunk_size), self._fingerprint_mask,
                        self._fingerprint, self._length, self._fingerprint_link,
                        self._fingerprint_heads, self._fingerprint_shift, self._presence_bits, self._presence_shift,
                    )  # fmt: skip
                    return self._match_exactly(starts, entries, data, chunk_size)
                key = PrefixKey(key_bytes[KEY_BYTES * position : KEY_BYTES * (position + 1)])
                matches.append(Match(start, length, key, source_start))  # positional: the hot loop
        return matches

    def _add_grid_matches(self, query: TokenArray, grid_bounds: Sequence[int], matches: list[Match]) -> list[Match]:
        """``matches`` and the chains found at the uncovered chunks of the query's own cut, merged leftmost first
        without overlap.

        Every chunk the query's chunking (``kvstore.keys.chunk_bounds``) makes and no match covers the start of is
        looked up by its exact content: a run's first chunk (a document after other text), a run's last, partial
        chunk where the chain that reached it ended, and every content-defined chunk. Chains end at dedup aliases: a
        document whose chunks repeat an earlier document's content (the next link belongs to the first writer) would
        otherwise lose its last chunk. A probe inside a chain an earlier probe found is not followed again: each
        chain is walked once, so a prompt of n cached chunks costs O(n), not O(n^2).
        """
        num_tokens = query.shape[0]
        if grid_bounds[-1] != num_tokens or any(end <= start for start, end in itertools.pairwise(grid_bounds)):
            raise InvalidInputError(f"grid_bounds must rise from 0 to len(query)={num_tokens} (chunk_bounds)")
        covered = MatchCoverage(matches)
        probes = [(start, end) for start, end in itertools.pairwise(grid_bounds) if not covered.holds(start)]
        if not probes:
            return matches
        starts = np.array([start for start, _ in probes], dtype=np.int64)
        contents = hash_chunks(
            query, starts, np.array([end for _, end in probes], dtype=np.int64), self.fingerprint_bits
        )
        entries = np.empty(len(probes), dtype=np.int32)
        data = memoryview(query.data).cast("B")
        digest = xxhash.xxh3_64_intdigest
        found: list[Match] = []
        with self._index_lock:
            table.find_contents(
                contents.fingerprints, contents.verifications, contents.lengths, self._fingerprint,
                self._verification, self._length, self._fingerprint_link, self._fingerprint_heads,
                self._fingerprint_shift, entries,
            )  # fmt: skip
            reached = 0  # where the chains found so far end: a probe before it would only repeat one of them
            for start, entry in zip(starts.tolist(), entries.tolist(), strict=True):
                if start < reached:
                    continue
                verified = True  # the run's first chunk: found by its content
                while entry >= 0:
                    length = int(self._length[entry])
                    if start + length > num_tokens:
                        break
                    span = data[4 * start : 4 * (start + length)]
                    if not verified and digest(span) != int(self._verification[entry]):
                        break
                    found.append(Match(start, length, self._key_of(entry), int(self._source_start[entry])))
                    start += length
                    entry = int(self._next[entry])
                    verified = False
                reached = max(reached, start)
        return leftmost_without_overlap([*matches, *found])

    def _match_exactly(
        self, starts: npt.NDArray[np.int64], entries: npt.NDArray[np.int32], data: memoryview, chunk_size: int
    ) -> list[Match]:
        """``match``'s slow path (lock held): verify candidates one by one, leftmost first, then follow links.

        Taken when a planned chunk fails verification, i.e. after a fingerprint collision.
        """
        digest = xxhash.xxh3_64_intdigest
        offsets, chain = table.follow_chains(starts, entries, len(data) // 4, self._next, self._length)
        lengths = self._length[chain].tolist()
        verifications = self._verification[chain].tolist()
        source_starts = self._source_start[chain].tolist()
        key_bytes = self._keys_bytes(chain)
        chain_bounds = offsets.tolist()
        matches: list[Match] = []
        cursor = 0
        verified_start, verified_hash = -1, 0
        for candidate, candidate_start in enumerate(starts.tolist()):
            if candidate_start < cursor:
                continue
            first = chain_bounds[candidate]
            if candidate_start != verified_start:
                verified_start = candidate_start
                verified_hash = digest(data[4 * candidate_start : 4 * (candidate_start + chunk_size)])
            if verified_hash != verifications[first]:
                continue
            start = candidate_start
            for position in range(first, chain_bounds[candidate + 1]):
                length = lengths[position]
                # Each later chunk must match the query by its own verification hash.
                if position != first and digest(data[4 * start : 4 * (start + length)]) != verifications[position]:
                    break
                matches.append(match_at(key_bytes, position, start, length, source_starts[position]))
                start += length
            cursor = start
        return matches

    def neighbours(self, keys: Sequence[PrefixKey]) -> list[tuple[Neighbour | None, Neighbour | None]]:
        """Each key's stored predecessor and successor (the ``prev`` and ``next`` links of its entry: the chunks
        around it in the first sequence registered with it), ``None`` where there is none or the key is not
        indexed."""
        found: list[tuple[Neighbour | None, Neighbour | None]] = []
        with self._index_lock:
            for key in keys:
                if len(key) != KEY_BYTES:
                    found.append((None, None))
                    continue
                low, high = np.frombuffer(key, dtype="<u8")
                entry = self._find(low, high)
                if entry < 0:
                    found.append((None, None))
                    continue
                found.append((self._neighbour(int(self._prev[entry])), self._neighbour(int(self._next[entry]))))
        return found

    def _neighbour(self, entry: int) -> Neighbour | None:
        if entry < 0:
            return None
        return Neighbour(self._key_of(entry), int(self._source_start[entry]), int(self._length[entry]))

    def partial_matches(
        self,
        query: TokenArray,
        anchors: Sequence[Anchor],
        stored_tokens: StoredTokens,
        *,
        min_tokens: int = MIN_PARTIAL_TOKENS,
    ) -> list[PartialMatch]:
        """The stretches of stored chunks next to ``anchors`` that the query holds token for token
        (``kvstore.content.partials``): each anchor's stored successor's common prefix with what follows it (a TAIL),
        its stored predecessor's common suffix with what precedes it (a HEAD), never over an anchor or each other.

        Args:
            query: the prompt's token ids.
            anchors: the query's planned ranges (matches and exact segments), sorted and disjoint; an anchor whose
                key is not indexed has no neighbours.
            stored_tokens: the tokens of a stored chunk (the index keeps none): the caller reads them where the chunk
                is stored; ``None`` leaves the chunk out.
            min_tokens: the shortest stretch returned (``MIN_PARTIAL_TOKENS``).

        Returns:
            The stretches, sorted by query start.
        """
        query = as_token_array(query)
        if min_tokens < 1:
            raise ConfigError(f"min_tokens={min_tokens} must be >= 1 (default {MIN_PARTIAL_TOKENS})")
        if not anchors:
            return []
        # each neighbour look takes the lock on its own: it is not held while the caller reads tokens
        return plan_partials(
            query, anchors, lambda key: self.neighbours([key])[0], stored_tokens, min_tokens=min_tokens
        )

    def remove(self, keys: Iterable[PrefixKey]) -> int:
        """Drop the entries of these keys and clear the ``next`` links that pointed at them.

        Costs one pass over the table per call (to clear links), so remove evicted keys in batches.

        Args:
            keys: prefix keys; keys not indexed (never registered, aliases, already removed) are ignored.

        Returns:
            How many entries were removed.
        """
        key_bytes = b"".join(key for key in keys if len(key) == KEY_BYTES)
        if not key_bytes:
            return 0
        halves = np.frombuffer(key_bytes, dtype="<u8").reshape(-1, 2)
        with self._index_lock:
            num_removed = int(
                table.remove_keys(
                    halves[:, 0].copy(), halves[:, 1].copy(), self._fingerprint, self._key_low, self._key_high,
                    self._length, self._next, self._prev, self._fingerprint_link, self._key_link,
                    self._fingerprint_heads, self._fingerprint_shift, self._key_heads, self._key_shift, self._state,
                )
            )  # fmt: skip
            self._stale_presence += num_removed
            if self._stale_presence > max(1024, int(self._state[2])):
                self._resize_heads(self._fingerprint_log2, self._key_log2)
        return num_removed

    def __len__(self) -> int:
        return int(self._state[2])

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return False
        low, high = np.frombuffer(key, dtype="<u8")
        with self._index_lock:
            return bool(self._find(low, high) >= 0)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays (rows, heads and presence bits); tokens are never stored."""
        with self._index_lock:
            return sum(array.nbytes for array in self._arrays()) + self._state.nbytes

    # --- internals (lock held) --------------------------------------------------------------------------------

    def _keys_bytes(self, entries: npt.NDArray[np.int32]) -> bytes:
        """The 16-byte keys of ``entries``, concatenated."""
        return np.stack([self._key_low[entries], self._key_high[entries]], axis=1).astype("<u8").tobytes()

    def _find(self, low: np.uint64, high: np.uint64) -> int:
        return int(
            table.find_key(low, high, self._key_low, self._key_high, self._key_link, self._key_heads, self._key_shift)
        )

    def _key_of(self, entry: int) -> PrefixKey:
        return PrefixKey(
            int(self._key_low[entry]).to_bytes(8, "little") + int(self._key_high[entry]).to_bytes(8, "little")
        )

    def _arrays(self) -> list[npt.NDArray[np.generic]]:
        return [
            self._fingerprint, self._verification, self._key_low, self._key_high, self._source_start,
            self._length, self._next, self._prev, self._fingerprint_link, self._key_link,
            self._fingerprint_heads, self._key_heads, self._presence_bits,
        ]  # fmt: skip

    def _reserve(self, num_live: int) -> None:
        """Grow rows so ``num_live`` entries fit without reuse, and the heads so chains stay short."""
        needed_rows = max(int(self._state[1]), num_live)
        if needed_rows > _MAX_ENTRIES:
            raise ConfigError(f"fingerprint index would hold {needed_rows} entries, over its limit of 2**31 - 1")
        capacity = self._fingerprint.shape[0]
        if needed_rows > capacity:
            new_capacity = min(_MAX_ENTRIES, max(needed_rows, capacity + int(capacity * _ENTRY_GROWTH_RATIO) + 16))
            for name in ("_fingerprint", "_verification", "_key_low", "_key_high", "_source_start", "_length"):
                old = getattr(self, name)
                grown = np.zeros(new_capacity, dtype=old.dtype)
                grown[:capacity] = old
                setattr(self, name, grown)
            for name in ("_next", "_prev", "_fingerprint_link", "_key_link"):
                old = getattr(self, name)
                grown = np.full(new_capacity, -1, dtype=np.int32)
                grown[:capacity] = old
                setattr(self, name, grown)
        fingerprint_log2, key_log2 = self._fingerprint_log2, self._key_log2
        while num_live > _FINGERPRINT_LOAD << fingerprint_log2:
            fingerprint_log2 += 1
        while num_live > _KEY_LOAD << key_log2:
            key_log2 += 1
        if (fingerprint_log2, key_log2) != (self._fingerprint_log2, self._key_log2):
            logger.debug("fingerprint index grows its heads to 2**%d / 2**%d", fingerprint_log2, key_log2)
            self._resize_heads(fingerprint_log2, key_log2)

    def _resize_heads(self, fingerprint_log2: int, key_log2: int) -> None:
        """Reallocate heads and presence bits and relink every live row (also clears stale presence bits)."""
        self._fingerprint_log2, self._key_log2 = fingerprint_log2, key_log2
        self._fingerprint_shift = np.uint64(64 - fingerprint_log2)
        self._key_shift = np.uint64(64 - key_log2)
        presence_words_log2 = fingerprint_log2 + _PRESENCE_BITS_PER_BUCKET.bit_length() - 1 - 6  # 64-bit words
        self._presence_shift = np.uint64(64 - presence_words_log2)
        self._fingerprint_heads = np.full(1 << fingerprint_log2, -1, dtype=np.int32)
        self._key_heads = np.full(1 << key_log2, -1, dtype=np.int32)
        self._presence_bits = np.zeros(1 << presence_words_log2, dtype=np.uint64)
        self._stale_presence = 0
        table.rebuild_chains(
            int(self._state[1]), self._fingerprint, self._key_low, self._length, self._fingerprint_link,
            self._key_link, self._fingerprint_heads, self._fingerprint_shift, self._key_heads, self._key_shift,
            self._presence_bits, self._presence_shift,
        )  # fmt: skip


@functools.cache
def compile_kernels(chunk_size: int) -> None:
    """Register, match, look up and remove one sequence in a throwaway index (once per process and chunk size),
    so every numba kernel the content index runs is compiled now. Compiling them takes seconds when numba's
    on-disk cache is cold (a fresh install, or another numba version's cache in the same tree), and a store that
    compiles on its first content lookup makes that lookup's client wait past its timeout. Called on the caller's
    thread: compiling on another thread can deadlock with an import that compiles eagerly (``relink``)."""
    check_chunk_size(chunk_size)
    index = FingerprintIndex()
    tokens = as_token_array(np.arange(2 * chunk_size + 1) % 50_000)
    keys: list[PrefixKey] = []
    previous = b""
    for start in range(0, len(tokens), chunk_size):
        keys.append(chained_key(previous, tokens[start : start + chunk_size]))
        previous = keys[-1]
    index.register(tokens, keys, chunk_size)
    index.match(tokens, chunk_size)
    index.find_contents(tokens, chunk_size)
    index.remove(keys)
