"""How well does a check layer's K/V deviation predict the tokens whose cached KV is most wrong? (SmolLM2, CPU)

For each multi-doc-qa query (the ``kvstore bench multi-doc-qa`` workload and seed), the prompt is prefilled in full
and its KV compared with the cached documents' KV re-rotated to their new positions. The *oracle* set is the top
``ratio`` of cached tokens by squared K+V difference summed over every layer after the check layers (what
recomputing them would fix); a selector's *recall* is the share of the oracle set it picks. Layer l's fresh K/V in
a blended prefill equal full prefill's for l <= check layer, so ``K@l`` is exactly what the blender would see with
``--check-layer l``. One JSON object per selector on stdout, best first.

Example::

    .venv/bin/python benchmarks/blend_selection_recall.py --num-queries 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.bench.multidoc_workload import PromptFormat, pick_combinations, prose_documents
from kvstore.blend import LayerwiseBlender, RopeRotator, token_deltas
from kvstore.blend.selection import num_tokens_to_recompute
from kvstore.models import default_model_cache_dir, load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-queries", type=int, default=8)
    parser.add_argument("--num-documents", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--docs-per-query", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-layer", type=int, default=5, help="selectors at layers 0..max-layer")
    args = parser.parse_args()
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ))
    tokenizer, layout = loaded.tokenizer, loaded.layout
    prompt_format = PromptFormat.for_tokenizer(tokenizer)
    documents = prose_documents(tokenizer, args.num_documents, args.document_tokens, seed=0)
    queries = pick_combinations(args.num_documents, args.docs_per_query, args.num_queries, seed=0)
    rng = np.random.default_rng(4)
    rotator = RopeRotator(layout.rope, layout.head_dim)
    recalls: dict[str, list[float]] = {}
    config = StoreConfig(tiers=("cpu",), cpu_capacity_bytes=1 << 30, enable_blend=True)
    with TieredStore(layout, config) as store, LayerwiseBlender(loaded.model, store) as blender:
        for document in documents:
            blender.prefill(prompt_format.warm_up_prompt(document), mode="full")
        for query in queries:
            question = prompt_format.question(documents[query.asked].fact, rng, len(tokenizer))
            prompt = prompt_format.query_prompt([documents[index] for index in query.order], question)
            full = blender.prefill(prompt, mode="full", store_result=False)
            retrieved = store.retrieve(store.lookup(prompt))
            cached = torch.zeros_like(full.kv)
            cached[:, :, : retrieved.kv.shape[2]] = retrieved.kv
            rotator.rotation(token_deltas(retrieved.segments, len(prompt))).apply_to_kv(cached)
            blend = torch.zeros(len(prompt), dtype=torch.bool)
            for segment in retrieved.segments:
                blend[segment.start : segment.end] = not segment.exact
            positions = blend.nonzero().flatten()
            count = num_tokens_to_recompute(args.ratio, len(positions))
            squared = (full.kv - cached)[:, :, positions].float().square().sum(dim=(3, 4))  # [layers, 2, tokens]
            oracle = set(torch.topk(squared[args.max_layer + 1 :].sum(dim=(0, 1)), count).indices.tolist())
            for layer in range(args.max_layer + 1):
                for name, score in (("key", squared[layer, 0]), ("value", squared[layer, 1]),
                                    ("key_value", squared[layer].sum(dim=0))):  # fmt: skip
                    picked = set(torch.topk(score, count).indices.tolist())
                    recalls.setdefault(f"{name}@{layer}", []).append(len(picked & oracle) / count)
    rows = [
        {"selector": name, "check_layer": int(name.split("@")[1]), "deviation": name.split("@")[0],
         "recall_of_oracle": round(statistics.fmean(values), 4), "num_queries": len(values), "ratio": args.ratio}
        for name, values in recalls.items()
    ]  # fmt: skip
    for row in sorted(rows, key=lambda row: -float(row["recall_of_oracle"])):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
