"""Do slices change a blended chat answer? The chat prompts of ``kvstore bench vllm --serve --chat`` (SmolLM2's chat
template, prose documents joined by blank lines, each cached alone in a warm-up round) blended in process by the
standalone ``LayerwiseBlender`` with the store's lookups planning slices and not (``partial`` on and off: the store
before slices), each against a full prefill of the same prompt, in the same run on the same stored KV.

Per query and variant: tokens reused (planned exact + blended) and recomputed, whether the blended next token is full
prefill's (top-1 agreement), the KL divergence of the next-token distributions, and whether the first
``--new-tokens`` greedy tokens are full prefill's (what ``kvstore bench vllm --serve`` compares with vLLM alone).

``--form ids`` blends the token-id prompts of ``kvstore bench vllm --serve`` without ``--chat`` instead (the parts
tokenized alone and joined by ``" # # "``), so chat and token-id prompts can be set side by side; ``--form ids-chat``
frames those token-id prompts in the chat template (the system turn and the user turn's header before them, the
turn's end and the assistant's header after), so that every document follows the separator in the warm-up as in the
query, as in ``ids``, but the answer is an assistant turn, as in ``chat``: which of the two differences carries chat's
extra error. ``--ratio`` is the blend's recompute ratio. Each sample also gives full prefill's margin between its
two likeliest next tokens (``full_top1_margin``): a small one flips under a small error.

Run: .venv/bin/python benchmarks/chat_slices_quality.py [--documents 6] [--queries 12] [--chunking content]
     [--form chat|ids|ids-chat] [--ratio 0.15] [--selection kv_deviation] [--variants slices] [--device cuda]
     [--json]
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
from kvstore.bench.vllm_serve_workload import CHAT_SEPARATOR, DEFAULT_SEPARATOR, DEFAULT_SYSTEM_PROMPT, serve_workload
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
    parser.add_argument("--form", choices=["chat", "ids", "ids-chat"], default="chat")
    parser.add_argument("--variants", default="slices,no_slices", help="comma-separated: slices, no_slices")
    parser.add_argument("--ratio", type=float, default=BlendConfig().recompute_ratio)
    parser.add_argument("--selection", choices=[policy.value for policy in SelectionPolicy],
                        default=BlendConfig().selection.value)  # fmt: skip
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda on a GPU host)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ), dtype=torch.float32, device=args.device)
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
    frame = _chat_frame(tokenizer, DEFAULT_SYSTEM_PROMPT) if args.form == "ids-chat" else None
    warm_ups = [_framed(prompt.tokens, frame) for prompt in workload.warm_up]
    queries = [_framed(query.tokens, frame) for query in workload.queries]
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
            wanted = args.variants.split(",")
            variants = {name: owner for name, owner in (("slices", store), ("no_slices", WithoutSlices(store)))
                        if name in wanted}  # fmt: skip
            blend_config = BlendConfig(recompute_ratio=args.ratio, selection=SelectionPolicy(args.selection))
            blenders = {name: LayerwiseBlender(model, owner, blend_config) for name, owner in variants.items()}
            try:
                for warm_up in warm_ups:
                    next(iter(blenders.values())).prefill(warm_up, mode="full", store_result=True)
                store.flush()
                samples = _samples(blenders, queries, args.new_tokens)
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
    first = next(iter(blenders.values()))
    model = first.model
    samples = []
    for index, prompt in enumerate(queries):
        full = first.prefill(prompt, mode="full", store_result=False)
        full_logits = full.logits
        top2 = torch.softmax(full_logits.float().reshape(-1), dim=0).topk(2).values
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
                "full_top1_margin": round(float(top2[0] - top2[1]), 4),
                "continuation_equal": continuation == reference,
            })  # fmt: skip
    return samples


ChatFrame = tuple[tuple[int, ...], tuple[int, ...], int]
"""The chat template's ids before and after a user message, and the length of the token-id prompts' system prompt."""


def _chat_frame(tokenizer: Any, system_prompt: str) -> ChatFrame:
    """The system turn and the user header; the turn's end and the assistant header (found around a marker)."""
    marker = "MARKER"
    turns = [{"role": "system", "content": system_prompt}, {"role": "user", "content": marker}]
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    marked = tokenizer.encode(marker, add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(marked)] == marked)
    system = len(tokenizer.encode(system_prompt, add_special_tokens=False))
    return tuple(ids[:at]), tuple(ids[at + len(marked) :]), system


def _framed(tokens: tuple[int, ...], frame: ChatFrame | None) -> tuple[int, ...]:
    """A token-id prompt (system prompt, then separated parts) as a chat's user message."""
    if frame is None:
        return tokens
    head, tail, system = frame
    return head + tokens[system:] + tail


if __name__ == "__main__":
    main()
