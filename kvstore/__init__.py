"""kvstore: a tiered KV-cache storage engine for LLM serving.

GPU pages over a CPU LRU over LMDB + zstd on disk, prefix-chained chunk keys, and (in ``kvstore.blend``) content
fingerprints and layerwise blending. Start with ``TieredStore`` and ``KVLayout``.
"""

from kvstore.config import StoreConfig
from kvstore.errors import (
    CapacityError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    StorageError,
    StoreClosedError,
)
from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
from kvstore.store import TieredStore

__all__ = [
    "CapacityError",
    "ConfigError",
    "InvalidInputError",
    "KVDtype",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "ProtocolError",
    "RopeScaling",
    "RopeSpec",
    "StorageError",
    "StoreClosedError",
    "StoreConfig",
    "TieredStore",
]
