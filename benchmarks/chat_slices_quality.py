"""Do slices change a blended chat answer? The chat prompts of ``kvstore bench vllm --serve --chat`` (SmolLM2's chat
template, prose documents joined by blank lines, each cached alone in a warm-up round) blended in process by the
standalone ``LayerwiseBlender`` with the store's lookups planning slices and not (``partial`` on and off: the store
before slices), each against a full prefill of the same prompt, in the same run on the same stored KV.

Per query and variant: tokens reused (planned exact + blended) and recomputed, whether the blended next token is full
prefill's (top-1 agreement), the KL divergence of the next-token distributions, and whether the first
``--new-tokens`` greedy tokens are full prefill's (what ``kvstore bench vllm --serve`` compares with vLLM alone).

``--form ids`` blends the token-id prompts of ``kvstore bench vllm --serve`` without ``--chat`` instead (the parts
tokenized alone and joined by ``" # # "``), so chat and token-id prompts can be set side by side; ``--ratio`` is the
blend's recompute ratio.

Run: .venv/bin/python benchmarks/chat_slices_quality.py [--documents 6] [--queries 12] [--chunking content]
     [--form chat|ids] [--ratio 0.15] [--selection kv_deviation] [--json]
Prints one JSON object per query and variant, then one summary per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvstore import StoreConfig, TieredStore
from kvstore.bench.blend_quality import greedy_continuation, kl_divergence
from kvstore.bench.vllm_serve import _chat_form
from kvstore.bench.vllm_serve_workload import CHAT_SEPARATOR, DEFAULT_SEPARATOR, serve_workload
from kvstore.blend import BlendConfig, LayerwiseBlender, SelectionPolicy
from kvstore.chunking import Chunking
from kvstore.models import default_model_cache_dir, load_smollm2
from kvstore.plan import LookupPlan
from kvstore.session import Session
from kvstore.tiers.base import TierName


class WithoutSlices:
    """The store as a caller from before slices sees it: every lookup with ``partial=False``."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def lookup(self, tokens: Sequence[int], **options: Any) -> LookupPlan:
        return self._store.lookup(tokens, partial=False, **options)

    def session(self, session_id: str | None = None) -> Session:
        return Session(self, session_id)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--docs-per-query", type=int, default=3)
    parser.add_argument("--queries", type=int, default=12)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--chunking", choices=[rule.value for rule in Chunking], default="content")
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--form", choices=["chat", "ids"], default="chat")
    parser.add_argument("--ratio", type=float, default=BlendConfig().recompute_ratio)
    parser.add_argument("--selection", choices=[policy.value for policy in SelectionPolicy],
                        default=BlendConfig().selection.value)  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ), dtype=torch.float32, device="cpu")
    tokenizer, model, layout = loaded.tokenizer, loaded.model, loaded.layout
    workload = serve_workload(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        corpus="prose",
        num_documents=args.documents,
        document_tokens=args.document_tokens,
        docs_per_query=args.docs_per_query,
        num_queries=args.queries,
        separator=CHAT_SEPARATOR if args.form == "chat" else DEFAULT_SEPARATOR,
        chat=_chat_form(tokenizer) if args.form == "chat" else None,
    )
    warm_ups = [prompt.tokens for prompt in workload.warm_up]
    with tempfile.TemporaryDirectory() as scratch:
        config = StoreConfig(
            tiers=(TierName.CPU,),
            chunk_size=args.chunk_size,
            chunking=Chunking(args.chunking),
            cpu_capacity_bytes=max(64 << 20, 4 * layout.chunk_bytes(sum(map(len, warm_ups)))),
            enable_blend=True,
            data_dir=Path(scratch) / "data",
        )
        with TieredStore(layout, config) as store:
            variants = {"slices": store, "no_slices": WithoutSlices(store)}
            blend_config = BlendConfig(recompute_ratio=args.ratio, selection=SelectionPolicy(args.selection))
            blenders = {name: LayerwiseBlender(model, owner, blend_config) for name, owner in variants.items()}
            try:
                for warm_up in warm_ups:
                    blenders["slices"].prefill(warm_up, mode="full", store_result=True)
                store.flush()
                samples = _samples(blenders, [query.tokens for query in workload.queries], args.new_tokens)
            finally:
                for blender in blenders.values():
                    blender.close()
    for sample in samples:
        print(json.dumps(sample) if args.json else sample)
    for name in blenders:
        mine = [sample for sample in samples if sample["variant"] == name]
        summary = {
            "variant": name,
            "form": args.form,
            "ratio": args.ratio,
            "selection": args.selection,
            "chunking": args.chunking,
            "queries": len(mine),
            "reused_tokens": sum(sample["reused_tokens"] for sample in mine),
            "prompt_tokens": sum(sample["prompt_tokens"] for sample in mine),
            "recomputed_tokens": sum(sample["recomputed_tokens"] for sample in mine),
            "top1_agreement": sum(sample["top1_equal"] for sample in mine),
            "continuation_equal": sum(sample["continuation_equal"] for sample in mine),
            "kl_mean": round(statistics.fmean(sample["kl"] for sample in mine), 4),
        }
        print(json.dumps(summary) if args.json else summary)


def _samples(
    blenders: dict[str, LayerwiseBlender], queries: list[tuple[int, ...]], new_tokens: int
) -> list[dict[str, Any]]:
    model = blenders["slices"].model
    samples = []
    for index, prompt in enumerate(queries):
        full = blenders["slices"].prefill(prompt, mode="full", store_result=False)
        full_logits = full.logits
        reference = greedy_continuation(model, full, new_tokens, None).tokens
        for name, blender in blenders.items():
            output = blender.prefill(prompt, mode="blend", store_result=False)
            logits = output.logits
            continuation = greedy_continuation(model, output, new_tokens, None).tokens
            samples.append({
                "query": index,
                "variant": name,
                "prompt_tokens": len(prompt),
                "reused_tokens": output.plan.num_exact_tokens + output.plan.num_blend_tokens,
                "recomputed_tokens": output.num_recomputed_tokens,
                "top1_equal": int(logits.argmax()) == int(full_logits.argmax()),
                "kl": round(kl_divergence(full_logits, logits), 5),
                "continuation_equal": continuation == reference,
            })  # fmt: skip
    return samples


if __name__ == "__main__":
    main()
