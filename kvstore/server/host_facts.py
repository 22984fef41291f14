"""What this machine has: CUDA, free RAM, free device memory, free disk -- for ``kvstore serve``'s checks.

Read once, before start-up, so a size that cannot fit fails with one line instead of an out-of-memory kill later.
``HostFacts`` is a value, so tests hand ``resolve_settings`` a machine of their choosing. Only ``probe_host`` imports
torch (CUDA's free memory): ``kvstore serve`` checks the given cpu and disk sizes against ``available_memory_bytes``
and ``free_disk_bytes`` before torch is imported.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostFacts", "available_memory_bytes", "free_disk_bytes", "probe_host"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFacts:
    """Resources of the machine a server starts on (bytes)."""

    cuda_available: bool
    available_memory_bytes: int
    gpu_free_bytes: int


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (what can be allocated without swapping), else total RAM."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def probe_host() -> HostFacts:
    """The facts of this machine now (imports torch: only CUDA can say what a device has free)."""
    import torch

    cuda = torch.cuda.is_available()
    gpu_free = int(torch.cuda.mem_get_info()[0]) if cuda else 0
    return HostFacts(cuda_available=cuda, available_memory_bytes=available_memory_bytes(), gpu_free_bytes=gpu_free)


def free_disk_bytes(path: Path) -> int:
    """Bytes a data dir at ``path`` could grow by: free space on its filesystem plus its current ``data.mdb``."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    existing = Path(path) / "data.mdb"
    current = existing.stat().st_size if existing.is_file() else 0
    return int(shutil.disk_usage(probe).free) + current
