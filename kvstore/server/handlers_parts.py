"""The server's side of chunks stored by parts (the ranks of a tensor- or pipeline-parallel engine).

A part store's KV goes into the chunks' assemblies (``ChunkAssembly``), and the chunks it completes are committed
to the store whole, a run of consecutive chunks per store call; a lookup names the missed chunks that still wait for
parts ``incomplete``. ``PartStores`` owns the one assembly, made at the first part store (it needs the store's
layout).

Threads: any number of workers; ``_assembly_lock`` guards the reference to the assembly (which has its own lock).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time

import torch

from kvstore.keys import TokenArray, keys_at_bounds
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.misses import Miss, MissReason
from kvstore.plan import ChunkOutcome, LookupPlan, StoreResult
from kvstore.server.bulk_tensors import transport_of
from kvstore.server.chunk_assembly import ASSEMBLY_TTL_S, AssemblyCounts, ChunkAssembly, CompletedChunk
from kvstore.server.metrics import BulkTransfer, ServerMetrics
from kvstore.server.store_host import StoreHost
from kvstore.server.usage.ledger import UsageLedger
from kvstore.wire.messages import StoreArgs

__all__ = ["PartStores", "written_tokens"]


class PartStores:
    """Part stores into the chunks' assemblies, and the ``incomplete`` misses they leave.

    Args:
        host: owns the store.
        usage: where each committed run is counted as a stored document.
        metrics: where store figures go (and the assembly's counts are read from).
    """

    def __init__(self, host: StoreHost, usage: UsageLedger, metrics: ServerMetrics) -> None:
        self._host = host
        self._usage = usage
        self._metrics = metrics
        self._assembly_lock = threading.Lock()
        self._assembly: ChunkAssembly | None = None
        metrics.watch_chunk_parts(self._counts)

    def store(
        self, client_id: str, args: StoreArgs, part: KVPart, kv: torch.Tensor, *, started_s: float
    ) -> StoreResult:
        """A rank's part of a store (``kv``: its part of ``tokens[start:]``; the request began at ``started_s``, a
        ``time.perf_counter`` reading): into the chunks' assemblies; the chunks it completes are committed whole."""
        store = self._host.require()
        layout = store.layout
        tokens = args.tokens
        bounds = store.chunk_bounds(tokens)
        first = bisect.bisect_left(bounds[:-1], args.start)
        keys = keys_at_bounds(layout.namespace, tokens, bounds)
        completed = self._assembly_of(layout).add(
            part, kv, keys=keys, bounds=bounds, first=first, start=args.start, held=lambda k: bool(store.contains(k))
        )
        result = StoreResult(num_chunks=len(keys) - first, num_new_chunks=0)
        num_new_tokens = 0
        for run in _runs(completed):
            run_start, run_end = bounds[run[0].index], bounds[run[-1].index + 1]
            run_kv = run[0].kv if len(run) == 1 else torch.cat([chunk.kv for chunk in run], dim=2)
            committed = store.store(tokens[:run_end], run_kv, start=run_start)
            result = StoreResult(
                num_chunks=result.num_chunks,
                num_new_chunks=result.num_new_chunks + committed.num_new_chunks,
                num_rejected_chunks=result.num_rejected_chunks + committed.num_rejected_chunks,
                num_aliased_chunks=result.num_aliased_chunks + committed.num_aliased_chunks,
            )
            run_keys = keys[run[0].index : run[-1].index + 1]
            self._usage.stored(run_keys, tokens[run_start:run_end], [bound - run_start for bound in
                               bounds[run[0].index : run[-1].index + 2]])  # fmt: skip
            num_new_tokens += written_tokens(committed)
        if args.durable and completed:
            store.flush()
        num_tokens = args.num_bulk_tokens
        transfer = BulkTransfer(
            transport=transport_of(args.bulk),
            seconds=time.perf_counter() - started_s,
            num_bulk_bytes=part.shape_layout(layout).chunk_bytes(num_tokens),
            num_tokens=num_new_tokens,
            num_bytes=layout.chunk_bytes(num_new_tokens),
        )
        self._metrics.observe_store(transfer, self._metrics.engine_of(client_id))
        return result

    def name_incomplete(self, plan: LookupPlan, tokens: TokenArray) -> LookupPlan:
        """The plan with its missed chunks that wait for parts (``ChunkAssembly``) named ``incomplete``."""
        with self._assembly_lock:
            assembly = self._assembly
        if assembly is None or not assembly.num_pending or not plan.misses:
            return plan
        store = self._host.require()
        bounds = store.chunk_bounds(tokens)
        keys = keys_at_bounds(store.layout.namespace, tokens, bounds)
        pending = [(bounds[i], bounds[i + 1]) for i, key in enumerate(keys) if assembly.pending(key)]
        if not pending:
            return plan
        return dataclasses.replace(plan, misses=_with_incomplete(plan.misses, pending))

    def expire(self, plan_ttl_s: float) -> None:
        """Drop assemblies not completed within the assembly TTL (or ``plan_ttl_s``, when shorter)."""
        with self._assembly_lock:
            assembly = self._assembly
        if assembly is not None:
            assembly.expire(min(ASSEMBLY_TTL_S, plan_ttl_s))

    def _assembly_of(self, layout: KVLayout) -> ChunkAssembly:
        with self._assembly_lock:
            if self._assembly is None:
                self._assembly = ChunkAssembly(layout)
            return self._assembly

    def _counts(self) -> AssemblyCounts:
        with self._assembly_lock:
            assembly = self._assembly
        return assembly.counts() if assembly is not None else AssemblyCounts()


def written_tokens(result: StoreResult) -> int:
    """The engine's stored tokens: those of the chunks a store wrote (not those it found held or aliased)."""
    return sum(chunk.num_tokens for chunk in result.chunks if chunk.outcome is ChunkOutcome.WRITTEN)


def _runs(completed: list[CompletedChunk]) -> list[list[CompletedChunk]]:
    """Completed chunks grouped into runs of consecutive indexes (each run is committed in one store call)."""
    runs: list[list[CompletedChunk]] = []
    for chunk in completed:
        if runs and runs[-1][-1].index + 1 == chunk.index:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _with_incomplete(misses: tuple[Miss, ...], pending: list[tuple[int, int]]) -> tuple[Miss, ...]:
    """``misses`` with the token ranges of chunks waiting for parts (``pending``, sorted) named ``incomplete``."""
    named: list[Miss] = []
    for miss in misses:
        cursor = miss.start
        for chunk_start, chunk_end in pending:
            low, high = max(chunk_start, miss.start), min(chunk_end, miss.end)
            if low >= high:
                continue
            if cursor < low:
                named.append(Miss(cursor, low, miss.reason))
            named.append(Miss(low, high, MissReason.INCOMPLETE))
            cursor = high
        if cursor < miss.end:
            named.append(Miss(cursor, miss.end, miss.reason))
    return tuple(named)
