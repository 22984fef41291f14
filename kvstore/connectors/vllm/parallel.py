"""A tensor- or pipeline-parallel vLLM engine as kvstore serves it: which part of every chunk each rank moves.

The store keeps chunks whole, in the model's full layout (``engine_facts.engine_layout``: every layer, every KV
head, whatever the engine's shape), so engines of any parallel shape share them and hold one copy of the tokens. A
worker (one rank) holds the layers of its pipeline stage and the KV heads of its tensor-parallel shard; it saves and
loads exactly that part (``kvstore.kv_part.KVPart``), and the server assembles a chunk from the ranks' parts,
storing it only once all have arrived (``kvstore.server.chunk_assembly``). The scheduler looks a prompt up once and
hands the pinned plan to every rank; each retrieves its part of it, and the server keeps the pins until every part
is done.

Which heads a rank holds is vLLM's split (``QKVParallelLinear``): with ``H`` KV heads over ``tp`` ranks, rank ``r``
holds heads ``[r H / tp, (r + 1) H / tp)``; with fewer heads than ranks each head is replicated on ``tp / H``
consecutive ranks, and rank ``r`` holds head ``r // (tp / H)`` (two ranks then save the same cells; the assembly
takes either). An MLA model's latent is the same on every tensor-parallel rank: every rank loads it whole, and only
the first rank of each stage saves it (``RankPart.saves``). The scheduler's pinned plan is retrieved by every rank
(``LoadSpec.readers``), whatever part each takes, and stays pinned until all have.

Blending runs on tensor-parallel engines: every rank runs each pass on its own KV heads, together with the others
(the lead's plan, the same tokens, a selection from scores summed over the group: ``kvstore.blend.vllm``). It is
refused at start on pipeline stages (``check_parallel_blend``): the pass runs every layer on one worker, and a stage
holds only some of them; such engines serve exact prefix reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.connectors.settings import ConnectorSettings
from kvstore.errors import ConfigError
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["RankPart", "check_parallel_blend", "rank_part"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """A worker's share of every chunk.

    Args:
        part: its layers and global KV heads (``None``: the whole chunk, a single-worker engine).
        shape: the layout of the KV it moves (``part.shape_layout``; the layout itself when whole).
        saves: whether it saves (an MLA model's other tensor-parallel ranks hold the same latent and do not).
        leads: whether its loads and saves are the ones counted in vLLM's stats (tokens and requests once per
            engine, not once per rank; every rank counts its bytes).
    """

    part: KVPart | None
    shape: KVLayout
    saves: bool = True
    leads: bool = True


def rank_part(
    layout: KVLayout, layer_indexes: Sequence[int], *, tp_rank: int, tp_size: int, mla: bool = False
) -> RankPart:
    """The part of every chunk a worker with these registered layers (global indexes) and tensor-parallel rank holds.

    Raises:
        ConfigError: the layers are not one contiguous range of the layout's, or the KV heads do not split over
            ``tp_size`` ranks the way vLLM splits them.
    """
    layers = sorted(layer_indexes)
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))) or layers[-1] >= layout.num_layers:
        raise ConfigError(
            f"this worker registered KV cache layers {layers[:3]}...{layers[-3:]} of a {layout.num_layers}-layer "
            "model; kvstore needs one contiguous range of them per pipeline stage"
        )
    heads = layout.num_kv_heads
    if mla or tp_size == 1:
        head_start, head_end = 0, heads
    elif heads % tp_size == 0:
        head_start, head_end = tp_rank * heads // tp_size, (tp_rank + 1) * heads // tp_size
    elif tp_size % heads == 0:
        head_start = tp_rank // (tp_size // heads)
        head_end = head_start + 1
    else:
        raise ConfigError(
            f"{heads} KV heads do not split over tensor_parallel_size={tp_size}; pick a size that divides them or "
            "that they divide"
        )
    part = KVPart(layer_start=layers[0], layer_end=layers[-1] + 1, head_start=head_start, head_end=head_end)
    first_stage = layers[0] == 0
    if part.is_whole(layout):
        return RankPart(part=None, shape=layout, saves=not mla or tp_rank == 0, leads=tp_rank == 0)
    return RankPart(
        part=part,
        shape=part.shape_layout(layout),
        saves=not mla or tp_rank == 0,
        leads=tp_rank == 0 and first_stage,
    )


def check_parallel_blend(vllm_config: VllmConfig, settings: ConnectorSettings) -> None:
    """Refuse ``kvstore.blend`` on a pipeline-parallel engine, with one line (tensor parallelism blends).

    Raises:
        ConfigError: blending is on and the engine has more than one pipeline stage.
    """
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if settings.blend and stages != 1:
        raise ConfigError(
            f"kvstore.blend is not supported with pipeline_parallel_size={stages} (a blend pass runs every layer on "
            "one worker; a stage holds only its own); turn kvstore.blend off to serve exact prefix reuse"
        )
