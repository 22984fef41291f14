"""``kvstore bench vllm``'s options, each declared once: its flag, type, help and the options-dataclass fields it
fills (``VllmBenchOptions``, ``VllmBlendOptions``, ``ServeBenchOptions``), whose defaults are its default.

Light on purpose: ``kvstore bench vllm --help`` and a refused option import this table and the option dataclasses
only (``tests/test_imports.py``), never vLLM, torch or the benchmark.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.bench.vllm_blend_options import VllmBlendOptions
from kvstore.bench.vllm_serve_options import ServeBenchOptions
from kvstore.bench.vllm_ttft import VllmBenchOptions
from kvstore.cli.declared_options import CliOption, OptionTarget

__all__ = ["BENCH_VLLM_OPTIONS", "NOT_OPTIONS"]


def _to(options_class: type, *field_names: str) -> tuple[OptionTarget, ...]:
    return tuple(OptionTarget(options_class=options_class, field_name=name) for name in field_names)


_TTFT = VllmBenchOptions
_BLEND = VllmBlendOptions
_SERVE = ServeBenchOptions

BENCH_VLLM_OPTIONS = (
    CliOption(name="as_json", declaration="--json", annotation=bool, default=False,
              help_text="One JSON object per mode on stdout."),
    CliOption(name="model", declaration="--model", annotation=Path | None,
              help_text="A Hugging Face model dir vLLM loads (default: SmolLM2-135M-Instruct, exported)."),
    CliOption(name="prompt_tokens", declaration="--prompt-tokens", annotation=int, help_text="Tokens per prompt.",
              targets=_to(_TTFT, "prompt_tokens")),
    CliOption(name="prompts", declaration="--prompts", annotation=int, help_text="Distinct prompts (samples per mode).",
              targets=_to(_TTFT, "num_prompts") + _to(_BLEND, "num_queries")),
    CliOption(name="dtype", declaration="--dtype", annotation=str, help_text="The model's dtype in vLLM.",
              targets=_to(_TTFT, "dtype") + _to(_SERVE, "dtype")),
    CliOption(name="tensor_parallel_size", declaration="--tensor-parallel-size", annotation=int,
              help_text="vLLM's TP size (the default mode).", targets=_to(_TTFT, "tensor_parallel_size")),
    CliOption(name="kv_cache_dtype", declaration="--kv-cache-dtype", annotation=str,
              help_text="vLLM's kv_cache_dtype (the default mode): auto, fp8, fp8_e4m3 or fp8_e5m2 (head size a "
              "multiple of 32).", targets=_to(_TTFT, "kv_cache_dtype")),
    CliOption(name="data_dir", declaration="--data-dir", annotation=Path | None,
              help_text="kvstore data dir (default: a temporary one).", targets=_to(_TTFT, "data_dir")),
    CliOption(name="blend", declaration="--blend", annotation=bool, default=False,
              help_text="CacheBlend inside vLLM: cold vs blended vs the standalone blender on multi-doc QA."),
    CliOption(name="documents", declaration="--documents", annotation=int, help_text="--blend: documents cached.",
              targets=_to(_BLEND, "num_documents") + _to(_SERVE, "num_documents")),
    CliOption(name="document_tokens", declaration="--document-tokens", annotation=int,
              help_text="--blend: tokens per document.",
              targets=_to(_BLEND, "document_tokens") + _to(_SERVE, "document_tokens")),
    CliOption(name="docs_per_query", declaration="--docs-per-query", annotation=int,
              help_text="--blend: documents in each query.",
              targets=_to(_BLEND, "docs_per_query") + _to(_SERVE, "docs_per_query")),
    CliOption(name="ratio", declaration="--ratio", annotation=float, help_text="--blend, --serve: the recompute ratio.",
              targets=_to(_BLEND, "ratio") + _to(_SERVE, "ratio")),
    CliOption(name="prefill_decode", declaration="--prefill-decode", annotation=bool, default=False,
              help_text="A prefill engine (kv_producer) and a decode engine (kv_consumer) on one store, through a "
              "proxy."),
    CliOption(name="serve", declaration="--serve", annotation=bool, default=False,
              help_text="Multi-doc QA through vLLM's OpenAI server: vLLM alone, + kvstore, + kvstore blending."),
    CliOption(name="queries", declaration="--queries", annotation=int, help_text="--serve: query-round requests.",
              targets=_to(_SERVE, "num_queries")),
    CliOption(name="max_inflight", declaration="--max-inflight", annotation=int,
              help_text="--serve: requests in flight at most.", targets=_to(_SERVE, "max_inflight")),
    CliOption(name="mixed_requests", declaration="--mixed-requests", annotation=int,
              help_text="--serve: mixed-round requests (hits, misses, blends).", targets=_to(_SERVE, "num_mixed")),
    CliOption(name="max_tokens", declaration="--max-tokens", annotation=int,
              help_text="--serve: tokens per warm-up and query request.", targets=_to(_SERVE, "max_tokens")),
    CliOption(name="mixed_max_tokens", declaration="--mixed-max-tokens", annotation=int,
              help_text="--serve: tokens per mixed-round request.", targets=_to(_SERVE, "mixed_max_tokens")),
    CliOption(name="separator", declaration="--separator", annotation=str | None,
              help_text="--serve: between the parts (default ' # # ', --chat a blank line).",
              targets=_to(_SERVE, "separator")),
    CliOption(name="chat", declaration="--chat", annotation=bool, default=False,
              help_text="--serve: text through chat completions (the model's chat template), not token ids.",
              targets=_to(_SERVE, "chat")),
    CliOption(name="connector_separator", declaration="--connector-separator/--no-connector-separator",
              annotation=bool, default=True,
              help_text="--serve: tell kvstore the separator (kvstore.chunk_separator), or cut without one.",
              targets=_to(_SERVE, "connector_separator")),
    CliOption(name="system_prompt", declaration="--system-prompt", annotation=str, help_text="--serve.",
              targets=_to(_SERVE, "system_prompt")),
    CliOption(name="corpus", declaration="--corpus", annotation=str,
              help_text="--serve: synthetic (the guide's) or prose.", targets=_to(_SERVE, "corpus")),
    CliOption(name="interleaved", declaration="--interleaved", annotation=bool, default=False,
              help_text="--serve: each kvstore deployment beside its own vLLM server, every request to both in turn "
              "(paired TTFT ratios).", targets=_to(_SERVE, "interleaved")),
    CliOption(name="pause", declaration="--pause", annotation=float,
              help_text="--serve --interleaved: seconds before each send.", targets=_to(_SERVE, "pause_s")),
    CliOption(name="deployments", declaration="--deployments", annotation=str | None,
              help_text="--serve: which of vllm,vllm_cold,kvstore_prefix,kvstore_blend to run (default: all but "
                        "vllm_cold, vLLM without its prefix cache)."),
    CliOption(name="chunk_size", declaration="--chunk-size", annotation=int | None,
              help_text="--serve: the store's chunk size.", targets=_to(_SERVE, "chunk_size")),
    CliOption(name="chunking", declaration="--chunking", annotation=str | None,
              help_text="--serve: the store's cut rule, fixed or content (kvstore.chunking).",
              targets=_to(_SERVE, "chunking")),
    CliOption(name="expected_ttft_gain", declaration="--expected-ttft-gain", annotation=float | None,
              help_text="--serve: exit 1 when blending's query TTFT gain over vLLM alone is less."),
    CliOption(name="work_dir", declaration="--work-dir", annotation=Path | None,
              help_text="--serve: keep the servers' logs and data dirs here (default: a temporary dir).",
              targets=_to(_SERVE, "work_dir")),
)  # fmt: skip
"""The options in ``--help``'s order. An option with several targets fills each mode's dataclass (their defaults
agree: ``tests/cli/test_declared_bench_options.py``)."""

NOT_OPTIONS = {
    VllmBenchOptions: ("model_dir", "env", "engine_timeout_s"),
    VllmBlendOptions: ("model_dir", "answer_tokens", "chunk_size", "engine_timeout_s"),
    ServeBenchOptions: (
        "model_dir",
        "question",
        "deployments",
        "stored_wait_s",
        "env",
        "seed",
    ),  # --deployments: a list
}
"""The options dataclasses' fields no option fills (``model_dir`` is ``--model`` once exported; the rest are for
Python callers and tests)."""
