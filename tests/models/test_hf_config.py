"""Hugging Face configs, transformers 4 and 5 style, read into layouts; RoPE schemes a rotation cannot fix refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvstore.blend.rope import inverse_frequencies
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, RopeScaling, RopeSpec
from kvstore.models import layout_from_hf_config, rope_spec_from_hf_config
from kvstore.presets import preset_layout

# config.json of Llama-3.1-8B as transformers 4 wrote it: rope_theta and rope_scaling at the top level.
LLAMA31_8B_V4 = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
}


def test_a_transformers_4_config_json_gives_the_preset_layout() -> None:
    layout = layout_from_hf_config(LLAMA31_8B_V4, model_id="meta-llama/Llama-3.1-8B")
    assert layout == preset_layout("llama3.1-8b")


def test_a_transformers_5_config_object_gives_the_same_layout() -> None:
    config = LlamaConfig(**{key: value for key, value in LLAMA31_8B_V4.items() if key != "model_type"})
    assert "rope_theta" in config.rope_parameters  # transformers 5 moved it there
    assert layout_from_hf_config(config, model_id="meta-llama/Llama-3.1-8B", dtype="bf16") == preset_layout(
        "llama3.1-8b"
    )


def test_old_style_keys_and_defaults() -> None:
    linear = {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2}}
    assert rope_spec_from_hf_config(linear) == RopeSpec(theta=1e4, scaling=RopeScaling.LINEAR, factor=2.0)
    assert rope_spec_from_hf_config({}) == RopeSpec(theta=10000.0)
    llama3_without_original = {
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
    }
    assert rope_spec_from_hf_config(llama3_without_original).original_max_position_embeddings == 4096


def test_shape_fields_dtype_and_name() -> None:
    config = {"_name_or_path": "org/tiny", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    layout = layout_from_hf_config(config)
    assert (layout.model_id, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        "org/tiny",
        4,
        16,
        KVDtype.FLOAT32,
    )
    assert layout_from_hf_config(config, dtype=torch.float16).dtype is KVDtype.FLOAT16
    assert layout_from_hf_config({**config, "dtype": "bfloat16"}).dtype is KVDtype.BFLOAT16


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn' cannot be moved by one rotation"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' cannot be moved"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "rope type 'longrope' cannot be moved"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"full_attention": {"rope_type": "default"}, "sliding_attention": {}}, "per-layer-type RoPE parameters"),
        ({"rope_type": "linear"}, "linear rope parameters lack a numeric 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "lack a numeric 'low_freq_factor'"),
    ],
)
def test_rope_schemes_a_rotation_cannot_correct_are_refused(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rope_spec_from_hf_config({"_name_or_path": "org/model", "rope_parameters": parameters})


def test_a_transformers_yarn_config_is_refused_with_the_model_name() -> None:
    config = LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    config._name_or_path = "org/long-context"
    with pytest.raises(ConfigError, match="refusing RoPE correction for model org/long-context: rope type 'yarn'"):
        rope_spec_from_hf_config(config)


def test_missing_or_bad_fields_say_which() -> None:
    with pytest.raises(ConfigError, match="config has no num_attention_heads"):
        layout_from_hf_config({"_name_or_path": "x", "hidden_size": 64})
    with pytest.raises(ConfigError, match="num_hidden_layers=0 must be a positive integer"):
        layout_from_hf_config(
            {"_name_or_path": "x", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 0}
        )
    with pytest.raises(ConfigError, match="carries no name; pass model_id"):
        layout_from_hf_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="are not a mapping"):
        rope_spec_from_hf_config({"rope_parameters": 3})


# Gemma 3's text config as transformers 5 writes it (trimmed): sliding-window layers and full-attention layers,
# each type with its own RoPE (the 4B-27B models scale the full layers' linearly).
GEMMA3_V5 = {
    "_name_or_path": "google/gemma-3-4b-it",
    "model_type": "gemma3_text",
    "hidden_size": 2560,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "num_hidden_layers": 6,
    "sliding_window": 1024,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
}


def test_a_sliding_window_model_with_rope_per_layer_type_is_stored_with_every_types_rope_in_its_identity() -> None:
    layout = layout_from_hf_config(GEMMA3_V5)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (6, 4, 256)
    assert layout.rope == RopeSpec(
        theta=1e6,
        scaling=RopeScaling.PER_LAYER_TYPE,
        extra=(
            ("full_attention.linear.factor", 8.0),
            ("full_attention.linear.theta", 1e6),
            ("sliding_attention.default.theta", 1e4),
        ),
    )
    local = {**GEMMA3_V5, "rope_parameters": {**GEMMA3_V5["rope_parameters"], "sliding_attention": {"rope_theta": 2e4}}}
    assert layout_from_hf_config(local).namespace != layout.namespace, "each type's RoPE is in the identity"
    with pytest.raises(ConfigError, match="per-layer-type RoPE parameters"):
        rope_spec_from_hf_config(GEMMA3_V5)  # what blending would ask: no one rotation moves its K
    with pytest.raises(ConfigError, match="has no rotation"):
        inverse_frequencies(layout.rope, layout.head_dim)


def test_a_transformers_4_gemma3_config_gives_the_same_layout_as_transformers_5() -> None:
    v4 = {key: value for key, value in GEMMA3_V5.items() if key not in ("rope_parameters", "layer_types")}
    v4 |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert layout_from_hf_config(v4) == layout_from_hf_config(GEMMA3_V5)


def test_per_layer_type_rope_of_a_model_using_one_type_is_that_types_rope() -> None:
    config = {**GEMMA3_V5, "layer_types": ["full_attention"] * 6}
    assert layout_from_hf_config(config).rope == RopeSpec(theta=1e6, scaling=RopeScaling.LINEAR, factor=8.0)
    with pytest.raises(ConfigError, match="layers of type 'chunked_attention' have no rope parameters"):
        layout_from_hf_config({**config, "layer_types": ["chunked_attention", "sliding_attention"]})


def test_a_sliding_window_model_with_one_rope_keeps_it_and_is_stored_even_with_yarn() -> None:
    qwen2_style = {
        "_name_or_path": "org/sliding",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "sliding_window": 128,
        "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    assert layout_from_hf_config(qwen2_style).rope == RopeSpec(theta=1e6)
    yarn = {**qwen2_style, "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 15e4}}
    assert layout_from_hf_config(yarn).rope.scaling is RopeScaling.YARN  # stored only: blending refuses the model
    with pytest.raises(ConfigError, match="rope type 'yarn' cannot be moved"):
        layout_from_hf_config({**yarn, "layer_types": ["full_attention"] * 2})
