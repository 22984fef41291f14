"""``kvstore bench vllm --blend``: CacheBlend inside a real vLLM engine, against a cold engine and the standalone
blender.

The multi-document QA workload (``multidoc_workload``: standard-library prose with one planted fact per document),
each document cached alone (from position 0, as ``kvstore bench multi-doc-qa --warm-up alone``), then queries that
hold several documents in a new order and ask about one of them::

    session              requests                      rows
    cold                 Q1, Q2, ...                    cold: no connector, no prefix cache (the baseline)
    kvstore blend        D1, D2, ..., Q1, Q2, ...       vllm_blend: each query blended inside vLLM (plugin +
                                                        connector, embedded server with --enable-blend)
    standalone blender   D1, D2, ..., Q1, Q2, ...       standalone_blend: ``LayerwiseBlender`` on the same model
                                                        (Hugging Face modules, in this process, no engine)

Every row gives TTFT (vLLM's own measurement for the engines; for the standalone blender its prefill time, which
leaves out request handling; it runs in a fresh process on the CPUs vLLM's worker gets, one torch thread each, so
both blends have the same compute), the ratio to cold, planted-fact accuracy (the first number of ``answer_tokens``
greedy tokens equals the fact's code), the share of queries whose first generated token equals the cold engine's
(next-token agreement) and, for ``vllm_blend``, the share of its recomputed positions the standalone blender also
recomputed on the same query. The queries' documents are the same tokens wherever they land, so a query's chunks
are found by content at new positions.

Quality on SmolLM2-135M is the model's, not the engine's (docs/benchmarks.md, "Blend quality on SmolLM2"): the
numbers are reported, not gated.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.blend_quality import first_number
from kvstore.bench.multidoc_stats import paired_facts
from kvstore.bench.multidoc_workload import PromptFormat, pick_combinations, prose_documents
from kvstore.bench.vllm_blend_options import VllmBlendOptions
from kvstore.bench.vllm_engine import EngineSpec, RequestResult
from kvstore.bench.vllm_ttft import CONNECTOR_CONFIG, CPU_ENGINE_ENV

__all__ = [
    "BlendQuery",
    "BlendWorkload",
    "StandaloneAnswer",
    "VllmBlendOptions",
    "VllmBlendRow",
    "answered",
    "blend_workload",
    "run_standalone_blender",
    "run_vllm_blend_benchmark",
    "selection_overlap",
]

@dataclass(frozen=True, slots=True, kw_only=True)
class BlendQuery:
    """A query prompt and the code its question asks for."""

    tokens: tuple[int, ...]
    code: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendWorkload:
    """Documents as cached alone (``separator + document`` from position 0), and queries over them."""

    documents: tuple[tuple[int, ...], ...]
    queries: tuple[BlendQuery, ...]


def blend_workload(
    tokenizer: Any, *, num_documents: int, document_tokens: int, num_queries: int, docs_per_query: int, seed: int = 0
) -> BlendWorkload:
    """The multi-document QA workload in the chat format of ``tokenizer`` (see the module docstring)."""
    prompt_format = PromptFormat.for_tokenizer(tokenizer)
    rng = np.random.default_rng(seed)
    documents = prose_documents(tokenizer, num_documents, document_tokens, seed)
    queries = []
    for spec in pick_combinations(num_documents, docs_per_query, num_queries, seed):
        fact = documents[spec.asked].fact
        assert fact is not None, "prose documents carry a fact"
        question = prompt_format.question(fact, rng, tokenizer.vocab_size)  # text: the rng is not drawn
        prompt = prompt_format.query_prompt([documents[index] for index in spec.order], question)
        queries.append(BlendQuery(tokens=tuple(int(token) for token in prompt), code=fact.code))
    cached = tuple(
        tuple(int(token) for token in prompt_format.warm_up_prompt(document, after_preamble=False))
        for document in documents
    )
    return BlendWorkload(documents=cached, queries=tuple(queries))


def answered(tokenizer: Any, token_ids: Sequence[int], code: str) -> bool:
    """Whether a greedy answer's first number is the planted fact's code."""
    return first_number(tokenizer.decode(list(token_ids), skip_special_tokens=True)) == code


def selection_overlap(engine_selected: Sequence[int], standalone_selected: Sequence[int], span_end: int) -> float:
    """The share of the engine's recomputed positions (below its span's last token, which it always computes)
    that the standalone blender recomputed too (1.0 when the engine recomputed none)."""
    engine = {position for position in engine_selected if position < span_end - 1}
    if not engine:
        return 1.0
    return len(engine & set(standalone_selected)) / len(engine)


@dataclass(frozen=True, slots=True, kw_only=True)
class StandaloneAnswer:
    """The standalone blender's answer to one query."""

    token_ids: tuple[int, ...]
    ttft_ms: float
    selected: tuple[int, ...]


def run_standalone_blender(
    workload: BlendWorkload,
    *,
    chunk_size: int,
    ratios: Sequence[float],
    answer_tokens: int,
    data_dir: Path,
    selection: str = "kv_deviation",
) -> list[StandaloneAnswer]:
    """Cache each document alone, then blend each query (at its ratio, selecting by ``selection``) with
    ``LayerwiseBlender`` on SmolLM2 (float32, cpu); a blended prompt is not stored, as the connector does not store
    one."""
    import torch

    from kvstore.bench.blend_quality import greedy_continuation
    from kvstore.blend.blender import LayerwiseBlender
    from kvstore.blend.layerwise import BlendConfig
    from kvstore.config import StoreConfig
    from kvstore.models import default_model_cache_dir, load_smollm2
    from kvstore.store import TieredStore
    from kvstore.tiers.base import TierName

    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ), dtype=torch.float32)
    config = StoreConfig(tiers=(TierName.CPU,), enable_blend=True, data_dir=data_dir, chunk_size=chunk_size)
    answers = []
    with TieredStore(loaded.layout, config) as store, LayerwiseBlender(loaded.model, store) as blender:
        for document in workload.documents:
            blender.prefill(document, mode="full")
        for query, ratio in zip(workload.queries, ratios, strict=True):
            blend = BlendConfig(recompute_ratio=ratio, selection=selection)  # type: ignore[arg-type]
            output = blender.prefill(query.tokens, mode="blend", config=blend, store_result=False)
            continuation = greedy_continuation(loaded.model, output, answer_tokens, None)
            positions = output.recomputed_positions
            answers.append(
                StandaloneAnswer(
                    token_ids=continuation.tokens,
                    ttft_ms=output.timings.total_ms,
                    selected=tuple(int(p) for p in positions) if positions is not None else (),
                )
            )
    return answers


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBlendRow:
    """One mode's TTFT and quality on the workload's queries."""

    mode: str
    prompt_tokens: int
    ttft_ms_p50: float
    ttft_vs_cold: float
    fact_accuracy: float
    first_token_agreement: float
    ttft_ms_samples: tuple[float, ...]
    accuracy_difference_ci95: tuple[float, float] | None = None
    selection_overlap_p50: float | None = None
    recomputed_tokens_p50: float | None = None
    blend_ms_p50: float | None = None

    def to_json_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "ttft_ms_p50": round(self.ttft_ms_p50, 1),
            "ttft_vs_cold": round(self.ttft_vs_cold, 3),
            "fact_accuracy": round(self.fact_accuracy, 3),
            "first_token_agreement": round(self.first_token_agreement, 3),
            "accuracy_difference_ci95": self.accuracy_difference_ci95,
            "selection_overlap_p50": self.selection_overlap_p50,
            "recomputed_tokens_p50": self.recomputed_tokens_p50,
            "blend_ms_p50": self.blend_ms_p50,
            "ttft_ms_samples": [round(sample, 1) for sample in self.ttft_ms_samples],
        }


def run_vllm_blend_benchmark(
    options: VllmBlendOptions,
    run_engine: Callable[[EngineSpec], list[RequestResult]],
    progress: Callable[[str], None] = lambda _: None,
) -> list[VllmBlendRow]:
    """Run the three sessions (see the module docstring); rows cold, vllm_blend, standalone_blend."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
    workload = blend_workload(
        tokenizer,
        num_documents=options.num_documents,
        document_tokens=options.document_tokens,
        num_queries=options.num_queries,
        docs_per_query=options.docs_per_query,
    )
    queries = [query.tokens for query in workload.queries]
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-blend-") as scratch:
        progress(f"vLLM session: cold ({len(queries)} queries)")
        model_dir, answers = options.model_dir, options.answer_tokens
        cold = run_engine(EngineSpec(model_dir=model_dir, prompts=queries, max_tokens=answers, env=CPU_ENGINE_ENV))
        progress(f"vLLM session: kvstore blend ({len(workload.documents)} documents, {len(queries)} queries)")
        extra = {
            "kvstore.data_dir": str(Path(scratch) / "engine-data"),
            "kvstore.tiers": "cpu",
            "kvstore.cpu_size": "2GiB",
            "kvstore.chunk_size": options.chunk_size,
            "kvstore.blend": True,
            "kvstore.blend_ratio": options.ratio,
        }
        report = {"kvstore": {"blend_report_selection": True}}
        first_query = len(workload.documents)
        blended = run_engine(
            EngineSpec(
                model_dir=options.model_dir,
                prompts=[*workload.documents, *queries],
                max_tokens=options.answer_tokens,
                env=CPU_ENGINE_ENV,
                kv_transfer_config={**CONNECTOR_CONFIG, "kv_connector_extra_config": extra},
                wait_until_stored_s=120.0,
                transfer_params={str(first_query + index): report for index in range(len(queries))},
            )
        )[first_query:]
        progress(f"standalone blender ({len(queries)} queries)")
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=_pin_to_worker_cpus) as pool:
            standalone = pool.submit(
                run_standalone_blender,
                workload,
                chunk_size=options.chunk_size,
                ratios=[options.ratio] * len(queries),
                answer_tokens=options.answer_tokens,
                data_dir=Path(scratch) / "standalone-data",
            ).result()
    return blend_rows(tokenizer, workload, cold, blended, standalone)


def _pin_to_worker_cpus() -> None:
    """In a fresh process for the standalone blender: the CPUs vLLM's CPU worker gets (all but
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``, the engine core's) and one torch thread per CPU, so the two blends compare on
    the same compute."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        reserved = int(CPU_ENGINE_ENV["VLLM_CPU_NUM_OF_RESERVED_CPU"])
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(allowed[: max(1, len(allowed) - reserved)]))
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def blend_rows(
    tokenizer: Any,
    workload: BlendWorkload,
    cold: Sequence[RequestResult],
    blended: Sequence[RequestResult],
    standalone: Sequence[StandaloneAnswer],
) -> list[VllmBlendRow]:
    """The three rows from each session's answers (in query order)."""
    codes = [query.code for query in workload.queries]
    prompt_tokens = int(statistics.median(len(query.tokens) for query in workload.queries))
    cold_ttft = [1000 * (result.ttft_s or 0.0) for result in cold]
    cold_p50 = statistics.median(cold_ttft)
    cold_right = [answered(tokenizer, result.token_ids, code) for result, code in zip(cold, codes, strict=True)]
    cold_first = [result.token_ids[0] for result in cold]

    def row(mode: str, answers: Sequence[Sequence[int]], ttft_ms: Sequence[float], **more: Any) -> VllmBlendRow:
        right = [answered(tokenizer, tokens, code) for tokens, code in zip(answers, codes, strict=True)]
        paired = paired_facts(cold_right, right)
        agree = sum(tokens[0] == first for tokens, first in zip(answers, cold_first, strict=True)) / len(answers)
        return VllmBlendRow(
            mode=mode,
            prompt_tokens=prompt_tokens,
            ttft_ms_p50=statistics.median(ttft_ms),
            ttft_vs_cold=statistics.median(ttft_ms) / cold_p50,
            fact_accuracy=sum(right) / len(right),
            first_token_agreement=agree,
            ttft_ms_samples=tuple(ttft_ms),
            accuracy_difference_ci95=(
                None if mode == "cold" else (paired.difference_ci95.low, paired.difference_ci95.high)
            ),
            **more,
        )

    reports: list[Mapping[str, Any]] = [(result.kv_transfer_params or {}).get("kvstore", {}).get("blend") or {}
                                        for result in blended]  # fmt: skip
    overlaps = [
        selection_overlap(report.get("selected", ()), answer.selected, int(report.get("span_tokens", 0)))
        for report, answer in zip(reports, standalone, strict=True)
        if report.get("selected") is not None
    ]
    return [
        row("cold", [result.token_ids for result in cold], cold_ttft),
        row(
            "vllm_blend",
            [result.token_ids for result in blended],
            [1000 * (result.ttft_s or 0.0) for result in blended],
            selection_overlap_p50=statistics.median(overlaps) if overlaps else None,
            recomputed_tokens_p50=statistics.median(int(report.get("recomputed_tokens", 0)) for report in reports),
            blend_ms_p50=statistics.median(float(report.get("blend_ms", 0.0)) for report in reports),
        ),
        row("standalone_blend", [answer.token_ids for answer in standalone], [a.ttft_ms for a in standalone]),
    ]
