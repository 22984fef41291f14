"""What ``kvstore bench server`` measures (``ServerBenchOptions``), checked without importing torch, numba or LMDB.

Why apart from ``kvstore.bench.server``: that module imports the store, the client and torch; ``kvstore bench
server`` builds these options, which check themselves, before it imports them, so a bad option is refused in a
fraction of a second. ``kvstore.bench.server`` re-exports ``ServerBenchOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.bench.option_checks import check_positive, check_preset_names
from kvstore.chunking import Chunking, ContentCutShape, parse_chunking

__all__ = ["ServerBenchOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerBenchOptions:
    """What ``run_server_benchmark`` measures.

    Args:
        lookup_layout: preset of the lookup phase (the plan, not the KV size, is what a lookup costs).
        bulk_layout: preset of the bandwidth phase.
        lookup_tokens: prompt length of the lookup phase (all of it cached).
        num_lookups: timed lookups per side.
        bulk_tokens: tokens stored and retrieved per bandwidth repeat.
        num_repeats: timed bandwidth repeats per side and variant, after one untimed warm-up.
        chunk_size: tokens per chunk (the longest chunk under ``content``).
        chunking: the stores' cut rule (``StoreConfig.chunking``): what content-defined chunks cost a prefix-only
            workload (chunks per prompt, lookup time) against a run with ``fixed``.
        seed: seed of the token ids and KV.
        kv_events: the servers publish KV events (``--kv-events`` on a bound socket nobody reads): with a run
            without, what publishing costs, each run's figures against the in-process store of the same run.
    """

    lookup_layout: str = "smollm2-135m"
    bulk_layout: str = "llama3.1-8b"
    lookup_tokens: int = 15_360
    num_lookups: int = 200
    bulk_tokens: int = 2048
    num_repeats: int = 5
    chunk_size: int = 256
    chunking: Chunking = Chunking.FIXED
    seed: int = 0
    kv_events: bool = False

    def __post_init__(self) -> None:
        check_preset_names((self.lookup_layout, self.bulk_layout))
        check_positive("server", self, ("lookup_tokens", "num_lookups", "bulk_tokens", "num_repeats", "chunk_size"))
        object.__setattr__(self, "chunking", parse_chunking(self.chunking))
        if self.chunking is Chunking.CONTENT:
            ContentCutShape.for_chunk_size(self.chunk_size)
