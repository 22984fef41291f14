"""The per-model RoPE gate: proof, with the model's own code, that re-rotating its cached K is exact.

Blending moves cached K to new positions with ``kvstore.blend.rope``; that is only right if our rotation is the
one the model applies. The gate runs the real model at positions ``p`` and ``p + d`` and checks
``rotate(K@p, d) == K@(p+d)`` for every layer and KV head, in the layout's cache dtype; ``require_rope_gate`` refuses
to blend a model that fails. It also compares the layout with the model's config (shape and RoPE parameters), so a
layout that merely happens to be close is refused too.

**Isolating the rotation.** K of layer l > 0 is k_proj of hidden states that earlier layers computed, and in a
prompt of several tokens those depend on positions through attention: K@(p+d) of a deep layer differs from
rotate(K@p, d) even when the rotation is right, because its input changed. The gate therefore feeds each probe as a
*sequence of one token*: attention over a single key is ``softmax([score]) = [1]`` whatever the score, so every
layer's attention returns that token's own V, and the hidden states, hence the pre-rotation K of every layer, are
the same at every position. The only position dependence left is the rotary embedding the model's own attention
code applies to K, which is exactly what is under test. V carries no rotation, so ``V@p == V@(p+d)`` checks the
isolation on every run; the gate fails if it does not hold. All probes (tokens x shifts) run as one batch of
one-token sequences with explicit ``position_ids``, and K and V are read from the returned cache.

**Tolerance** (``gate_tolerance``), on the relative error of each head vector, ``|rotated - K@(p+d)| / |K@(p+d)|``
(a rotation keeps norms, so this is scale-free). Let u be a dtype's unit roundoff: 2**-24 (float32), 2**-11
(float16), 2**-8 (bfloat16).

- Angles: the model computes ``position * inv_freq`` in float32, off by up to ``angle * 2**-24`` rad; K@p and K@(p+d)
  each carry that (ours is float64, exact), moving the vector by at most ``2 * max_angle * 2**-24`` of its norm;
  plus 16 float32 ulps for cos/sin and the rotation arithmetic. With positions up to 8123 and inv_freq[0] = 1 that
  is 9.7e-4: the float32 bound, dominated by the model's own float32 angles, not by our rotation.
- Cache rounding: K@p stored in the cache dtype, the rotated result stored again, K@(p+d) stored: 3 u(cache).
- Model arithmetic: a model running in half precision applies RoPE in that dtype (cos, sin, two products and a
  sum rounded: under 4 u per application, two applications): 8 u(compute).

On SmolLM2-135M-Instruct the error of the right layout stays under its bound in every dtype combination, and a layout
with the wrong theta lands far above every bound (measured: docs/design-notes.md#blend-rope-gate). A wrong scaling of
the lowest frequencies can hide under the bfloat16 bound; the config comparison catches it exactly.

Runs the model under ``torch.inference_mode`` in eval mode (restored afterwards); not thread-safe with other users
of the same model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.blend.rope import RopeRotator
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
from kvstore.models.hf_config import layout_from_hf_config

__all__ = [
    "DEFAULT_PROBE_TOKEN_IDS",
    "DEFAULT_SHIFTS",
    "PositionShift",
    "ProbedKV",
    "RopeGateReport",
    "check_rope_gate",
    "gate_report",
    "gate_tolerance",
    "layout_mismatches",
    "raise_unless_passed",
    "require_rope_gate",
]

logger = logging.getLogger(__name__)

_UNIT_ROUNDOFF = {KVDtype.FLOAT32: 2.0**-24, KVDtype.FLOAT16: 2.0**-11, KVDtype.BFLOAT16: 2.0**-8}
_FLOAT32_ULPS_FOR_TRIGONOMETRY = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class PositionShift:
    """K computed at ``position`` is moved by ``delta`` (negative moves it earlier)."""

    position: int
    delta: int

    def __post_init__(self) -> None:
        if self.position < 0 or self.position + self.delta < 0:
            raise ConfigError(
                f"position shift {self.position} -> {self.position + self.delta} leaves the prompt; both "
                "positions must be >= 0"
            )

    @property
    def target(self) -> int:
        return self.position + self.delta


DEFAULT_SHIFTS = (
    PositionShift(position=0, delta=1),
    PositionShift(position=0, delta=4095),
    PositionShift(position=7, delta=300),
    PositionShift(position=300, delta=-300),
    PositionShift(position=1000, delta=3000),
    PositionShift(position=4000, delta=-3999),
    PositionShift(position=4096, delta=4000),
    PositionShift(position=123, delta=8000),
)
"""Small and large moves both ways; large deltas expose errors in the low frequencies (long wavelengths)."""

DEFAULT_PROBE_TOKEN_IDS = (1, 17, 256, 1000, 5000, 20000)
"""Token ids run at every shift (reduced modulo the vocabulary size)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeGateReport:
    """What the gate measured for one model and layout.

    Args:
        model_id: the layout's model id.
        compute_dtype: the model's parameter dtype.
        cache_dtype: the layout's KV dtype, in which K was compared.
        num_layers: layers whose K was checked.
        num_probes: token x shift probes per layer.
        max_key_error: largest relative error of a rotated K head vector.
        mean_key_error: mean of the same over every layer, probe and head.
        max_value_error: largest relative difference of V between the two positions (0 when isolation held).
        tolerance: the bound both maxima must stay within (``gate_tolerance``).
        worst_layer_idx: layer of the largest K error.
        worst_shift: the shift of the largest K error.
        config_mismatches: differences between the layout and the model's config, one sentence each.
    """

    model_id: str
    compute_dtype: KVDtype
    cache_dtype: KVDtype
    num_layers: int
    num_probes: int
    max_key_error: float
    mean_key_error: float
    max_value_error: float
    tolerance: float
    worst_layer_idx: int
    worst_shift: PositionShift
    config_mismatches: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return (
            not self.config_mismatches
            and self.max_key_error <= self.tolerance
            and self.max_value_error <= self.tolerance
        )

    def describe(self) -> str:
        """One line for logs and errors."""
        verdict = "passed" if self.passed else "FAILED"
        text = (
            f"rope gate {verdict} for {self.model_id} ({self.compute_dtype.value} model, {self.cache_dtype.value} "
            f"cache, {self.num_layers} layers x {self.num_probes} probes): max K error {self.max_key_error:.3g} "
            f"(mean {self.mean_key_error:.3g}, tolerance {self.tolerance:.3g}) at layer {self.worst_layer_idx}, "
            f"position {self.worst_shift.position} -> {self.worst_shift.target}; max V difference "
            f"{self.max_value_error:.3g}"
        )
        if self.config_mismatches:
            text += "; config mismatches: " + "; ".join(self.config_mismatches)
        return text


def gate_tolerance(*, compute_dtype: KVDtype, cache_dtype: KVDtype, max_angle_rad: float) -> float:
    """The largest relative K error a correct rotation can show (derivation in the module docstring).

    Args:
        compute_dtype: the model's dtype.
        cache_dtype: the KV cache dtype the comparison runs in.
        max_angle_rad: the largest rotary angle probed, ``max position * max inv_freq``.
    """
    float32 = _UNIT_ROUNDOFF[KVDtype.FLOAT32]
    angles = (2 * max_angle_rad + _FLOAT32_ULPS_FOR_TRIGONOMETRY) * float32
    return angles + 3 * _UNIT_ROUNDOFF[cache_dtype] + 8 * _UNIT_ROUNDOFF[compute_dtype]


def check_rope_gate(
    model: torch.nn.Module,
    layout: KVLayout,
    *,
    shifts: Sequence[PositionShift] = DEFAULT_SHIFTS,
    token_ids: Sequence[int] = DEFAULT_PROBE_TOKEN_IDS,
) -> RopeGateReport:
    """Run the gate: the model's K at ``p`` rotated by ``d`` with ``layout.rope`` against its K at ``p + d``.

    Args:
        model: a Hugging Face causal LM of the Llama family (``LoadedModel.model``), on any device.
        layout: the layout whose RoPE parameters blending would use.
        shifts: the (position, delta) pairs to probe.
        token_ids: the tokens probed at each shift.

    Returns:
        The report; ``report.passed`` says whether blending this model with this layout is exact.

    Raises:
        ConfigError: no shifts or tokens, a model dtype that is no KV dtype, or a model that returns no
            per-layer KV cache.
    """
    if not shifts or not token_ids:
        raise ConfigError("the rope gate needs at least one position shift and one probe token")
    config = getattr(model, "config", None)
    parameter = next(model.parameters())
    compute_dtype = KVDtype.parse(parameter.dtype)
    vocab_size = int(getattr(config, "vocab_size", 0) or max(token_ids) + 1)
    tokens = torch.tensor([token_id % vocab_size for token_id in token_ids], dtype=torch.int64)
    input_ids = tokens.repeat(len(shifts))[:, None].to(parameter.device)
    sources = torch.tensor([shift.position for shift in shifts], dtype=torch.int64).repeat_interleave(len(tokens))
    deltas = torch.tensor([shift.delta for shift in shifts], dtype=torch.int64).repeat_interleave(len(tokens))
    deltas = deltas.to(parameter.device)
    sources = sources.to(parameter.device)

    was_training = model.training
    model.eval()
    try:
        keys_at_source, values_at_source = _probe(model, input_ids, sources, layout.model_id)
        keys_at_target, values_at_target = _probe(model, input_ids, sources + deltas, layout.model_id)
    finally:
        model.train(was_training)
    return gate_report(
        ProbedKV(keys=keys_at_source, values=values_at_source),
        ProbedKV(keys=keys_at_target, values=values_at_target),
        deltas=deltas,
        shifts=shifts,
        compute_dtype=compute_dtype,
        layout=layout,
        config_mismatches=layout_mismatches(config, layout),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbedKV:
    """K and V ``[layers, probes, kv_heads, head_dim]`` a model produced for the gate's probes at one set of
    positions (V is position-free when the probe isolates the rotation)."""

    keys: torch.Tensor
    values: torch.Tensor


def gate_report(
    at_source: ProbedKV,
    at_target: ProbedKV,
    *,
    deltas: torch.Tensor,
    shifts: Sequence[PositionShift],
    compute_dtype: KVDtype,
    layout: KVLayout,
    config_mismatches: tuple[str, ...],
) -> RopeGateReport:
    """Compare the layout's rotation of K at the probes' sources with K at their targets (probe ``i`` is shift
    ``i // (probes / shifts)``, moved by ``deltas[i]``); any model's probe feeds this."""
    keys_at_source, values_at_source = at_source.keys, at_source.values
    keys_at_target, values_at_target = at_target.keys, at_target.values
    device = keys_at_source.device
    probes_per_shift = int(keys_at_source.shape[1]) // len(shifts)
    cache_dtype = layout.dtype.torch_dtype
    rotator = RopeRotator(layout.rope, int(keys_at_source.shape[-1]))
    # keys are [layers, probes, heads, dim]: a token axis of one per probe, each probe with its own delta.
    rotation = rotator.rotation(deltas.to(device)[:, None], device=device)
    rotated = rotation.apply(keys_at_source.to(cache_dtype).unsqueeze(2)).squeeze(2)
    key_errors = _relative_errors(rotated, keys_at_target.to(cache_dtype))
    value_errors = _relative_errors(values_at_source.to(cache_dtype), values_at_target.to(cache_dtype))

    worst_layer_idx, worst_probe_idx, _ = (
        int(index) for index in torch.unravel_index(torch.argmax(key_errors), key_errors.shape)
    )
    max_angle_rad = max(max(shift.position, shift.target) for shift in shifts) * float(rotator.inv_freq.max())
    report = RopeGateReport(
        model_id=layout.model_id,
        compute_dtype=compute_dtype,
        cache_dtype=layout.dtype,
        num_layers=int(key_errors.shape[0]),
        num_probes=int(key_errors.shape[1]),
        max_key_error=float(key_errors.max()),
        mean_key_error=float(key_errors.mean()),
        max_value_error=float(value_errors.max()),
        tolerance=gate_tolerance(compute_dtype=compute_dtype, cache_dtype=layout.dtype, max_angle_rad=max_angle_rad),
        worst_layer_idx=worst_layer_idx,
        worst_shift=shifts[worst_probe_idx // probes_per_shift],
        config_mismatches=config_mismatches,
    )
    logger.info("%s", report.describe())
    return report


def require_rope_gate(
    model: torch.nn.Module,
    layout: KVLayout,
    *,
    shifts: Sequence[PositionShift] = DEFAULT_SHIFTS,
    token_ids: Sequence[int] = DEFAULT_PROBE_TOKEN_IDS,
) -> RopeGateReport:
    """``check_rope_gate``, raising unless it passed; the blender calls this once per model before reusing KV.

    Raises:
        ConfigError: "refusing to blend model X: ..." with what differed and what to change.
    """
    return raise_unless_passed(check_rope_gate(model, layout, shifts=shifts, token_ids=token_ids))


def raise_unless_passed(report: RopeGateReport) -> RopeGateReport:
    """The report of a gate that passed.

    Raises:
        ConfigError: "refusing to blend model X: ..." with what differed and what to change.
    """
    if report.passed:
        return report
    reasons = list(report.config_mismatches)
    if report.max_value_error > report.tolerance:
        reasons.append(
            f"V of a one-token sequence changed with its position (by {report.max_value_error:.3g}), so the model "
            "has position dependence besides RoPE and its cached KV cannot be moved by a rotation"
        )
    if report.max_key_error > report.tolerance:
        reasons.append(
            f"its K at position {report.worst_shift.target} differs from the layout's rotation of its K at position "
            f"{report.worst_shift.position} by {report.max_key_error:.3g} (layer {report.worst_layer_idx}, "
            f"tolerance {report.tolerance:.3g})"
        )
    fix = (
        "build the layout from the model config (kvstore.models.layout_from_hf_config)"
        if report.config_mismatches
        else "the model applies RoPE differently from kvstore's rotation, so blending is not available for it (a "
        "model cast with .to(dtype) after loading has its rotary inv_freq rounded too: load it with dtype= instead)"
    )
    reason = "; ".join([*reasons, fix])
    raise ConfigError(f"refusing to blend model {report.model_id}: {reason}")


def _probe(
    model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, model_id: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, probes, kv_heads, head_dim]`` of one-token sequences at ``positions``."""
    with torch.inference_mode():
        outputs = model(input_ids=input_ids, position_ids=positions[:, None], use_cache=True)
    # transformers 5.24 renamed the output's ``past_key_values`` to ``cache``; the old name still works but warns.
    cache = outputs["cache"] if "cache" in outputs else outputs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ConfigError(
            f"model {model_id} returned no per-layer KV cache; the rope gate needs a transformers (>= 5) causal LM"
        )
    keys = torch.stack([layer.keys[:, :, 0] for layer in layers])
    values = torch.stack([layer.values[:, :, 0] for layer in layers])
    return keys, values


def _relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``|actual - expected| / |expected|`` per head vector, in float32."""
    difference = torch.linalg.vector_norm(actual.float() - expected.float(), dim=-1)
    scale = torch.linalg.vector_norm(expected.float(), dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    errors: torch.Tensor = difference / scale
    return errors


def _describe_rope(rope: RopeSpec) -> str:
    text = f"{rope.scaling.value} theta={rope.theta:g}"
    if rope.scaling is not RopeScaling.DEFAULT:
        text += f" factor={rope.factor:g}"
    if rope.scaling is RopeScaling.LLAMA3:
        text += (
            f" low_freq_factor={rope.low_freq_factor:g} high_freq_factor={rope.high_freq_factor:g}"
            f" original_max_position_embeddings={rope.original_max_position_embeddings}"
        )
    return text


def layout_mismatches(config: object, layout: KVLayout) -> tuple[str, ...]:
    """How ``layout`` differs from what a Hugging Face ``config`` implies (shape and RoPE), one sentence each."""
    if config is None:
        return ("the model has no config to compare the layout with",)
    try:
        expected = layout_from_hf_config(config, model_id=layout.model_id, dtype=layout.dtype)
    except ConfigError as exc:
        return (str(exc),)
    mismatches = [
        f"layout {name}={getattr(layout, name)} but the model has {getattr(expected, name)}"
        for name in ("num_layers", "num_kv_heads", "head_dim")
        if getattr(layout, name) != getattr(expected, name)
    ]
    if layout.rope != expected.rope:
        mismatches.append(
            f"layout rope is {_describe_rope(layout.rope)} but the model config says {_describe_rope(expected.rope)}"
        )
    return tuple(mismatches)
