"""Dedup-content aliases: prefix keys whose chunk content is stored once, under another key.

With dedup-content on, a popular document stored after 100 different prefixes is written once: the first copy
keeps its payload and its entry in the fingerprint index, and each later prefix key is recorded here as an alias
of it. A prefix lookup that reaches an alias reports a *blend* segment (the copy's KV was computed after other
preceding tokens, at ``source_start``), never an exact hit.

Threads: safe to share; ``_aliases_lock`` guards the map.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.keys import PrefixKey

__all__ = ["AliasTable", "AliasTarget"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AliasTarget:
    """The stored copy an alias stands for.

    Args:
        key: prefix key of the stored copy.
        source_start: position the copy's KV was computed at.
        num_tokens: tokens in the chunk.
    """

    key: PrefixKey
    source_start: int
    num_tokens: int


class AliasTable:
    """Alias key -> the stored copy with the same content."""

    def __init__(self) -> None:
        self._aliases_lock = threading.Lock()
        self._targets: dict[PrefixKey, AliasTarget] = {}

    def add(self, alias: PrefixKey, target: AliasTarget) -> None:
        with self._aliases_lock:
            self._targets[alias] = target

    def get(self, alias: PrefixKey) -> AliasTarget | None:
        with self._aliases_lock:
            return self._targets.get(alias)

    def remove(self, alias: PrefixKey) -> None:
        with self._aliases_lock:
            self._targets.pop(alias, None)

    def __len__(self) -> int:
        with self._aliases_lock:
            return len(self._targets)
