"""What ``kvstore bench vllm --serve`` runs (``ServeBenchOptions``, the ``DEPLOYMENTS``), checked before the benchmark's
servers, client and asyncio are imported.

Why apart from ``kvstore.bench.vllm_serve``: ``kvstore bench vllm`` builds these options, which check themselves,
before it imports the benchmark, so a bad option is refused in a fraction of a second. ``kvstore.bench.vllm_serve``
re-exports both names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.vllm_serve_workload import (
    CHAT_SEPARATOR,
    DEFAULT_QUESTION,
    DEFAULT_SEPARATOR,
    DEFAULT_SYSTEM_PROMPT,
    Corpus,
    check_workload_counts,
)
from kvstore.blend.config import check_recompute_ratio
from kvstore.chunking import parse_chunking
from kvstore.errors import ConfigError

__all__ = ["DEFAULT_DEPLOYMENTS", "DEPLOYMENTS", "VLLM_ALONE", "ServeBenchOptions"]

DEPLOYMENTS = ("vllm", "vllm_cold", "kvstore_prefix", "kvstore_blend")
VLLM_ALONE = ("vllm", "vllm_cold")
"""The deployments without kvstore: vLLM as deployed (its prefix cache on), and vLLM computing every prompt."""
DEFAULT_DEPLOYMENTS = ("vllm", "kvstore_prefix", "kvstore_blend")
"""``vllm_cold`` only when asked for: it is the baseline of a cold prefill, one more server and round of prefills."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeBenchOptions:
    """What ``kvstore bench vllm --serve`` runs.

    Args:
        model_dir: a Hugging Face model directory vLLM loads.
        corpus: ``synthetic`` (the guide's documents) or ``prose`` (real English).
        num_documents, document_tokens, docs_per_query, num_queries: the workload.
        num_mixed: requests of the mixed round (0: no mixed round).
        max_inflight: requests in flight at most, every round.
        max_tokens: tokens generated per warm-up and query request.
        mixed_max_tokens: tokens generated per mixed request (enough for an inter-token latency).
        separator, system_prompt, question: the prompts' fixed parts (``separator`` ``None``: the guide's
            ``" # # "`` between token-id parts, a blank line between a chat prompt's documents).
        chat: send text through ``/v1/chat/completions`` (the model's chat template) instead of token ids.
        connector_separator: tell the kvstore deployments the separator (``kvstore.chunk_separator``); off, they cut
            chunks without one.
        interleaved: run each kvstore deployment beside a vLLM server of its own and send every request to both,
            one at a time (``max_inflight`` 1), for paired TTFT ratios.
        pause_s: with ``interleaved``, the pause before each send (an idle vLLM server polls its queues for about a
            second after a request, on the cores the other server needs).
        ratio: the blend's recompute ratio (``kvstore.blend_ratio``).
        chunk_size: the store's chunk size (``None``: the store's default).
        chunking: the store's cut rule, ``fixed`` or ``content`` (``None``: the store's default).
        dtype: the model's dtype.
        deployments: which deployments to run, a subset of ``DEPLOYMENTS`` in that order (``vllm`` is the reference
            of the output checks and of ``ttft_vs_vllm``, ``vllm_cold`` of ``ttft_vs_cold``).
        stored_wait_s: after the warm-up round, the longest to wait until the store holds every warm-up prompt
            (the connector saves asynchronously).
        env: extra environment for the servers (over the CPU defaults).
        work_dir: where logs and data dirs go (a temporary dir, removed, when ``None``).
        seed: the query sampling's seed.
    """

    model_dir: Path
    corpus: Corpus = "synthetic"
    num_documents: int = 5
    document_tokens: int = 1000
    docs_per_query: int = 5
    num_queries: int = 20
    num_mixed: int = 12
    max_inflight: int = 1
    max_tokens: int = 2
    mixed_max_tokens: int = 16
    separator: str | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    question: str = DEFAULT_QUESTION
    ratio: float = 0.15
    chunk_size: int | None = None
    chunking: str | None = None
    dtype: str = "float32"
    deployments: tuple[str, ...] = DEFAULT_DEPLOYMENTS
    stored_wait_s: float = 60.0
    env: Mapping[str, str] | None = None
    work_dir: Path | None = None
    seed: int = 0
    chat: bool = False
    connector_separator: bool = True
    interleaved: bool = False
    pause_s: float = 1.5

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ConfigError(f"--max-inflight {self.max_inflight}: at least 1")
        if self.max_tokens < 1 or self.mixed_max_tokens < 1:
            raise ConfigError("--max-tokens must be at least 1")
        if not self.deployments or any(name not in DEPLOYMENTS for name in self.deployments):
            raise ConfigError(f"deployments {self.deployments}: a subset of {', '.join(DEPLOYMENTS)}")
        check_workload_counts(
            num_documents=self.num_documents,
            document_tokens=self.document_tokens,
            docs_per_query=self.docs_per_query,
            num_queries=self.num_queries,
            num_mixed=self.num_mixed,
        )
        check_recompute_ratio(self.ratio)
        if self.interleaved and self.max_inflight != 1:
            raise ConfigError(f"--interleaved sends one request at a time; drop --max-inflight {self.max_inflight}")
        if self.interleaved and set(self.deployments) <= set(VLLM_ALONE):
            raise ConfigError("--interleaved pairs kvstore deployments with vLLM alone; name one in --deployments")
        if self.interleaved and "vllm_cold" in self.deployments:
            raise ConfigError("--interleaved pairs each kvstore deployment with a vLLM of its own; drop vllm_cold")
        if self.pause_s < 0:
            raise ConfigError(f"--pause {self.pause_s}: a pause is at least 0 seconds")
        if self.chunking is not None:
            parse_chunking(self.chunking)
        if self.separator == "":
            raise ConfigError("--separator '': give the text between the parts, or leave it out for the default")

    @property
    def joiner(self) -> str:
        """The text between the prompts' parts."""
        if self.separator is not None:
            return self.separator
        return CHAT_SEPARATOR if self.chat else DEFAULT_SEPARATOR
