"""Content index rebuild at open (persistence): how long reopening a data dir of N chunks takes.

``kvstore bench rebuild`` (and ``benchmarks/bench_rebuild.py``) runs it. The workload is the index benchmark's
(``kvstore.bench.index``): documents of 3000 random tokens in chunks of 256 (12 chunks, the last one of 184
tokens), each chunk written through a real ``DiskTier`` with its prefix key, source start, tokens and parent key.
The KV is tiny (1 layer x 1 KV head x ``head_dim`` fp16), so a million chunks build in minutes and fit in a few
GB; the rebuild reads only the chunks' meta records, whose size does not depend on the KV.

The data dir is kept: a later run with the same chunk count, seed and layout reuses it (a manifest in the dir
says what it holds), so repeated runs skip the build. A dir that holds anything else is never touched.

Measured, each ``num_repeats`` times, alternating (figures are medians):

* rebuild_s: ``TieredStore(layout, StoreConfig(tiers=("disk",), enable_blend=True))``: the disk tier's recovery of
  every meta record, which feeds the content index as it goes (one pass: relink sequences through their parent
  keys, register them in the ``FingerprintIndex``): everything the store does before it serves a lookup;
  rebuild_cpu_s is the process's CPU time over it (steadier than wall time when other work shares the machine),
  rebuild_gc_s the part the cyclic garbage collector ran (``gc.callbacks``);
* the baseline, in the same run: disk_open_s (the same ``DiskTier`` opened alone) plus read_records_s (one pass of
  ``DiskTier.iter_records()``, which decodes and checks every meta record, tokens included): the raw cost of getting
  the records out of LMDB without indexing them; ``rebuild_to_baseline_ratio`` compares the two;
* rebuild_one_pass_s: the same one-pass open built by hand from its parts (a ``ContentCatalog``, the disk tier
  opened with ``content_records=catalog.start_rebuild().add``, then ``finish()``, collector paused): a cross-check
  that it indexes as many chunks as the store; rebuild_one_pass_cpu_s its CPU time. (Before commit 073ae0d the
  store read the records twice and this was the faster path it has since become.)
* chunks_per_s: chunks / rebuild_s (target 100,000: 1M chunks in 10 s on the 2-core dev machine);
* index_entries: entries in the rebuilt index (every chunk: the documents' contents are distinct; the one-pass
  open must index as many);
* recall, doc_coverage, false_positives: ``lookup`` on the reopened store of ``num_queries`` queries of a 30-token
  system prompt + 5 documents in random order with 4-token separators + a 20-token question; recall is full chunks
  found at their place with their key, coverage counts every document token (partial last chunks included),
  a false positive is a segment that is not a document chunk at its place.

With ``cold`` the data dir is dropped from the page cache (``POSIX_FADV_DONTNEED``) before every timed open.

Threads: the caller's (the tiers and the catalog run their own workers). While it times an open it adds a callback
to ``gc.callbacks`` (removed afterwards). Logs; never prints.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.bench.page_cache import drop_page_cache
from kvstore.bench.rag_workload import CHUNK_TOKENS, CHUNKS_PER_DOCUMENT, DOCUMENT_TOKENS, DOCUMENTS_PER_QUERY, VOCAB
from kvstore.bench.rebuild_options import RebuildBenchOptions, default_data_dir
from kvstore.config import StoreConfig
from kvstore.content.catalog import ContentCatalog, ResidencyCheck
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey, TokenArray, prefix_keys
from kvstore.layout import KVDtype, KVLayout
from kvstore.stats import CatalogStats
from kvstore.store import TieredStore
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.disk.tier import DiskTier

__all__ = [
    "RebuildBenchOptions",
    "RebuildBenchRow",
    "RebuildProgress",
    "bench_layout",
    "capacity_bytes",
    "default_data_dir",
    "run_rebuild_benchmark",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "kvstore-bench-rebuild.json"
TARGET_CHUNKS_PER_S = 100_000  # the goal: 1M chunks in <= 10 s on the dev machine
_SYSTEM_TOKENS, _SEPARATOR_TOKENS, _QUESTION_TOKENS = 30, 4, 20
_MIB = 1024 * 1024
_QUERY_STREAM = 2**32 - 1  # the queries' random stream: no document index reaches it

RebuildProgress = Callable[[str, int, int | None], None]
"""Called with a step's description, the units done and the units in all (``None``: unknown)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RebuildBenchRow:
    """One measured data dir; every field is described in the module docstring."""

    chunks: int
    documents: int
    data_dir: str
    data_dir_bytes: int
    reused_data_dir: bool
    build_s: float | None
    cold: bool
    repeats: int
    rebuild_s: float
    rebuild_s_min: float
    rebuild_s_max: float
    rebuild_cpu_s: float
    rebuild_gc_s: float
    rebuild_one_pass_s: float
    rebuild_one_pass_cpu_s: float
    baseline: str
    disk_open_s: float
    read_records_s: float
    rebuild_to_baseline_ratio: float
    chunks_per_s: int
    target_chunks_per_s: int
    met: bool
    index_entries: int
    index_bytes_per_chunk: float
    queries: int
    recall: float
    doc_coverage: float
    false_positives: int
    lookup_ms_median: float

    def to_json_dict(self) -> dict[str, str | int | float | bool | None]:
        return {"bench": "index_rebuild"} | {name: getattr(self, name) for name in self.__slots__}


def bench_layout(options: RebuildBenchOptions) -> KVLayout:
    """The tiny KV layout of the benchmark's chunks: 1 layer, 1 KV head, ``options.head_dim``, fp16."""
    return KVLayout(
        model_id="kvstore-bench-rebuild",
        num_layers=1,
        num_kv_heads=1,
        head_dim=options.head_dim,
        dtype=KVDtype.FLOAT16,
    )


def capacity_bytes(options: RebuildBenchOptions) -> int:
    """Room for every chunk twice over: nothing is evicted, at build or at open."""
    chunk_bound_bytes = bench_layout(options).chunk_bytes(CHUNK_TOKENS) + 4 * CHUNK_TOKENS + 256
    return 2 * options.num_documents * CHUNKS_PER_DOCUMENT * chunk_bound_bytes + 64 * _MIB


def document_tokens(seed: int, document_idx: int) -> TokenArray:
    """The tokens of one document, regenerated from its seed (the run never holds every document)."""
    return np.random.default_rng((seed, document_idx)).integers(0, VOCAB, DOCUMENT_TOKENS).astype("<u4")


def run_rebuild_benchmark(options: RebuildBenchOptions, progress: RebuildProgress | None = None) -> RebuildBenchRow:
    """Build (or reuse) the data dir, time the store's open against the baseline, check the rebuilt index."""
    say = progress or (lambda _step, _done, _total: None)
    data_dir = options.resolved_data_dir
    build_s = _ensure_data_dir(options, data_dir, say)
    samples: dict[str, list[float]] = {
        name: [] for name in ("rebuild", "cpu", "gc", "one_pass", "one_pass_cpu", "opening", "read")
    }
    store, catalog = _time_opens(options, data_dir, samples, say)
    say("checking the rebuilt index", 0, options.num_queries)
    try:
        check = _check_lookups(store, options, say)
    finally:
        store.close()
    return _rebuild_row(options, data_dir, build_s, _Opens(samples=samples, catalog=catalog), check)


def _time_opens(
    options: RebuildBenchOptions, data_dir: Path, samples: dict[str, list[float]], say: RebuildProgress
) -> tuple[TieredStore, CatalogStats]:
    """Time ``options.num_repeats`` opens of the data dir, each beside its baseline and the one-pass open, into
    ``samples``; the last store is left open for the lookups, with its catalog's figures."""
    config = StoreConfig(
        tiers=(TierName.DISK,), data_dir=data_dir, disk_capacity_bytes=capacity_bytes(options), enable_blend=True
    )
    expected_chunks = options.num_documents * CHUNKS_PER_DOCUMENT
    catalog: CatalogStats | None = None
    for repeat in range(options.num_repeats):
        say(f"timing opens, repeat {repeat + 1}/{options.num_repeats}", repeat, options.num_repeats)
        disk_open_s, read_records_s, num_records = _time_baseline(options, data_dir)
        if num_records != expected_chunks:
            raise ConfigError(
                f"data dir {data_dir} holds {num_records} chunks, its manifest says {expected_chunks}; "
                "delete it and run again"
            )
        samples["opening"].append(disk_open_s)
        samples["read"].append(read_records_s)
        one_pass = _time_one_pass_rebuild(options, data_dir)
        samples["one_pass"].append(one_pass.elapsed_s)
        samples["one_pass_cpu"].append(one_pass.cpu_s)
        if options.cold:
            drop_page_cache(data_dir)
        with _GcClock() as gc_clock:
            started_s, started_cpu_s = time.perf_counter(), time.process_time()
            store = TieredStore(bench_layout(options), config)
            samples["rebuild"].append(time.perf_counter() - started_s)
            samples["cpu"].append(time.process_time() - started_cpu_s)
        samples["gc"].append(gc_clock.elapsed_s)
        catalog = store.stats().catalog
        assert catalog is not None, "TieredStore(enable_blend=True) opened without a catalog"
        if repeat < options.num_repeats - 1:
            store.close()
        if one_pass.num_entries != catalog.num_entries:
            raise AssertionError(
                f"the one-pass open indexed {one_pass.num_entries} chunks, the store {catalog.num_entries}"
            )
    assert catalog is not None, "num_repeats >= 1 (RebuildBenchOptions checks it)"
    return store, catalog


@dataclass(frozen=True, slots=True, kw_only=True)
class _Opens:
    """The timed opens' samples (seconds, by name) and the rebuilt catalog's figures."""

    samples: dict[str, list[float]]
    catalog: CatalogStats


def _rebuild_row(
    options: RebuildBenchOptions, data_dir: Path, build_s: float | None, opens: _Opens, check: _LookupCheck
) -> RebuildBenchRow:
    """The row: medians of the timed opens against the baseline, the index's size and the lookups' check."""
    samples, catalog = opens.samples, opens.catalog
    expected_chunks = options.num_documents * CHUNKS_PER_DOCUMENT
    rebuild_s = statistics.median(samples["rebuild"])
    baseline_s = statistics.median(samples["opening"]) + statistics.median(samples["read"])
    chunks_per_s = round(expected_chunks / rebuild_s)
    return RebuildBenchRow(
        chunks=expected_chunks,
        documents=options.num_documents,
        data_dir=str(data_dir),
        data_dir_bytes=sum(path.stat().st_size for path in data_dir.iterdir() if path.is_file()),
        reused_data_dir=build_s is None,
        build_s=None if build_s is None else round(build_s, 2),
        cold=options.cold,
        repeats=options.num_repeats,
        rebuild_s=round(rebuild_s, 3),
        rebuild_s_min=round(min(samples["rebuild"]), 3),
        rebuild_s_max=round(max(samples["rebuild"]), 3),
        rebuild_cpu_s=round(statistics.median(samples["cpu"]), 3),
        rebuild_gc_s=round(statistics.median(samples["gc"]), 3),
        rebuild_one_pass_s=round(statistics.median(samples["one_pass"]), 3),
        rebuild_one_pass_cpu_s=round(statistics.median(samples["one_pass_cpu"]), 3),
        baseline="DiskTier open + one pass of DiskTier.iter_records() (records read and checked, not indexed)",
        disk_open_s=round(statistics.median(samples["opening"]), 3),
        read_records_s=round(statistics.median(samples["read"]), 3),
        rebuild_to_baseline_ratio=round(rebuild_s / baseline_s, 2),
        chunks_per_s=chunks_per_s,
        target_chunks_per_s=TARGET_CHUNKS_PER_S,
        met=chunks_per_s >= TARGET_CHUNKS_PER_S and check.recall == 1.0,
        index_entries=catalog.num_entries,
        index_bytes_per_chunk=round(catalog.index_bytes / max(1, catalog.num_entries), 2),
        queries=options.num_queries,
        recall=round(check.recall, 6),
        doc_coverage=round(check.doc_coverage, 6),
        false_positives=check.false_positives,
        lookup_ms_median=round(check.lookup_ms_median, 3),
    )


# -- the data dir -----------------------------------------------------------------------------------------------


def _manifest(options: RebuildBenchOptions) -> dict[str, int | str]:
    return {
        "num_documents": options.num_documents,
        "document_tokens": DOCUMENT_TOKENS,
        "chunk_size": CHUNK_TOKENS,
        "seed": options.seed,
        "layout": bench_layout(options).to_json(),
    }


def _ensure_data_dir(options: RebuildBenchOptions, data_dir: Path, say: RebuildProgress) -> float | None:
    """Build the data dir unless it already holds this workload; returns the build's seconds (``None``: reused)."""
    manifest_path = data_dir / MANIFEST_NAME
    wanted = _manifest(options)
    if manifest_path.exists():
        if json.loads(manifest_path.read_text()) == wanted:
            logger.info("bench rebuild: reusing %s (%d documents)", data_dir, options.num_documents)
            return None
        logger.info("bench rebuild: %s holds another build of this benchmark; rebuilding it", data_dir)
        for path in data_dir.iterdir():
            path.unlink()
    elif data_dir.exists() and any(data_dir.iterdir()):
        raise ConfigError(
            f"--data-dir {data_dir} is not empty and was not built by kvstore bench rebuild; give a new or empty "
            "directory"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    # KV + meta value per chunk, and half again for LMDB's pages (measured: docs/design-notes.md#bench-rebuild)
    chunk_bytes = bench_layout(options).chunk_bytes(CHUNK_TOKENS) + 4 * CHUNK_TOKENS + 72
    needed_bytes = options.num_documents * CHUNKS_PER_DOCUMENT * chunk_bytes * 3 // 2
    free_bytes = shutil.disk_usage(data_dir).free
    if free_bytes < 2 * needed_bytes:
        raise ConfigError(
            f"--data-dir {data_dir}: about {needed_bytes / 2**30:.1f} GiB needed for {options.num_chunks} chunks, "
            f"{free_bytes / 2**30:.1f} GiB free (want twice that); give a --data-dir on a larger disk or fewer --chunks"
        )
    started_s = time.perf_counter()
    _build(options, data_dir, say)
    build_s = time.perf_counter() - started_s
    manifest_path.write_text(json.dumps(wanted))  # last: a build cut short is never reused
    logger.info("bench rebuild: built %s in %.1f s", data_dir, build_s)
    return build_s


def _build(options: RebuildBenchOptions, data_dir: Path, say: RebuildProgress) -> None:
    """Write every document's chunks through a real disk tier, each with its key, position, tokens and parent."""
    layout = bench_layout(options)
    generator = torch.Generator().manual_seed(options.seed)
    kv = torch.randn(layout.chunk_shape(DOCUMENT_TOKENS), generator=generator).to(layout.dtype.torch_dtype)
    namespace = layout.namespace
    total_chunks = options.num_documents * CHUNKS_PER_DOCUMENT
    disk = DiskTier(data_dir, layout, CHUNK_TOKENS, capacity_bytes(options))
    try:
        for document_idx in range(options.num_documents):
            tokens = document_tokens(options.seed, document_idx)
            parent: PrefixKey | None = None
            for chunk_idx, key in enumerate(prefix_keys(namespace, tokens, CHUNK_TOKENS)):
                start = chunk_idx * CHUNK_TOKENS
                end = min(start + CHUNK_TOKENS, DOCUMENT_TOKENS)
                record = ChunkRecord(key=key, source_start=start, tokens=tokens[start:end], parent_key=parent)
                if not disk.put(record, kv[:, :, start:end]):
                    raise ConfigError(f"disk tier {data_dir} rejected a chunk; its capacity is too small")
                parent = key
            if document_idx % 256 == 255:
                say("building the data dir (chunks)", (document_idx + 1) * CHUNKS_PER_DOCUMENT, total_chunks)
        say("building the data dir: flushing", total_chunks, total_chunks)
        disk.flush()
    finally:
        disk.close()


def _time_baseline(options: RebuildBenchOptions, data_dir: Path) -> tuple[float, float, int]:
    """Seconds to open the disk tier alone and to read every record once; and how many records it read."""
    if options.cold:
        drop_page_cache(data_dir)
    started_s = time.perf_counter()
    disk = DiskTier(data_dir, bench_layout(options), CHUNK_TOKENS, capacity_bytes(options))
    try:
        opened_s = time.perf_counter()
        num_records = sum(1 for _ in disk.iter_records())
        read_s = time.perf_counter()
    finally:
        disk.close()
    return opened_s - started_s, read_s - opened_s, num_records


@dataclass(frozen=True, slots=True, kw_only=True)
class _OnePassTiming:
    elapsed_s: float
    cpu_s: float
    num_entries: int


def _time_one_pass_rebuild(options: RebuildBenchOptions, data_dir: Path) -> _OnePassTiming:
    """Open the disk tier with its recovery feeding a content index (one pass over the meta records), the collector
    paused as in the store's open; the seconds, CPU seconds and the index's size."""
    if options.cold:
        drop_page_cache(data_dir)
    was_enabled = gc.isenabled()
    gc.disable()
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    catalog = ContentCatalog(CHUNK_TOKENS, ResidencyCheck(is_resident=lambda _key: True, in_transit=lambda _key: False))
    disk: DiskTier | None = None
    try:
        rebuild = catalog.start_rebuild()
        disk = DiskTier(
            data_dir, bench_layout(options), CHUNK_TOKENS, capacity_bytes(options), content_records=rebuild.add
        )
        rebuild.finish()
        elapsed_s, cpu_s = time.perf_counter() - started_s, time.process_time() - started_cpu_s
        return _OnePassTiming(elapsed_s=elapsed_s, cpu_s=cpu_s, num_entries=len(catalog.index))
    finally:
        if was_enabled:
            gc.enable()
        catalog.close()
        if disk is not None:
            disk.close()


class _GcClock:
    """Seconds the cyclic garbage collector runs inside a ``with`` block (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.elapsed_s = 0.0
        self._started_s = 0.0

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
        else:
            self.elapsed_s += time.perf_counter() - self._started_s


# -- the check --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _LookupCheck:
    recall: float
    doc_coverage: float
    false_positives: int
    lookup_ms_median: float


def _check_lookups(store: TieredStore, options: RebuildBenchOptions, say: RebuildProgress) -> _LookupCheck:
    """Look up reordered multi-document queries; every document must be found whole at its place."""
    rng = np.random.default_rng((options.seed, _QUERY_STREAM))
    namespace = bench_layout(options).namespace
    found = expected = covered = false_positives = 0
    latencies_ms: list[float] = []
    for query_idx in range(options.num_queries):
        chosen = rng.choice(options.num_documents, size=DOCUMENTS_PER_QUERY, replace=False).tolist()
        parts = [rng.integers(0, VOCAB, _SYSTEM_TOKENS).astype("<u4")]
        # query position -> (key, source start) of the document chunk placed there
        placed: dict[int, tuple[PrefixKey, int]] = {}
        position = _SYSTEM_TOKENS
        for document_idx in chosen:
            tokens = document_tokens(options.seed, document_idx)
            for chunk_idx, key in enumerate(prefix_keys(namespace, tokens, CHUNK_TOKENS)):
                placed[position + chunk_idx * CHUNK_TOKENS] = (key, chunk_idx * CHUNK_TOKENS)
            parts += [tokens, rng.integers(0, VOCAB, _SEPARATOR_TOKENS).astype("<u4")]
            position += DOCUMENT_TOKENS + _SEPARATOR_TOKENS
        parts[-1] = rng.integers(0, VOCAB, _QUESTION_TOKENS).astype("<u4")
        query = np.concatenate(parts)
        started_s = time.perf_counter()
        plan = store.lookup(query)
        latencies_ms.append((time.perf_counter() - started_s) * 1e3)
        store.release(plan)
        hits = {segment.start: segment for segment in plan.segments}
        for query_start, (key, source_start) in placed.items():
            segment = hits.pop(query_start, None)
            is_hit = segment is not None and segment.key == key and segment.source_start == source_start
            covered += segment.num_tokens if is_hit and segment is not None else 0
            false_positives += int(segment is not None and not is_hit)
            if source_start + CHUNK_TOKENS <= DOCUMENT_TOKENS:  # recall counts full chunks
                expected += 1
                found += int(is_hit)
        false_positives += len(hits)
        if query_idx % 16 == 15:
            say("checking the rebuilt index", query_idx + 1, options.num_queries)
    return _LookupCheck(
        recall=found / max(1, expected),
        doc_coverage=covered / (options.num_queries * DOCUMENTS_PER_QUERY * DOCUMENT_TOKENS),
        false_positives=false_positives,
        lookup_ms_median=statistics.median(latencies_ms),
    )
