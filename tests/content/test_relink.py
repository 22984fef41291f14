"""sequence_runs: the vectorised relinking orders chunks exactly as a plain walk from each run's head would."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.content.relink import sequence_runs, sequence_runs_of_words
from kvstore.errors import InvalidInputError
from kvstore.keys import PrefixKey


def reference_runs(
    keys: list[PrefixKey], parent_keys: list[PrefixKey | None]
) -> tuple[list[int], list[int]]:
    """The rules of ``kvstore.content.relink``, one chunk at a time."""
    position = {key: index for index, key in enumerate(keys)}  # the last record of a key wins
    kept = sorted(position.values())
    successor: dict[int, int] = {}
    for index in kept:
        parent_key = parent_keys[index]
        parent = position.get(parent_key) if parent_key is not None else None
        if parent is not None and parent not in successor:
            successor[parent] = index  # the first child in input order continues its parent
    continuing = set(successor.values())
    order: list[int] = []
    run_offsets = [0]
    for head in (index for index in kept if index not in continuing):
        chunk: int | None = head
        while chunk is not None:
            order.append(chunk)
            chunk = successor.get(chunk)
        run_offsets.append(len(order))
    for index in kept:  # chunks on a cycle of parents: one run each
        if index not in order:
            order.append(index)
            run_offsets.append(len(order))
    return order, run_offsets


def make_key(low: int, high: int) -> PrefixKey:
    return PrefixKey(low.to_bytes(8, "little") + high.to_bytes(8, "little"))


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 30), st.one_of(st.none(), st.integers(0, 35))), max_size=40),
    shared_low_word=st.booleans(),
)
def test_sequence_runs_agrees_with_a_plain_walk(
    chunks: list[tuple[int, int | None]], shared_low_word: bool
) -> None:
    # Keys from a small pool (duplicates), parents among them or absent (ids 31-35), any shape of links, cycles
    # included; with a shared low word the exact (dict) path runs. No key is all zeros: that means "no parent".
    def key_of(key_id: int) -> PrefixKey:
        if shared_low_word:
            return make_key(7, key_id + 1)
        return make_key((key_id + 1) * 0x9E3779B97F4A7C15 % 2**64, key_id)

    keys = [key_of(key_id) for key_id, _ in chunks]
    parent_keys = [None if parent_id is None else key_of(parent_id) for _, parent_id in chunks]

    runs = sequence_runs(keys, parent_keys)

    order, run_offsets = reference_runs(keys, parent_keys)
    assert runs.order.tolist() == order
    assert runs.run_offsets.tolist() == run_offsets


def test_a_ten_thousand_chunk_sequence_in_reverse_is_one_run() -> None:
    keys = [make_key((index + 1) * 0x9E3779B97F4A7C15 % 2**64, index) for index in range(10_000)]
    parents = [None, *keys[:-1]]
    runs = sequence_runs(keys[::-1], parents[::-1])
    assert runs.order.tolist() == list(range(9_999, -1, -1)) and runs.run_offsets.tolist() == [0, 10_000]


def test_a_cycle_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    keys = [make_key(1, 1), make_key(2, 2)]
    with caplog.at_level(logging.WARNING, logger="kvstore.content.relink"):
        runs = sequence_runs(keys, keys[::-1])
    assert runs.order.tolist() == [0, 1] and runs.run_offsets.tolist() == [0, 1, 2]
    assert "2 chunks form cycles" in caplog.text


def test_keys_must_be_16_bytes() -> None:
    with pytest.raises(InvalidInputError, match="16 bytes"):
        sequence_runs([PrefixKey(b"short")], [None])
    with pytest.raises(InvalidInputError, match="parent keys"):
        sequence_runs([make_key(1, 1)], [])


def test_key_words_must_be_rows_of_two() -> None:
    with pytest.raises(InvalidInputError, match=r"\(n, 2\)"):
        sequence_runs_of_words(np.zeros((3, 2), np.uint64), np.zeros((2, 2), np.uint64))


def test_words_and_bytes_relink_alike() -> None:
    keys = [make_key(index + 1, index) for index in range(50)]
    parents = [None, *keys[:24], None, *keys[25:49]]
    words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(50, 2)
    parent_words = np.frombuffer(b"".join(key or bytes(16) for key in parents), dtype="<u8").reshape(50, 2)

    runs = sequence_runs_of_words(words[::-1], parent_words[::-1])

    assert runs.order.tolist() == list(range(24, -1, -1)) + list(range(49, 24, -1))
    assert runs.run_offsets.tolist() == [0, 25, 50]
