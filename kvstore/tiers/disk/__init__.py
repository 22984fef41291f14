"""The disk tier: chunks in one LMDB environment per data dir, compressed per frame, kept across restarts.

- ``tier``: ``DiskTier``, the ``Tier`` the store holds;
- ``opening``: opening a data dir: the environment, the layout check, index recovery, the codec pool and the writer;
- ``environment``: the LMDB environment of one data dir, its ownership, the layout record and safe map growth;
- ``format``: the sub-databases and the bytes of their keys and values;
- ``layout_copy``: the data dir's layout, read without opening LMDB (before a server opens its store);
- ``data_file_check``: whether ``data.mdb`` is whole enough to map, checked with plain reads;
- ``value_extents``: whether every value in ``data.mdb``'s trees lies inside the file (a walk of the tree pages);
- ``state``: the in-memory LRU index of resident chunks, pins, writes in flight and counters;
- ``entries``: what the index records about a chunk and hands out (entries, writes in flight, read tickets);
- ``records``: the chunk ``meta`` records: recovery at open, single lookups, batched listing;
- ``meta_batch``: many chunk-meta records decoded at once into arrays;
- ``meta_checksum``: the meta checksum of many records at once;
- ``recovered``: the chunks held at open that nobody has used since, kept as arrays;
- ``check``: a full consistency walk of a data dir;
- ``writer``: the one writer thread: group commit of writes, deletes, access times and syncs;
- ``commit``: how a chunk reaches LMDB whole or not at all (intent records and their recovery);
- ``reader``: reading a committed chunk, its frames decoded on the codec pool into a buffer;
- ``victim_reads``: chunks evicted for room, read out just before they are deleted, for a tier below;
- ``staging``: a bounded pool of reusable host buffers for ``put`` (backpressure for a burst of puts);
- ``outage``: a full filesystem: one warning per outage, one line when writes resume;
- ``lifecycle``: the open/closed state and the lock that orders work before close;
- ``tuning``: rarely changed knobs, with the reason behind each default.

The frames themselves (codec, codec pool, host copies) are ``kvstore.tiers.frames``; the data dir's owner lock is
``kvstore.data_dir``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.tiers.disk.tier import DiskTier

__getattr__, __dir__ = lazy_exports(__name__, {"kvstore.tiers.disk.tier": ("DiskTier",)})
__all__ = ["DiskTier"]
