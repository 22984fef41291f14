"""Values a lookup returns and a retrieve consumes.

A ``PrefixLookup`` says how many leading tokens of a prompt are cached and where each chunk sits::

    prompt:  | chunk 0 (cpu) | chunk 1 (disk) | chunk 2 (gpu) | not cached ...... |
             0               256              512             768
             <------------ num_cached_tokens = 768 ---------->

The chunks it lists are pinned in their tiers until the lookup is retrieved or released, so a retrieve never finds
them gone. Values are immutable and safe to share between threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.keys import PrefixKey
from kvstore.tiers.base import TierName

__all__ = ["CachedChunk", "PrefixLookup", "RetrieveResult", "StoreResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedChunk:
    """One cached chunk of a prompt.

    Args:
        key: the chunk's prefix key.
        start: position of its first token in the prompt.
        num_tokens: tokens in the chunk.
        tier: the fastest tier that held it at lookup time (where it is pinned).
    """

    key: PrefixKey
    start: int
    num_tokens: int
    tier: TierName

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixLookup:
    """The cached prefix of a prompt; pins its chunks until retrieved or released.

    Args:
        lookup_id: the store's handle for the pins this lookup holds.
        num_query_tokens: length of the prompt that was looked up.
        chunks: the cached leading chunks, in order, contiguous from position 0.
    """

    lookup_id: int
    num_query_tokens: int
    chunks: tuple[CachedChunk, ...]

    @property
    def num_cached_tokens(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    def num_tokens_in(self, tier: TierName) -> int:
        """Cached tokens that were found in ``tier``."""
        return sum(chunk.num_tokens for chunk in self.chunks if chunk.tier is tier)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveResult:
    """KV loaded for a lookup.

    Args:
        num_tokens: tokens actually loaded from position 0; less than the lookup promised only when a chunk turned
            out corrupt on disk (the prefix is cut there and the loss is counted).
        kv: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (a view of the caller's buffer when one was given).
    """

    num_tokens: int
    kv: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreResult:
    """What a ``store`` call did.

    Args:
        num_chunks: chunks the tokens split into.
        num_new_chunks: chunks that were not cached before and were written.
        num_rejected_chunks: chunks no tier could take because everything resident was pinned.
    """

    num_chunks: int
    num_new_chunks: int
    num_rejected_chunks: int = 0
