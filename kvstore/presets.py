"""KV layouts of the models kvstore is measured with, by short name.

``smollm2-135m`` is the real trained model the quality tests load; ``llama3.1-8b``
is the shape the speed benchmarks use (128 KiB of bf16 KV per token, 32 MiB per 256-token chunk).
"""

from __future__ import annotations

from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
from kvstore.preset_names import PRESET_NAMES, check_preset_name

__all__ = ["PRESET_NAMES", "preset_layout"]


def preset_layout(name: str) -> KVLayout:
    """The layout of a named model shape.

    Raises:
        ConfigError: the name is not one of ``PRESET_NAMES``.
    """
    check_preset_name(name)
    if name == "smollm2-135m":
        return KVLayout(
            model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            dtype=KVDtype.BFLOAT16,
            rope=RopeSpec(theta=100000.0),
        )
    if name == "llama3.1-8b":
        return KVLayout(
            model_id="meta-llama/Llama-3.1-8B",
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=KVDtype.BFLOAT16,
            rope=RopeSpec(
                theta=500000.0,
                scaling=RopeScaling.LLAMA3,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        )
    raise AssertionError(f"preset {name!r} is in PRESET_NAMES but has no layout here")
