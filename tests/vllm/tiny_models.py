"""Tiny random-weight models of the engine shapes kvstore serves, as Hugging Face directories vLLM loads.

An fp8 KV cache on vLLM's CPU backend needs a head size divisible by 32; vLLM's CPU MLA kernels accept only
576-wide latents (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64) and its AMX MLA backend only bfloat16 weights. The
models here are those shapes at toy width and depth (two layers), so an engine starts and prefills in seconds on two
cores. Random weights give deterministic greedy outputs, so "identical with and without the connector" is a real
check. They use SmolLM2's tokenizer (copied from ``export_smollm2_for_vllm``'s directory), and each directory is
built once per machine in the model cache (its name carries a hash of the config, so a changed shape builds anew).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from kvstore.models.built_once import built_once

__all__ = ["TINY_DEEPSEEK_V2", "TINY_GEMMA3", "TINY_LLAMA", "tiny_model_dir"]

_VOCAB = 49152  # SmolLM2's tokenizer
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": _VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
"""A two-layer Llama with four 64-wide KV heads (fp8 KV on CPU needs a head size divisible by 32; four heads split
over two tensor-parallel ranks two by two, so per-head fp8 scales can differ within a rank)."""

TINY_DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": _VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # every layer dense: no MoE kernels in the way of the attention under test
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
}
"""A two-layer DeepSeek-V2 (MLA: a 512-wide compressed latent and a 64-wide rope part per token)."""

TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": _VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}
"""A four-layer Gemma 3 (text only): three sliding-window layers of a 64-token window and a full-attention layer last
(Gemma 3's five-to-one pattern, shortened), each type with its own RoPE theta. Weights drawn with a wide range (0.3,
not 0.02) and the output head untied: with Gemma's scaled, tied embeddings every prompt decodes to its own last token
repeated, whatever its KV; this way another prefix (beyond the window) changes the greedy tokens."""


def tiny_model_dir(cache_dir: Path, tokenizer_dir: Path, config: dict[str, Any], *, dtype: torch.dtype) -> Path:
    """The directory of a random model of ``config`` in ``dtype`` (built once, seed 0), with ``tokenizer_dir``'s
    tokenizer files."""
    text = json.dumps(config, sort_keys=True) + str(dtype)
    target = cache_dir / f"tiny-{config['model_type']}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    def build(directory: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        settings = {key: value for key, value in config.items() if key not in ("architectures", "model_type")}
        hf_config = AutoConfig.for_model(config["model_type"], **settings)
        hf_config.architectures = list(config["architectures"])
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        model.save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, directory / name)

    return built_once(target, "config.json", build, f"the tiny {config['model_type']} model")
