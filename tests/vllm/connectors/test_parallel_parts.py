"""The part of every chunk a tensor- or pipeline-parallel vLLM worker moves (``kvstore.connectors.vllm.parallel``):
its stage's layers times vLLM's split of the KV heads, whole for a single worker, one line for what cannot be split.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm.parallel import check_parallel_blend, rank_part
from kvstore.errors import ConfigError
from kvstore.kv_part import KVPart, PartCoverage
from kvstore.layout import KVLayout

LAYOUT = KVLayout(model_id="test/parallel", num_layers=4, num_kv_heads=8, head_dim=16)


def test_a_single_worker_moves_whole_chunks() -> None:
    rank = rank_part(LAYOUT, range(4), tp_rank=0, tp_size=1)
    assert rank.part is None and rank.shape == LAYOUT and rank.saves and rank.leads


@pytest.mark.parametrize(("tp_size", "heads"), [(2, [(0, 4), (4, 8)]), (4, [(0, 2), (2, 4), (4, 6), (6, 8)])])
def test_tensor_parallel_ranks_split_the_heads_as_vllm_does(tp_size: int, heads: list[tuple[int, int]]) -> None:
    coverage = PartCoverage(LAYOUT)
    for tp_rank, (head_start, head_end) in enumerate(heads):
        rank = rank_part(LAYOUT, range(4), tp_rank=tp_rank, tp_size=tp_size)
        assert rank.part == KVPart(layer_start=0, layer_end=4, head_start=head_start, head_end=head_end)
        assert rank.shape.num_kv_heads == head_end - head_start and rank.shape.num_layers == 4
        assert rank.leads == (tp_rank == 0), "an engine's tokens are counted once"
        coverage.add(rank.part)
    assert coverage.complete


def test_fewer_heads_than_ranks_are_replicated_on_consecutive_ranks() -> None:
    layout = KVLayout(model_id="test/parallel", num_layers=2, num_kv_heads=2, head_dim=16)
    heads = [rank_part(layout, range(2), tp_rank=r, tp_size=8).part for r in range(8)]
    assert [(part.head_start, part.head_end) for part in heads if part is not None] == [(0, 1)] * 4 + [(1, 2)] * 4


def test_pipeline_stages_hold_their_layers_and_only_the_first_stage_leads() -> None:
    first = rank_part(LAYOUT, [0, 1], tp_rank=0, tp_size=1)
    second = rank_part(LAYOUT, [3, 2], tp_rank=0, tp_size=1)
    assert first.part == KVPart(layer_start=0, layer_end=2, head_start=0, head_end=8) and first.leads
    assert second.part == KVPart(layer_start=2, layer_end=4, head_start=0, head_end=8) and not second.leads


def test_an_mla_latent_is_whole_on_every_rank_and_saved_by_the_first() -> None:
    latent = KVLayout(model_id="test/mla", num_layers=2, num_kv_heads=1, head_dim=576)
    ranks = [rank_part(latent, range(2), tp_rank=r, tp_size=2, mla=True) for r in range(2)]
    assert [rank.part for rank in ranks] == [None, None]
    assert [rank.saves for rank in ranks] == [True, False]


@pytest.mark.parametrize("layers", [[0, 2], [], [3, 4]])
def test_layers_that_are_not_one_range_of_the_model_are_refused(layers: list[int]) -> None:
    with pytest.raises(ConfigError, match="contiguous range"):
        rank_part(LAYOUT, layers, tp_rank=0, tp_size=1)


def test_heads_that_do_not_split_are_refused() -> None:
    layout = KVLayout(model_id="test/parallel", num_layers=2, num_kv_heads=3, head_dim=16)
    with pytest.raises(ConfigError, match="3 KV heads do not split over tensor_parallel_size=2"):
        rank_part(layout, range(2), tp_rank=0, tp_size=2)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)])
def test_blending_is_refused_on_pipeline_stages_in_one_line(tp: int, pp: int) -> None:
    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    with pytest.raises(ConfigError, match=r"kvstore\.blend is not supported with pipeline_parallel_size=2") as refused:
        check_parallel_blend(engine, ConnectorSettings(blend=True))  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)
    check_parallel_blend(engine, ConnectorSettings(blend=False))  # type: ignore[arg-type]


def test_blending_runs_on_tensor_parallel_ranks() -> None:
    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1))
    check_parallel_blend(engine, ConnectorSettings(blend=True))  # type: ignore[arg-type]
