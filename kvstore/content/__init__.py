"""The content index: finds stored chunks by their tokens anywhere in a new prompt (below the store).

- ``rolling_hash``, ``fingerprint_table``, ``match_scan``, ``index``: content fingerprints, their numba table and the
  scan that plans matches over a query (``FingerprintIndex``);
- ``catalog``: the store's content side (``ContentCatalog``): the index, asynchronous ``registration``, lazy
  two-strike eviction (``strikes``), dedup-content ``aliases``;
- ``relink``, ``catalog_rebuild``: the index of a reopened data dir, rebuilt from the disk tier's chunk records.

The engine side of blending (RoPE re-rotation, selective recompute) is ``kvstore.blend``, above the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.content.catalog import ContentCatalog
    from kvstore.content.index import Alias, FingerprintIndex, Match, RegistrationResult

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.content.catalog": ("ContentCatalog",),
        "kvstore.content.index": ("Alias", "FingerprintIndex", "Match", "RegistrationResult"),
    },
)
__all__ = ["Alias", "ContentCatalog", "FingerprintIndex", "Match", "RegistrationResult"]
