"""How much of a prompt a blend pass computes: from the engine's own cached prefix to the last cached token.

A prompt's plan (``lookup(blend=True)``) covers it with exact segments (the same tokens after the same prefix),
blend segments (cached chunks found at other positions) and gaps. vLLM accepts only a contiguous run of external
tokens after its own prefix cache, so the connector reports the blended span ``[local_end, end)`` as external
tokens: the pass computes every gap inside it and writes the span's KV into the request's blocks, and vLLM
computes the rest of the prompt ``[end, T)`` (the question, typically) over that KV, and with it the first token.

``end`` is the end of the last cached segment, cut down to a block boundary (the blocks are vLLM's unit) and below
the prompt's last token (vLLM computes at least that one). A span is worth a pass only when it holds blended
tokens beyond what an exact load would give: otherwise the exact path (a plain load) serves the request.

Pure arithmetic; no engine imports.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.plan import Segment

__all__ = ["blend_span_end"]


def blend_span_end(segments: Sequence[Segment], *, num_tokens: int, block_size: int, exact_end: int) -> int | None:
    """The end of the span a blend pass computes, or ``None`` when blending would reuse nothing an exact load
    does not.

    Args:
        segments: the plan's segments (exact and blend), in prompt order.
        num_tokens: the prompt's length.
        block_size: vLLM's block size.
        exact_end: where the exact path's load would end (block-aligned; 0 without one).
    """
    last_cached = max((segment.end for segment in segments), default=0)
    end = min(last_cached, num_tokens - 1)
    end -= end % block_size
    has_blend = any(not segment.exact and segment.start < end for segment in segments)
    if not has_blend or end <= exact_end:
        return None
    return end
