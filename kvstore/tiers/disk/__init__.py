"""The disk tier: chunks in one LMDB environment per data dir, compressed per frame, kept across restarts.

By job:

- the tier: ``tier`` (``DiskTier``), wired up by ``opening``;
- the data dir: ``environment`` (the LMDB environment and its sub-databases), ``owner_lock`` (one writer per data
  dir), ``data_file_check`` (is ``data.mdb`` whole enough to map), ``format`` (what is kept, in which bytes);
- what it holds: ``state`` (in-memory LRU of resident chunks, pins, writes in flight; values in ``entries``),
  ``records``, ``meta_batch``, ``meta_checksum`` and ``recovered`` (the chunk records read at open, a batch at a
  time, into arrays), ``check`` (a full consistency walk);
- moving bytes: ``writer`` (the one writer thread, group commit), ``commit`` (a chunk reaches LMDB whole or not at
  all), ``reader``, ``codec`` and ``codec_pool`` (frames: byte-plane shuffle, zstd, checksum), ``staging`` and
  ``host_copy`` (host buffers for puts), ``outage`` (a full filesystem), ``lifecycle``, ``tuning``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.tiers.disk.tier import DiskTier

__getattr__, __dir__ = lazy_exports(__name__, {"kvstore.tiers.disk.tier": ("DiskTier",)})
__all__ = ["DiskTier"]
