from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
from tests.factories import make_kv


def test_namespace_is_16_bytes_and_stable_across_equal_layouts(small_layout: KVLayout) -> None:
    twin = KVLayout.from_json(small_layout.to_json())
    assert twin == small_layout
    assert len(small_layout.namespace) == 16
    assert twin.namespace == small_layout.namespace


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"num_layers": 5},
        {"num_kv_heads": 3},
        {"head_dim": 32},
        {"dtype": KVDtype.FLOAT16},
        {"rope": RopeSpec(theta=1e4)},
        {"rope": RopeSpec(theta=1e5, scaling=RopeScaling.LINEAR, factor=2.0)},
    ],
)
def test_every_field_changes_the_namespace(small_layout: KVLayout, change: dict[str, object]) -> None:
    assert dataclasses.replace(small_layout, **change).namespace != small_layout.namespace  # type: ignore[arg-type]


def test_dtype_aliases() -> None:
    assert KVDtype.parse("bf16") is KVDtype.BFLOAT16
    assert KVDtype.parse(torch.float16) is KVDtype.FLOAT16
    assert KVDtype.parse("FP32") is KVDtype.FLOAT32
    with pytest.raises(ConfigError, match="int8"):
        KVDtype.parse("int8")


def test_sizes(small_layout: KVLayout) -> None:
    assert small_layout.bytes_per_token == 4 * 2 * 2 * 16 * 2
    assert small_layout.chunk_bytes(256) == 256 * small_layout.bytes_per_token
    assert make_kv(small_layout, 7).numel() * 2 == small_layout.chunk_bytes(7)


@pytest.mark.parametrize(
    "bad", [{"num_layers": 0}, {"head_dim": -1}, {"model_id": ""}, {"num_kv_heads": 1.5}]
)
def test_bad_layout_fields_are_refused(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8} | bad
    with pytest.raises(ConfigError):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_check_kv_names_the_problem(small_layout: KVLayout) -> None:
    kv = make_kv(small_layout, 10)
    small_layout.check_kv(kv, 10)
    with pytest.raises(InvalidInputError, match="holds 10 tokens but 9 token ids"):
        small_layout.check_kv(kv, 9)
    with pytest.raises(InvalidInputError, match="dtype"):
        small_layout.check_kv(kv.float(), 10)
    with pytest.raises(InvalidInputError, match="shape"):
        small_layout.check_kv(kv[0], 10)
    with pytest.raises(InvalidInputError, match=r"torch\.Tensor"):
        small_layout.check_kv([1, 2], 10)  # type: ignore[arg-type]


def test_bad_rope_is_refused() -> None:
    with pytest.raises(ConfigError, match="theta"):
        RopeSpec(theta=0)
    with pytest.raises(ValueError):
        RopeSpec(scaling="dynamic")  # type: ignore[arg-type]  # (yarn is a stored-only scheme: MLA models)


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="cannot read a KV layout"):
        KVLayout.from_json("{not json")
