"""A loan's KV as views of the server's shared cpu arena, mapped read-only by a client on its host.

``Client.lend`` returns these instead of copying the KV into a buffer: each piece is a view of one chunk's slot
(its part's layers and KV heads, its rows from the lend's start), so the caller's own copy (into an engine's paged
blocks) is the only one. The views are valid until the caller returns the plan (``Client.return_loan``); after that
the server may put another chunk in the slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import InvalidInputError
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.misses import Miss
from kvstore.plan import Loan
from kvstore.wire.shm import MappedArena

__all__ = ["LentKV", "lent_kv"]


@dataclass(frozen=True, slots=True)
class LentPiece:
    """One lent segment: tokens ``[start, start + kv.shape[2])`` of the prompt, ``kv`` a read-only arena view
    ``[layers, planes, tokens, heads, head_dim]`` (strided: a part's heads of a chunk's)."""

    start: int
    kv: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + int(self.kv.shape[2])


@dataclass(frozen=True, slots=True)
class LentKV:
    """A loan (``kvstore.plan.Loan``) and its pieces, in prompt order from the loan's start."""

    loan: Loan
    pieces: tuple[LentPiece, ...]

    @property
    def num_prefix_tokens(self) -> int:
        return self.loan.num_prefix_tokens

    @property
    def misses(self) -> tuple[Miss, ...]:
        return self.loan.misses


def lent_kv(arena: MappedArena, loan: Loan, layout: KVLayout, part: KVPart | None) -> LentKV:
    """The views of ``arena`` (the server's, mapped here) that ``loan`` names, shaped by ``layout`` and cut to
    ``part``; each chunk's pages are mapped before the caller first reads them (``MappedArena.populate``).

    Raises:
        InvalidInputError: a chunk the loan names lies outside the arena (a reply that does not fit this mapping).
    """
    dtype = layout.dtype.torch_dtype
    pieces: list[LentPiece] = []
    for segment, offset in zip(loan.segments, loan.offsets, strict=True):
        nbytes = layout.chunk_bytes(segment.stored_tokens)
        if offset + nbytes > arena.tensor.numel():
            raise InvalidInputError(
                f"lent chunk at byte {offset} ({nbytes} bytes) lies outside the server's arena of "
                f"{arena.tensor.numel()}"
            )
        arena.populate(offset, nbytes)
        chunk = arena.tensor[offset : offset + nbytes].view(dtype).view(layout.chunk_shape(segment.stored_tokens))
        if part is not None:
            chunk = part.of(chunk)
        held = max(0, loan.start - segment.start)  # leading tokens the caller holds already
        rows = chunk[:, :, segment.offset + held : segment.offset + segment.num_tokens]
        pieces.append(LentPiece(start=segment.start + held, kv=rows))
    return LentKV(loan=loan, pieces=tuple(pieces))
