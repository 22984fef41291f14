"""A part of a chunk's KV: a layer range times a global KV-head range of the model's full layout.

A tensor-parallel engine's rank holds only some KV heads of every layer, a pipeline stage only some layers. The store
keeps every chunk whole, in the full model's layout (so engines of any parallel shape share keys and one copy of the
tokens); a rank stores and retrieves its *part*::

    full chunk [num_layers, 2, tokens, num_kv_heads, head_dim]
    part       [layers.stop - layers.start, 2, tokens, heads.stop - heads.start, head_dim]
               = full[layers.start:layers.stop, :, :, heads.start:heads.stop]

What identifies stored KV never names a rank: a part is a slice of the whole, so a chunk stored by a TP=2 engine's
two ranks is the same chunk a TP=1 engine stores and loads.

``PartCoverage`` says which cells (layer, head) of a chunk the parts seen so far cover: a chunk assembled from parts
is complete (and may be committed), and a plan retrieved by parts is done (and its pins may go), only when every
cell is covered.

Values here are immutable (``KVPart``) or guarded by their owner (``PartCoverage``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidInputError
from kvstore.layout import KVLayout

__all__ = ["KVPart", "PartCoverage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVPart:
    """Layers ``[layer_start, layer_end)`` and global KV heads ``[head_start, head_end)`` of a layout."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end or not 0 <= self.head_start < self.head_end:
            raise InvalidInputError(
                f"KV part layers [{self.layer_start}, {self.layer_end}) x heads [{self.head_start}, {self.head_end}) "
                "is empty or negative; give start < end for both"
            )

    @classmethod
    def whole(cls, layout: KVLayout) -> KVPart:
        """Every layer and head of ``layout``."""
        return cls(layer_start=0, layer_end=layout.num_layers, head_start=0, head_end=layout.num_kv_heads)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_kv_heads(self) -> int:
        return self.head_end - self.head_start

    def check(self, layout: KVLayout) -> None:
        """Raise ``InvalidInputError`` unless the part lies inside ``layout``."""
        if self.layer_end > layout.num_layers or self.head_end > layout.num_kv_heads:
            raise InvalidInputError(
                f"KV part {self.describe()} lies outside layout {layout.model_id} ({layout.num_layers} layers x "
                f"{layout.num_kv_heads} kv heads)"
            )

    def is_whole(self, layout: KVLayout) -> bool:
        return self == KVPart.whole(layout)

    def shape_layout(self, layout: KVLayout) -> KVLayout:
        """``layout`` with the part's layer and head counts: for shapes and byte counts of the part's KV only (its
        namespace is not the layout's and names no stored KV). Per-layer (per-head) fp8 scales keep the part's
        layers' (and heads')."""
        scales = layout.kv_scales
        if scales is not None:
            scales = scales.part(range(self.layer_start, self.layer_end), range(self.head_start, self.head_end))
        return dataclasses.replace(layout, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, kv_scales=scales)

    def of(self, kv: torch.Tensor) -> torch.Tensor:
        """The part's view of a full-layout KV tensor ``[num_layers, 2, tokens, num_kv_heads, head_dim]``."""
        return kv[self.layer_start : self.layer_end, :, :, self.head_start : self.head_end]

    def describe(self) -> str:
        return f"layers [{self.layer_start}, {self.layer_end}) x kv heads [{self.head_start}, {self.head_end})"

    def to_wire(self) -> list[int]:
        return [self.layer_start, self.layer_end, self.head_start, self.head_end]

    @classmethod
    def from_wire(cls, values: list[object]) -> KVPart:
        """Raises ``InvalidInputError`` unless ``values`` is four integers making a non-empty part."""
        ints = [value for value in values if isinstance(value, int) and not isinstance(value, bool)]
        if len(values) != 4 or len(ints) != 4:
            raise InvalidInputError(f"a KV part is [layer_start, layer_end, head_start, head_end]; got {values!r:.80}")
        layer_start, layer_end, head_start, head_end = ints
        return cls(layer_start=layer_start, layer_end=layer_end, head_start=head_start, head_end=head_end)


class PartCoverage:
    """Which (layer, head) cells of a chunk or plan the parts added so far cover. Not thread-safe: its owner
    guards it."""

    __slots__ = ("_cells",)

    def __init__(self, layout: KVLayout) -> None:
        self._cells = torch.zeros((layout.num_layers, layout.num_kv_heads), dtype=torch.bool)

    def add(self, part: KVPart) -> None:
        self._cells[part.layer_start : part.layer_end, part.head_start : part.head_end] = True

    @property
    def complete(self) -> bool:
        return bool(self._cells.all())
