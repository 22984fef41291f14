"""What ``kvstore bench tiers`` measures (``TierBenchOptions``), checked without importing torch, numba or LMDB.

Why apart from ``kvstore.bench.tiers``: that module imports torch and the tiers; ``kvstore bench tiers`` builds
these options, which check themselves, before it imports them, so a bad option is refused in a fraction of a second.
``kvstore.bench.tiers`` re-exports ``TierBenchOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.option_checks import check_positive, check_preset_names
from kvstore.preset_names import PRESET_NAMES
from kvstore.tiers.names import TierName

__all__ = ["TierBenchOptions"]

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class TierBenchOptions:
    """What ``run_tier_benchmark`` measures, and how much.

    Args:
        layouts: names from ``kvstore.presets.PRESET_NAMES``.
        tiers: tiers to measure. ``gpu`` (put, get and cpu -> gpu promotion) is skipped, with a logged note,
            when torch sees no CUDA device and ``device`` is a CUDA device.
        chunk_size: tokens per chunk.
        memory_bytes: KV bytes per repeat for the cpu tier (its arena and the baseline buffer each hold this).
        gpu_memory_bytes: the same for the gpu tier and promotion (device memory; promotion adds pinned host).
        disk_bytes: uncompressed KV bytes written and read back per disk repeat.
        source_bytes: bytes of distinct random chunks rotated as sources (at least 2 chunks).
        num_repeats: timed repeats of each cpu/gpu op, after one untimed warm-up.
        num_disk_repeats: timed repeats of the disk ops, each in a fresh data dir.
        directory: parent of the temporary disk data dir (default: the system temp dir); removed afterwards.
        device: ``"cuda"``/``"cuda:N"`` for the gpu tier, or ``"cpu"`` to run its logic on host memory.
        zstd_level: disk codec level.
        num_codec_threads: disk codec threads.
        seed: seed of the random KV and token ids.
    """

    layouts: tuple[str, ...] = PRESET_NAMES
    tiers: tuple[TierName, ...] = (TierName.GPU, TierName.CPU, TierName.DISK)
    chunk_size: int = 256
    memory_bytes: int = 512 * _MIB
    gpu_memory_bytes: int = 2048 * _MIB
    disk_bytes: int = 768 * _MIB
    source_bytes: int = 64 * _MIB
    num_repeats: int = 5
    num_disk_repeats: int = 5
    directory: Path | None = None
    device: str = "cuda"
    zstd_level: int = 1
    num_codec_threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(TierName(tier) for tier in self.tiers))
        check_preset_names(self.layouts)
        check_positive(
            "tier",
            self,
            (
                "chunk_size",
                "memory_bytes",
                "gpu_memory_bytes",
                "disk_bytes",
                "source_bytes",
                "num_repeats",
                "num_disk_repeats",
                "num_codec_threads",
            ),
        )
