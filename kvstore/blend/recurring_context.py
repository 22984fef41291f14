"""Cached tokens whose context recurs earlier in the prompt: what a full prefill would have cross-attended.

A cached span was computed without the documents in front of it, and CacheBlend's check-layer deviation only sees
what that changes in the first layers. One effect it misses shows in the middle layers: prefix-matching
(induction-style) attention, where a token whose recent context already appeared earlier in the prompt attends to
that earlier occurrence and to what followed it. When several documents repeat a pattern ("The access code for the
<name> archive is <code>.") the later copies, cached alone, never saw the earlier ones, and a question about an
early document is then answered from a later one (docs/benchmarks.md, "Blend quality on SmolLM2": recomputing the
later documents' repeated sentences brings most of those answers back).

So the blend can recompute, on top of its ratio, every token of a reused span whose last ``match_tokens`` tokens
(all inside the span) occur as a run that ends before the span starts::

    prompt:  | ... The access code for the | ... | doc 3: ... The access code for the ... |
                                                         ^^^ ^^^^^^ ^^^^ ^^^ ^^^  each ends a 4-token run seen before

On SmolLM2 (docs/benchmarks.md) it lowered the KL to full prefill but left the planted-fact answers unchanged (measured:
docs/design-notes.md#blend-recurring-context), hence off by default (``BlendConfig.recurring_context_tokens = 0``).

Only token ids are read, before layer 0, in O(T log T).

Pure functions; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.blend.selection import reused_span_starts
from kvstore.keys import TokenArray
from kvstore.plan import Segment

__all__ = ["recurring_context_positions"]

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it permutes 64-bit values


def recurring_context_positions(tokens: TokenArray, segments: Sequence[Segment], match_tokens: int) -> torch.Tensor:
    """Positions of reused tokens whose last ``match_tokens`` tokens occur, as a run, ending before their span.

    Args:
        tokens: the prompt's token ids.
        segments: the plan's segments in prompt order (exact ones are never returned).
        match_tokens: run length, ``>= 1``; longer runs select fewer, more specific tokens.

    Returns:
        int64 positions on the CPU, sorted ascending.
    """
    ids = np.ascontiguousarray(tokens, dtype=np.int64)
    num_windows = ids.shape[0] - match_tokens + 1
    if num_windows <= 0:
        return torch.zeros(0, dtype=torch.int64)
    # Each run as one 64-bit hash (a collision only recomputes a token more): sorting integers is much faster than
    # sorting the runs as byte strings (measured: docs/design-notes.md#blend-recurring-context).
    hashes = np.zeros(num_windows, dtype=np.uint64)
    for offset in range(match_tokens):
        hashes = (hashes ^ ids[offset : offset + num_windows].astype(np.uint64)) * _MIX
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    first_end = first[inverse] + match_tokens - 1  # where each window's run first ended
    ends = np.arange(num_windows, dtype=np.int64) + match_tokens - 1
    span_start = reused_span_starts(segments, ids.shape[0])[ends]
    inside = (span_start >= 0) & (ends - match_tokens + 1 >= span_start)
    return torch.from_numpy(ends[inside & (first_end < span_start)])
