"""numba kernels over the fingerprint index's struct-of-arrays table (the owner is ``FingerprintIndex``).

Layout (entry id = row, ``int32``; ``-1`` means "none")::

    per entry (capacity rows)                                  bytes
    fingerprint      u64  polynomial hash of the chunk's tokens    8
    verification     u64  xxh3_64 of the chunk's token bytes       8
    key_low/high     u64  the 16-byte prefix key, two halves      16
    source_start     u32  token position in the stored sequence    4
    length           u16  tokens in the chunk; 0 = free row        2
    next             i32  entry of the sequence's next chunk       4
    prev             i32  entry of the sequence's previous chunk   4
    fingerprint_link i32  next entry in the same fingerprint bucket 4
    key_link         i32  next entry in the same key bucket,       4
                          or the next free row when free           --
                                                                  54
    fingerprint_heads i32[2**k]  first entry of each fingerprint bucket (load <= 2)
    key_heads         i32[2**j]  first entry of each key bucket (load <= 4)
    presence_bits     u64[2**(k-1)]  blocked Bloom filter, 32 bits per fingerprint bucket, 3 bits per entry
                                 in one word; a word missing any of a window's 3 bits proves it absent

``state`` is ``[free_head, high_water, num_live]``: rows below ``high_water`` have been used; free rows form a
list through ``key_link``. Invariant: a row with ``length > 0`` is on exactly one fingerprint chain and one key
chain, and its presence bits are set (stale bits of removed rows are allowed: they only cost a chain walk).

The kernels are called with the owner's lock held; they release the GIL but never run concurrently.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__: list[str] = []


# The kernels take the table's columns one by one (numba cannot take the owner object), so their long
# parameter lists are kept dense by hand.
# fmt: off
@njit(cache=True, nogil=True, inline="always")
def _bucket(value, shift):  # type: ignore[no-untyped-def]
    return np.int64((value * np.uint64(0x9E3779B97F4A7C15)) >> shift)


@njit(cache=True, nogil=True, inline="always")
def _presence_word(fingerprint, shift):  # type: ignore[no-untyped-def]
    return np.int64((fingerprint * np.uint64(0xC2B2AE3D27D4EB4F)) >> shift)


@njit(cache=True, nogil=True, inline="always")
def _presence_mask(fingerprint):  # type: ignore[no-untyped-def]
    mixed = (fingerprint ^ (fingerprint >> np.uint64(31))) * np.uint64(0xD6E8FEB86659FD93)
    one = np.uint64(1)
    return (
        (one << (mixed >> np.uint64(58)))
        | (one << ((mixed >> np.uint64(52)) & np.uint64(63)))
        | (one << ((mixed >> np.uint64(46)) & np.uint64(63)))
    )


@njit(cache=True, nogil=True)
def link_entry(  # type: ignore[no-untyped-def]
    entry, table_fingerprint, table_key_low, table_fingerprint_link, table_key_link, fingerprint_heads,
    fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
):
    """Push ``entry`` onto its fingerprint and key chains and set its presence bits."""
    bucket = _bucket(table_fingerprint[entry], fingerprint_shift)
    table_fingerprint_link[entry] = fingerprint_heads[bucket]
    fingerprint_heads[bucket] = entry
    bucket = _bucket(table_key_low[entry], key_shift)
    table_key_link[entry] = key_heads[bucket]
    key_heads[bucket] = entry
    fingerprint = table_fingerprint[entry]
    presence_bits[_presence_word(fingerprint, presence_shift)] |= _presence_mask(fingerprint)


@njit(cache=True, nogil=True)
def rebuild_chains(  # type: ignore[no-untyped-def]
    high_water, table_fingerprint, table_key_low, table_length, table_fingerprint_link, table_key_link,
    fingerprint_heads, fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
):
    """Refill freshly cleared heads and presence bits from every live row (growth, stale-bit cleanup).

    Free rows keep their free-list links in ``table_key_link``.
    """
    for entry in range(high_water):
        if table_length[entry] > 0:
            link_entry(
                entry, table_fingerprint, table_key_low, table_fingerprint_link, table_key_link, fingerprint_heads,
                fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
            )


@njit(cache=True, nogil=True)
def find_key(  # type: ignore[no-untyped-def]
    key_low, key_high, table_key_low, table_key_high, table_key_link, key_heads, key_shift
):
    """Entry id of the live row holding this key, or -1."""
    entry = key_heads[_bucket(key_low, key_shift)]
    while entry >= 0:
        if table_key_low[entry] == key_low and table_key_high[entry] == key_high:
            return entry
        entry = table_key_link[entry]
    return -1


@njit(cache=True, nogil=True)
def find_content(  # type: ignore[no-untyped-def]
    fingerprint, verification, length, table_fingerprint, table_verification, table_length, table_fingerprint_link,
    fingerprint_heads, fingerprint_shift,
):
    """Entry id of the live row with this content (fingerprint, verification hash and length), or -1."""
    entry = fingerprint_heads[_bucket(fingerprint, fingerprint_shift)]
    while entry >= 0:
        if (
            table_fingerprint[entry] == fingerprint
            and table_verification[entry] == verification
            and table_length[entry] == length
        ):
            return entry
        entry = table_fingerprint_link[entry]
    return -1


@njit(cache=True, nogil=True)
def find_contents(  # type: ignore[no-untyped-def]
    fingerprints, verifications, lengths, table_fingerprint, table_verification, table_length,
    table_fingerprint_link, fingerprint_heads, fingerprint_shift, out_entries,
):
    """``find_content`` for each chunk of a sequence."""
    for chunk in range(fingerprints.shape[0]):
        out_entries[chunk] = find_content(
            fingerprints[chunk], verifications[chunk], lengths[chunk], table_fingerprint, table_verification,
            table_length, table_fingerprint_link, fingerprint_heads, fingerprint_shift,
        )


@njit(cache=True, nogil=True)
def insert_chunks(  # type: ignore[no-untyped-def]
    fingerprints, verifications, lengths, key_low, key_high, source_starts, table_fingerprint, table_verification,
    table_key_low, table_key_high, table_source_start, table_length, table_next, table_prev, table_fingerprint_link,
    table_key_link, fingerprint_heads, fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
    state, out_entries, out_is_new,
):
    """Add one sequence's chunks, reusing an entry with the same key or equal content (first writer wins).

    Then links each chunk's entry to the next chunk's, and back to the previous one's (keeping an existing entry's
    link, if it has one).

    The caller has grown the table to hold every chunk as a new row.
    """
    for chunk in range(fingerprints.shape[0]):
        # One entry per key: a key already indexed keeps its entry (prefix keys name their content).
        found = np.int32(
            find_key(
                key_low[chunk], key_high[chunk], table_key_low, table_key_high, table_key_link, key_heads, key_shift
            )
        )
        if found >= 0:
            out_entries[chunk] = found
            out_is_new[chunk] = False
            continue
        fingerprint = fingerprints[chunk]
        found = np.int32(
            find_content(
                fingerprint, verifications[chunk], lengths[chunk], table_fingerprint, table_verification,
                table_length, table_fingerprint_link, fingerprint_heads, fingerprint_shift,
            )
        )
        if found >= 0:
            out_entries[chunk] = found
            out_is_new[chunk] = False
            continue
        if state[0] >= 0:
            entry = np.int32(state[0])
            state[0] = table_key_link[entry]
        else:
            entry = np.int32(state[1])
            state[1] += 1
        table_fingerprint[entry] = fingerprint
        table_verification[entry] = verifications[chunk]
        table_key_low[entry] = key_low[chunk]
        table_key_high[entry] = key_high[chunk]
        table_source_start[entry] = source_starts[chunk]
        table_length[entry] = lengths[chunk]
        table_next[entry] = -1
        table_prev[entry] = -1
        link_entry(
            entry, table_fingerprint, table_key_low, table_fingerprint_link, table_key_link, fingerprint_heads,
            fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
        )
        state[2] += 1
        out_entries[chunk] = entry
        out_is_new[chunk] = True
    for chunk in range(fingerprints.shape[0] - 1):
        entry = out_entries[chunk]
        if out_is_new[chunk] or table_next[entry] < 0:
            table_next[entry] = out_entries[chunk + 1]
        successor = out_entries[chunk + 1]
        if out_is_new[chunk + 1] or table_prev[successor] < 0:
            table_prev[successor] = entry


@njit(cache=True, nogil=True)
def insert_runs(  # type: ignore[no-untyped-def]
    run_offsets, fingerprints, verifications, lengths, key_low, key_high, source_starts, table_fingerprint,
    table_verification, table_key_low, table_key_high, table_source_start, table_length, table_next, table_prev,
    table_fingerprint_link, table_key_link, fingerprint_heads, fingerprint_shift, key_heads, key_shift,
    presence_bits, presence_shift, state, out_entries, out_is_new,
):
    """``insert_chunks`` for many sequences at once: run ``r`` is chunks ``run_offsets[r]:run_offsets[r + 1]``.

    Exactly as one ``insert_chunks`` call per run, in order (links never cross a run boundary).
    """
    for run in range(run_offsets.shape[0] - 1):
        begin = run_offsets[run]
        end = run_offsets[run + 1]
        insert_chunks(
            fingerprints[begin:end], verifications[begin:end], lengths[begin:end], key_low[begin:end],
            key_high[begin:end], source_starts[begin:end], table_fingerprint, table_verification, table_key_low,
            table_key_high, table_source_start, table_length, table_next, table_prev, table_fingerprint_link,
            table_key_link, fingerprint_heads, fingerprint_shift, key_heads, key_shift, presence_bits, presence_shift,
            state, out_entries[begin:end], out_is_new[begin:end],
        )


@njit(cache=True, nogil=True)
def span_fingerprints(tokens, starts, ends, fingerprint_mask, out):  # type: ignore[no-untyped-def]
    """Fingerprint of each span ``tokens[starts[i]:ends[i]]``, masked (``rolling_hash``'s polynomial)."""
    base = np.uint64(0x100000001B3)
    for span in range(out.shape[0]):
        value = np.uint64(0)
        for position in range(starts[span], ends[span]):
            value = value * base + np.uint64(tokens[position])
        out[span] = value & fingerprint_mask


@njit(cache=True, nogil=True)
def remove_keys(  # type: ignore[no-untyped-def]
    key_low, key_high, table_fingerprint, table_key_low, table_key_high, table_length, table_next, table_prev,
    table_fingerprint_link, table_key_link, fingerprint_heads, fingerprint_shift, key_heads, key_shift, state,
):
    """Unchain and free the rows of these keys, then clear every ``next`` and ``prev`` link that pointed at one.

    Returns:
        How many keys were indexed (and are now removed).
    """
    removed = np.zeros(state[1], dtype=np.bool_)
    num_removed = 0
    for index in range(key_low.shape[0]):
        bucket = _bucket(key_low[index], key_shift)
        previous = np.int32(-1)
        entry = key_heads[bucket]
        while entry >= 0:
            if table_key_low[entry] == key_low[index] and table_key_high[entry] == key_high[index]:
                break
            previous = entry
            entry = table_key_link[entry]
        if entry < 0:
            continue
        if previous < 0:
            key_heads[bucket] = table_key_link[entry]
        else:
            table_key_link[previous] = table_key_link[entry]
        bucket = _bucket(table_fingerprint[entry], fingerprint_shift)
        previous = np.int32(-1)
        other = fingerprint_heads[bucket]
        while other != entry:
            previous = other
            other = table_fingerprint_link[other]
        if previous < 0:
            fingerprint_heads[bucket] = table_fingerprint_link[entry]
        else:
            table_fingerprint_link[previous] = table_fingerprint_link[entry]
        table_length[entry] = 0
        table_next[entry] = -1
        table_prev[entry] = -1
        table_fingerprint_link[entry] = -1
        table_key_link[entry] = state[0]
        state[0] = entry
        state[2] -= 1
        removed[entry] = True
        num_removed += 1
    if num_removed:
        for entry in range(state[1]):
            successor = table_next[entry]
            if successor >= 0 and removed[successor]:
                table_next[entry] = -1
            predecessor = table_prev[entry]
            if predecessor >= 0 and removed[predecessor]:
                table_prev[entry] = -1
    return num_removed


@njit(cache=True, nogil=True)
def probe_windows(  # type: ignore[no-untyped-def]
    query, window_tokens, leaving_weight, fingerprint_mask, table_fingerprint, table_length,
    table_fingerprint_link, fingerprint_heads, fingerprint_shift, presence_bits, presence_shift,
):
    """Roll the fingerprint over every window of ``query`` and collect rows whose fingerprint and length match.

    Returns:
        ``(query_starts, entries)``, int64 and int32 arrays in increasing query start; unverified candidates.
    """
    base = np.uint64(0x100000001B3)
    num_windows = query.shape[0] - window_tokens + 1
    if num_windows <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
    # Windows go in blocks whose buffers stay in L1 (and no per-call allocation is large enough to be mmapped
    # and page-faulted). Per block: (1) roll the fingerprints; (2) keep, branch-free, the windows whose presence
    # bits are all set (Bloom false-positive rate about 1% at 16 filter bits per entry, less at 32); (3) walk the
    # survivors' fingerprint chains, two or three dependent cache misses each.
    block_windows = 2048
    survivor_starts = np.empty(block_windows, dtype=np.int64)
    survivor_fingerprints = np.empty(block_windows, dtype=np.uint64)
    capacity = 64
    starts = np.empty(capacity, dtype=np.int64)
    entries = np.empty(capacity, dtype=np.int32)
    count = 0
    value = np.uint64(0)
    for position in range(window_tokens):
        value = value * base + np.uint64(query[position])
    window_fingerprints = np.empty(block_windows, dtype=np.uint64)
    for block_start in range(0, num_windows, block_windows):
        block_size = min(block_windows, num_windows - block_start)
        for window in range(block_size):
            window_fingerprints[window] = value & fingerprint_mask
            start = block_start + window
            if start + 1 < num_windows:
                value = (value - np.uint64(query[start]) * leaving_weight) * base + np.uint64(
                    query[start + window_tokens]
                )
        num_survivors = 0
        for window in range(block_size):  # branch-free: the presence-word misses of many windows overlap
            fingerprint = window_fingerprints[window]
            mask = _presence_mask(fingerprint)
            survivor_starts[num_survivors] = block_start + window
            survivor_fingerprints[num_survivors] = fingerprint
            num_survivors += (presence_bits[_presence_word(fingerprint, presence_shift)] & mask) == mask
        for survivor in range(num_survivors):
            fingerprint = survivor_fingerprints[survivor]
            entry = fingerprint_heads[_bucket(fingerprint, fingerprint_shift)]
            while entry >= 0:
                if table_fingerprint[entry] == fingerprint and table_length[entry] == window_tokens:
                    if count == capacity:
                        capacity *= 2
                        grown_starts = np.empty(capacity, dtype=np.int64)
                        grown_starts[:count] = starts
                        starts = grown_starts
                        grown_entries = np.empty(capacity, dtype=np.int32)
                        grown_entries[:count] = entries
                        entries = grown_entries
                    starts[count] = survivor_starts[survivor]
                    entries[count] = entry
                    count += 1
                entry = table_fingerprint_link[entry]
    return starts[:count], entries[:count]


@njit(cache=True, nogil=True)
def follow_chains(starts, entries, num_query_tokens, table_next, table_length):  # type: ignore[no-untyped-def]
    """For each candidate, its entry and the entries of its sequence's later chunks that fit in the query.

    Unverified: the caller checks each chunk's verification hash and stops at the first mismatch. A chain stops
    at its sequence's end or where the next chunk would run past ``num_query_tokens``; a self-linked repeated
    chunk still stops there, since every step advances by its length (>= 1).

    Returns:
        ``(offsets, chain_entries)``: candidate i's chain is ``chain_entries[offsets[i]:offsets[i + 1]]``.
    """
    offsets = np.empty(starts.shape[0] + 1, dtype=np.int64)
    chain = np.empty(max(16, 4 * starts.shape[0]), dtype=np.int32)
    count = 0
    for candidate in range(starts.shape[0]):
        offsets[candidate] = count
        entry = entries[candidate]
        start = starts[candidate]
        while entry >= 0 and start + np.int64(table_length[entry]) <= num_query_tokens:
            if count == chain.shape[0]:
                grown = np.empty(2 * count, dtype=np.int32)
                grown[:count] = chain
                chain = grown
            chain[count] = entry
            count += 1
            start += np.int64(table_length[entry])
            entry = table_next[entry]
    offsets[starts.shape[0]] = count
    return offsets, chain[:count]


# fmt: on
