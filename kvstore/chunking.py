"""How a store cuts token sequences into chunks: the rule's name and the sizes it derives from ``chunk_size``.

Two rules (``kvstore.keys.chunk_bounds`` applies them; ``kvstore.content_cut`` computes the content-defined one):

- ``fixed``: every ``chunk_size`` tokens from each separator run's start. A document's chunks depend on where it
  sits: placed after other text, it shares none of them with the same document stored alone.
- ``content``: a chunk ends where a hash of the last ``window_tokens`` token ids hits a target, so the cut follows
  the tokens, not their positions: two prompts holding one document agree on every cut from a little past its
  start (``ContentCutShape`` gives the sizes, docs/design-notes.md#content-defined-chunks the choice).

``chunk_size`` stays the longest chunk under both rules: every tier, the wire and the content index keep sizing a
chunk by it. Light on purpose (no numpy): ``kvstore serve`` checks its settings before heavy imports.

Pure values; thread-safe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["MIN_CONTENT_CHUNK_SIZE", "Chunking", "ContentCutShape", "parse_chunking"]

MIN_CONTENT_CHUNK_SIZE = 16
"""The smallest ``chunk_size`` content-defined chunking takes: below it the hash window shrinks to a few tokens and
chunks to one or two, which costs keys without finding anything a fixed cut would not."""

_MAX_WINDOW_TOKENS = 16


class Chunking(enum.StrEnum):
    """The cut rule a store uses (``StoreConfig.chunking``, ``kvstore serve --chunking``); a data dir records it."""

    FIXED = "fixed"
    CONTENT = "content"


def parse_chunking(value: object) -> Chunking:
    """``"content"`` (or a ``Chunking``) as a ``Chunking``.

    Raises:
        ConfigError: anything else, in one line.
    """
    if isinstance(value, str) and value in {rule.value for rule in Chunking}:
        return Chunking(value)
    names = ", ".join(rule.value for rule in Chunking)
    raise ConfigError(f"chunking={value!r} must be one of {names}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentCutShape:
    """The sizes of content-defined chunking for one ``chunk_size`` (``for_chunk_size``).

    Attributes:
        max_tokens: the longest chunk (``chunk_size``): a run with no content cut for that long is cut there.
        min_tokens: ``chunk_size // 4``: a position is a content cut only when no other candidate lies in the
            ``min_tokens - 1`` positions before it, so chunks between content cuts hold at least this many tokens.
        window_tokens: tokens hashed to decide whether a position is a candidate (16, fewer for small chunks).
        divisor: a position is a candidate when its window's hash is a multiple of this (``chunk_size // 4``).
    """

    max_tokens: int
    min_tokens: int
    window_tokens: int
    divisor: int

    @classmethod
    def for_chunk_size(cls, chunk_size: int) -> ContentCutShape:
        """The shape for ``chunk_size`` (at least ``MIN_CONTENT_CHUNK_SIZE``).

        Raises:
            ConfigError: ``chunk_size`` below ``MIN_CONTENT_CHUNK_SIZE``.
        """
        if chunk_size < MIN_CONTENT_CHUNK_SIZE:
            raise ConfigError(
                f"chunking=content needs chunk_size >= {MIN_CONTENT_CHUNK_SIZE} tokens (got {chunk_size}); raise "
                "--chunk-size, e.g. 256, or use --chunking fixed"
            )
        quarter = chunk_size // 4
        return cls(
            max_tokens=chunk_size,
            min_tokens=quarter,
            window_tokens=min(_MAX_WINDOW_TOKENS, quarter),
            divisor=quarter,
        )

    @property
    def sync_tokens(self) -> int:
        """How far into a document two prompts may disagree on whether a position is a content cut: a cut's decision
        reads the ``window_tokens + min_tokens - 1`` tokens before it, so from this offset on it is the same."""
        return self.window_tokens + self.min_tokens - 1
