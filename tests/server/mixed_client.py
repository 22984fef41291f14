"""Clients of the concurrency test: ``python -m tests.server.mixed_client URL NUM_CLIENTS SECONDS``.

The process imports torch and kvstore once, then forks NUM_CLIENTS children before any torch work (no thread
pool exists yet, so forking is safe, and 8 clients start in a second instead of 8 interpreter start-ups on a
2-core machine). Each child is one client with its own seed; it runs random operations for SECONDS -- stores
(some durable, some from a shared-memory buffer), lookups that it retrieves (checking every exact segment's bytes
against what was stored), releases, or abandons to a session's end, evictions, stats -- over a pool of documents
shared by all clients (so they pin and evict each other's chunks), then closes and prints one JSON line of counts
with its pid. The parent exits 1 when any child failed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

import numpy as np
import torch

from kvstore import Client
from kvstore.tiers.base import TierName
from tests.server.conftest import SERVER_LAYOUT

NUM_DOCUMENTS = 24
DOCUMENT_TOKENS = 96


def document(index: int) -> tuple[np.ndarray, torch.Tensor]:
    """Document ``index``: the same tokens and KV in every process."""
    tokens = np.random.default_rng(index).integers(0, 50_000, size=DOCUMENT_TOKENS)
    kv = torch.randn(SERVER_LAYOUT.chunk_shape(DOCUMENT_TOKENS), generator=torch.Generator().manual_seed(index))
    return tokens, kv.to(torch.bfloat16)


def check(result_segments: tuple, kv_out: torch.Tensor, expected: torch.Tensor) -> int:
    """Compare each exact segment of a retrieve with the stored KV; returns the tokens checked."""
    checked = 0
    for segment in result_segments:
        if segment.exact:
            got = kv_out[:, :, segment.start : segment.end]
            if not torch.equal(got, expected[:, :, segment.start : segment.end]):
                raise AssertionError(f"segment {segment} read back different bytes")
            checked += segment.num_tokens
    return checked


def run_client(url: str, seed: int, seconds: float) -> None:
    rng = random.Random(seed)
    documents = [document(index) for index in range(NUM_DOCUMENTS)]
    counts = {"store": 0, "retrieve": 0, "release": 0, "session": 0, "evict": 0, "stats": 0, "checked_tokens": 0}
    with Client(url, SERVER_LAYOUT, name=f"mixed-{seed}", timeout_s=60) as client:
        buffer = client.buffer(DOCUMENT_TOKENS)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            index = rng.randrange(NUM_DOCUMENTS)
            tokens, kv = documents[index]
            op = rng.random()
            if op < 0.25:
                if rng.random() < 0.3:
                    buffer.copy_(kv)
                    client.store(tokens, buffer, durable=rng.random() < 0.2)
                else:
                    client.store(tokens, kv, durable=rng.random() < 0.1)
                counts["store"] += 1
            elif op < 0.55:
                out = buffer if rng.random() < 0.3 else None
                result = client.retrieve(client.lookup(tokens), out)
                counts["checked_tokens"] += check(result.segments, result.kv, kv)
                counts["retrieve"] += 1
            elif op < 0.7:
                client.release(client.lookup(np.concatenate([tokens, tokens[:7]])))
                counts["release"] += 1
            elif op < 0.85:
                with client.session() as session:
                    plans = [session.lookup(documents[rng.randrange(NUM_DOCUMENTS)][0]) for _ in range(3)]
                    if rng.random() < 0.5:
                        session.retrieve(plans[0])
                counts["session"] += 1
            elif op < 0.92:
                plan = client.lookup(tokens)
                client.release(plan)
                if plan.segments:
                    client.evict([rng.choice(plan.segments).key])
                else:
                    client.evict_bytes(16 * 1024, TierName.CPU)
                counts["evict"] += 1
            else:
                stats = client.stats()
                assert stats.num_open_plans >= 0
                counts["stats"] += 1
    # One write(2) under PIPE_BUF bytes: the eight forked clients share the pipe, and print's separate writes of the
    # line and its newline interleaved two clients' lines into one (test_eight_clients_with_mixed_operations).
    os.write(sys.stdout.fileno(), (json.dumps(counts | {"pid": os.getpid()}) + "\n").encode())


def main() -> None:
    url, num_clients, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    children = []
    for seed in range(num_clients):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_client(url, seed, seconds)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        children.append(pid)
    failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
