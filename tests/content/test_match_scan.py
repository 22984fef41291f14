"""``scan_and_plan`` plans exactly the chunks that probing every window and then planning would: the reference
below is that two-step plan (every window's candidates from ``probe_windows``, then leftmost-first runs that follow
``next`` links while the query continues the stored sequence), written out in Python."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.content import FingerprintIndex
from kvstore.content import fingerprint_table as table
from kvstore.content.match_scan import scan_and_plan
from kvstore.content.rolling_hash import block_fingerprints, window_base_power
from kvstore.keys import PrefixKey, TokenArray


def table_arrays(index: FingerprintIndex) -> dict[str, object]:
    return {
        "mask": index._fingerprint_mask, "fingerprint": index._fingerprint, "length": index._length,
        "link": index._fingerprint_link, "next": index._next, "heads": index._fingerprint_heads,
        "shift": index._fingerprint_shift, "presence": index._presence_bits, "presence_shift": index._presence_shift,
    }  # fmt: skip


def reference_plan(index: FingerprintIndex, query: TokenArray, window: int) -> list[tuple[int, int]]:
    arrays = table_arrays(index)
    starts, entries = table.probe_windows(
        query, window, window_base_power(window), arrays["mask"], arrays["fingerprint"], arrays["length"],
        arrays["link"], arrays["heads"], arrays["shift"], arrays["presence"], arrays["presence_shift"],
    )  # fmt: skip
    length, following, fingerprint = index._length, index._next, index._fingerprint
    planned: list[tuple[int, int]] = []
    cursor = 0
    for start, entry in zip(starts.tolist(), entries.tolist(), strict=True):
        if start < cursor:
            continue
        while True:
            planned.append((start, entry))
            start += int(length[entry])
            entry = int(following[entry])
            if entry < 0 or start + int(length[entry]) > len(query):
                break
            span = query[start : start + int(length[entry])]
            if int(block_fingerprints(span, len(span))[0]) & int(arrays["mask"]) != int(fingerprint[entry]):
                break
        cursor = start
    return planned


def scanned_plan(index: FingerprintIndex, query: TokenArray, window: int) -> list[tuple[int, int]]:
    arrays = table_arrays(index)
    starts, entries = scan_and_plan(
        query, window, window_base_power(window), arrays["mask"], arrays["fingerprint"], arrays["length"],
        arrays["link"], arrays["next"], arrays["heads"], arrays["shift"], arrays["presence"], arrays["presence_shift"],
    )  # fmt: skip
    return list(zip(starts.tolist(), entries.tolist(), strict=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    window=st.integers(2, 16),
    fingerprint_bits=st.sampled_from([4, 10, 64]),  # 4 bits: fingerprints collide everywhere
    vocab=st.sampled_from([3, 50_000]),  # 3 tokens: repeated windows and self-similar documents
)
def test_scanning_plans_what_probing_every_window_plans(
    seed: int, window: int, fingerprint_bits: int, vocab: int
) -> None:
    rng = np.random.default_rng(seed)
    index = FingerprintIndex(initial_capacity=4, fingerprint_bits=fingerprint_bits)
    documents = [rng.integers(0, vocab, int(rng.integers(1, 6 * window))).astype(np.uint32) for _ in range(5)]
    for document in documents:
        num = -(-len(document) // window)
        index.register(document, [PrefixKey(rng.bytes(16)) for _ in range(num)], window)
    for _ in range(5):
        parts = []
        for _ in range(int(rng.integers(1, 5))):
            document = documents[int(rng.integers(0, len(documents)))]
            cut = int(rng.integers(0, len(document)))
            parts += [
                document[cut:] if rng.random() < 0.3 else document,
                rng.integers(0, vocab, int(rng.integers(0, 4))),
            ]
        query = np.concatenate(parts).astype(np.uint32)
        assert scanned_plan(index, query, window) == reference_plan(index, query, window)
