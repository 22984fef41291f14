"""What a store publishes to the fleet directory, read back from a real Valkey by another host's remote tier."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.bench.valkey_server import ValkeyServer
from kvstore.keys import as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.remote_address import parse_remote_url
from kvstore.store.fleet_publish import RecentRuns, publish_records, records_in_runs
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.remote.directory import DirectoryRun
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames
from kvstore.tiers.remote.tier import RemoteTier
from tests.factories import make_kv, make_tokens

CHUNK = 16
LAYOUT = KVLayout(model_id="test/publish", num_layers=1, num_kv_heads=1, head_dim=8)


def _tier(url: str, host_id: int) -> RemoteTier:
    link = RemoteLink(parse_remote_url(url), timeout_s=2.0)
    return RemoteTier(link, RemoteNames.for_layout("ns", LAYOUT, CHUNK), LAYOUT, CHUNK, host_id=host_id)


@pytest.fixture
def publisher_and_reader(valkey: ValkeyServer) -> Iterator[tuple[RemoteTier, RemoteTier]]:
    publisher, reader = _tier(valkey.url, 1), _tier(valkey.url, 2)
    try:
        yield publisher, reader
    finally:
        publisher.close()
        reader.close()


def _records(tokens: np.ndarray) -> list[ChunkRecord]:
    keys = prefix_keys(LAYOUT.namespace, tokens, CHUNK)
    array = as_token_array(tokens)
    return [
        ChunkRecord(
            key=key,
            source_start=index * CHUNK,
            tokens=array[index * CHUNK : (index + 1) * CHUNK],
            parent_key=keys[index - 1] if index else None,
        )
        for index, key in enumerate(keys)
    ]


def test_records_are_joined_into_runs_by_parent_keys_in_any_order() -> None:
    first, second = _records(make_tokens(3 * CHUNK + 5, seed=1)), _records(make_tokens(2 * CHUNK, seed=2))
    shuffled = [first[2], second[1], first[0], first[3], second[0], first[1]]
    runs = records_in_runs(shuffled)
    assert sorted([[r.key for r in run] for run in runs]) == sorted([[r.key for r in first], [r.key for r in second]])


def test_a_document_evicted_in_two_parts_is_published_as_one_linked_run(
    publisher_and_reader: tuple[RemoteTier, RemoteTier],
) -> None:
    publisher, reader = publisher_and_reader
    records = _records(make_tokens(4 * CHUNK + 5, seed=3))
    recent = RecentRuns()
    for part in (records[:3], records[3:]):  # two evictions
        for record in part:  # only chunks that reach the remote are published
            assert publisher.put(record, make_kv(LAYOUT, record.num_tokens, seed=record.source_start))
        for run in records_in_runs(part):
            publish_records(publisher, run, 64, recent)
    assert publisher.flush(5)
    runs: list[DirectoryRun] = sorted(reader.read_directory() or [], key=lambda run: run.source_start)  # shards
    assert [list(run.keys) for run in runs] == [
        [r.key for r in records[:3]],
        [r.key for r in records[2:]],  # starts again with the first part's last chunk: the link survives
    ]
    assert runs[1].source_start == 2 * CHUNK and list(runs[1].lengths) == [CHUNK, CHUNK, 5]
    assert np.array_equal(runs[1].fingerprints[0], runs[0].fingerprints[2])
