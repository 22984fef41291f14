"""``BlendConfig.stale_key_scale``: the keys of cached tokens kept after the check layer are scaled in the attention
and in the decode cache, never in the stored ``kv``; the selection, ratio 0 and ratio 1.0 keep their meaning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.blend import BlendConfig, LayerwiseBlender
from kvstore.blend.blender import BlendOutput
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models import RandomInitModel
from kvstore.tiers.base import TierName

CHUNK = 8
CHECK_LAYER = 1
SCALE = 0.5  # a power of two: scaled keys compare exactly


def _documents() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 500, 27).tolist() for _ in range(3)]


def _prompt(docs: list[list[int]]) -> list[int]:
    """81 blend tokens at new offsets, 11 gap tokens (the last one included)."""
    return [1, 2, 3, 4, 5] + docs[2] + [6] + docs[0] + [7, 8] + docs[1] + [9, 10, 11]


def _decode_keys(output: BlendOutput, layer: int) -> torch.Tensor:
    """The decode cache's keys of one layer, token-major ``[T, Hkv, D]`` like ``kv``."""
    return output.cache.layers[layer].keys[0].permute(1, 0, 2)


@pytest.fixture(params=[KVDtype.FLOAT32, KVDtype.BFLOAT16], ids=["same-dtype", "bf16-cache"])
def blender(request: pytest.FixtureRequest, tiny_llama: RandomInitModel, tmp_path: Path) -> LayerwiseBlender:
    """A cpu-tier blender whose cache dtype is the model's (keys are views of ``kv``) or bfloat16 (copies)."""
    base = tiny_llama.layout
    layout = KVLayout(model_id=base.model_id, num_layers=base.num_layers, num_kv_heads=base.num_kv_heads,
                      head_dim=base.head_dim, dtype=request.param, rope=base.rope)  # fmt: skip
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK, cpu_capacity_bytes=64 << 20,
                         data_dir=tmp_path / "data", enable_blend=True)  # fmt: skip
    store = TieredStore(layout, config)
    blender = LayerwiseBlender(tiny_llama.model, store)
    request.addfinalizer(store.close)
    request.addfinalizer(blender.close)
    for doc in _documents():
        blender.prefill(doc, mode="full")
    return blender


def test_kept_cached_keys_are_scaled_for_attention_and_decoding_but_not_stored(blender: LayerwiseBlender) -> None:
    prompt = _prompt(_documents())
    plain = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=0.15))
    damped = blender.prefill(prompt, store_result=False,
                             config=BlendConfig(recompute_ratio=0.15, stale_key_scale=SCALE))  # fmt: skip
    assert damped.plan == plain.plan and damped.num_recomputed_tokens == plain.num_recomputed_tokens == 24
    num_kept = damped.plan.num_blend_tokens - (damped.num_recomputed_tokens - damped.plan.num_gap_tokens)
    num_layers = damped.kv.shape[0]
    for layer in range(num_layers):
        stored = damped.kv[layer, 0]
        decoded = _decode_keys(damped, layer).to(stored.dtype)  # fresh float32 keys are stored rounded
        differs = (decoded != stored).any(dim=(1, 2))
        if layer <= CHECK_LAYER:  # every non-exact token is fresh up to the check layer: nothing is kept
            assert not differs.any()
            continue
        assert int(differs.sum()) == num_kept == 68
        torch.testing.assert_close(decoded[differs].float(), stored[differs].float() * SCALE, rtol=0, atol=0)
        # The stored KV of the kept tokens is the cached KV as loaded, as without the option.
        torch.testing.assert_close(damped.kv[layer][:, differs], plain.kv[layer][:, differs], rtol=0, atol=0)
    torch.testing.assert_close(damped.cache.layers[0].values, plain.cache.layers[0].values, rtol=0, atol=0)
    assert not torch.equal(damped.logits, plain.logits), "the scaled keys change what the last token attends to"


def test_ratio_zero_stays_plain_reuse_and_ratio_one_a_full_prefill(blender: LayerwiseBlender) -> None:
    prompt = _prompt(_documents())
    for ratio in (0.0, 1.0):
        plain = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=ratio))
        scaled = blender.prefill(prompt, store_result=False,
                                 config=BlendConfig(recompute_ratio=ratio, stale_key_scale=SCALE))  # fmt: skip
        torch.testing.assert_close(scaled.logits, plain.logits, rtol=0, atol=0)
        torch.testing.assert_close(scaled.kv, plain.kv, rtol=0, atol=0)
        for layer in range(scaled.kv.shape[0]):
            torch.testing.assert_close(_decode_keys(scaled, layer), _decode_keys(plain, layer), rtol=0, atol=0)


@pytest.mark.parametrize("scale", [0, 0.0, -0.5, 1.5, True, "0.9", float("nan")])
def test_a_scale_outside_zero_to_one_is_refused(scale: object) -> None:
    with pytest.raises(ConfigError, match=r"stale_key_scale=.* must be in \(0, 1\]"):
        BlendConfig(stale_key_scale=scale)  # type: ignore[arg-type]
