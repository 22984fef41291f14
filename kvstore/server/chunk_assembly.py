"""Chunks assembled from the parts a tensor- or pipeline-parallel engine's ranks store.

Each rank of such an engine holds some layers (its pipeline stage) and some KV heads (its tensor-parallel shard) of
every token, and stores that *part* (``kvstore.kv_part.KVPart``) on its own, at its own time. The store keeps chunks
whole, in the full model's layout, so that:

- an engine of any parallel shape finds them under the same keys (TP=2 stores, TP=1 loads, and back);
- the tokens take one copy of memory and disk, not one per rank;
- eviction, the content index, KV events and the tiers see ordinary chunks, and drop them whole.

So a part does not go to the store. It is copied into the chunk's *assembly* here, a full-layout staging tensor,
and the chunk is handed back for the store to commit only once every (layer, head) cell of it has arrived. Until
then the chunk is not stored: a lookup misses it (reason ``incomplete``), so no rank ever loads a chunk another rank's
part is missing from. A chunk the store holds already (whole, from any engine) takes no part.

Limits: assemblies use at most ``max_bytes``; a new one that does not fit drops the oldest incomplete ones
(``dropped``). One never completed (a rank that died, a save that failed on one rank) expires after ``ttl_s``
(``expired``, ``expire``, called by the janitor). Both are counted and logged: a chunk lost that way is a later miss,
nothing else.

Threads: any; ``_lock`` guards the assemblies and the counts (the copy of a part is made under it: ranks' parts of
one chunk must not race their coverage).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.keys import PrefixKey
from kvstore.kv_part import KVPart, PartCoverage
from kvstore.layout import KVLayout

__all__ = ["ASSEMBLY_TTL_S", "MAX_ASSEMBLY_BYTES", "AssemblyCounts", "ChunkAssembly", "CompletedChunk"]

logger = logging.getLogger(__name__)

MAX_ASSEMBLY_BYTES = 2 * 1024**3
"""Staging memory for chunks whose parts are still arriving (a TP engine's ranks save within the same step, so an
assembly normally lives for milliseconds)."""

ASSEMBLY_TTL_S = 60.0
"""An assembly not completed within this long (or the server's plan TTL, when shorter) is dropped."""


@dataclass(slots=True)
class _Assembly:
    kv: torch.Tensor  # the whole chunk, full layout
    coverage: PartCoverage
    started_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletedChunk:
    """A chunk every part of which has arrived: ``index`` among the store call's chunks, ``kv`` its whole KV."""

    index: int
    kv: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class AssemblyCounts:
    """What the assembly did since the server started (``kvstore_chunk_parts_total`` by outcome)."""

    parts: int = 0  # chunk parts received (one per chunk a part store covered, not held already)
    completed: int = 0  # chunks whose last part arrived (handed to the store)
    expired: int = 0  # incomplete assemblies dropped after the TTL
    dropped: int = 0  # incomplete assemblies dropped to make room for newer ones
    pending: int = 0  # incomplete assemblies now
    pending_bytes: int = 0


class ChunkAssembly:
    """The staging area of chunks stored by parts.

    Args:
        layout: the store's layout (assemblies are whole chunks of it).
        max_bytes: staging memory for incomplete chunks.
        clock: monotonic seconds (tests replace it).
    """

    def __init__(
        self, layout: KVLayout, *, max_bytes: int = MAX_ASSEMBLY_BYTES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._layout = layout
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._assemblies: OrderedDict[PrefixKey, _Assembly] = OrderedDict()  # oldest first
        self._bytes = 0
        self._parts = self._completed = self._expired = self._dropped = 0

    def add(
        self,
        part: KVPart,
        kv: torch.Tensor,
        *,
        keys: Sequence[PrefixKey],
        bounds: Sequence[int],
        first: int,
        start: int,
        held: Callable[[PrefixKey], bool],
    ) -> list[CompletedChunk]:
        """Copy a part of chunks ``first..`` of a store call into their assemblies; return the chunks it completed.

        Args:
            part: which layers and heads ``kv`` holds.
            kv: the part's KV of tokens ``[start, bounds[-1])``: ``[part layers, 2, tokens, part heads, head_dim]``.
            keys: the prefix keys of the call's chunks; ``bounds`` their token boundaries (``len(keys) + 1``).
            first: the first chunk the call writes (the first that begins at or after ``start``).
            start: the token ``kv`` begins at.
            held: whether the store holds a chunk already (it then takes no part, and an assembly of it is dropped).
        """
        completed: list[CompletedChunk] = []
        now = self._clock()
        with self._lock:
            for index in range(first, len(keys)):
                key = keys[index]
                if held(key):
                    self._forget(key)
                    continue
                chunk_start, chunk_end = bounds[index], bounds[index + 1]
                assembly = self._assemblies.get(key)
                if assembly is not None and assembly.kv.shape[2] != chunk_end - chunk_start:
                    self._forget(key)  # another cut of the same key cannot happen (keys chain over the tokens)
                    assembly = None
                if assembly is None:
                    assembly = self._new_assembly(key, chunk_end - chunk_start, now)
                    if assembly is None:
                        continue
                part.of(assembly.kv).copy_(kv[:, :, chunk_start - start : chunk_end - start])
                assembly.coverage.add(part)
                self._parts += 1
                if assembly.coverage.complete:
                    self._forget(key)
                    self._completed += 1
                    completed.append(CompletedChunk(index=index, kv=assembly.kv))
        return completed

    def _new_assembly(self, key: PrefixKey, num_tokens: int, now: float) -> _Assembly | None:
        nbytes = self._layout.chunk_bytes(num_tokens)
        if nbytes > self._max_bytes:
            logger.warning("a chunk of %d bytes is over the assembly limit of %d; not stored", nbytes, self._max_bytes)
            self._dropped += 1
            return None
        while self._bytes + nbytes > self._max_bytes and self._assemblies:
            oldest = next(iter(self._assemblies))
            self._forget(oldest)
            self._dropped += 1
            logger.warning("dropped the incomplete assembly of chunk %s to make room (assembly limit)", oldest.hex())
        kv = torch.empty(self._layout.chunk_shape(num_tokens), dtype=self._layout.dtype.torch_dtype)
        assembly = _Assembly(kv=kv, coverage=PartCoverage(self._layout), started_s=now)
        self._assemblies[key] = assembly
        self._bytes += nbytes
        return assembly

    def _forget(self, key: PrefixKey) -> None:
        assembly = self._assemblies.pop(key, None)
        if assembly is not None:
            self._bytes -= self._layout.chunk_bytes(int(assembly.kv.shape[2]))

    def expire(self, ttl_s: float) -> int:
        """Drop the assemblies older than ``ttl_s``; returns how many."""
        deadline = self._clock() - ttl_s
        with self._lock:
            old = [key for key, assembly in self._assemblies.items() if assembly.started_s < deadline]
            for key in old:
                self._forget(key)
            self._expired += len(old)
        if old:
            logger.warning(
                "dropped %d chunks whose parts did not all arrive within %.0f s (a rank's save failed or never came)",
                len(old), ttl_s,
            )  # fmt: skip
        return len(old)

    def pending(self, key: PrefixKey) -> bool:
        """Whether some but not all parts of a chunk have arrived."""
        with self._lock:
            return key in self._assemblies

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._assemblies)

    def counts(self) -> AssemblyCounts:
        with self._lock:
            return AssemblyCounts(
                parts=self._parts,
                completed=self._completed,
                expired=self._expired,
                dropped=self._dropped,
                pending=len(self._assemblies),
                pending_bytes=self._bytes,
            )
