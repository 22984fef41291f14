"""kvstore: a tiered KV-cache storage engine for LLM serving.

GPU pages over a CPU LRU over LMDB + zstd on disk, prefix-chained chunk keys, content fingerprints
(``kvstore.content``) and layerwise blending (``kvstore.blend``). Start with ``TieredStore`` and ``KVLayout``;
``Client`` is the same surface for a running ``kvstore serve``.

The names below are imported when first used, so ``import kvstore.client`` does not load the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from kvstore.lazy_exports import lazy_exports
from kvstore.version import __version__

if TYPE_CHECKING:
    from kvstore.client import Client
    from kvstore.config import StoreConfig
    from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec
    from kvstore.store import TieredStore
    from kvstore.surface import StoreSurface

# The errors above are light; the layout (torch), the store and the client are imported when first used, so that
# ``kvstore --version`` and every ``import kvstore.<module>`` that needs no torch load none: a CLI call
# that fails on its arguments answers in a fraction of a second, not after seconds of imports.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.client": ("Client",),
        "kvstore.config": ("StoreConfig",),
        "kvstore.layout": ("KVDtype", "KVLayout", "RopeScaling", "RopeSpec"),
        "kvstore.store": ("TieredStore",),
        "kvstore.surface": ("StoreSurface",),
    },
)
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
    "StoreSurface",
    "TieredStore",
    "__version__",
]
