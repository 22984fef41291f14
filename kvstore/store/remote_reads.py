"""A retrieve's reads from a shared tier: a group of chunks per round trip, fetched as the retrieve reaches them.

``retrieve`` walks a plan's segments in order; the chunks only a shared tier (the remote) holds, not landed by a
prefetch, are fetched ``REMOTE_FETCH_GROUP`` at a time, starting at the first one not fetched yet, and each is
decoded straight into its place in the caller's buffer. Fetching lazily bounds the memory a long prompt's values
take to one group, and a retrieve that stops early (a cut prefix) fetches nothing past it.

Threads: one ``RemoteReads`` per retrieve, used by its thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.keys import PrefixKey
from kvstore.misses import MissReason
from kvstore.plan import Segment
from kvstore.store.prefetch import REMOTE_FETCH_GROUP
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.shared import SharedChunk, SharedTier

__all__ = ["RemoteReads"]

logger = logging.getLogger(__name__)


class RemoteReads:
    """Fetches and decodes one retrieve's remote chunks.

    Args:
        remote: the shared tier the keys are read from.
        keys: the keys the retrieve will read from it, in plan order.
    """

    def __init__(self, remote: SharedTier[Any], keys: Sequence[PrefixKey]) -> None:
        self._remote = remote
        self._keys = list(keys)
        self._position = {key: index for index, key in enumerate(self._keys)}
        self._fetched: dict[PrefixKey, SharedChunk | MissReason] = {}

    def serves(self, segment: Segment) -> bool:
        """Whether the retrieve reads this segment here (a shared segment no prefetch landed)."""
        return segment.key in self._position and segment.tier is self._remote.name

    def load_into(self, key: PrefixKey, place: torch.Tensor) -> ChunkRecord | MissReason:
        """Decode chunk ``key`` into ``place`` (its shape, any device); its record, or why not: gone
        (``EVICTED_REMOTE``), corrupt or of another length (``CHECKSUM``), the remote down (``REMOTE_UNAVAILABLE``)."""
        if key not in self._fetched:
            start = self._position.get(key, len(self._keys))
            # A key the remote tier forgot since the lookup (its prefetch missed, or found the value damaged) is a
            # miss already: not fetched again.
            group = [k for k in self._keys[start : start + REMOTE_FETCH_GROUP] if self._remote.knows(k)]
            self._fetched.update(zip(group, self._remote.fetch(group), strict=True))
        chunk = self._fetched.pop(key, None)
        if chunk is None:  # forgotten before this read (a prefetch found it gone or damaged)
            return self._remote.why_forgotten(key)
        if isinstance(chunk, MissReason):
            return chunk
        if chunk.record.num_tokens != place.shape[2]:  # never decoded into part of the place, nor broadcast over it
            self._remote.count_inconsistent(key)
            logger.warning("remote chunk %s holds %d tokens, the plan %d (a directory record of another length): "
                           "a counted miss", key.hex(), chunk.record.num_tokens, place.shape[2])  # fmt: skip
            return MissReason.CHECKSUM
        return chunk.record if self._remote.decode_into(chunk, place) else MissReason.CHECKSUM
