"""Settings of a ``TieredStore``: which tiers, how big, where the data dir is.

Sizes are bytes here; the CLI parses ``8GiB``-style strings once, at its edge (``parse_size``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from kvstore.chunking import Chunking, ContentCutShape, parse_chunking
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.remote_address import DEFAULT_NAMESPACE, check_namespace, parse_remote_url
from kvstore.tiers.names import TierName

__all__ = [
    "DEFAULT_DATA_DIR",
    "REMOTE_WRITE_POLICIES",
    "StoreConfig",
    "check_byte_count",
    "check_chunk_separator",
    "parse_chunk_separator",
    "parse_size",
    "parse_tiers",
    "tier_name",
]

GIB = 1024**3
MAX_INDEXED_CHUNK_TOKENS = 2**16 - 1  # the content index keeps chunk lengths in 16 bits
DEFAULT_DATA_DIR = Path("kvstore-data")
REMOTE_WRITE_POLICIES = ("through", "evict")
_TIER_ORDER = (TierName.GPU, TierName.CPU, TierName.DISK, TierName.REMOTE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
    "e": 1000**6,
    "eb": 1000**6,
    "eib": 1024**6,
}


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512MB"``, ``"1.5g"`` or a plain integer.

    Raises:
        ConfigError: the text is not a non-negative size.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"size {text!r} is not a size; write e.g. 8GiB, 512MiB, 2GB or a byte count")
    num_bytes = Fraction(match.group(1)) * _SIZE_UNITS[unit]  # exact: 1.5GiB is whole, 0.25 bytes is not
    if num_bytes.denominator != 1:
        raise ConfigError(f"size {text!r} is {float(num_bytes):g} bytes, not a whole number of bytes")
    return int(num_bytes)


def parse_tiers(text: str) -> tuple[TierName, ...]:
    """``"gpu,cpu,disk"`` -> tiers, checked for names, duplicates and fastest-first order."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    try:
        tiers = tuple(TierName(name) for name in names)
    except ValueError:
        raise ConfigError(
            f"--tiers {text!r}: each tier must be one of gpu, cpu, disk, remote (e.g. gpu,cpu,disk)"
        ) from None
    _check_tiers(tiers)
    return tiers


def check_byte_count(num_bytes: object) -> None:
    """Raise ``InvalidInputError`` unless ``num_bytes`` is a non-negative whole number (a bool is not one)."""
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise InvalidInputError(f"num_bytes={num_bytes!r} must be a non-negative whole number of bytes")


def tier_name(value: TierName | str) -> TierName:
    """One tier by name (``"cpu"`` or ``TierName.CPU``).

    Raises:
        ConfigError: not one of gpu, cpu, disk, remote.
    """
    try:
        return TierName(value)
    except ValueError:
        raise ConfigError(f"tier {value!r} is not one of gpu, cpu, disk, remote") from None


def _check_tiers(tiers: tuple[TierName, ...]) -> None:
    if not tiers:
        raise ConfigError("no tiers given; name at least one of gpu, cpu, disk (e.g. --tiers cpu,disk)")
    if tiers == (TierName.REMOTE,):
        raise ConfigError("the remote tier needs a local tier above it; add one (e.g. --tiers cpu,disk,remote)")
    if len(set(tiers)) != len(tiers):
        raise ConfigError(f"tiers {[t.value for t in tiers]} name a tier twice; list each once")
    positions = [_TIER_ORDER.index(tier) for tier in tiers]
    if positions != sorted(positions):
        raise ConfigError(
            f"tiers {','.join(t.value for t in tiers)} are out of order; list them fastest first (gpu,cpu,disk,remote)"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How a ``TieredStore`` is built.

    Args:
        tiers: storage levels, fastest first; any non-empty ordered subset of gpu, cpu, disk, remote (remote needs a
            local tier above it and ``remote_url``).
        chunk_size: tokens per chunk (prefix keys depend on it; a data dir keeps the one it was created with).
        chunk_separator: token ids after which a chunk restarts (``kvstore.keys.chunk_bounds``), e.g. a RAG
            template's document delimiter: a document is then cached in chunks of its own and found wherever it sits
            in a later prompt. Empty: chunks every ``chunk_size`` tokens from position 0. Changing it keeps stored
            chunks valid (a key names its cut), but prompts cut another way miss them.
        chunking: the cut rule (``kvstore.chunking``): ``fixed``, every ``chunk_size`` tokens; ``content``, where a
            hash of the last few token ids says, so a document is cut the same way wherever it sits in a prompt
            (``chunk_size`` is then the longest chunk, at least 16). A data dir records it and refuses another.
        gpu_capacity_bytes: device memory for the gpu tier.
        gpu_device: CUDA device of the gpu tier (``"cpu"`` runs the gpu-tier logic without a GPU, for tests).
        cpu_capacity_bytes: host memory for the cpu tier (page-locked when CUDA is present).
        cpu_shared_memory: keep the cpu tier in a memory file that clients on the same host map read-only, so a
            server lends them its chunks (``TieredStore.lend``) instead of copying; only where the tier is not
            page-locked (no CUDA). ``kvstore serve`` sets it.
        data_dir: the data dir holding ``data.mdb``.
        disk_capacity_bytes: hard cap on the disk tier's stored (compressed) bytes.
        disk_zstd_level: zstd level of the disk codec (1 is the measured sweet spot).
        disk_codec_threads: threads that compress and decompress disk frames.
        promote_on_hit: move hits up a tier: disk hits are prefetched into the cpu tier at lookup, cpu hits are
            copied into the gpu tier after retrieve.
        enable_blend: keep a content fingerprint index so a lookup also finds cached chunks at any offset of the
            prompt (blend segments; the engine must re-rotate and blend them).
        enable_segmented_prefix: a chunk missing or failing in the middle of a prefix hit becomes a gap; the exact
            chunks after it are kept (without it the prefix is cut at the gap).
        enable_dedup_content: a chunk whose content is already stored under another prefix is recorded as an alias
            of that copy instead of a second payload (needs ``enable_blend``).
        remote_url: the Valkey/Redis of the remote tier (``kvstore.remote_address``), single node or cluster.
        remote_password: replaces the URL's password (keeps it off command lines).
        remote_namespace: prefix of every key this deployment writes; deployments sharing a Valkey differ here.
        remote_timeout_ms: bound on every round trip to the remote; past it the request goes on without it.
        remote_max_queued_bytes: chunks waiting to be written to the remote before new ones are not sent.
        remote_write: ``"through"``: every new chunk is written to the remote too (other hosts find it at once);
            ``"evict"``: a chunk goes to the remote only when it leaves the last local tier (the disk's capacity
            victims, as the disk stored them; the cpu tier's without a disk), sparing Valkey's memory for what no
            host keeps locally.
    """

    tiers: tuple[TierName, ...] = (TierName.CPU, TierName.DISK)
    chunk_size: int = 256
    chunk_separator: tuple[int, ...] = ()
    chunking: Chunking = Chunking.FIXED
    gpu_capacity_bytes: int = 4 * GIB
    gpu_device: str = "cuda"
    cpu_capacity_bytes: int = 4 * GIB
    cpu_shared_memory: bool = False
    data_dir: Path = field(default=DEFAULT_DATA_DIR)
    disk_capacity_bytes: int = 64 * GIB
    disk_zstd_level: int = 1
    disk_codec_threads: int = 2
    promote_on_hit: bool = True
    enable_blend: bool = False
    enable_segmented_prefix: bool = False
    enable_dedup_content: bool = False
    remote_url: str | None = None
    remote_password: str | None = field(default=None, repr=False)
    remote_namespace: str = DEFAULT_NAMESPACE
    remote_timeout_ms: int = 250
    remote_max_queued_bytes: int = 512 * 2**20
    remote_write: str = "through"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "tiers", tuple(TierName(t) for t in self.tiers))
        except (ValueError, TypeError):
            raise ConfigError(
                f"tiers={self.tiers!r}: each tier must be one of gpu, cpu, disk (e.g. ('cpu', 'disk'))"
            ) from None
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        _check_tiers(self.tiers)
        for name in ("chunk_size", "gpu_capacity_bytes", "cpu_capacity_bytes", "disk_capacity_bytes",
                     "disk_zstd_level", "disk_codec_threads"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be a whole number")
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size={self.chunk_size} must be a positive number of tokens, e.g. 256")
        object.__setattr__(self, "chunk_separator", check_chunk_separator(self.chunk_separator))
        object.__setattr__(self, "chunking", parse_chunking(self.chunking))
        if self.chunking is Chunking.CONTENT:
            ContentCutShape.for_chunk_size(self.chunk_size)
        for name in ("gpu_capacity_bytes", "cpu_capacity_bytes", "disk_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} cannot be negative")
        if self.enable_blend and self.chunk_size > MAX_INDEXED_CHUNK_TOKENS:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is too long for the content index (at most "
                f"{MAX_INDEXED_CHUNK_TOKENS} tokens); use 256 or turn enable_blend off"
            )
        if self.enable_dedup_content and not self.enable_blend:
            raise ConfigError(
                "enable_dedup_content needs enable_blend: deduplicated chunks are found through the content index"
            )
        self._check_remote()
        if self.disk_codec_threads < 1:
            raise ConfigError(f"disk_codec_threads={self.disk_codec_threads} must be at least 1")

    def _check_remote(self) -> None:
        has_tier = TierName.REMOTE in self.tiers
        if has_tier and not self.remote_url:
            raise ConfigError("the remote tier needs remote_url (--remote-url valkey://HOST:PORT)")
        if self.remote_url and not has_tier:
            raise ConfigError(f"remote_url is set but the tiers {_names(self.tiers)} have no remote; add it last")
        if self.remote_url is not None:
            parse_remote_url(self.remote_url)
        check_namespace(self.remote_namespace)
        if self.remote_write not in REMOTE_WRITE_POLICIES:
            raise ConfigError(f"remote_write={self.remote_write!r} must be one of {', '.join(REMOTE_WRITE_POLICIES)}")
        for name in ("remote_timeout_ms", "remote_max_queued_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive whole number")


MAX_SEPARATOR_TOKENS = 64


def check_chunk_separator(separator: object) -> tuple[int, ...]:
    """``separator`` as a tuple of token ids, checked: 0 to ``MAX_SEPARATOR_TOKENS`` ids in [0, 2**32).

    Raises:
        ConfigError: anything else, in one line.
    """
    if isinstance(separator, str | bytes) or not isinstance(separator, tuple | list):
        raise ConfigError(
            f"chunk_separator={separator!r} must be a sequence of token ids, e.g. (198, 198) (a string separator "
            "is tokenized by the engine's connector, kvstore.chunk_separator)"
        )
    if len(separator) > MAX_SEPARATOR_TOKENS:
        raise ConfigError(f"chunk_separator has {len(separator)} tokens; at most {MAX_SEPARATOR_TOKENS}")
    for token in separator:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**32:
            raise ConfigError(f"chunk_separator={list(separator)}: {token!r} is not a token id in [0, 2**32)")
    return tuple(separator)


def parse_chunk_separator(text: str) -> tuple[int, ...]:
    """``"198,198"`` -> ``(198, 198)``: ``--chunk-separator``'s token ids (empty text: none)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return check_chunk_separator([int(part) for part in parts])
    except ValueError:
        raise ConfigError(
            f"--chunk-separator {text!r} must be comma-separated token ids, e.g. 198,198 (tokenize the separator "
            "string with the model's tokenizer)"
        ) from None


def _names(tiers: tuple[TierName, ...]) -> str:
    return ",".join(tier.value for tier in tiers)
