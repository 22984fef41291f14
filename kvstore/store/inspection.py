"""What a data dir holds, read offline (no store open on it needed): the model behind ``kvstore inspect``.

Opens the disk tier read-only, so it is safe next to a live process that owns the data dir.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import StorageError
from kvstore.keys import PrefixKey
from kvstore.tiers.disk.check import DiskCheckReport
from kvstore.tiers.disk.data_file_check import DATA_FILE, data_file_damage
from kvstore.tiers.disk.tier import DiskTier, StoredChunk

__all__ = ["ChunkSummary", "DataDirSummary", "check_data_dir", "chunks_on_disk", "find_chunk", "summarize_data_dir"]

ProgressCallback = Callable[[int, int], None]
"""Called with (chunks seen, chunks in total) while a summary scans the data dir."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataDirSummary:
    """Counts, sizes and settings of one data dir (all sizes in bytes, times as ISO-8601 UTC)."""

    path: str
    layout: str
    layout_namespace: str
    chunk_size: int
    num_chunks: int
    num_sequences: int
    num_partial_chunks: int
    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    compression_ratio: float
    capacity_bytes: int
    file_bytes: int
    oldest_access: str | None
    newest_access: str | None

    def to_json_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkSummary:
    """One chunk of a data dir, for ``kvstore inspect --key``."""

    key: str
    num_tokens: int
    source_start: int
    raw_bytes: int
    stored_bytes: int
    num_frames: int
    last_access: str
    first_tokens: list[int]

    def to_json_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC).isoformat(timespec="seconds")


def _open(path: Path) -> DiskTier:
    if not (Path(path) / DATA_FILE).is_file():
        raise StorageError(f"{path} is not a kvstore data dir (no data.mdb); pass the --data-dir a store used")
    return DiskTier.open_existing(Path(path), read_only=True, num_codec_threads=1)


def summarize_data_dir(path: Path, progress: ProgressCallback | None = None) -> DataDirSummary:
    """Scan a data dir's chunk metadata (never the payloads) and summarise it.

    Raises:
        StorageError: ``path`` is not a data dir or cannot be opened.
    """
    tier = _open(path)
    try:
        info = tier.describe()
        num_sequences = num_partial = num_tokens = 0
        for seen, chunk in enumerate(tier.iter_records(), start=1):
            num_sequences += chunk.source_start == 0
            num_partial += chunk.num_tokens < info.chunk_size
            num_tokens += chunk.num_tokens
            if progress is not None and seen % 1024 == 0:
                progress(seen, info.num_chunks)
        if progress is not None:
            progress(info.num_chunks, info.num_chunks)
    finally:
        tier.close()
    return DataDirSummary(
        path=str(path),
        layout=info.layout.describe(),
        layout_namespace=info.layout.namespace.hex(),
        chunk_size=info.chunk_size,
        num_chunks=info.num_chunks,
        num_sequences=num_sequences,
        num_partial_chunks=num_partial,
        num_tokens=num_tokens,
        raw_bytes=info.used_bytes,
        stored_bytes=info.stored_bytes,
        compression_ratio=round(info.used_bytes / info.stored_bytes, 4) if info.stored_bytes else 1.0,
        capacity_bytes=info.capacity_bytes,
        file_bytes=info.file_bytes,
        oldest_access=_iso(info.oldest_access_ns),
        newest_access=_iso(info.newest_access_ns),
    )


def find_chunk(path: Path, key: PrefixKey) -> ChunkSummary | None:
    """One chunk's metadata, or ``None`` when the data dir does not hold it."""
    tier = _open(path)
    try:
        found: StoredChunk | None = next((c for c in tier.iter_records() if c.key == key), None)
    finally:
        tier.close()
    if found is None:
        return None
    return ChunkSummary(
        key=found.key.hex(),
        num_tokens=found.num_tokens,
        source_start=found.source_start,
        raw_bytes=found.raw_bytes,
        stored_bytes=found.stored_bytes,
        num_frames=found.num_frames,
        last_access=_iso(found.last_access_ns) or "",
        first_tokens=[int(t) for t in found.tokens[:16]],
    )


def check_data_dir(path: Path, progress: Callable[[int], None] | None = None) -> DiskCheckReport:
    """Walk every chunk and frame of a data dir, read-only, and report every defect (``DiskTier.check``); a
    damaged ``data.mdb`` (one that cannot be mapped safely) is reported as the one defect, without opening it."""
    damage = data_file_damage(Path(path) / DATA_FILE)
    if damage is not None:
        return DiskCheckReport(
            num_chunks=0,
            num_frames=0,
            num_unfinished_frames=0,
            stored_bytes=0,
            problems=(damage.message(),),
            num_problems=1,
        )
    tier = _open(path)
    try:
        return tier.check(progress)
    finally:
        tier.close()


def chunks_on_disk(path: Path, keys: Iterable[PrefixKey]) -> set[PrefixKey]:
    """Which of ``keys`` the data dir holds (``kvstore inspect``'s tiers of its top documents, offline).

    Raises:
        StorageError: ``path`` is not a data dir or cannot be opened.
    """
    wanted = list(keys)
    if not wanted:
        return set()
    tier = _open(path)
    try:
        return {key for key in wanted if tier.contains(key)}
    finally:
        tier.close()
