"""The pure parts of blending inside vLLM: the span a pass computes, a request's blend settings, the plugin hook.

They live in ``kvstore.connectors.vllm`` (whose package imports vLLM), so they are tested here, in ``.venv-vllm``.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from kvstore.blend.load_cost import DiskPolicy
from kvstore.blend.selection import SelectionPolicy
from kvstore.blend.vllm import hook as blend_hook
from kvstore.blend.vllm.request_choice import blend_choice
from kvstore.blend.vllm.span import blend_span_end
from kvstore.connectors.settings import BLEND_DISK_POLICIES, BLEND_SELECTIONS, parse_connector_settings
from kvstore.keys import PrefixKey
from kvstore.plan import Segment
from kvstore.tiers import TierName


def segment(start: int, num_tokens: int, *, exact: bool) -> Segment:
    return Segment(
        start=start, num_tokens=num_tokens, key=PrefixKey(bytes(16)), source_start=0 if not exact else start,
        exact=exact, tier=TierName.CPU,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("segments", "num_tokens", "exact_end", "expected"),
    [
        pytest.param([segment(0, 64, exact=True), segment(64, 64, exact=False)], 170, 64, 128, id="to-last-cached"),
        pytest.param([segment(10, 100, exact=False)], 200, 0, 96, id="cut-to-a-block"),
        pytest.param([segment(0, 100, exact=False)], 100, 0, 96, id="leaves-the-last-token"),
        pytest.param([segment(0, 64, exact=True), segment(64, 60, exact=True)], 200, 112, None, id="exact-only"),
        pytest.param([segment(0, 64, exact=True), segment(70, 20, exact=False)], 200, 64, 80, id="a-gap-inside"),
        pytest.param([segment(0, 64, exact=True), segment(70, 5, exact=False)], 200, 64, None, id="within-a-block"),
        pytest.param([], 200, 0, None, id="nothing-cached"),
    ],
)
def test_the_blend_span_ends_at_the_last_cached_block_and_only_when_it_reuses_more_than_a_load(
    segments: list[Segment], num_tokens: int, exact_end: int, expected: int | None
) -> None:
    assert blend_span_end(segments, num_tokens=num_tokens, block_size=16, exact_end=exact_end) == expected


def test_a_request_changes_its_blend_within_what_the_deployment_allows() -> None:
    on = parse_connector_settings({"kvstore.blend": True, "kvstore.blend_ratio": 0.2})
    off = parse_connector_settings({})

    assert blend_choice(on, None).enabled and blend_choice(on, None).ratio == 0.2
    assert not blend_choice(on, {"kvstore": {"blend": False}}).enabled
    assert blend_choice(on, {"kvstore": {"blend_ratio": 1}}).ratio == 1.0
    assert blend_choice(on, {"kvstore": {"blend_report_selection": True}}).report_selection
    asked = blend_choice(off, {"kvstore": {"blend": True}})
    assert not asked.enabled and asked.notes == ("blend is off for this deployment (kvstore.blend): not blended",)
    bad = blend_choice(on, {"kvstore": {"blend_ratio": True, "blend": "yes", "other": 1}})
    assert bad.enabled and bad.ratio == 0.2
    assert bad.notes == ("ignored blend_ratio=True: not a valid value", "ignored blend='yes': not a valid value")
    assert blend_choice(on, {"kvstore": 3}).notes == ("ignored kvstore=3: expected an object",)


def test_blend_settings_are_checked_at_start_and_turn_on_the_embedded_servers_index() -> None:
    assert set(BLEND_DISK_POLICIES) == {policy.value for policy in DiskPolicy}
    assert set(BLEND_SELECTIONS) == {policy.value for policy in SelectionPolicy}
    chosen = parse_connector_settings(
        {"kvstore.blend_selection": "query_attention", "kvstore.blend_chunk_start_tokens": 8}
    )
    assert (chosen.blend_selection, chosen.blend_chunk_start_tokens) == ("query_attention", 8)
    assert parse_connector_settings({}).blend_passes_per_step == 1
    assert parse_connector_settings({"kvstore.blend_passes_per_step": 3}).blend_passes_per_step == 3
    assert parse_connector_settings({}).blend_gate is True
    assert parse_connector_settings({"kvstore.blend_gate": False}).blend_gate is False
    data_dir = {"kvstore.data_dir": "kvstore-data/engine"}  # else the engine's layout names it (settle_data_dir)
    settings = parse_connector_settings({"kvstore.blend": True, "kvstore.blend_disk_policy": "recompute"} | data_dir)
    assert "--enable-blend" in settings.embedded.serve_flags()
    assert "--enable-blend" not in parse_connector_settings(data_dir).embedded.serve_flags()
    for bad, message in (
        ({"kvstore.blend_ratio": 1.5}, "kvstore.blend_ratio must be a fraction in [0, 1]"),
        ({"kvstore.blend_check_layer": -1}, "kvstore.blend_check_layer must be a layer index >= 0"),
        ({"kvstore.blend_disk_policy": "never"}, "kvstore.blend_disk_policy must be one of auto, wait, recompute"),
        ({"kvstore.blend_selection": "attention"}, "kvstore.blend_selection must be one of kv_deviation, query_att"),
        ({"kvstore.blend_chunk_start_tokens": 0}, "kvstore.blend_chunk_start_tokens must be a token count >= 1"),
        ({"kvstore.blend_passes_per_step": 0}, "kvstore.blend_passes_per_step must be a number of passes >= 1"),
        ({"kvstore.enable_blend": True}, "unknown kvstore connector setting 'kvstore.enable_blend'"),
    ):
        with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_connector_settings(bad)


def test_the_plugin_is_an_entry_point_that_registers_without_importing_vllm_or_the_blend_pass() -> None:
    """vLLM loads it in every process (torch is loaded there already: ``import kvstore`` needs it too)."""
    (plugin,) = [point for point in entry_points(group="vllm.general_plugins") if point.name == "kvstore_blend"]
    assert plugin.value == "kvstore.blend.vllm.plugin:register"
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "(point,) = [p for p in entry_points(group='vllm.general_plugins') if p.name == 'kvstore_blend']\n"
        "point.load()(); point.load()()\n"
        "from kvstore.blend.vllm.hook import blend_engine_factory\n"
        "assert blend_engine_factory() is not None\n"
        "heavy = ('vllm', 'numba', 'transformers', 'lmdb', 'kvstore.blend.layerwise', 'kvstore.blend.vllm.engine')\n"
        "assert not [name for name in heavy if name in sys.modules], [n for n in heavy if n in sys.modules]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_without_a_registered_engine_the_hook_has_none() -> None:
    saved = blend_hook.blend_engine_factory()
    try:
        blend_hook.register_blend_engine(None)  # type: ignore[arg-type]
        assert blend_hook.blend_engine_factory() is None
    finally:
        blend_hook.register_blend_engine(saved)  # type: ignore[arg-type]


def test_a_blending_worker_without_the_plugin_refuses_to_start_with_one_line() -> None:
    """``VLLM_PLUGINS`` without ``kvstore_blend`` (or a broken install) leaves the hook empty in the worker."""
    from kvstore.connectors.store_link import StoreLink
    from kvstore.connectors.vllm.worker_side import WorkerSide
    from kvstore.errors import ConfigError
    from kvstore.layout import KVLayout

    settings = parse_connector_settings({"kvstore.url": "tcp://127.0.0.1:9", "kvstore.blend": True})
    layout = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    links = tuple(StoreLink(settings, layout, name=name, timeout_s=1.0) for name in ("load", "async", "save", "blend"))
    worker = WorkerSide(None, layout, links[:3], block_size=16, blend_link=links[3], settings=settings)  # type: ignore[arg-type]
    saved = blend_hook.blend_engine_factory()
    blend_hook.register_blend_engine(None)  # type: ignore[arg-type]
    try:
        with pytest.raises(ConfigError, match=r"kvstore\.blend needs kvstore's vLLM plugin .* VLLM_PLUGINS") as refused:
            worker._build_blend_engine(("model.layers.0.self_attn.attn",))
        assert "\n" not in str(refused.value)
    finally:
        blend_hook.register_blend_engine(saved)  # type: ignore[arg-type]
        worker.close()
