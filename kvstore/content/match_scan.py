"""One left-to-right scan of a query that probes windows only where no planned match covers them.

Probing every window of the query (``fingerprint_table.probe_windows``), then planning the leftmost-first,
non-overlapping matches from the candidates, wastes most probes: in a prompt made of stored documents almost every
window lies inside a document the plan covers by following ``next`` links from its first chunk, and each probe is a
presence-bit read and often a chain walk (cache misses on a large index). ``scan_and_plan`` plans as it scans: at a
window whose fingerprint is stored it takes the first matching entry (the one the two-step plan would take),
follows the entry's links while the query continues the stored sequence, and resumes probing where the run ends.
The planned chunks are exactly the two-step plan's (``tests/content/test_match_scan.py`` holds it as the reference),
and unverified as there: the caller verifies each and, after a fingerprint collision, falls back to the full probe
and the exact, candidate-by-candidate path. On a 1M-chunk index it made a match several times faster (measured:
docs/design-notes.md#content-match-scan).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvstore.content.fingerprint_table import _bucket, _presence_mask, _presence_word

__all__ = ["scan_and_plan"]


@njit(cache=True, nogil=True, inline="always")
def _span_fingerprint(query, start, length):  # type: ignore[no-untyped-def]
    base = np.uint64(0x100000001B3)
    value = np.uint64(0)
    for position in range(start, start + length):
        value = value * base + np.uint64(query[position])
    return value


# fmt: off
@njit(cache=True, nogil=True)
def scan_and_plan(  # type: ignore[no-untyped-def]
    query, window_tokens, leaving_weight, fingerprint_mask, table_fingerprint, table_length, table_fingerprint_link,
    table_next, fingerprint_heads, fingerprint_shift, presence_bits, presence_shift,
):
    """The leftmost-first, non-overlapping planned chunks of ``query`` (see the module docstring).

    Returns:
        ``(query_starts, entries)`` of the planned chunks, int64 and int32, in increasing query start.
    """
    base = np.uint64(0x100000001B3)
    num_tokens = query.shape[0]
    num_windows = num_tokens - window_tokens + 1
    planned_starts = np.empty(64, dtype=np.int64)
    planned_entries = np.empty(64, dtype=np.int32)
    count = 0
    if num_windows <= 0:
        return planned_starts[:0], planned_entries[:0]
    position = 0
    value = _span_fingerprint(query, 0, window_tokens)
    while position < num_windows:
        fingerprint = value & fingerprint_mask
        found = -1
        mask = _presence_mask(fingerprint)
        if (presence_bits[_presence_word(fingerprint, presence_shift)] & mask) == mask:
            entry = fingerprint_heads[_bucket(fingerprint, fingerprint_shift)]
            while entry >= 0:
                if table_fingerprint[entry] == fingerprint and table_length[entry] == window_tokens:
                    found = entry
                    break
                entry = table_fingerprint_link[entry]
        if found < 0:
            if position + 1 < num_windows:
                value = (value - np.uint64(query[position]) * leaving_weight) * base + np.uint64(
                    query[position + window_tokens]
                )
            position += 1
            continue
        start = np.int64(position)
        entry = found
        while True:
            if count == planned_starts.shape[0]:
                grown_starts = np.empty(2 * count, dtype=np.int64)
                grown_starts[:count] = planned_starts
                planned_starts = grown_starts
                grown_entries = np.empty(2 * count, dtype=np.int32)
                grown_entries[:count] = planned_entries
                planned_entries = grown_entries
            planned_starts[count] = start
            planned_entries[count] = entry
            count += 1
            start += np.int64(table_length[entry])
            entry = table_next[entry]
            if entry < 0 or start + np.int64(table_length[entry]) > num_tokens:
                break
            length = np.int64(table_length[entry])
            if _span_fingerprint(query, start, length) & fingerprint_mask != table_fingerprint[entry]:
                break
        position = int(start)
        if position < num_windows:
            value = _span_fingerprint(query, position, window_tokens)
    return planned_starts[:count], planned_entries[:count]
# fmt: on
