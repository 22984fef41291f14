"""FingerprintIndex on the retrieval workload: recall, false positives, document coverage, match latency, memory.

``kvstore bench index`` (and ``benchmarks/bench_index.py``) runs it. For N chunks: store N/12 documents of 3000
random tokens (chunk 256 -> 12 chunks, the last one of 184 tokens), then match queries of a 30-token system
prompt + 5 documents in random order joined by 4-token separators + a 20-token question (~15.1K tokens).

* recall: full chunks found at their place with their key / full chunks placed in queries;
* false_positives: matches whose query tokens differ from the stored chunk's (must be 0);
* doc_coverage: document tokens covered by correct matches / document tokens in queries (partial chunks count);
* match_ms_median / match_ms_p99: ``FingerprintIndex.match`` per query, queries matched back to back;
* match_ms_median_cold / match_ms_p99_cold: the same after sweeping 64 MiB through the caches before each of
  50 queries (the index's arrays start out of cache, as after a model step);
* register_tokens_per_s: stored tokens / time of all ``register`` calls;
* baseline_ms_median, match_to_baseline_ratio: the numba rolling hash alone over the same queries (the
  hashing floor of any probe), measured in the same run because these machines are shared and noisy;
* bytes_per_chunk: ``memory_bytes / len(index)``;
* recall_after_evicting_10pct: remove a random 10% of chunks (one ``remove`` call), recall over the chunks left;
  the run fails if a removed chunk is ever returned.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.bench.rag_workload import (
    CHUNK_TOKENS,
    CHUNKS_PER_DOCUMENT,
    DOCUMENT_TOKENS,
    DOCUMENTS_PER_QUERY,
    Placed,
    document_keys,
    make_documents,
    make_queries,
)
from kvstore.content import FingerprintIndex
from kvstore.content.rolling_hash import rolling_fingerprints
from kvstore.keys import PrefixKey

__all__ = ["IndexBenchRow", "run_index_benchmark"]


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexBenchRow:
    """One measured index size; every field is described in the module docstring."""

    chunks: int
    queries: int
    query_tokens: int
    recall: float
    false_positives: int
    doc_coverage: float
    match_ms_median: float
    match_ms_p99: float
    baseline: str
    baseline_ms_median: float
    match_to_baseline_ratio: float
    match_ms_median_cold: float
    match_ms_p99_cold: float
    register_tokens_per_s: int
    bytes_per_chunk: float
    recall_after_evicting_10pct: float

    def to_json_dict(self) -> dict[str, str | int | float]:
        return {"bench": "fingerprint_index"} | {name: getattr(self, name) for name in self.__slots__}


def _percentile(samples: list[float], ratio: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(ratio * len(ordered)))]


def run_index_benchmark(num_chunks: int, num_queries: int = 200, seed: int = 0) -> IndexBenchRow:
    """Build an index of about ``num_chunks`` chunks and measure it (see the module docstring for each field)."""
    rng = np.random.default_rng(seed)
    documents, raw_keys = make_documents(rng, num_chunks)
    num_documents = documents.shape[0]
    keys = [document_keys(raw_keys, document) for document in range(num_documents)]
    warm_up = FingerprintIndex()  # load the numba kernels outside the timings
    warm_up.register(documents[0], keys[0], CHUNK_TOKENS)
    warm_up.match(documents[0], CHUNK_TOKENS)
    index = FingerprintIndex()
    started = time.perf_counter()
    for document, its_keys in zip(documents, keys, strict=True):
        index.register(document, its_keys, CHUNK_TOKENS)
    register_s = time.perf_counter() - started

    workload = _Workload(documents=documents, keys=keys, queries=make_queries(rng, documents, num_queries))
    warm = _score(index, workload, set())
    baseline_ms = _baseline_ms(workload.queries)
    cold_ms = _cold_latencies_ms(index, workload.queries)
    bytes_per_chunk = index.memory_bytes / len(index)
    all_keys = [key for document_keys in keys for key in document_keys]
    victims = {all_keys[i] for i in rng.choice(len(all_keys), size=len(all_keys) // 10, replace=False).tolist()}
    removed_count = index.remove(victims)
    assert removed_count == len(victims), (removed_count, len(victims))
    after = _score(index, workload, victims)
    latencies_ms = warm.latencies_ms
    return IndexBenchRow(
        chunks=len(all_keys),
        queries=num_queries,
        query_tokens=int(workload.queries[0][0].shape[0]),
        recall=round(warm.recall, 6),
        false_positives=warm.false_positives + after.false_positives,
        doc_coverage=round(warm.coverage, 6),
        match_ms_median=round(statistics.median(latencies_ms), 4),
        match_ms_p99=round(_percentile(latencies_ms, 0.99), 4),
        baseline="numba rolling hash of every window of the query (the hashing floor), same run",
        baseline_ms_median=round(statistics.median(baseline_ms), 4),
        match_to_baseline_ratio=round(statistics.median(latencies_ms) / statistics.median(baseline_ms), 1),
        match_ms_median_cold=round(statistics.median(cold_ms), 4),
        match_ms_p99_cold=round(_percentile(cold_ms, 0.99), 4),
        register_tokens_per_s=round(num_documents * DOCUMENT_TOKENS / register_s),
        bytes_per_chunk=round(bytes_per_chunk, 2),
        recall_after_evicting_10pct=round(after.recall, 6),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Workload:
    """The indexed documents, each one's chunk keys, and the prompts matched against them."""

    documents: npt.NDArray[np.uint32]
    keys: list[list[PrefixKey]]
    queries: list[tuple[npt.NDArray[np.uint32], Placed]]

    @property
    def location(self) -> dict[PrefixKey, tuple[int, int]]:
        """Each key's (document, chunk)."""
        return {key: (d, c) for d, document_keys in enumerate(self.keys) for c, key in enumerate(document_keys)}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Score:
    """One pass of matches over every prompt: what they found, and each match's latency."""

    recall: float
    false_positives: int
    coverage: float
    latencies_ms: list[float]


def _score(index: FingerprintIndex, workload: _Workload, removed: set[PrefixKey]) -> _Score:
    """Match every prompt back to back, as a scheduler looking up a batch would, then check each match against
    the documents: recall of the full chunks not ``removed``, false positives, and tokens covered."""
    queries, keys = workload.queries, workload.keys
    latencies_ms, results = [], []
    for query, _ in queries:
        started = time.perf_counter()
        results.append(index.match(query, CHUNK_TOKENS))
        latencies_ms.append((time.perf_counter() - started) * 1e3)
    location = workload.location
    found = expected = false_positives = covered = 0
    for (query, placed), matches in zip(queries, results, strict=True):
        assert not removed & {m.key for m in matches}, "a removed chunk was returned"
        by_start = {m.query_start: m for m in matches}
        for match in matches:
            stored = location[match.key]
            source = workload.documents[stored[0], match.source_start : match.source_start + match.num_tokens]
            false_positives += int(
                not np.array_equal(query[match.query_start : match.query_start + match.num_tokens], source)
            )
        for position, document_idx in placed:
            for chunk_idx, key in enumerate(keys[document_idx]):
                hit = by_start.get(position + chunk_idx * CHUNK_TOKENS)
                is_hit = hit is not None and hit.key == key
                covered += hit.num_tokens if is_hit and hit is not None else 0
                if chunk_idx < CHUNKS_PER_DOCUMENT - 1 and key not in removed:
                    expected += 1
                    found += int(is_hit)
    coverage = covered / (len(queries) * DOCUMENTS_PER_QUERY * DOCUMENT_TOKENS)
    return _Score(
        recall=found / max(1, expected), false_positives=false_positives, coverage=coverage, latencies_ms=latencies_ms
    )


def _baseline_ms(queries: list[tuple[npt.NDArray[np.uint32], Placed]]) -> list[float]:
    """Each prompt's rolling hash of every window, in ms: the hashing floor a match cannot beat."""
    baseline_ms = []
    for query, _ in queries:
        started = time.perf_counter()
        rolling_fingerprints(query, CHUNK_TOKENS)
        baseline_ms.append((time.perf_counter() - started) * 1e3)
    return baseline_ms


def _cold_latencies_ms(index: FingerprintIndex, queries: list[tuple[npt.NDArray[np.uint32], Placed]]) -> list[float]:
    """Each match after sweeping 64 MiB through the caches: the index's arrays start out of L2/L3."""
    sweep = np.ones(8 * 2**20)
    samples = []
    for query, _ in queries[:50]:
        sweep += 1.0
        started = time.perf_counter()
        index.match(query, CHUNK_TOKENS)
        samples.append((time.perf_counter() - started) * 1e3)
    return samples
