"""``TieredStore`` and ``Client`` both satisfy ``StoreSurface``.

mypy checks ``surfaces_of`` (``make lint``); the first test compares every protocol method's parameters with both
classes' at run time (a renamed or reordered argument fails it), the second runs the same code through each.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from kvstore import Client, StoreConfig, StoreSurface, TieredStore
from kvstore.surface import StoreSurface as SurfaceProtocol
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, running_server


def surfaces_of(store: TieredStore, client: Client) -> tuple[StoreSurface, StoreSurface]:
    """Typed as ``StoreSurface``: mypy fails here if either class drifts from the protocol."""
    return store, client


def _protocol_methods() -> list[str]:
    return [
        name
        for name, member in vars(SurfaceProtocol).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    ]


@pytest.mark.parametrize("implementation", [TieredStore, Client])
def test_every_surface_method_takes_the_protocols_parameters(implementation: type) -> None:
    assert len(_protocol_methods()) >= 12
    for name in _protocol_methods():
        member = vars(SurfaceProtocol)[name]
        if isinstance(member, property):
            continue  # ``layout``: an attribute of both, checked by the round trip below
        wanted = inspect.signature(member).parameters
        offered = inspect.signature(getattr(implementation, name)).parameters
        for parameter in wanted.values():
            assert parameter.name in offered, f"{implementation.__name__}.{name} lacks {parameter.name}"
            got = offered[parameter.name]
            assert got.kind == parameter.kind, f"{implementation.__name__}.{name}({parameter.name}) kind"
            assert got.default == parameter.default, f"{implementation.__name__}.{name}({parameter.name}) default"
        extra = [p for p in offered.values() if p.name not in wanted and p.default is inspect.Parameter.empty]
        assert extra == [], f"{implementation.__name__}.{name} requires more than the protocol: {extra}"


def _round_trip(surface: StoreSurface, tokens: list[int], kv: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Store, look up, retrieve and release through the protocol alone."""
    surface.store(tokens, kv)
    surface.flush()
    with surface.session() as session:
        plan = session.lookup(tokens)
        retrieved = session.retrieve(plan).kv
    assert retrieved is not None
    return plan.num_prefix_tokens, retrieved.clone()


def test_a_store_and_a_client_answer_alike_through_the_surface(tmp_path: Path) -> None:
    tokens = [int(t) for t in make_tokens(3 * CHUNK_SIZE, seed=41)]
    kv = make_kv(SERVER_LAYOUT, len(tokens), seed=42)
    config = StoreConfig(tiers=(TierName.CPU,), cpu_capacity_bytes=1 << 24, chunk_size=CHUNK_SIZE)
    with (
        running_server(tmp_path / "data", "--tiers", "cpu") as server,
        TieredStore(SERVER_LAYOUT, config) as store,
        Client(server.url, SERVER_LAYOUT) as client,
    ):
        answers = [_round_trip(surface, tokens, kv) for surface in surfaces_of(store, client)]
        for surface in surfaces_of(store, client):
            assert surface.stats().tiers[0].num_chunks >= 3
            assert surface.layout == SERVER_LAYOUT
    assert [covered for covered, _ in answers] == [len(tokens), len(tokens)]
    assert torch.equal(answers[0][1], kv) and torch.equal(answers[1][1], kv)
