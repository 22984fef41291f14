from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import as_token_array, key_from_hex, num_chunks, prefix_keys
from kvstore.layout import KVLayout

LAYOUT = KVLayout(model_id="test/keys", num_layers=2, num_kv_heads=1, head_dim=8)
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300)


def keys_of(tokens: list[int], chunk_size: int = 16, layout: KVLayout = LAYOUT) -> list[bytes]:
    return prefix_keys(layout.namespace, as_token_array(tokens), chunk_size)


@given(tokens=token_lists, chunk_size=st.integers(min_value=1, max_value=64))
def test_one_key_per_chunk_partial_last_included(tokens: list[int], chunk_size: int) -> None:
    keys = keys_of(tokens, chunk_size)
    assert len(keys) == num_chunks(len(tokens), chunk_size)
    assert all(len(key) == 16 for key in keys)
    assert len(set(keys)) == len(keys)


@given(tokens=token_lists, data=st.data())
def test_any_token_change_changes_its_key_and_every_later_one(tokens: list[int], data: st.DataObject) -> None:
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    before, after = keys_of(tokens), keys_of(changed)
    first_changed = position // 16
    assert before[:first_changed] == after[:first_changed]
    assert all(a != b for a, b in zip(before[first_changed:], after[first_changed:], strict=True))


@given(tokens=token_lists, extra=token_lists)
def test_keys_of_a_chunk_aligned_prefix_are_a_prefix_of_the_keys(tokens: list[int], extra: list[int]) -> None:
    aligned = tokens[: len(tokens) // 16 * 16]
    assert keys_of(aligned + extra)[: len(aligned) // 16] == keys_of(aligned)


@settings(max_examples=20)
@given(tokens=token_lists)
def test_every_layout_field_separates_keys(tokens: list[int]) -> None:
    other = dataclasses.replace(LAYOUT, num_kv_heads=2)
    assert set(keys_of(tokens, layout=other)).isdisjoint(keys_of(tokens))


@settings(max_examples=20)
@given(tokens=token_lists)
def test_integer_type_of_the_input_does_not_matter(tokens: list[int]) -> None:
    expected = keys_of(tokens)
    assert keys_of(np.array(tokens, dtype=np.uint64)) == expected  # type: ignore[arg-type]
    assert keys_of(np.array(tokens, dtype=np.uint32)) == expected  # type: ignore[arg-type]


def test_partial_chunk_key_differs_from_full_chunk_key() -> None:
    tokens = list(range(32))
    assert keys_of(tokens[:31])[-1] != keys_of(tokens)[-1]
    assert keys_of(tokens[:31])[0] == keys_of(tokens)[0]


def test_keys_match_in_a_fresh_process() -> None:
    """No Python hash() anywhere: another interpreter (another hash seed) computes the same keys."""
    tokens = list(range(1000, 1600))
    code = (
        "from kvstore.keys import as_token_array, prefix_keys; from kvstore.layout import KVLayout;"
        "layout = KVLayout(model_id='test/keys', num_layers=2, num_kv_heads=1, head_dim=8);"
        "print(','.join(k.hex() for k in prefix_keys(layout.namespace, as_token_array(list(range(1000, 1600))), 16)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert result.stdout.strip().split(",") == [key.hex() for key in keys_of(tokens)]


def test_known_vector_pins_the_format() -> None:
    """Changing the key format breaks every existing data dir: this vector must never change silently."""
    assert LAYOUT.namespace.hex() == "c5d97aca052d4100def02a29fa3f85e3"
    assert [key.hex() for key in keys_of([1, 2, 3], 2)] == [
        "288dbd46d2eda1e6f6a95d9411f8f6cc",
        "f5051188ef4cc0ad20f4207cd337dcfd",
    ]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([-1, 2], r"\[0, 2\*\*32\)"),
        ([2**32], r"\[0, 2\*\*32\)"),
        ([1.5, 2.0], "integers"),
        ([[1, 2]], "1-D"),
        (["a"], "integers"),
    ],
)
def test_bad_token_ids_are_refused(tokens: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        as_token_array(tokens)  # type: ignore[arg-type]


def test_empty_tokens_give_no_keys() -> None:
    assert keys_of([]) == []


def test_bad_chunk_size_and_key_text() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        prefix_keys(LAYOUT.namespace, as_token_array([1]), 0)
    with pytest.raises(ConfigError, match="32 hex digits"):
        key_from_hex("abc")
    key = keys_of([1, 2, 3])[0]
    assert key_from_hex(key.hex()) == key
