"""``request_misses``: a request's missed tokens by reason always add up to its looked-up tokens less the served
ones, whatever the probe held and whatever the connector did with it; and each reason lands where it belongs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvstore.connectors.vllm.request_misses import cached_tokens, request_misses
from kvstore.keys import PrefixKey
from kvstore.misses import Miss, MissReason
from kvstore.plan import Segment, exact_prefix_tokens, gaps_between
from kvstore.tiers.base import TierName

CHUNK = 16
KEY = PrefixKey(bytes(16))


def probe(layout: list[tuple[str, int]]) -> tuple[tuple[Segment, ...], tuple[Miss, ...], int]:
    """Segments and misses from ``(kind, tokens)`` pieces: ``exact``, ``blend`` or a miss reason."""
    segments: list[Segment] = []
    misses: list[Miss] = []
    cursor = 0
    for kind, length in layout:
        if kind in ("exact", "blend"):
            segments.append(
                Segment(start=cursor, num_tokens=length, key=KEY, source_start=cursor, exact=kind == "exact",
                        tier=TierName.CPU)
            )  # fmt: skip
        else:
            misses.append(Miss(cursor, cursor + length, MissReason(kind)))
        cursor += length
    assert sum(g.num_tokens for g in gaps_between(tuple(segments), cursor)) == sum(m.num_tokens for m in misses)
    return tuple(segments), tuple(misses), cursor


pieces = st.lists(
    st.tuples(st.sampled_from(["exact", "blend", "never_stored", "evicted_cpu"]), st.integers(1, 3 * CHUNK)),
    min_size=1,
    max_size=8,
).map(lambda layout: [piece for index, piece in enumerate(layout) if index == 0 or piece[0] != layout[index - 1][0]])


@given(layout=pieces, data=st.data())
def test_reasons_add_up_to_the_tokens_not_served(layout: list[tuple[str, int]], data: st.DataObject) -> None:
    segments, misses, num_tokens = probe(layout)
    exact_end = exact_prefix_tokens(segments)
    local_end = data.draw(st.integers(0, num_tokens))
    served_end = data.draw(st.integers(local_end, max(local_end, exact_end)))
    served = cached_tokens(segments, local_end, served_end)
    undelivered_tokens = data.draw(st.integers(0, served))
    missed = request_misses(
        segments, misses, local_end=local_end, num_tokens=num_tokens, served_end=served_end, exact_end=exact_end,
        gate_refused=data.draw(st.booleans()),
        declined=data.draw(st.sampled_from([None, MissReason.LOAD_FAILED])),
        undelivered={MissReason.CHECKSUM: undelivered_tokens},
    )  # fmt: skip
    assert (served - undelivered_tokens) + sum(missed.values()) == num_tokens - local_end
    assert all(count > 0 for count in missed.values())


def test_each_reason_lands_where_it_belongs() -> None:
    segments, misses, num_tokens = probe(
        [("exact", 40), ("evicted_cpu", 16), ("exact", 16), ("blend", 16), ("never_stored", 5)]
    )
    # vLLM held 8 tokens, the connector loaded [8, 32): 8 cached tokens of the exact prefix are past the last block
    missed = request_misses(segments, misses, local_end=8, num_tokens=num_tokens, served_end=32, exact_end=40)
    assert missed == {
        MissReason.BLOCK_BOUNDARY: 8,
        MissReason.EVICTED_CPU: 16,
        MissReason.BEHIND_GAP: 32,  # the exact chunk and the blend chunk after the gap
        MissReason.NEVER_STORED: 5,
    }
    refused = request_misses(
        segments, misses, local_end=0, num_tokens=num_tokens, served_end=32, exact_end=40, gate_refused=True
    )
    assert refused[MissReason.BLEND_GATE] == 32
    declined = request_misses(
        segments, misses, local_end=0, num_tokens=num_tokens, served_end=0, exact_end=40,
        declined=MissReason.LOAD_FAILED,
    )  # fmt: skip
    assert declined == {MissReason.LOAD_FAILED: 72, MissReason.EVICTED_CPU: 16, MissReason.NEVER_STORED: 5}
