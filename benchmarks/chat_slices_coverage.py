"""How much of a chat query's documents a store's plan covers, with and without slices (issue 44): the prompts of
``kvstore bench vllm --serve --chat`` (SmolLM2's chat template, prose documents joined by blank lines, each cached
alone in a warm-up round), stored in process with placeholder KV, then every query looked up.

No model runs: the figure is the plan's coverage, a count (what the store hands a blending engine to load before
its recompute); an engine's reused share is this less what the pass recomputes of it. Both chunkings, lookups with
``partial`` off (the store before slices) and on, in the same run on the same stored chunks.

Run: .venv/bin/python benchmarks/chat_slices_coverage.py [--documents 6] [--document-tokens 1000]
     [--docs-per-query 3] [--queries 6] [--chunk-size 256] [--json]
Prints one JSON object per (chunking, partial): prompt and document tokens, covered tokens (exact and blended),
slices, and the document tokens not covered at each document's head and tail.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.bench.vllm_serve import _chat_form
from kvstore.bench.vllm_serve_workload import CHAT_SEPARATOR, serve_workload
from kvstore.chunking import Chunking
from kvstore.models import default_model_cache_dir
from kvstore.presets import preset_layout
from kvstore.tiers.base import TierName


def _document_spans(prompt: list[int], documents: list[list[int]]) -> list[tuple[int, int]]:
    """Where each document sits in a query: found by its third to eighteenth tokens (its first ones may merge
    otherwise with what precedes it), as long as its warm-up copy."""
    spans = []
    tokens = np.asarray(prompt)
    for document in documents:
        probe = np.asarray(document[2:18])
        starts = [s for s in range(len(tokens) - len(probe)) if np.array_equal(tokens[s : s + len(probe)], probe)]
        assert starts, "a document's tokens were not found in its chat prompt"
        start = starts[0] - 2
        spans.append((start, start + len(document)))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--docs-per-query", type=int, default=3)
    parser.add_argument("--queries", type=int, default=6)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = next(
        path
        for path in sorted((default_model_cache_dir({}) / "models").glob("SmolLM2-135M-Instruct-*"))
        if (path / "tokenizer.json").is_file()
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = _chat_form(tokenizer)
    workload = serve_workload(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        corpus="prose",
        num_documents=args.documents,
        document_tokens=args.document_tokens,
        docs_per_query=args.docs_per_query,
        num_queries=args.queries,
        separator=CHAT_SEPARATOR,
        chat=chat,
    )
    document_ids = _warm_up_documents([list(prompt.tokens) for prompt in workload.warm_up])
    layout = preset_layout("smollm2-135m")
    spans = [
        _document_spans(list(query.tokens), [document_ids[number] for number in query.documents])
        for query in workload.queries
    ]
    for chunking in Chunking:
        with tempfile.TemporaryDirectory() as scratch:
            config = StoreConfig(
                tiers=(TierName.CPU,),
                chunk_size=args.chunk_size,
                cpu_capacity_bytes=layout.chunk_bytes(args.chunk_size) * 32 * len(workload.warm_up),
                enable_blend=True,
                chunking=chunking,
                data_dir=Path(scratch),
            )
            with TieredStore(layout, config) as store:
                for prompt in workload.warm_up:
                    kv = torch.zeros(layout.chunk_shape(len(prompt.tokens)), dtype=layout.dtype.torch_dtype)
                    store.store(prompt.tokens, kv)
                store.flush()
                for partial in (False, True):
                    totals = _coverage(store, [query.tokens for query in workload.queries], spans, partial)
                    row = {
                        "chunking": chunking.value,
                        "partial": partial,
                        "chunk_size": args.chunk_size,
                        "queries": len(workload.queries),
                        **totals,
                        "covered_share": round(totals["covered"] / totals["prompt_tokens"], 4),
                        "document_share": round(totals["covered_document_tokens"] / totals["document_tokens"], 4),
                    }
                    print(json.dumps(row) if args.json else row)


def _coverage(
    store: TieredStore, queries: list[tuple[int, ...]], spans: list[list[tuple[int, int]]], partial: bool
) -> dict[str, int]:
    """Every query looked up (and released): tokens covered exact and blended, slices, and per document the tokens
    covered and those missed before its first covered token and after its last."""
    names = ("prompt_tokens", "document_tokens", "covered", "exact", "blended", "covered_document_tokens",
             "head_missed", "tail_missed", "slices")  # fmt: skip
    totals = dict.fromkeys(names, 0)
    for tokens, query_spans in zip(queries, spans, strict=True):
        plan = store.lookup(tokens, partial=partial)
        covered = np.zeros(len(tokens), dtype=bool)
        for segment in plan.segments:
            covered[segment.start : segment.end] = True
            totals["exact" if segment.exact else "blended"] += segment.num_tokens
            totals["slices"] += segment.is_slice
        store.release(plan)
        totals["prompt_tokens"] += len(tokens)
        totals["covered"] += int(covered.sum())
        for start, end in query_spans:
            inside = covered[start:end]
            hit = np.flatnonzero(inside)
            totals["document_tokens"] += end - start
            totals["covered_document_tokens"] += int(inside.sum())
            totals["head_missed"] += int(hit[0]) if hit.size else end - start
            totals["tail_missed"] += int(end - start - 1 - hit[-1]) if hit.size else 0
    return totals


def _warm_up_documents(warm_ups: list[list[int]]) -> list[list[int]]:
    """Each document's ids as its warm-up prompt holds them: what lies between the template's prefix and suffix
    (the tokens every warm-up prompt shares from the start and from the end)."""
    head = min(_shared(warm_ups[0], other) for other in warm_ups[1:])
    tail = min(_shared(warm_ups[0][::-1], other[::-1]) for other in warm_ups[1:])
    return [prompt[head : len(prompt) - tail] for prompt in warm_ups]


def _shared(left: list[int], right: list[int]) -> int:
    count = 0
    while count < min(len(left), len(right)) and left[count] == right[count]:
        count += 1
    return count


if __name__ == "__main__":
    main()
