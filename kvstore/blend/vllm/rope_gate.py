"""The RoPE gate on a vLLM model: kvstore's rotation of cached K must equal vLLM's own rotary embedding.

The Hugging Face gate (``kvstore.blend.rope_gate``) isolates the rotation by running one-token sequences through the
whole model. Inside vLLM the rotation is one op per layer (``rotary_emb``, vLLM's kernel for the device), so the
probe calls it directly: each layer's pre-RoPE K of the probe tokens (their embedding through that layer's norm and
``qkv_proj``) is rotated by vLLM to ``p`` and to ``p + d``, and kvstore's rotation of the first by ``d`` must match
the second within the same tolerance. The layout is also compared with the model's config (shape and RoPE
parameters), as for Hugging Face models.

vLLM's rotary embedding looks its angles up in a table of ``max_position_embeddings`` rows, so only the shifts whose
both ends lie inside it are probed: an engine never rotates to a position past the table (a prompt that long is
refused), and probing one would read outside it (a 4,096-position model such as Llama 2 would fail the gate).
"""

from __future__ import annotations

import torch

from kvstore.blend.rope_gate import (
    DEFAULT_PROBE_TOKEN_IDS,
    DEFAULT_SHIFTS,
    PositionShift,
    ProbedKV,
    RopeGateReport,
    gate_report,
    layout_mismatches,
    raise_unless_passed,
)
from kvstore.blend.vllm.llama_stack import VllmLlamaStack
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout

__all__ = ["require_vllm_rope_gate"]


def require_vllm_rope_gate(stack: VllmLlamaStack, layout: KVLayout, hf_config: object) -> RopeGateReport:
    """Run the gate on every layer's rotary embedding; the report of a gate that passed.

    Raises:
        ConfigError: "refusing to blend model X: ..." (the layout differs from the config, or vLLM rotates
            differently from kvstore).
    """
    vocab_size = int(getattr(hf_config, "vocab_size", 0) or max(DEFAULT_PROBE_TOKEN_IDS) + 1)
    device = stack.device
    tokens = torch.tensor([token % vocab_size for token in DEFAULT_PROBE_TOKEN_IDS], dtype=torch.int64, device=device)
    shifts = _shifts_inside(stack.max_rope_position(), DEFAULT_SHIFTS)
    sources = torch.tensor([shift.position for shift in shifts], dtype=torch.int64).repeat_interleave(len(tokens))
    deltas = torch.tensor([shift.delta for shift in shifts], dtype=torch.int64).repeat_interleave(len(tokens))
    probe_tokens = tokens.repeat(len(shifts))
    at_source, at_target = [], []
    with torch.inference_mode():
        for layer_idx in range(stack.num_layers):
            raw = stack.raw_keys(layer_idx, probe_tokens)
            at_source.append(stack.rotate_keys(layer_idx, raw, sources.to(device)))
            at_target.append(stack.rotate_keys(layer_idx, raw, (sources + deltas).to(device)))
    shape = (stack.num_layers, len(probe_tokens), stack.num_kv_heads, stack.head_dim)
    keys_at_source = torch.stack(at_source).view(shape)
    keys_at_target = torch.stack(at_target).view(shape)
    values = torch.zeros(shape, dtype=keys_at_source.dtype, device=device)  # no V moves: only K is rotated here
    report = gate_report(
        ProbedKV(keys=keys_at_source, values=values),
        ProbedKV(keys=keys_at_target, values=values),
        deltas=deltas,
        shifts=shifts,
        compute_dtype=KVDtype.parse(stack.dtype),
        layout=layout,
        config_mismatches=layout_mismatches(hf_config, layout),
    )
    return raise_unless_passed(report)


def _shifts_inside(num_positions: int, shifts: tuple[PositionShift, ...]) -> tuple[PositionShift, ...]:
    """The shifts whose both ends are positions the rotary table holds.

    Raises:
        ConfigError: none is (a table too short to probe).
    """
    inside = tuple(shift for shift in shifts if max(shift.position, shift.target) < num_positions)
    if not inside:
        raise ConfigError(f"kvstore.blend: the model's rotary table holds {num_positions} positions, too few to check")
    return inside
