"""vLLM's KV cache groups as the connector sees them: which layers share a block table, and which of them vLLM frees
behind a sliding window.

With vLLM's hybrid KV cache manager (the connector is ``SupportsHMA``) a model with sliding-window layers gets several
groups, each with its own block table over one shared KV tensor: a block id belongs to one group at a time, so every
layer is copied through its own group's blocks. A sliding-window group holds a block only while some token still to
be computed attends to it: vLLM frees the blocks below the window (``remove_skipped_blocks``, as a step is
scheduled) and gives a loaded request the null block (id 0) outside the window. The store's chunks stay whole (every
layer, every token), the same with and without the hybrid manager (docs/design-notes.md#sliding-window-hybrid).

Under tensor and pipeline parallelism every worker has the same groups, in the same order: vLLM groups the whole
model's layers, then gives each pipeline stage its own layers of each group, so a stage's group may hold none
(``get_kv_cache_configs``; the scheduler's groups are the first stage's). The scheduler's block ids per group are
every rank's, and each rank copies its own layers and KV heads through them.

``KVGroups.held_start`` applies vLLM's rule (``SlidingWindowManager.get_num_skipped_tokens``: ``computed - window +
1`` tokens skipped, whole blocks freed) to the tokens computed before a step, which is never less than vLLM's own
count (it frees on processed tokens, fewer under async scheduling): the tokens it says are gone may be more than
vLLM freed, never fewer, so a save never reads a block another request may own by then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.connectors.group_copies import NULL_BLOCK_ID
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = ["NULL_BLOCK_ID", "KVGroup", "KVGroups", "check_groups_compose", "kv_groups_of"]


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: its layers' names and its sliding window (``None``: full attention, every block kept)."""

    layer_names: tuple[str, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The engine's KV cache groups, in vLLM's order (block ids travel in that order), all of ``block_size``."""

    groups: tuple[KVGroup, ...]
    block_size: int

    @property
    def hybrid(self) -> bool:
        """More than one group: vLLM's hybrid manager is on (block ids per group; a load that falls short can only
        be reported whole, since vLLM cannot map a failed block id to a group)."""
        return len(self.groups) > 1

    @property
    def frees_blocks(self) -> bool:
        """Some group frees blocks before the request ends (a sliding window)."""
        return any(group.sliding_window is not None for group in self.groups)

    def held_start(self, num_computed_tokens: int) -> int:
        """The first token (block-aligned) whose blocks every group still holds in a step that begins with
        ``num_computed_tokens`` computed (0: every block since the prompt's start)."""
        start = 0
        for group in self.groups:
            if group.sliding_window is not None:
                skipped = max(0, num_computed_tokens - group.sliding_window + 1)
                start = max(start, skipped - skipped % self.block_size)
        return start

    def group_of_layers(self, layer_names: Sequence[str]) -> list[int]:
        """The group of each of ``layer_names`` (a worker's registered layers).

        Raises:
            ConfigError: a layer in no group.
        """
        index = {name: group for group, kv in enumerate(self.groups) for name in kv.layer_names}
        missing = [name for name in layer_names if name not in index]
        if missing:
            raise ConfigError(f"vLLM registered KV cache layer {missing[0]} outside its KV cache groups")
        return [index[name] for name in layer_names]


def kv_groups_of(kv_cache_config: KVCacheConfig, block_size: int) -> KVGroups:
    """The groups of ``kv_cache_config``, checked: full attention (MLA included) and sliding windows only, every
    group of the engine's block size.

    Raises:
        ConfigError: another kind of group (e.g. chunked local attention, Mamba), or another block size, in one line.
    """
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        window = _sliding_window(group.kv_cache_spec)
        spec_block_size = int(getattr(group.kv_cache_spec, "block_size", block_size))
        if spec_block_size != block_size:
            raise ConfigError(
                f"kvstore's vLLM connector needs every KV cache group in blocks of {block_size} tokens; one has "
                f"{spec_block_size} (start vLLM with --disable-hybrid-kv-cache-manager)"
            )
        groups.append(KVGroup(layer_names=tuple(group.layer_names), sliding_window=window))
    return KVGroups(groups=tuple(groups), block_size=block_size)


def check_groups_compose(groups: KVGroups | None, *, blend: bool) -> None:
    """Refuse, in one line, what several groups do not compose with yet: blending (a pass writes one block table).

    Tensor and pipeline parallelism compose: every worker's ``kv_cache_config`` has the same groups in the same order
    (vLLM groups the whole model's layers, then keeps each stage's own in each group: a group may hold none of a
    stage's layers), so the scheduler's block ids per group are every rank's, and each rank copies its own layers
    and KV heads through them (``kvstore.connectors.vllm.parallel``).

    Raises:
        ConfigError: several groups with ``kvstore.blend``.
    """
    if blend and groups is not None and groups.hybrid:
        raise ConfigError(
            f"kvstore.blend writes one block table and this engine has {len(groups.groups)} KV cache groups; turn "
            "kvstore.blend off or start vLLM with --disable-hybrid-kv-cache-manager"
        )


def _sliding_window(spec: KVCacheSpec) -> int | None:
    """A group spec's sliding window (``None``: full attention).

    Raises:
        ConfigError: a spec that is neither.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = [_sliding_window(inner) for inner in spec.kv_cache_specs.values()]
        if any(window is not None for window in windows):
            # the smallest window frees the most: assuming it never reads a block another layer's window freed
            return min(window if window is not None else 1 << 62 for window in windows)
        return None
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):  # not their subclasses: some free blocks or sink
        return None
    if type(spec) is SlidingWindowSpec:
        return int(spec.sliding_window)
    raise ConfigError(
        f"kvstore's vLLM connector serves full-attention and sliding-window KV cache groups; this model has "
        f"{type(spec).__name__} (start vLLM with --disable-hybrid-kv-cache-manager)"
    )
