"""``KVStoreConnectorStats``: what vLLM's "KV Transfer metrics" line reports, and when it has something to report."""

from __future__ import annotations

from kvstore.connectors.vllm.metadata import STALL_REPORT_S, KVStoreConnectorStats


def test_a_stall_without_any_transfer_is_reported() -> None:
    """A store that is down: no load or save finishes, yet the engine's thread waited in the connector's hooks."""
    stats = KVStoreConnectorStats()
    assert stats.is_empty()
    stats.record(on_path_seconds=STALL_REPORT_S / 100)  # the hooks' own overhead: nothing to say
    assert stats.is_empty()
    stats.record(on_path_seconds=31.0)
    assert not stats.is_empty() and stats.reduce()["on_path_ms"] > 31_000


def test_transfers_are_reported_and_aggregate() -> None:
    first, second = KVStoreConnectorStats(), KVStoreConnectorStats()
    first.record(loads=1, load_seconds=0.5)
    second.record(saves=2, save_seconds=0.2)
    merged = first.aggregate(second)
    assert not merged.is_empty()
    reduced = merged.reduce()
    assert (reduced["loads"], reduced["saves"], reduced["load_ms_mean"], reduced["save_ms_mean"]) == (1, 2, 500, 100)
