"""The names of the storage tiers, fastest first, without the tier interface's imports.

Why a module of its own: ``kvstore.config`` (``parse_tiers``, ``StoreConfig``) and the CLI's argument checks name
tiers, and ``kvstore.tiers.base`` imports torch and numpy for the ``Tier`` contract; a command that only refuses a
bad ``--tiers`` must not pay for them. ``kvstore.tiers.base`` re-exports ``TierName``.
"""

from __future__ import annotations

import enum

__all__ = ["TierName"]


class TierName(enum.StrEnum):
    """Tiers from fastest to slowest."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"
