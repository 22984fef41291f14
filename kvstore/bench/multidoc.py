"""``kvstore bench multi-doc-qa`` and ``kvstore bench shuffle``: TTFT and quality of full, prefix, blend and reuse.

The seed benchmark's design (LMCache's multi_doc_qa / shuffle_doc_qa) on the embedded store with a local model:

1. **warm-up**: ``multi_doc_qa`` stores each document after the system preamble (as a query's first document sits;
   ``warm_up=alone``: each document from position 0, so no query starts with a cached prefix; ``warm_up=grouped``:
   ``docs_per_query`` documents at a time in one prompt like a query's context, so most documents are cached
   behind others, as a server holds the documents of earlier requests);
   ``shuffle`` stores the identity order once (preamble + every document);
2. **queries**: ``multi_doc_qa`` sends random ordered selections of ``docs_per_query`` documents; ``shuffle``
   sends derangements (no document in its warm-up slot); each ends with a question about one planted fact.

Each query is prefilled in every mode, full first (the reference), against the same store state (queries do not
store their KV):

- ``full``: the model's forward over every token;
- ``prefix``: the cached exact prefix plus a forward over the rest (a prefix cache);
- ``blend``: CacheBlend at ``recompute_ratio`` (default 0.15);
- ``reuse``: the blend engine at ratio 0 (plain reuse: only uncached tokens are computed).

TTFT is ``BlendOutput.timings.total_ms`` (lookup to logits on the host, synchronised on CUDA); the first query is
run once in every mode before timing starts (kernels, allocator, caches). Rows report mean / p50 / p90 / p99 / max
and ``speedup_vs_full`` = mean full TTFT / mean TTFT of the mode, measured in the same run. Quality
(``kvstore.bench.blend_quality``) is measured with a real tokenizer and prose documents; with ``--random-init`` the
quality fields are ``None``.

Single-threaded (the blender's loader thread aside).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.bench.blend_quality import first_number, greedy_continuation, kl_divergence
from kvstore.bench.multidoc_options import BenchMode, BenchWorkload, MultiDocOptions, WarmUp
from kvstore.bench.multidoc_rows import MultiDocRow, QuerySample, RunContext, summarize
from kvstore.bench.multidoc_workload import (
    Document,
    PromptFormat,
    QuerySpec,
    TokenIds,
    pick_combinations,
    pick_derangements,
    prose_documents,
    random_documents,
)
from kvstore.blend import BlendConfig, BlendOutput, LayerwiseBlender
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models import load_local_model, load_smollm2, random_init_model
from kvstore.store import TieredStore

__all__ = [
    "BenchMode",
    "BenchWorkload",
    "MultiDocOptions",
    "WarmUp",
    "resolve_device",
    "resolve_dtype",
    "run_multidoc_benchmark",
    "warm_up_prompts",
]

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Model:
    model: Any
    layout: KVLayout
    tokenizer: Any | None
    name: str


@dataclass(slots=True)
class _Reference:
    """Full prefill's answer to one query, which the other modes are compared with."""

    logits: torch.Tensor
    continuation: tuple[int, ...] = field(default_factory=tuple)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return KVDtype.parse(dtype).torch_dtype


def _load_model(options: MultiDocOptions, device: str, dtype: torch.dtype) -> _Model:
    if options.random_init is not None:
        built = random_init_model(options.random_init, num_layers=options.num_layers, device=device, dtype=dtype,
                                  seed=options.seed)  # fmt: skip
        return _Model(model=built.model, layout=built.layout, tokenizer=None, name=built.layout.model_id)
    if options.num_layers is not None:
        raise ConfigError("--num-layers only applies to --random-init models")
    if options.model_path is not None:
        loaded = load_local_model(options.model_path, dtype=dtype, device=device)
    else:
        loaded = load_smollm2(cache_dir=options.model_cache_dir, dtype=dtype, device=device)
    return _Model(model=loaded.model, layout=loaded.layout, tokenizer=loaded.tokenizer, name=loaded.layout.model_id)


@contextmanager
def _data_dir(options: MultiDocOptions) -> Iterator[Path]:
    if options.data_dir is not None:
        yield options.data_dir
        return
    directory = Path(tempfile.mkdtemp(prefix="kvstore-bench-blend-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _queries(options: MultiDocOptions) -> list[QuerySpec]:
    """Which documents each query holds, in which order; needs no model, so bad counts fail before it loads."""
    if options.workload is BenchWorkload.SHUFFLE:
        return pick_derangements(options.num_documents, options.num_queries, options.seed)
    return pick_combinations(options.num_documents, options.docs_per_query, options.num_queries, options.seed)


def _documents(options: MultiDocOptions, model: _Model) -> tuple[PromptFormat, list[Document]]:
    vocab_size = int(model.model.config.vocab_size)
    if model.tokenizer is not None:
        prompt_format = PromptFormat.for_tokenizer(model.tokenizer)
        documents = prose_documents(
            model.tokenizer, options.num_documents, options.document_tokens, options.seed, options.facts
        )
    else:
        prompt_format = PromptFormat.random(vocab_size, np.random.default_rng(options.seed + 3))
        documents = random_documents(vocab_size, options.num_documents, options.document_tokens, options.seed)
    return prompt_format, documents


def run_multidoc_benchmark(options: MultiDocOptions, progress: Progress | None = None) -> list[MultiDocRow]:
    """Warm the store up, prefill every query in every mode, and return one row per mode.

    Raises:
        ConfigError: bad options, a model the blender refuses, or a device/dtype that is not available.
    """
    report = progress or (lambda step, done, total: None)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    blend_config = options.blend
    configs = {BenchMode.BLEND: blend_config, BenchMode.REUSE: dataclasses.replace(blend_config, recompute_ratio=0.0)}
    queries = _queries(options)
    model = _load_model(options, device, dtype)
    prompt_format, documents = _documents(options, model)
    rng = np.random.default_rng(options.seed + 4)
    vocab_size = int(model.model.config.vocab_size)
    prompts = [
        prompt_format.query_prompt(
            [documents[index] for index in query.order],
            prompt_format.question(documents[query.asked].fact, rng, vocab_size),
        )
        for query in queries
    ]
    warm_ups = warm_up_prompts(options, prompt_format, documents)
    total_steps = len(warm_ups) + (len(prompts) + 1) * len(options.modes)
    samples: dict[BenchMode, list[QuerySample]] = {mode: [] for mode in options.modes}
    with _data_dir(options) as directory:
        store_config = _store_config(options, model.layout, warm_ups, device, directory)
        with TieredStore(model.layout, store_config) as store, \
                LayerwiseBlender(model.model, store, blend_config) as blender:  # fmt: skip
            done = 0
            for warm_up in warm_ups:
                blender.prefill(warm_up, mode="full", store_result=True)
                done += 1
                report("warm-up: storing documents", done, total_steps)
            store.flush()
            for mode in options.modes:  # untimed: kernels, allocator, caches
                _prefill(blender, prompts[0], mode, configs)
                done += 1
                report("warm-up: one query per mode", done, total_steps)
            with _sample_writer(options.samples_path) as write_sample:
                for index, (prompt, query) in enumerate(zip(prompts, queries, strict=True)):
                    reference: _Reference | None = None
                    for mode in options.modes:
                        output = _prefill(blender, prompt, mode, configs)
                        sample, reference = _measure(model, output, reference, documents[query.asked], options)
                        samples[mode].append(sample)
                        write_sample({"query": index, "mode": mode.value, "order": list(query.order),
                                      "asked": query.asked, **sample.to_json_dict()})  # fmt: skip
                        del output
                        done += 1
                        report(f"query {index + 1}/{len(prompts)}: {mode.value}", done, total_steps)
    context = _run_context(options, model, device, dtype)
    return [
        summarize(context, mode.value, configs[mode].recompute_ratio if mode in configs else None, samples[mode],
                  samples[BenchMode.FULL])
        for mode in options.modes
    ]  # fmt: skip


def _store_config(
    options: MultiDocOptions, layout: KVLayout, warm_ups: list[TokenIds], device: str, directory: Path
) -> StoreConfig:
    """The benchmark's store, its data under ``directory``."""
    # Memory tiers sized to the workload when not given: twice the warm-up's KV (and at least 64 MiB), so the
    # documents stay resident and a tiny layout does not get millions of slots.
    fitted = max(64 << 20, 2 * layout.chunk_bytes(sum(len(prompt) for prompt in warm_ups) + options.chunk_size))
    return StoreConfig(
        tiers=options.tiers,
        chunk_size=options.chunk_size,
        chunking=options.chunking,
        cpu_capacity_bytes=options.cpu_capacity_bytes or fitted,
        gpu_capacity_bytes=options.gpu_capacity_bytes or fitted,
        gpu_device=device if device.startswith("cuda") else "cpu",
        data_dir=directory / "data",
        disk_capacity_bytes=options.disk_capacity_bytes,
        enable_blend=True,
    )


def _run_context(options: MultiDocOptions, model: _Model, device: str, dtype: torch.dtype) -> RunContext:
    """What every row repeats about the run: the workload, the blend settings, the model and the store."""
    blend_config = options.blend
    return RunContext(
        bench=options.workload.value,
        selection=blend_config.selection.value,
        chunk_start_tokens=blend_config.chunk_start_tokens,
        check_layer=blend_config.check_layer,
        deviation=blend_config.deviation.value,
        num_head_tokens=blend_config.num_head_tokens,
        recurring_context_tokens=blend_config.recurring_context_tokens,
        stale_key_scale=blend_config.stale_key_scale,
        disk_policy=blend_config.disk_policy.value,
        seed=options.seed,
        model=model.name,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        tiers=",".join(tier.value for tier in options.tiers),
        chunk_size=options.chunk_size,
        chunking=options.chunking.value,
        warm_up=options.warm_up.value if options.workload is BenchWorkload.MULTI_DOC_QA else "identity_order",
        facts=options.facts.value if model.tokenizer is not None else "none",
        num_documents=options.num_documents,
        document_tokens=options.document_tokens,
        docs_per_query=options.num_documents if options.workload is BenchWorkload.SHUFFLE else options.docs_per_query,
    )


def warm_up_prompts(options: MultiDocOptions, prompt_format: PromptFormat, documents: list[Document]) -> list[TokenIds]:
    """The prompts whose KV the warm-up stores (the module docstring's step 1)."""
    if options.workload is BenchWorkload.SHUFFLE:
        return [prompt_format.context_prompt(documents)]
    if options.warm_up is WarmUp.GROUPED:
        size = options.docs_per_query
        groups = [documents[start : start + size] for start in range(0, len(documents), size)]
        return [prompt_format.context_prompt(group) for group in groups]
    after_preamble = options.warm_up is WarmUp.PREAMBLE
    return [prompt_format.warm_up_prompt(document, after_preamble=after_preamble) for document in documents]


@contextmanager
def _sample_writer(path: Path | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Appends one JSON line per sample to ``path`` and flushes it, so a run cut short keeps what it measured."""
    if path is None:
        yield lambda sample: None
        return
    try:
        file = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--samples {path}: cannot write it ({exc.strerror})") from None
    with file:

        def write(sample: dict[str, Any]) -> None:
            file.write(json.dumps(sample) + "\n")
            file.flush()

        yield write


def _prefill(
    blender: LayerwiseBlender, prompt: np.ndarray, mode: BenchMode, configs: dict[BenchMode, BlendConfig]
) -> BlendOutput:
    if mode in configs:
        return blender.prefill(prompt, mode="blend", store_result=False, config=configs[mode])
    return blender.prefill(prompt, mode=mode.value, store_result=False)


def _measure(
    model: _Model,
    output: BlendOutput,
    reference: _Reference | None,
    asked: Document,
    options: MultiDocOptions,
) -> tuple[QuerySample, _Reference]:
    """One sample; the first call for a query (full prefill) makes the reference the others are compared with."""
    plan = output.plan
    sample = QuerySample(
        timings=output.timings,
        prompt_tokens=plan.num_tokens,
        exact_tokens=plan.num_exact_tokens,
        blend_tokens=plan.num_blend_tokens,
        recomputed_tokens=output.num_recomputed_tokens,
        skipped_disk_tokens=output.num_skipped_disk_tokens,
    )
    if model.tokenizer is None or asked.fact is None:
        return sample, reference or _Reference(logits=output.logits)
    continuation = greedy_continuation(model.model, output, options.continuation_tokens, model.tokenizer)
    if reference is None:
        reference = _Reference(logits=output.logits, continuation=continuation.tokens)
    matches = sum(a == b for a, b in zip(continuation.tokens, reference.continuation, strict=True))
    return dataclasses.replace(
        sample,
        top1=int(output.logits.argmax()) == int(reference.logits.argmax()),
        kl=kl_divergence(reference.logits, output.logits),
        continuation_match=matches / len(reference.continuation),
        fact_correct=first_number(continuation.text) == asked.fact.code,
    ), reference
