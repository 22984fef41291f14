"""Finding the model a vLLM worker loaded, by identity, and refusing the ones the pass cannot run (one line each).

The trees here are plain torch modules named and shaped as vLLM's Llama classes are (``model.layers.N.self_attn``
with ``qkv_proj``, ``o_proj``, ``rotary_emb``, ``attn``): the lookup reads only those names and attributes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore.blend.vllm.model_lookup import find_loaded_model
from kvstore.errors import ConfigError


class _Rotary(torch.nn.Module):
    def __init__(self, rotary_dim: int = 64, neox: bool = True) -> None:
        super().__init__()
        self.rotary_dim, self.is_neox_style = rotary_dim, neox


class _Attention(torch.nn.Module):
    def __init__(self, **rotary: Any) -> None:
        super().__init__()
        self.head_dim = 64
        self.qkv_proj, self.o_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.rotary_emb, self.attn = _Rotary(**rotary), torch.nn.Identity()


class _Layer(torch.nn.Module):
    def __init__(self, **rotary: Any) -> None:
        super().__init__()
        self.self_attn = _Attention(**rotary)


class _Decoder(torch.nn.Module):
    def __init__(self, num_layers: int, **rotary: Any) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(**rotary) for _ in range(num_layers))
        self.start_layer, self.end_layer = 0, num_layers


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, num_layers: int = 2, **rotary: Any) -> None:
        super().__init__()
        self.model = _Decoder(num_layers, **rotary)
        self.config = SimpleNamespace(layer_types=None)


class GPT2LMHeadModel(LlamaForCausalLM):
    pass


def engine_config(**changes: Any) -> SimpleNamespace:
    model_config = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization=None)
    settings = {"speculative_config": None, "lora_config": None} | changes
    return SimpleNamespace(model_config=model_config, **settings)


def attention_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {f"model.layers.{index}.self_attn.attn": layer.self_attn.attn for index, layer in
            enumerate(model.model.layers)}  # type: ignore[union-attr, arg-type]  # fmt: skip


def test_the_model_owning_the_engines_attention_layers_is_found_among_others() -> None:
    model, other = LlamaForCausalLM(), LlamaForCausalLM()
    assert find_loaded_model(engine_config(), attention_of(model)) is model
    assert find_loaded_model(engine_config(), attention_of(other)) is other


@pytest.mark.parametrize(
    ("build", "config", "message"),
    [
        pytest.param(GPT2LMHeadModel, {}, "kvstore.blend runs LlamaForCausalLM", id="architecture"),
        pytest.param(lambda: LlamaForCausalLM(neox=False), {}, "NeoX-style RoPE over the whole head", id="gptj-rope"),
        pytest.param(lambda: LlamaForCausalLM(rotary_dim=32), {}, "rotary_dim=32", id="partial-rope"),
        pytest.param(LlamaForCausalLM, {"speculative_config": object()}, "speculative decoding", id="speculative"),
        pytest.param(LlamaForCausalLM, {"lora_config": object()}, "LoRA", id="lora"),
    ],
)
def test_what_the_pass_cannot_run_is_refused_with_one_line(build: Any, config: dict[str, Any], message: str) -> None:
    model = build()
    with pytest.raises(ConfigError, match=message) as refused:
        find_loaded_model(engine_config(**config), attention_of(model))
    assert "\n" not in str(refused.value)


def test_qk_norm_sliding_windows_and_pipeline_stages_are_refused() -> None:
    normed = LlamaForCausalLM()
    normed.model.layers[0].self_attn.q_norm = torch.nn.Identity()  # type: ignore[index, union-attr]
    sliding = LlamaForCausalLM()
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    staged = LlamaForCausalLM()
    staged.model.start_layer = 1  # type: ignore[union-attr, assignment]
    for model, message in ((normed, "qk_norm"), (sliding, "sliding-window"), (staged, "pipeline")):
        with pytest.raises(ConfigError, match=message):
            find_loaded_model(engine_config(), attention_of(model))
