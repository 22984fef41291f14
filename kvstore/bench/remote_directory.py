"""``kvstore bench remote``, part 2: the fleet content directory at scale.

``num_chunks`` chunks' directory records (documents of 3,000 random tokens, 12 chunks of 256, the last of 184) are
published to the remote the way hosts publish them (``DirectoryRun`` records, ``XADD`` to the sharded streams), as
if other hosts had stored them; no KV is written, since a lookup never reads it. Then:

* ``directory_bytes_per_chunk``: ``MEMORY USAGE`` of every shard, summed, over the chunks (LMCache's coordinator
  index: ~2 KB per chunk, its published figure);
* ``sync_s``: a new host (a ``TieredStore`` with tiers cpu,remote and blending on) opens and reads the whole
  directory into its content index in the background, until every chunk is indexed;
* ``lookup_ms_p50`` / ``p99``: that host's ``lookup`` of 200 prompts of a 30-token system prompt, 5 of the documents
  in random order with 4-token separators and a 20-token question (15,066 tokens), back to back, each released
  (the plan's chunks are planned from the remote; nothing is fetched: prefetching is off). Baselines in the same
  run: one loopback round trip to Valkey (``PING``), and LMCache's coordinator (~1.2 ms median, published);
* ``recall``: document chunks the plans place at the right position from the remote, over those in the prompts.

Targets: p50 ≤ 1 ms, p99 ≤ 3 ms, recall 1.0.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.bench.rag_workload import (
    CHUNK_TOKENS,
    CHUNKS_PER_DOCUMENT,
    DOCUMENT_TOKENS,
    document_keys,
    make_documents,
    make_queries,
)
from kvstore.config import StoreConfig
from kvstore.content.index import hash_chunks
from kvstore.errors import StorageError
from kvstore.layout import KVLayout
from kvstore.remote_address import parse_remote_url
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
from kvstore.tiers.remote.directory import DirectoryRun, publish_command
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames

__all__ = ["DirectoryRow", "run_directory"]

LMCACHE_COORDINATOR_MS = 1.2
LMCACHE_BYTES_PER_CHUNK = 2048
P50_TARGET_MS = 1.0
P99_TARGET_MS = 3.0
_PUBLISH_BATCH = 2000
_SYNC_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectoryRow:
    """The directory part's figures (see the module docstring)."""

    part: str
    chunks: int
    runs: int
    publish_s: float
    directory_bytes_per_chunk: float
    lmcache_bytes_per_chunk: int
    sync_s: float
    sync_chunks_per_s: float
    queries: int
    query_tokens: int
    recall: float
    lookup_ms_p50: float
    lookup_ms_p99: float
    ping_ms_p50: float
    lookup_to_ping: float
    lmcache_coordinator_ms: float
    lookup_to_lmcache: float
    met: bool


def run_directory(
    url: str,
    layout: KVLayout,
    *,
    num_chunks: int,
    num_queries: int = 200,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> DirectoryRow:
    """Publish ``num_chunks`` chunks' records, sync a new host, measure its lookups (see the module docstring).

    ``progress(done, total)`` hears of the chunks published.
    """
    rng = np.random.default_rng(seed)
    namespace = f"kvstore-bench-dir-{os.getpid()}"
    names = RemoteNames.for_layout(namespace, layout, CHUNK_TOKENS)
    link = RemoteLink(parse_remote_url(url), timeout_s=60.0)
    documents, raw_keys = make_documents(rng, num_chunks)
    corpus = _Corpus(documents=documents, raw_keys=raw_keys)
    try:
        publish_s = _publish_corpus(link, names, corpus, num_chunks, progress)
        directory_bytes = link.call(lambda client: _memory_usage(client, names), default=0, what="memory usage")
        host = _measure_host(_host_config(url, layout, namespace), layout, corpus, rng, num_queries)
        pings_ms = _ping_ms(link)
    finally:
        link.call(lambda client: _delete(client, names), default=0, what="delete the benchmark's directory")
        link.close()
    return _directory_row(corpus, publish_s, directory_bytes, host, pings_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Corpus:
    """The benchmark's documents (one row of tokens each) and their chunks' keys (``document_keys`` cuts them)."""

    documents: npt.NDArray[np.uint32]
    raw_keys: bytes

    @property
    def num_documents(self) -> int:
        return int(self.documents.shape[0])

    @property
    def num_chunks(self) -> int:
        return self.num_documents * CHUNKS_PER_DOCUMENT


@dataclass(frozen=True, slots=True, kw_only=True)
class _HostFigures:
    """What the new host measured: its sync time, each lookup's latency, and the chunks its plans placed."""

    sync_s: float
    latencies_ms: list[float]
    num_found: int
    num_expected: int
    num_queries: int
    query_tokens: int


def _publish_corpus(
    link: RemoteLink,
    names: RemoteNames,
    corpus: _Corpus,
    num_chunks: int,
    progress: Callable[[int, int], None] | None,
) -> float:
    """Publish every document's directory record, ``_PUBLISH_BATCH`` per pipeline; the seconds it took."""
    starts = np.arange(0, DOCUMENT_TOKENS, CHUNK_TOKENS, dtype=np.int64)
    ends = np.minimum(starts + CHUNK_TOKENS, DOCUMENT_TOKENS)
    num_documents = corpus.num_documents
    started = time.perf_counter()
    for batch_start in range(0, num_documents, _PUBLISH_BATCH):
        runs = []
        for document in range(batch_start, min(batch_start + _PUBLISH_BATCH, num_documents)):
            contents = hash_chunks(corpus.documents[document], starts, ends)
            runs.append(
                DirectoryRun(
                    keys=tuple(document_keys(corpus.raw_keys, document)),
                    source_start=0,
                    fingerprint_bits=contents.fingerprint_bits,
                    fingerprints=contents.fingerprints,
                    verifications=contents.verifications,
                    lengths=contents.lengths,
                )
            )
        published = link.call(functools.partial(_publish, names=names, runs=runs), default=False, what="publish")
        _require(published)
        if progress is not None:
            progress(min(batch_start + _PUBLISH_BATCH, num_documents) * CHUNKS_PER_DOCUMENT, num_chunks)
    return time.perf_counter() - started


def _host_config(url: str, layout: KVLayout, namespace: str) -> StoreConfig:
    """The new host: tiers cpu,remote (the cpu tier one chunk), blending on, nothing promoted or prefetched."""
    return StoreConfig(
        tiers=(TierName.CPU, TierName.REMOTE),
        chunk_size=CHUNK_TOKENS,
        cpu_capacity_bytes=layout.chunk_bytes(CHUNK_TOKENS),
        remote_url=url,
        remote_namespace=namespace,
        remote_timeout_ms=5000,
        enable_blend=True,
        promote_on_hit=False,
    )


def _measure_host(
    config: StoreConfig, layout: KVLayout, corpus: _Corpus, rng: np.random.Generator, num_queries: int
) -> _HostFigures:
    """Open a new host, wait until it has indexed the whole directory, then time its lookups of the prompts."""
    with TieredStore(layout, config) as host:
        opened = time.perf_counter()
        deadline = opened + _SYNC_TIMEOUT_S
        while _indexed(host) < corpus.num_chunks and time.perf_counter() < deadline:
            time.sleep(0.01)
        sync_s = time.perf_counter() - opened
        queries = make_queries(rng, corpus.documents, num_queries)
        host.release(host.lookup(queries[0][0]))  # warm: first-call costs stay out of the timings
        latencies_ms, found, expected = [], 0, 0
        for query, placed in queries:
            started = time.perf_counter()
            plan = host.lookup(query)
            latencies_ms.append((time.perf_counter() - started) * 1e3)
            host.release(plan)
            at = {(s.start, s.key) for s in plan.segments if s.tier is TierName.REMOTE}
            for position, document in placed:
                for chunk, key in enumerate(document_keys(corpus.raw_keys, document)):
                    expected += 1
                    found += (position + chunk * CHUNK_TOKENS, key) in at
    return _HostFigures(
        sync_s=sync_s,
        latencies_ms=latencies_ms,
        num_found=found,
        num_expected=expected,
        num_queries=num_queries,
        query_tokens=int(queries[0][0].shape[0]),
    )


def _ping_ms(link: RemoteLink) -> list[float]:
    """200 loopback round trips to Valkey (``PING``), in ms: the lookup's baseline."""
    pings_ms = []
    for _ in range(200):
        started = time.perf_counter()
        link.call(lambda client: client.ping(), default=False, what="ping")
        pings_ms.append((time.perf_counter() - started) * 1e3)
    return pings_ms


def _directory_row(
    corpus: _Corpus, publish_s: float, directory_bytes: int, host: _HostFigures, pings_ms: list[float]
) -> DirectoryRow:
    """The row of the figures measured, against the baselines and targets."""
    latencies_ms, total_chunks = host.latencies_ms, corpus.num_chunks
    p50 = statistics.median(latencies_ms)
    p99 = float(np.percentile(latencies_ms, 99))
    ping = statistics.median(pings_ms)
    recall = host.num_found / host.num_expected
    return DirectoryRow(
        part="directory",
        chunks=total_chunks,
        runs=corpus.num_documents,
        publish_s=round(publish_s, 2),
        directory_bytes_per_chunk=round(directory_bytes / total_chunks, 1),
        lmcache_bytes_per_chunk=LMCACHE_BYTES_PER_CHUNK,
        sync_s=round(host.sync_s, 2),
        sync_chunks_per_s=round(total_chunks / host.sync_s),
        queries=host.num_queries,
        query_tokens=host.query_tokens,
        recall=round(recall, 6),
        lookup_ms_p50=round(p50, 4),
        lookup_ms_p99=round(p99, 4),
        ping_ms_p50=round(ping, 4),
        lookup_to_ping=round(p50 / ping, 2),
        lmcache_coordinator_ms=LMCACHE_COORDINATOR_MS,
        lookup_to_lmcache=round(p50 / LMCACHE_COORDINATOR_MS, 3),
        met=p50 <= P50_TARGET_MS and p99 <= P99_TARGET_MS and recall == 1.0,
    )


def _indexed(host: TieredStore) -> int:
    catalog = host.stats().catalog
    return catalog.num_entries if catalog is not None else 0


def _publish(client: Any, *, names: RemoteNames, runs: list[DirectoryRun]) -> bool:
    pipe = client.pipeline(transaction=False)
    for run in runs:
        publish_command(pipe, names, run, host_id=0, max_runs_per_shard=1 << 24)
    pipe.execute()
    return True


def _memory_usage(client: Any, names: RemoteNames) -> int:
    return sum(client.memory_usage(shard, samples=0) or 0 for shard in names.directory_shards())


def _delete(client: Any, names: RemoteNames) -> int:
    return sum(client.delete(shard) for shard in names.directory_shards())


def _require(ok: bool) -> None:
    if not ok:
        raise StorageError("kvstore bench remote: publishing the directory failed (see the log)")
