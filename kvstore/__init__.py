"""kvstore: a tiered KV-cache storage engine for LLM serving.

GPU pages over a CPU LRU over LMDB + zstd on disk, prefix-chained chunk keys, and (in ``kvstore.blend``) content
fingerprints and layerwise blending. Start with ``TieredStore`` and ``KVLayout``; ``Client`` is the same surface
for a running ``kvstore serve``.
"""

from kvstore.client import Client
from kvstore.config import StoreConfig
from kvstore.errors import (
    CapacityError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    ServerBusyError,
    ServerUnavailableError,
    StorageError,
    StoreClosedError,
)
from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
from kvstore.store import TieredStore
from kvstore.version import __version__

__all__ = [
    "CapacityError",
    "Client",
    "ConfigError",
    "InvalidInputError",
    "KVDtype",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "ProtocolError",
    "RopeScaling",
    "RopeSpec",
    "ServerBusyError",
    "ServerUnavailableError",
    "StorageError",
    "StoreClosedError",
    "StoreConfig",
    "TieredStore",
    "__version__",
]
