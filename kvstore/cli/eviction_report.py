"""What ``kvstore evict`` reports, the same keys offline (``--data-dir``) and through a server (``--url``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import typer

from kvstore.cli.quantities import count_text, size_text
from kvstore.tiers.base import TierStats

__all__ = ["echo_eviction", "eviction_report"]


def eviction_report(
    *,
    data_dir: Path | None,
    url: str | None,
    before: Sequence[TierStats],
    after: Sequence[TierStats],
    not_found: list[str],
    still_cached: list[str] | None = None,
) -> dict[str, object]:
    """What ``kvstore evict`` did, the same keys offline (``--data-dir``) and through a server (``--url``): chunk copies
    dropped and stored bytes freed per tier (from the tiers' counters before and after), chunks left per tier, keys
    not found, and keys still cached because a lookup pins them (a server only)."""
    after_by_tier = {stats.tier: stats for stats in after}
    freed = {b.tier.value: max(0, b.stored_bytes - after_by_tier[b.tier].stored_bytes) for b in before}
    dropped = sum(max(0, b.num_chunks - after_by_tier[b.tier].num_chunks) for b in before)
    return {
        "data_dir": None if data_dir is None else str(data_dir),
        "url": url,
        "evicted_chunks": dropped,
        "freed_bytes": freed,
        "remaining_chunks": {stats.tier.value: stats.num_chunks for stats in after},
        "not_found": not_found,
        "still_cached": still_cached or [],
    }


def echo_eviction(report: dict[str, object], as_json: bool) -> None:
    """Print an ``eviction_report``: as one JSON object, or one line."""
    if as_json:
        typer.echo(json.dumps(report))
        return
    freed = report["freed_bytes"]
    remaining = report["remaining_chunks"]
    assert isinstance(freed, dict) and isinstance(remaining, dict), "eviction_report builds dicts"
    not_found, still_cached = report["not_found"], report["still_cached"]
    typer.echo(
        f"evicted {count_text(report['evicted_chunks'], 'chunk copy', 'chunk copies')}, freed "  # type: ignore[arg-type]
        + ", ".join(f"{size_text(num_bytes)} of {tier}" for tier, num_bytes in freed.items())
        + "; left: "
        + ", ".join(f"{count_text(count, 'chunk')} in {tier}" for tier, count in remaining.items())
        + (f"; not found: {', '.join(not_found)}" if not_found else "")  # type: ignore[arg-type]
        + (f"; still cached (pinned): {', '.join(still_cached)}" if still_cached else "")  # type: ignore[arg-type]
    )
