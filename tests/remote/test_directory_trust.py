"""What another host's directory claims is checked against what the remote holds: a record claiming more tokens
than its chunk's value has is a miss, never one token's KV copied over the claimed length (a copy never
broadcasts). Real valkey-server, real ``kvstore serve`` hosts; the forged record is written with the directory's
own encoder, as a buggy or foreign publisher would."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.bench.remote_fleet import lookup_when_known
from kvstore.bench.valkey_server import ValkeyServer
from kvstore.client import Client
from kvstore.content.index import hash_chunks
from kvstore.keys import as_token_array, chained_key
from kvstore.remote_address import DEFAULT_NAMESPACE
from kvstore.tiers.base import TierName
from kvstore.tiers.remote.directory import DirectoryRun, publish_command
from kvstore.tiers.remote.names import RemoteNames
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, running_server


def test_a_directory_record_longer_than_its_chunk_is_a_miss_not_a_broadcast(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    remote = ("--tiers", "cpu,disk,remote", "--remote-url", valkey.url, "--enable-blend", "--remote-timeout-ms", "500")
    with running_server(tmp_path / "writer", *remote) as writer, running_server(tmp_path / "reader", *remote) as reader:
        one_token = make_tokens(1, seed=40)
        key = chained_key(SERVER_LAYOUT.namespace, as_token_array(one_token))
        claimed = as_token_array(make_tokens(CHUNK_SIZE, seed=41))  # a whole chunk the record says the key holds
        contents = hash_chunks(claimed, np.array([0]), np.array([CHUNK_SIZE]))
        run = DirectoryRun(keys=(key,), source_start=0, fingerprint_bits=contents.fingerprint_bits,
                           fingerprints=contents.fingerprints, verifications=contents.verifications,
                           lengths=contents.lengths)  # fmt: skip
        names = RemoteNames.for_layout(DEFAULT_NAMESPACE, SERVER_LAYOUT, CHUNK_SIZE)
        with valkey.client() as forger, forger.pipeline() as pipe:
            publish_command(pipe, names, run, host_id=12345, max_runs_per_shard=1000)
            pipe.execute()
        with Client(writer.url, SERVER_LAYOUT) as client:  # the chunk the record names: one token's value
            client.store(one_token, make_kv(SERVER_LAYOUT, 1, seed=40))
            client.flush()

        prompt = np.concatenate([make_tokens(5, seed=42), claimed])
        with Client(reader.url, SERVER_LAYOUT) as client:
            plan = lookup_when_known(client, prompt, CHUNK_SIZE)
            assert [(s.start, s.num_tokens, s.tier) for s in plan.segments] == [(5, CHUNK_SIZE, TierName.REMOTE)]
            result = client.retrieve(plan)
            remote = client.stats().tier(TierName.REMOTE)
        assert result.segments == (), "the chunk holds 1 token, the record claimed 16: nothing is served"
        assert result.kv.shape[2] == 0
        # A counted miss: with the damaged values when the value was fetched and found short, or as a plain miss
        # when a prefetch's timing left the key forgotten before the retrieve (seen once under a loaded CI run)
        assert remote is not None and remote.corrupt_reads + remote.misses >= 1 and remote.corrupt_reads <= 1
        assert reader.process.poll() is None and "Traceback" not in reader.stderr()
