"""The contract between kvstore's vLLM connector and the blend engine, and the registry the plugin fills.

Blending inside vLLM needs the model's layers and kvstore's layerwise pass (``kvstore.blend``), which the connector
does not import: the connector imports this package's light modules (this contract, the gate, the span and the
request's choice) and nothing else of ``kvstore.blend``, and nothing in ``kvstore.blend`` imports the connector
(``tests/test_layering.py``). The connector's half of a pass (writing the span into the engine's paged blocks, the
shared buffers the server retrieves into) reaches the engine through its context as a ``SpanWriter`` and a
``RetrieveBuffers``. The composition root is kvstore's vLLM plugin (``kvstore.blend.vllm.plugin``, the
``vllm.general_plugins`` entry point): vLLM loads it in every engine process and it registers a factory here; the
worker-side connector asks for it when a deployment turns blending on, and refuses to start without one.

No torch or engine imports: the plugin runs in every vLLM process of every user with kvstore installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvstore.client import Client
    from kvstore.kv_part import KVPart
    from kvstore.layout import KVLayout

__all__ = [
    "BlendEngine",
    "BlendEngineContext",
    "BlendEngineFactory",
    "BlendOutcome",
    "RetrieveBuffers",
    "SpanWriter",
    "blend_engine_factory",
    "register_blend_engine",
]


class SpanWriter(Protocol):
    """Writes a computed span's KV into a request's paged blocks (the connector's block format, every layer)."""

    def write(self, kv: torch.Tensor, block_ids: tuple[int, ...], local_end: int, end: int) -> None:
        """Tokens ``[local_end, end)`` of ``kv`` (every layer, from token 0) into ``block_ids``, whole blocks in
        order."""
        ...


class RetrieveBuffers(Protocol):
    """Shared-memory buffers a server on this host retrieves into, kept between passes."""

    def take(self, client: Client, num_tokens: int, *, part: KVPart | None = None) -> torch.Tensor | None:
        """A buffer with room for ``num_tokens``, shaped by ``part`` when given (``None``: the server is not on this
        host)."""
        ...

    def give_back(self, buffer: torch.Tensor | None) -> None:
        """Keep a buffer from ``take`` for the next pass."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendEngineContext:
    """What a blend engine is built from, in the worker, once its KV caches are registered.

    Args:
        engine_config: the engine's own config object (vLLM's ``VllmConfig``).
        layout: the model's KV layout.
        part: this worker's KV heads of every chunk on a tensor-parallel engine (``None``: all of them); its ranks
            run every pass together (``kvstore.blend.vllm.tensor_parallel``).
        span_writer: writes a pass's span into the request's blocks.
        buffers: the buffers the pass's retrieves land in.
        layer_names: the engine's attention layer names, in the same order.
        check_layer: the deployment's check layer (validated against the model when the engine is built).
        selection: the deployment's selection policy (``kvstore.blend_selection``).
        chunk_start_tokens: first tokens of every reused span the ``chunk_start`` policies take.
        disk_policy: the deployment's disk policy (``auto``, ``wait`` or ``recompute``).
    """

    engine_config: Any
    layout: KVLayout
    span_writer: SpanWriter
    buffers: RetrieveBuffers
    layer_names: tuple[str, ...]
    check_layer: int
    disk_policy: str
    part: KVPart | None = None
    selection: str = "kv_deviation"
    chunk_start_tokens: int = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendOutcome:
    """How one blend pass served tokens ``[0, end)`` of a prompt (tokens ``[local_end, end)`` written to blocks).

    Args:
        exact_tokens: reused as cached.
        blend_tokens: cached at other positions, re-rotated and blended.
        gap_tokens: no cached KV (or skipped), computed in every layer.
        recomputed_tokens: tokens computed in the last layer (the selection, the gaps and the span's last token).
        skipped_disk_tokens: cached tokens computed instead of waiting for the disk (the disk policy).
        selected: the recomputed positions, when the request asked for them (``blend_report_selection``).
        blend_ms: the pass's wall time, the blocks' writes included.
        load_wait_ms: of it, the time the pass waited for cached KV to arrive.
        write_ms: of it, the time writing the span's KV into the blocks took.
    """

    exact_tokens: int
    blend_tokens: int
    gap_tokens: int
    recomputed_tokens: int
    skipped_disk_tokens: int
    selected: tuple[int, ...] | None = None
    blend_ms: float = 0.0
    load_wait_ms: float = 0.0
    write_ms: float = 0.0


class BlendEngine(Protocol):
    """Runs blend passes on the engine's model and writes their KV into the engine's blocks."""

    def run(
        self,
        client: Client,
        *,
        token_ids: tuple[int, ...],
        block_ids: tuple[int, ...],
        local_end: int,
        end: int,
        ratio: float,
        report_selection: bool,
    ) -> BlendOutcome:
        """Blend tokens ``[0, end)`` of the prompt ``token_ids`` and write ``[local_end, end)`` into ``block_ids``.

        Raises:
            KVStoreError: the store failed the lookup or the retrieve (the caller's link treats it as an outage).
        """
        ...

    def close(self) -> None: ...


BlendEngineFactory = Callable[[BlendEngineContext], BlendEngine]

_lock = threading.Lock()
_factory: BlendEngineFactory | None = None


def register_blend_engine(factory: BlendEngineFactory) -> None:
    """Make ``factory`` the blend engine of this process (idempotent: the last registration wins)."""
    global _factory
    with _lock:
        _factory = factory


def blend_engine_factory() -> BlendEngineFactory | None:
    """The registered factory, or ``None`` when no plugin registered one in this process."""
    with _lock:
        return _factory
