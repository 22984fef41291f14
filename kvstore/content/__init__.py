"""The content index: finds stored chunks by their tokens anywhere in a new prompt (below the store).

- ``rolling_hash``: content fingerprints, a 64-bit polynomial hash of a token window;
- ``fingerprint_table``: the numba kernels over the index's struct-of-arrays table;
- ``chunk_contents``: a chunk's content hashes (fingerprint, verification hash, length), hashed in bulk;
- ``match_scan``: the scan of a query that probes windows only where no planned match covers them;
- ``matches``: the index's answers (``Match``, ``Alias``, ``RegistrationResult``) and how matches combine;
- ``partials``: the stretch of a stored chunk next to a match that a query holds token for token (a document's head
  or tail stored in other surroundings);
- ``index``: ``FingerprintIndex``, stored chunks found by their tokens at any offset;
- ``catalog``: ``ContentCatalog``, the store's content side, over the modules below;
- ``registration``: asynchronous fingerprint registration, off the store path;
- ``strikes``: lazy two-strike eviction of entries whose chunk has left every tier;
- ``aliases``: dedup-content aliases, prefix keys whose content is stored once under another key;
- ``relink``: which stored chunk continues which, from their chunk records;
- ``catalog_rebuild``: the index of a reopened data dir, rebuilt from the disk tier's chunk records.

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
