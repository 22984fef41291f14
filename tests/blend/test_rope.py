"""RoPE correction: rotations compose, invert, keep norms, and match transformers' own Llama rotary embedding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvstore.blend.rope import RopeRotator, inverse_frequencies, rotate_keys, token_deltas
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.layout import RopeScaling, RopeSpec
from kvstore.models import rope_spec_from_hf_config
from kvstore.presets import preset_layout

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT32_ROTATION_TOLERANCE = 1e-5  # float64 angles, float32 cos/sin and arithmetic: a few ulps per rotation

SPECS = [
    RopeSpec(theta=1e5),
    RopeSpec(theta=1e4, scaling=RopeScaling.LINEAR, factor=4.0),
    preset_layout("llama3.1-8b").rope,
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the cpu twin runs everywhere)")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def device(request: pytest.FixtureRequest) -> str:
    """Device-following tests run on the CPU, and on a real GPU where there is one."""
    return str(request.param)


def random_keys(num_tokens: int, num_heads: int, head_dim: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest ``|actual - expected| / |expected|`` over head vectors."""
    difference = torch.linalg.vector_norm(actual.double() - expected.double(), dim=-1)
    return float((difference / torch.linalg.vector_norm(expected.double(), dim=-1)).max())


key_shapes = st.tuples(st.integers(1, 6), st.integers(1, 3), st.sampled_from([2, 8, 64]), st.integers(0, 2**31))
deltas = st.integers(-50_000, 50_000)
specs = st.sampled_from(SPECS)


@PROPERTY_SETTINGS
@given(shape=key_shapes, first=deltas, second=deltas, rope=specs)
def test_rotations_compose(shape: tuple[int, int, int, int], first: int, second: int, rope: RopeSpec) -> None:
    keys = random_keys(*shape)
    twice = rotate_keys(rotate_keys(keys, first, rope), second, rope)
    once = rotate_keys(keys, first + second, rope)
    assert relative_error(twice, once) < FLOAT32_ROTATION_TOLERANCE


@PROPERTY_SETTINGS
@given(shape=key_shapes, delta=deltas, rope=specs)
def test_rotating_back_restores_the_keys_and_norms_are_kept(
    shape: tuple[int, int, int, int], delta: int, rope: RopeSpec
) -> None:
    keys = random_keys(*shape)
    moved = rotate_keys(keys, delta, rope)
    assert relative_error(rotate_keys(moved, -delta, rope), keys) < FLOAT32_ROTATION_TOLERANCE
    half = keys.shape[-1] // 2
    pair_norms = torch.hypot(keys[..., :half], keys[..., half:])
    moved_pair_norms = torch.hypot(moved[..., :half], moved[..., half:])
    torch.testing.assert_close(moved_pair_norms, pair_norms, rtol=FLOAT32_ROTATION_TOLERANCE, atol=1e-6)
    if delta != 0 and shape[2] == 64:
        assert relative_error(moved, keys) > 1e-3  # it really moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_delta_is_an_exact_identity_in_every_dtype(dtype: torch.dtype) -> None:
    keys = random_keys(5, 2, 64, seed=1).to(dtype)
    assert torch.equal(rotate_keys(keys, 0, SPECS[2]), keys)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keys_are_rotated_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    keys = random_keys(5, 2, 64, seed=2).to(dtype)
    rotated = rotate_keys(keys, 777, SPECS[0])
    assert rotated.dtype == dtype
    assert torch.equal(rotated, rotate_keys(keys.float(), 777, SPECS[0]).to(dtype))


@PROPERTY_SETTINGS
@given(
    token_deltas_list=st.lists(st.integers(-20_000, 20_000), min_size=1, max_size=8),
    seed=st.integers(0, 2**31),
)
def test_per_token_deltas_equal_rotating_each_token_alone(token_deltas_list: list[int], seed: int) -> None:
    keys = random_keys(len(token_deltas_list), 3, 16, seed)
    rotated = rotate_keys(keys, torch.tensor(token_deltas_list), SPECS[1])
    for index, delta in enumerate(token_deltas_list):
        alone = rotate_keys(keys[index : index + 1], delta, SPECS[1])
        assert torch.equal(rotated[index : index + 1], alone)


def test_one_rotation_applies_to_every_layer_and_chunk_with_broadcast_deltas() -> None:
    rotator = RopeRotator(SPECS[2], 16)
    chunks = torch.randn(3, 4, 5, 2, 16, generator=torch.Generator().manual_seed(3))  # [chunks, layers, tokens, ...]
    per_chunk = torch.tensor([[[10, 11, 12, 13, 14]], [[-5, -5, -5, -5, -5]], [[0, 0, 0, 0, 0]]])  # [3, 1, 5]
    rotated = rotator.rotation(per_chunk).apply(chunks)
    for chunk_idx in range(3):
        for layer_idx in range(4):
            expected = rotate_keys(chunks[chunk_idx, layer_idx], per_chunk[chunk_idx, 0], SPECS[2])
            assert torch.equal(rotated[chunk_idx, layer_idx], expected)


def test_in_place_writes_into_the_keys_and_apply_to_kv_leaves_values_alone(device: str) -> None:
    rotator = RopeRotator(SPECS[0], 16)
    rotation = rotator.rotation(torch.arange(6), device=device)
    kv = torch.randn(4, 2, 6, 2, 16, generator=torch.Generator().manual_seed(4)).to(device)
    expected_keys = rotation.apply(kv[:, 0])
    values_before = kv[:, 1].clone()
    rotation.apply_to_kv(kv)
    assert torch.equal(kv[:, 0], expected_keys)
    assert torch.equal(kv[:, 1], values_before)
    keys = random_keys(6, 2, 16, seed=5, device=device)
    out = rotation.apply(keys, in_place=True)
    assert out is keys
    assert rotation.device == keys.device


def test_token_deltas_place_each_segment_and_leave_gaps_at_zero() -> None:
    @dataclasses.dataclass(frozen=True)
    class Placed:
        start: int
        num_tokens: int
        rope_delta: int

    deltas = token_deltas([Placed(2, 3, 100), Placed(6, 2, -4)], 10)
    assert deltas.tolist() == [0, 0, 100, 100, 100, 0, -4, -4, 0, 0]
    with pytest.raises(InvalidInputError, match="outside the prompt's 10 tokens"):
        token_deltas([Placed(8, 3, 1)], 10)
    with pytest.raises(InvalidInputError, match="overlaps"):
        token_deltas([Placed(0, 4, 1), Placed(3, 2, 1)], 10)


def hf_config(rope: RopeSpec, head_dim: int) -> LlamaConfig:
    """A tiny Llama config with the given rotary parameters (only the rotary embedding is built from it)."""
    parameters: dict[str, object] = {"rope_type": rope.scaling.value, "rope_theta": rope.theta}
    if rope.scaling is not RopeScaling.DEFAULT:
        parameters["factor"] = rope.factor
    if rope.scaling is RopeScaling.LLAMA3:
        parameters |= {
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=131072,
        rope_parameters=parameters,
    )


@pytest.mark.parametrize("rope", SPECS, ids=[spec.scaling.value for spec in SPECS])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_inverse_frequencies_are_bit_identical_to_transformers(rope: RopeSpec, head_dim: int) -> None:
    config = hf_config(rope, head_dim)
    assert rope_spec_from_hf_config(config) == rope
    assert torch.equal(inverse_frequencies(rope, head_dim), LlamaRotaryEmbedding(config).inv_freq)


def test_the_llama3_case_covers_all_three_frequency_bands() -> None:
    """Guards the test above: Llama 3.1's 128-dim heads have kept, smoothed and slowed frequencies."""
    rope = SPECS[2]
    unscaled = inverse_frequencies(RopeSpec(theta=rope.theta), 128)
    ratio = unscaled / inverse_frequencies(rope, 128)
    assert (ratio == 1).any() and (ratio == rope.factor).any() and ((ratio > 1) & (ratio < rope.factor)).any()


@pytest.mark.parametrize("rope", SPECS, ids=[spec.scaling.value for spec in SPECS])
def test_moving_transformers_keys_matches_transformers_at_the_new_position(rope: RopeSpec, device: str) -> None:
    """K that transformers rotated to p, moved by d with kvstore, equals K transformers rotated to p + d."""
    head_dim, num_tokens = 64, 12
    config = hf_config(rope, head_dim)
    rotary = LlamaRotaryEmbedding(config).to(device)
    raw = random_keys(num_tokens, 2, head_dim, seed=6, device=device)  # [tokens, heads, dim]
    sources = torch.arange(num_tokens, device=device) * 97
    moves = torch.tensor([1, -1, 5, 300, 1000, 2047, 0, 4096, -500, 1, 2, 3], device=device)

    def transformers_rotation(positions: torch.Tensor) -> torch.Tensor:
        as_hf = raw.transpose(0, 1)[None]  # [batch, heads, tokens, dim]
        cos, sin = rotary(as_hf, positions[None])
        _, keys = apply_rotary_pos_emb(as_hf, as_hf, cos, sin)
        return keys[0].transpose(0, 1)

    at_source, at_target = transformers_rotation(sources), transformers_rotation(sources + moves)
    moved = RopeRotator(rope, head_dim).rotation(moves).apply(at_source)
    # transformers' float32 angles are off by up to angle * 2**-24 at each end; positions stay below 6000 here.
    assert relative_error(moved, at_target) < 2 * 6000 * 2**-24 + FLOAT32_ROTATION_TOLERANCE
    from_zero = RopeRotator(rope, head_dim).rotation(sources + moves).apply(raw)
    assert relative_error(from_zero, at_target) < 6000 * 2**-24 + FLOAT32_ROTATION_TOLERANCE


def test_bad_inputs_are_refused_with_clear_errors() -> None:
    rotator = RopeRotator(SPECS[0], 16)
    rotation = rotator.rotation(torch.arange(4))
    with pytest.raises(InvalidInputError, match=r"dtype torch\.int64 cannot be rotated"):
        rotation.apply(torch.zeros(4, 2, 16, dtype=torch.int64))
    with pytest.raises(InvalidInputError, match=r"must end in \[num_tokens, num_kv_heads, head_dim=16\]"):
        rotation.apply(torch.zeros(4, 2, 8))
    with pytest.raises(InvalidInputError, match=r"must end in"):
        rotation.apply(torch.zeros(4, 16))
    with pytest.raises(InvalidInputError, match=r"deltas of shape \[4\] do not broadcast over keys \[5, 2, 16\]"):
        rotation.apply(torch.zeros(5, 2, 16))
    with pytest.raises(InvalidInputError, match="keys are on meta but the rotation on cpu"):
        rotation.apply(torch.zeros(4, 2, 16, device="meta"))
    with pytest.raises(InvalidInputError, match=r"must be a torch\.Tensor"):
        rotation.apply([[0.0]])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="not an integer type"):
        rotator.rotation(torch.tensor([0.5]))
    with pytest.raises(InvalidInputError, match="must be an int or an integer tensor"):
        rotator.rotation(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="is not chunk KV"):
        rotation.apply_to_kv(torch.zeros(3, 4, 2, 16))
    with pytest.raises(ConfigError, match="head_dim=15 must be a positive even number"):
        RopeRotator(SPECS[0], 15)
    with pytest.raises(ConfigError, match=r"high_freq_factor=1\.0 must exceed low_freq_factor=1\.0"):
        RopeRotator(RopeSpec(scaling=RopeScaling.LLAMA3, factor=8.0, high_freq_factor=1.0), 16)
