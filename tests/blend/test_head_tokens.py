"""``BlendConfig.num_head_tokens``: the first tokens of every reused span are recomputed on top of the ratio, and
ratios 0 and 1.0 keep their meaning (plain reuse; a full prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.blend import BlendConfig, LayerwiseBlender
from kvstore.blend.selection import num_tokens_to_recompute
from kvstore.errors import ConfigError

CHUNK = 8
DOCUMENT_TOKENS = 27


@pytest.fixture
def blender(tiny_blender: LayerwiseBlender) -> LayerwiseBlender:
    """Three random documents of ``DOCUMENT_TOKENS`` stored alone."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        tiny_blender.prefill(rng.integers(3, 500, DOCUMENT_TOKENS).tolist(), mode="full")
    return tiny_blender


def prompt(blender: LayerwiseBlender) -> list[int]:
    """The three stored documents in reverse order, each after a separator: three spans whose sources start at 0."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 500, DOCUMENT_TOKENS).tolist() for _ in range(3)]
    return [1, 2, 3, 4, 5] + docs[2] + [6] + docs[0] + [7, 8] + docs[1] + [9, 10, 11]


def test_the_first_tokens_of_every_reused_span_are_recomputed_on_top_of_the_ratio(blender: LayerwiseBlender) -> None:
    tokens = prompt(blender)
    plain = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=0.15))
    heads = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=0.15, num_head_tokens=2))
    assert plain.plan.num_blend_tokens == heads.plan.num_blend_tokens == 3 * DOCUMENT_TOKENS
    num_gap_tokens = len(tokens) - 3 * DOCUMENT_TOKENS  # 5 + 1 + 2 + 3, the last token among them
    # Three spans (one per document) with two head tokens each; the ratio chooses among the 81 - 6 others.
    assert heads.num_recomputed_tokens == num_gap_tokens + 3 * 2 + num_tokens_to_recompute(0.15, 81 - 6)
    assert plain.num_recomputed_tokens == num_gap_tokens + num_tokens_to_recompute(0.15, 81)
    assert not torch.equal(heads.logits, plain.logits)


def test_ratio_zero_stays_plain_reuse_and_ratio_one_a_full_prefill(blender: LayerwiseBlender) -> None:
    tokens = prompt(blender)
    reuse = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=0.0))
    reuse_heads = blender.prefill(tokens, store_result=False,
                                  config=BlendConfig(recompute_ratio=0.0, num_head_tokens=4))  # fmt: skip
    assert reuse_heads.num_recomputed_tokens == reuse.num_recomputed_tokens == len(tokens) - 3 * DOCUMENT_TOKENS
    torch.testing.assert_close(reuse_heads.logits, reuse.logits, rtol=0, atol=0)
    full = blender.prefill(tokens, mode="full", store_result=False)
    exact = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=1.0, num_head_tokens=4))
    torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-5)


def test_a_negative_head_count_is_refused() -> None:
    with pytest.raises(ConfigError, match="num_head_tokens=-1 must be a token count >= 0"):
        BlendConfig(num_head_tokens=-1)
