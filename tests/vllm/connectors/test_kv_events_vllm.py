"""kvstore's KV events decoded with vLLM's own structs (``vllm.distributed.kv_events.KVEventBatch``, msgspec), as a
router that subscribes to vLLM engines decodes them: every event is one of vLLM's classes, the residency rebuilt
from them is the server's, and a late joiner's snapshot and replay decode the same way."""

from __future__ import annotations

from pathlib import Path

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvstore import Client
from kvstore.keys import as_token_array, prefix_keys
from kvstore.server.kv_events.consumer import ResidencyMirror, Subscriber, free_port, join_late
from kvstore.server.kv_events.encoding import MEDIUMS
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, running_server

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_with_vllm(payload: bytes) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """vLLM's decoder: the mirror reads vLLM's structs as they are."""
    decoded = _DECODER.decode(payload)
    assert isinstance(decoded.ts, float) and decoded.data_parallel_rank is None
    assert all(isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared) for event in decoded.events)
    return list(decoded.events)


def test_a_router_decoding_with_vllms_structs_rebuilds_the_residency(tmp_path: Path) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ResidencyMirror(decode=decode_with_vllm), replay)
    flags = ("--tiers", "cpu,disk", "--cpu-size", "64KiB", "--kv-events", subscriber.endpoint, "--kv-events-replay")
    documents = [make_tokens(5 * CHUNK_SIZE + 3, seed=seed) for seed in range(30)]
    keys = [key for tokens in documents for key in prefix_keys(SERVER_LAYOUT.namespace, as_token_array(tokens), 16)]
    try:
        with running_server(tmp_path / "data", *flags, replay) as server, Client(server.url, SERVER_LAYOUT) as client:
            for seed, tokens in enumerate(documents):
                client.store(tokens, make_kv(SERVER_LAYOUT, len(tokens), seed=seed))
            client.evict(keys[:4])
            client.flush()
            subscriber.receive(quiet_s=1.5)
            truth = {(MEDIUMS[tier], key) for key in keys for tier in client.chunk(key).tiers}
            late, by_keys = ResidencyMirror(decode=decode_with_vllm), ResidencyMirror(decode=decode_with_vllm)
            join_late(replay, late)
            join_late(replay, by_keys, with_tokens=False)
    finally:
        subscriber.close()
    assert {medium for medium, _ in truth} == {"CPU", "STORAGE"}
    assert subscriber.mirror.resident == truth and late.resident == truth and by_keys.resident == truth
    assert all(block.token_ids.size == 0 and block.parent_block_hash is None for block in by_keys.stored.values())
    stored = subscriber.mirror.stored[keys[1]]
    assert stored.block_size == CHUNK_SIZE and stored.parent_block_hash == keys[0]
    assert stored.token_ids.tolist() == documents[0][CHUNK_SIZE : 2 * CHUNK_SIZE].tolist()
