"""Random-init models of real shapes: the 8B config is Llama-3.1-8B's (checked on the meta device, no memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.blend import require_rope_gate
from kvstore.errors import ConfigError
from kvstore.models import layout_from_hf_config, random_init_config, random_init_model
from kvstore.presets import preset_layout


def test_the_8b_preset_has_llama_3_1_8b_shape_and_rope() -> None:
    from transformers import AutoModelForCausalLM

    config = random_init_config("llama3.1-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layout = layout_from_hf_config(model.config, model_id="meta-llama/Llama-3.1-8B", dtype="bfloat16")
    assert layout == preset_layout("llama3.1-8b")
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (4096, 14336, 32)
    assert config.vocab_size == 128256
    assert 8.0e9 < sum(parameter.numel() for parameter in model.parameters()) < 8.1e9
    assert random_init_config("llama3.1-8b", num_layers=2).num_hidden_layers == 2


def test_a_tiny_model_is_deterministic_passes_the_rope_gate_and_keeps_the_callers_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = random_init_model("tiny-llama", dtype=torch.bfloat16, seed=7)
    assert torch.equal(torch.rand(1), before)  # the caller's random stream is untouched
    second = random_init_model("tiny-llama", dtype=torch.bfloat16, seed=7)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert first.layout.model_id == "random-init/tiny-llama-seed7"
    assert first.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert require_rope_gate(first.model, first.layout).passed
    shallow = random_init_model("tiny-llama", num_layers=2, dtype=torch.float32)
    assert dataclasses.replace(shallow.layout, model_id="x").num_layers == 2
    assert shallow.layout.model_id == "random-init/tiny-llama-2layers-seed0"


def test_unknown_presets_and_depths_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown random-init model 'gpt5'; use one of llama3\.1-8b, tiny-llama"):
        random_init_config("gpt5")
    with pytest.raises(ConfigError, match="num_layers=0 must be a positive number of layers"):
        random_init_config("tiny-llama", num_layers=0)


def test_the_light_names_are_the_configured_presets() -> None:
    """``kvstore bench`` checks --random-init against the torch-free names: they must be the configurations' keys."""
    from kvstore.models import random_init
    from kvstore.models.random_init_names import RANDOM_INIT_PRESETS

    assert tuple(random_init._PRESETS) == RANDOM_INIT_PRESETS == random_init.RANDOM_INIT_PRESETS
