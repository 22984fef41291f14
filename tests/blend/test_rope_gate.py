"""The per-model RoPE gate on the real SmolLM2-135M-Instruct: its own layout passes, wrong layouts are refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kvstore.blend.rope_gate import (
    DEFAULT_SHIFTS,
    PositionShift,
    check_rope_gate,
    gate_tolerance,
    require_rope_gate,
)
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, RopeScaling, RopeSpec
from kvstore.models import LoadedModel, load_local_model
from kvstore.presets import preset_layout


def test_the_real_model_passes_with_its_own_layout_in_float32(smollm2: LoadedModel) -> None:
    report = require_rope_gate(smollm2.model, smollm2.layout)
    assert report.passed and report.config_mismatches == ()
    assert report.num_layers == 30 and report.num_probes == len(DEFAULT_SHIFTS) * 6
    assert report.max_value_error == 0.0  # one-token sequences: hidden states do not depend on position
    assert 0 < report.max_key_error <= report.tolerance
    assert report.max_key_error < 1e-4  # measured 3.6e-5: float32 angle rounding at positions up to 8123


def test_the_real_model_passes_with_the_bfloat16_preset_layout(smollm2: LoadedModel) -> None:
    preset = preset_layout("smollm2-135m")
    report = require_rope_gate(smollm2.model, preset)
    assert report.passed and report.cache_dtype is KVDtype.BFLOAT16 and report.compute_dtype is KVDtype.FLOAT32
    assert 1e-3 < report.max_key_error <= report.tolerance  # bfloat16 rounding shows, within 3 ulps


def test_the_real_model_passes_in_bfloat16(smollm2: LoadedModel) -> None:
    loaded = load_local_model(smollm2.source, model_id=smollm2.layout.model_id, dtype=torch.bfloat16)
    assert loaded.layout == preset_layout("smollm2-135m")
    report = require_rope_gate(loaded.model, loaded.layout)
    assert report.compute_dtype is KVDtype.BFLOAT16 and report.max_key_error <= report.tolerance


def test_a_model_cast_to_bfloat16_after_loading_is_refused(smollm2: LoadedModel) -> None:
    """Module.to(bfloat16) also rounds the float32 rotary inv_freq buffer, so the model's own RoPE drifts from
    the true frequencies (K error 0.6 at position 8123); the gate catches it and says how to load instead."""
    model = copy.deepcopy(smollm2.model).to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"cast with \.to\(dtype\) after loading"):
        require_rope_gate(model, preset_layout("smollm2-135m"))


def test_a_wrong_theta_is_refused(smollm2: LoadedModel) -> None:
    wrong = dataclasses.replace(smollm2.layout, rope=RopeSpec(theta=1e4))
    report = check_rope_gate(smollm2.model, wrong)
    assert not report.passed
    assert report.max_key_error > 100 * report.tolerance
    assert report.config_mismatches == (
        "layout rope is default theta=10000 but the model config says default theta=100000",
    )
    with pytest.raises(ConfigError, match="refusing to blend model HuggingFaceTB/SmolLM2-135M-Instruct: layout rope"):
        require_rope_gate(smollm2.model, wrong)


def test_a_scaling_the_model_does_not_use_is_refused(smollm2: LoadedModel) -> None:
    wrong = dataclasses.replace(smollm2.layout, rope=RopeSpec(theta=1e5, scaling=RopeScaling.LINEAR, factor=2.0))
    report = check_rope_gate(smollm2.model, wrong)
    assert not report.passed and report.max_key_error > 100 * report.tolerance


def test_the_numbers_alone_refuse_a_model_whose_rotation_differs_from_its_config(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that claims theta=1e4 while the weights' rotary embedding uses 1e5: the config check agrees with
    the layout, so only the measured K error can catch it."""
    monkeypatch.setitem(smollm2.model.config.rope_parameters, "rope_theta", 1e4)
    wrong = dataclasses.replace(smollm2.layout, rope=RopeSpec(theta=1e4))
    report = check_rope_gate(smollm2.model, wrong)
    assert report.config_mismatches == () and not report.passed
    with pytest.raises(ConfigError, match="applies RoPE differently from kvstore's rotation"):
        require_rope_gate(smollm2.model, wrong)


def test_a_model_config_with_a_scheme_kvstore_cannot_rotate_is_refused(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(smollm2.model.config.rope_parameters, "rope_type", "yarn")
    with pytest.raises(ConfigError, match=r"refusing to blend model .*rope type 'yarn' cannot be moved"):
        require_rope_gate(smollm2.model, smollm2.layout, shifts=DEFAULT_SHIFTS[:2], token_ids=[5])


def test_a_layout_of_another_shape_is_refused(smollm2: LoadedModel) -> None:
    report = check_rope_gate(smollm2.model, preset_layout("llama3.1-8b"), shifts=DEFAULT_SHIFTS[:2], token_ids=[5])
    assert not report.passed and report.num_probes == 2
    assert "layout num_kv_heads=8 but the model has 3" in report.config_mismatches


def test_the_model_is_left_in_the_mode_it_was_in(smollm2: LoadedModel) -> None:
    smollm2.model.train()
    try:
        check_rope_gate(smollm2.model, smollm2.layout, shifts=DEFAULT_SHIFTS[:1], token_ids=[5])
        assert smollm2.model.training
    finally:
        smollm2.model.eval()


def test_tolerances_follow_the_derivation() -> None:
    max_angle = 8123.0  # DEFAULT_SHIFTS reach position 8123; inv_freq[0] is 1
    float32 = gate_tolerance(compute_dtype=KVDtype.FLOAT32, cache_dtype=KVDtype.FLOAT32, max_angle_rad=max_angle)
    assert float32 == pytest.approx((2 * 8123 + 16) * 2**-24 + 11 * 2**-24)
    cached_bf16 = gate_tolerance(
        compute_dtype=KVDtype.FLOAT32, cache_dtype=KVDtype.BFLOAT16, max_angle_rad=max_angle
    )
    all_bf16 = gate_tolerance(compute_dtype=KVDtype.BFLOAT16, cache_dtype=KVDtype.BFLOAT16, max_angle_rad=max_angle)
    assert float32 < 1e-3 < cached_bf16 < 0.013 < all_bf16 < 0.045


def test_bad_gate_arguments_are_refused(smollm2: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="at least one position shift"):
        check_rope_gate(smollm2.model, smollm2.layout, shifts=[])
    with pytest.raises(ConfigError, match="position shift 5 -> -1 leaves the prompt"):
        PositionShift(position=5, delta=-6)
