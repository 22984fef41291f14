"""``kvstore bench multi-doc-qa`` and ``kvstore bench shuffle``'s options, each declared once: its flag, type, help
and the field it fills (of ``MultiDocOptions``, or of the blend mode's ``BlendConfig``), whose default is its
default; an enum's default is offered as its value, the text the option takes.

Options whose text is parsed into another type (tiers, sizes, modes) fill no field directly: the command parses them
(``kvstore.cli.bench_blend``), and ``tests/cli/test_declared_bench_options.py`` checks their defaults parse into the
fields' defaults.

Light on purpose: ``--help`` and a refused option import this table and the option dataclasses only.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.bench.multidoc_options import MultiDocOptions
from kvstore.blend.config import BlendConfig, SelectionPolicy
from kvstore.cli.declared_options import CliOption, OptionTarget
from kvstore.models.random_init_names import RANDOM_INIT_PRESETS

__all__ = ["MULTIDOC_OPTIONS", "NOT_OPTIONS", "PARSED_OPTIONS"]


def _to(options_class: type, field_name: str) -> tuple[OptionTarget, ...]:
    return (OptionTarget(options_class=options_class, field_name=field_name),)


_RUN = MultiDocOptions
_BLEND = BlendConfig

MULTIDOC_OPTIONS = (
    CliOption(name="as_json", declaration="--json", annotation=bool, default=False,
              help_text="One JSON object per mode on stdout."),
    CliOption(name="model_path", declaration="--model", annotation=Path | None, targets=_to(_RUN, "model_path"),
              help_text="A local Llama-family Hugging Face directory (default: SmolLM2-135M-Instruct)."),
    CliOption(name="random_init", declaration="--random-init", annotation=str | None,
              help_text=f"A random model of a real shape: {', '.join(RANDOM_INIT_PRESETS)}.",
              targets=_to(_RUN, "random_init")),
    CliOption(name="num_layers", declaration="--num-layers", annotation=int | None,
              help_text="Depth override of --random-init.", targets=_to(_RUN, "num_layers")),
    CliOption(name="device", declaration="--device", annotation=str, help_text="cpu, cuda, cuda:N, or auto.",
              targets=_to(_RUN, "device")),
    CliOption(name="dtype", declaration="--dtype", annotation=str,
              help_text="float32, bfloat16, float16, or auto (bf16 on CUDA).", targets=_to(_RUN, "dtype")),
    CliOption(name="tiers", declaration="--tiers", annotation=str, default="cpu",
              help_text="Store tiers holding the cached KV, e.g. gpu / cpu,disk."),
    CliOption(name="data_dir", declaration="--data-dir", annotation=Path | None,
              help_text="Disk tier data dir (default: a temp dir).", targets=_to(_RUN, "data_dir")),
    CliOption(name="chunk_size", declaration="--chunk-size", annotation=int, help_text="Tokens per stored chunk.",
              targets=_to(_RUN, "chunk_size")),
    CliOption(name="chunking", declaration="--chunking", annotation=str, targets=_to(_RUN, "chunking"),
              help_text="How the store cuts chunks: 'fixed' (every --chunk-size tokens) or 'content' (where the "
              "tokens say: a document is cut alike wherever it sits; --chunk-size is the longest chunk)."),
    CliOption(name="warm_up", declaration="--warm-up", annotation=str, targets=_to(_RUN, "warm_up"),
              help_text="multi-doc-qa: store documents after the 'preamble', 'alone', or --docs-per-query at a time "
              "('grouped')."),
    CliOption(name="facts", declaration="--facts", annotation=str, targets=_to(_RUN, "facts"),
              help_text="Planted facts: 'distinct' relations per document, or the 'same' sentence in each (binding "
              "test)."),
    CliOption(name="cpu_capacity", declaration="--cpu-size", annotation=str | None,
              help_text="cpu tier size (default: twice the documents' KV, at least 64MiB)."),
    CliOption(name="gpu_capacity", declaration="--gpu-size", annotation=str | None,
              help_text="gpu tier size (default: twice the documents' KV, at least 64MiB)."),
    CliOption(name="num_documents", declaration="--num-documents", annotation=int, help_text="Documents stored.",
              targets=_to(_RUN, "num_documents")),
    CliOption(name="document_tokens", declaration="--document-tokens", annotation=int, help_text="Tokens each.",
              targets=_to(_RUN, "document_tokens")),
    CliOption(name="num_queries", declaration="--num-queries", annotation=int, help_text="Timed queries.",
              targets=_to(_RUN, "num_queries")),
    CliOption(name="docs_per_query", declaration="--docs-per-query", annotation=int,
              help_text="Documents per query (multi-doc-qa).", targets=_to(_RUN, "docs_per_query")),
    CliOption(name="recompute_ratio", declaration="--recompute-ratio", annotation=float, help_text="Blend ratio.",
              targets=_to(_BLEND, "recompute_ratio")),
    CliOption(name="check_layer", declaration="--check-layer", annotation=int, help_text="Blend check layer.",
              targets=_to(_BLEND, "check_layer")),
    CliOption(name="selection", declaration="--selection", annotation=str, targets=_to(_BLEND, "selection"),
              help_text="Blend: how the ratio's tokens are chosen: "
              + ", ".join(policy.value for policy in SelectionPolicy) + "."),
    CliOption(name="chunk_start_tokens", declaration="--chunk-start-tokens", annotation=int,
              help_text="Blend: first tokens of every reused span the chunk_start policies take (within the ratio).",
              targets=_to(_BLEND, "chunk_start_tokens")),
    CliOption(name="deviation", declaration="--deviation", annotation=str, targets=_to(_BLEND, "deviation"),
              help_text="What kv_deviation compares: 'key', 'value' or 'key_value'."),
    CliOption(name="attention", declaration="--attention", annotation=str, targets=_to(_BLEND, "attention"),
              help_text="Attention of the recomputed tokens: 'sdpa', 'flex' or 'auto' (flex on CUDA)."),
    CliOption(name="num_head_tokens", declaration="--num-head-tokens", annotation=int,
              help_text="Blend: also recompute the first N tokens of every reused span (on top of the ratio).",
              targets=_to(_BLEND, "num_head_tokens")),
    CliOption(name="recurring_context_tokens", declaration="--recurring-context-tokens", annotation=int,
              help_text="Blend: also recompute reused tokens whose last N tokens occur earlier in the prompt (0: off).",
              targets=_to(_BLEND, "recurring_context_tokens")),
    CliOption(name="stale_key_scale", declaration="--stale-key-scale", annotation=float,
              help_text="Blend: scale the keys of cached tokens kept after the check layer, in (0, 1] (1.0: off).",
              targets=_to(_BLEND, "stale_key_scale")),
    CliOption(name="disk_policy", declaration="--disk-policy", annotation=str, targets=_to(_BLEND, "disk_policy"),
              help_text="Blend: chunks only the disk holds: 'auto' (recompute when faster), 'wait' or 'recompute'."),
    CliOption(name="modes", declaration="--modes", annotation=str, default="full,prefix,blend,reuse",
              help_text="Modes to run (full always runs)."),
    CliOption(name="continuation_tokens", declaration="--continuation-tokens", annotation=int,
              help_text="Greedy tokens compared.", targets=_to(_RUN, "continuation_tokens")),
    CliOption(name="seed", declaration="--seed", annotation=int, targets=_to(_RUN, "seed"),
              help_text="Seed of documents, facts, queries, weights."),
    CliOption(name="samples_path", declaration="--samples", annotation=Path | None, targets=_to(_RUN, "samples_path"),
              help_text="Also write one JSON line per query and mode to this file, as they come."),
    CliOption(name="expected_ttft_gain", declaration="--expected-ttft-gain", annotation=float | None,
              help_text="Exit 1 when blend's speedup over full is below this."),
)  # fmt: skip
"""The options in ``--help``'s order."""

PARSED_OPTIONS = {
    "tiers": "tiers",
    "cpu_capacity": "cpu_capacity_bytes",
    "gpu_capacity": "gpu_capacity_bytes",
    "modes": "modes",
}
"""Options parsed into a ``MultiDocOptions`` field of another type: option -> the field."""

NOT_OPTIONS = {
    MultiDocOptions: ("workload", "model_cache_dir", "disk_capacity_bytes", "blend"),
    BlendConfig: (),
}
"""The fields no option fills: the workload is the command, the model cache comes from the environment, the disk
tier takes its default, and ``blend`` is built from the ``BlendConfig`` options."""
