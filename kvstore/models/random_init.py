"""Randomly initialised Llama models of real shapes, built in code: speed benchmarks without downloading weights.

A prefill's time depends on the model's shape, not on its weights, so the GPU speed benchmark runs a random model of
Llama-3.1-8B's exact configuration (32 layers, hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocabulary
128256, llama3 RoPE with theta 5e5) in bfloat16. Its outputs are noise, so quality metrics mean nothing with it.
``tiny-llama`` is the same architecture at toy size (llama3 RoPE included) for CPU tests.

The weights are created directly on the target device in the target dtype (``torch.device`` context), so an 8B
model never passes through host memory, and the random state is forked so the caller's RNG is untouched. The rotary
``inv_freq`` buffer stays float32 (transformers computes it in float32 explicitly), which the RoPE gate checks.

Functions are safe to call from several threads; the returned model is not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models.hf_config import layout_from_hf_config
from kvstore.models.random_init_names import RANDOM_INIT_PRESETS, check_random_init_preset

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["RANDOM_INIT_PRESETS", "RandomInitModel", "random_init_config", "random_init_model"]

logger = logging.getLogger(__name__)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
    "tiny-llama": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomInitModel:
    """A random model and its KV layout (``model_id`` ``random-init/<preset>...``, never a real model's namespace)."""

    model: PreTrainedModel
    layout: KVLayout


def random_init_config(preset: str, *, num_layers: int | None = None) -> Any:
    """The transformers ``LlamaConfig`` of a preset (``num_layers`` overrides its depth).

    Raises:
        ConfigError: an unknown preset or a non-positive ``num_layers``.
    """
    check_random_init_preset(preset)
    if num_layers is not None and (isinstance(num_layers, bool) or num_layers < 1):
        raise ConfigError(f"num_layers={num_layers!r} must be a positive number of layers")
    from transformers import LlamaConfig

    settings = dict(_PRESETS[preset])
    if num_layers is not None:
        settings["num_hidden_layers"] = num_layers
    return LlamaConfig(**settings)


def random_init_model(
    preset: str,
    *,
    num_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> RandomInitModel:
    """Build a randomly initialised model of a preset's shape, in eval mode, on ``device`` in ``dtype``.

    Args:
        preset: one of ``RANDOM_INIT_PRESETS``.
        num_layers: override of the preset's depth (a shallow 8B-wide model for a quick run).
        device: where the weights are created.
        dtype: their dtype (and the layout's KV dtype).
        seed: the weights' random seed.

    Raises:
        ConfigError: an unknown preset or a bad ``num_layers``.
    """
    from transformers import AutoModelForCausalLM

    config = random_init_config(preset, num_layers=num_layers)
    target = torch.device(device)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        torch.manual_seed(seed)
        with target:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.eval()
    depth = "" if num_layers is None else f"-{num_layers}layers"
    layout = layout_from_hf_config(model.config, model_id=f"random-init/{preset}{depth}-seed{seed}",
                                   dtype=KVDtype.parse(dtype))  # fmt: skip
    logger.info("built a random %s in %.1f s", layout.describe(), time.perf_counter() - started)
    return RandomInitModel(model=model, layout=layout)
