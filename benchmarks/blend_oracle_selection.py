"""Research probe: would a better choice of tokens to recompute bring a blend's answers back to full prefill's?

The blender picks the tokens to recompute at the check layer (layer 1) by a cheap score: K deviation
(``kv_deviation``) or the attention the question pays them there (``query_attention``). This probe replaces that
choice with oracles a real prefill cannot have, measured on the query's own full prefill:

- ``deviation`` oracles: each token's deviation in the *deep* layers (2 to the last) -- the squared K and V
  differences between full prefill and plain reuse, each layer divided by its mean so every layer counts alike;
- ``attention`` oracles: the attention full prefill's computed tokens (the question, separators, the last token)
  pay each token, in every layer (each layer's mass divided by its total, then summed).

If an oracle's answers match full prefill at a budget, the method needs a better cheap predictor of that family;
if they do not, no selection of that family at that budget will do.

It swaps ``kvstore.blend.layerwise._Pass._select`` for one that ranks by the oracle (a probe, not an engine
feature), on the multi-doc-qa workload of ``kvstore bench multi-doc-qa`` (SmolLM2-135M-Instruct, 32 documents of
512 tokens, 4 per query, seed 0, documents stored after the system preamble, chunks of 64, 32-token greedy
answers). One JSON line per query: the asked slot and, per variant, whether the answer is the planted code; a
summary line on stdout at the end: per variant (right, lost against full, gained against full).

    .venv/bin/python benchmarks/blend_oracle_selection.py --facts same --device cuda --out oracle_same.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.bench.blend_quality import first_number, greedy_continuation
from kvstore.bench.multidoc_workload import FactStyle, PromptFormat, pick_combinations, prose_documents
from kvstore.blend import BlendConfig, BlendOutput, LayerwiseBlender, layerwise
from kvstore.blend.selection import select_tokens
from kvstore.config import StoreConfig
from kvstore.models import default_model_cache_dir, load_smollm2
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName

VARIANTS = (
    ("default15", 0.15, None),
    ("query_attention15", 0.15, None),
    ("oracle15", 0.15, "deviation"),
    ("attention_oracle15", 0.15, "attention"),
    ("attention_oracle20", 0.2, "attention"),
    ("oracle30", 0.3, "deviation"),
)
"""(name, ratio, oracle): ``None`` runs the blender's own policy (``query_attention`` when the name says so)."""


class OracleSelection:
    """Replaces the check layer's choice while ``deviation`` is set; the blender's own choice otherwise."""

    def __init__(self) -> None:
        self.deviation: torch.Tensor | None = None
        self._original = layerwise._Pass._select

    def install(self) -> None:
        probe = self

        def select(
            self: Any, classes: Any, fresh: Any, keys: Any, values: Any, blend_in_active: Any, positions: Any
        ) -> torch.Tensor:
            if probe.deviation is None:
                return probe._original(self, classes, fresh, keys, values, blend_in_active, positions)
            positions = classes.blend_positions.to(self.device)
            return select_tokens(scores=probe.deviation[positions], cached_positions=positions,
                                 forced_positions=classes.forced.to(self.device),
                                 recompute_ratio=self.settings.recompute_ratio)  # fmt: skip

        layerwise._Pass._select = select  # type: ignore[method-assign]


def attention_oracle(model: Any, prompt: list[int], computed: torch.Tensor) -> torch.Tensor:
    """Per position: the attention full prefill's ``computed`` tokens pay it, each layer's mass over its total, summed
    over layers (eager attention, which reports its weights; the model is put back to sdpa after)."""
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=model.device)
            attentions = model(ids, output_attentions=True).attentions
        score = torch.zeros(len(prompt), device=model.device)
        for layer in attentions:
            mass = layer[0][:, computed.to(model.device)].float().sum(dim=(0, 1))
            score += mass / mass.sum()
        return score
    finally:
        model.set_attn_implementation("sdpa")


def deep_deviation(full_kv: torch.Tensor, reuse_kv: torch.Tensor) -> torch.Tensor:
    """Per position: K and V squared differences, each layer over its mean, summed over layers 2 to the last."""
    full, reuse = full_kv.float(), reuse_kv.float()
    per_layer = (full - reuse).square().sum(dim=(-1, -2)).sum(dim=1)  # [layers, tokens]
    per_layer = per_layer / per_layer.mean(dim=1, keepdim=True).clamp_min(1e-12)
    return per_layer[2:].sum(dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--facts", choices=[style.value for style in FactStyle], default="distinct")
    parser.add_argument("--num-queries", type=int, default=400)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop starting queries after this")
    parser.add_argument("--out", type=Path, required=True, help="one JSON line per query")
    args = parser.parse_args()
    started = time.monotonic()
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ), dtype=torch.float32, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt_format = PromptFormat.for_tokenizer(tokenizer)
    documents = prose_documents(tokenizer, 32, 512, 0, FactStyle(args.facts))
    queries = pick_combinations(32, 4, args.num_queries, 0)
    rng = np.random.default_rng(4)  # the bench's question rng (seed + 4)
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=64, cpu_capacity_bytes=1 << 30, enable_blend=True,
                         gpu_device=args.device)  # fmt: skip
    probe = OracleSelection()
    probe.install()

    def answers_right(output: BlendOutput, code: str) -> bool:
        return first_number(greedy_continuation(model, output, 32, tokenizer).text) == code

    rows: list[dict[str, Any]] = []
    sdpa = BlendConfig(attention="sdpa")  # the bench's H200 quality runs used sdpa too
    with TieredStore(loaded.layout, config) as store, LayerwiseBlender(model, store, sdpa) as blender, \
            args.out.open("w") as sink:  # fmt: skip
        for document in documents:
            blender.prefill(prompt_format.warm_up_prompt(document), mode="full", store_result=True)
        for index, query in enumerate(queries):
            if time.monotonic() - started > args.seconds:
                break
            asked = documents[query.asked]
            assert asked.fact is not None
            question = prompt_format.question(asked.fact, rng, 0)
            prompt = prompt_format.query_prompt([documents[i] for i in query.order], question)
            full = blender.prefill(prompt, mode="full", store_result=False)
            row: dict[str, Any] = {"query": index, "slot": query.order.index(query.asked),
                                   "full": answers_right(full, asked.fact.code)}  # fmt: skip
            probe.deviation = None
            reuse = blender.prefill(prompt, store_result=False, config=replace(sdpa, recompute_ratio=0.0))
            oracles = {
                "deviation": deep_deviation(full.kv, reuse.kv),
                "attention": attention_oracle(model, list(prompt), reuse.recomputed_positions),  # gaps, last token
            }
            for name, ratio, oracle in VARIANTS:
                probe.deviation = oracles[oracle] if oracle is not None else None
                policy = "query_attention" if name.startswith("query_attention") else "kv_deviation"
                config = replace(sdpa, recompute_ratio=ratio, selection=policy)
                output = blender.prefill(prompt, store_result=False, config=config)
                row[name] = answers_right(output, asked.fact.code)
            probe.deviation = None
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    summary = {
        name: {"right": sum(row[name] for row in rows), "lost": sum(row["full"] and not row[name] for row in rows),
               "gained": sum(row[name] and not row["full"] for row in rows)}
        for name, _, _ in VARIANTS
    }  # fmt: skip
    print(json.dumps({"facts": args.facts, "queries": len(rows), "full_right": sum(row["full"] for row in rows),
                      **summary}))  # fmt: skip


if __name__ == "__main__":
    main()
