"""``LayerwiseBlender``: prefill a prompt with a Llama-family model, reusing the store's cached KV (CacheBlend).

Three modes share one output type, so callers (and ``kvstore bench multi-doc-qa``) compare them directly:

- ``full``: the model's own forward over every token (the baseline; nothing is looked up);
- ``prefix``: the exact cached prefix (``lookup(blend=False)``), then the model's own forward over the rest with that
  prefix as its cache (what a prefix cache such as vLLM's does);
- ``blend``: the layerwise CacheBlend pass (``kvstore.blend.layerwise``): exact and blend segments, re-rotated K,
  check-layer selection, selective recompute.

Every mode returns the last token's float32 logits (on the CPU), a transformers ``DynamicCache`` to continue decoding
with (``model.generate(..., cache=output.cache)`` or a forward with ``cache=``), the prompt's KV in the layout dtype
(what ``store.store`` takes) and stage timings. With ``store_result`` the prompt's KV is stored afterwards, so the
same prompt (or one that starts with it) is an exact prefix hit next time, even when it was blended now.

Construction checks the model once: a Llama-family structure (``LlamaStack``), a layout equal to the one its config
implies, and the per-model RoPE gate (``require_rope_gate``), so a model whose cached K cannot be re-rotated exactly
is refused before any KV is reused.

Timings (milliseconds): ``total_ms`` runs from the call until the logits are on the host (on CUDA, synchronised);
``lookup_ms`` is the store's lookup; ``load_ms`` the time compute waited for cached KV (``load_total_ms``: how long
the retrieve took, overlapped or not); ``recompute_ms`` the model's layers; ``other_ms`` the rest (embedding, LM
head, plan bookkeeping). Building the returned cache and the stored KV comes after ``total_ms``; storing is
``store_ms``, outside it too.

Threads: one prefill at a time (the model is not thread-safe); the blender owns one loader thread, joined in
``close``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from kvstore.blend.kv_loading import KVLoader
from kvstore.blend.layerwise import BlendConfig, BlendPlanSummary, run_blend_pass
from kvstore.blend.llama_layers import LlamaStack
from kvstore.blend.load_cost import LoadCostModel
from kvstore.blend.rope import RopeRotator
from kvstore.blend.rope_gate import RopeGateReport, require_rope_gate
from kvstore.blend.stage_clock import StageClock
from kvstore.errors import ConfigError, InvalidInputError, LayoutMismatchError
from kvstore.keys import TokenArray, as_token_array
from kvstore.models.cache_argument import cache_argument
from kvstore.models.hf_config import layout_from_hf_config
from kvstore.session import Session

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import DynamicCache

    from kvstore.surface import StoreSurface

__all__ = ["BlendOutput", "LayerwiseBlender", "PrefillMode", "PrefillTimings"]

logger = logging.getLogger(__name__)


class PrefillMode(enum.StrEnum):
    """How ``LayerwiseBlender.prefill`` computes the prompt's KV."""

    FULL = "full"
    PREFIX = "prefix"
    BLEND = "blend"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillTimings:
    """Where a prefill's time went, in milliseconds (see the module docstring for each stage)."""

    lookup_ms: float
    load_ms: float
    load_total_ms: float
    recompute_ms: float
    other_ms: float
    total_ms: float
    store_ms: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendOutput:
    """The result of one prefill.

    Args:
        mode: how it was computed.
        logits: float32 ``[vocab]`` logits of the last prompt token, on the CPU.
        cache: the prompt's KV as a transformers ``DynamicCache`` in the model dtype, to continue decoding.
        kv: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in the layout dtype on the model device.
        num_recomputed_tokens: tokens computed in the last layer (all of them for ``full``, the uncached suffix for
            ``prefix``, the selection for ``blend``).
        plan: how the prompt's tokens were served.
        timings: stage timings.
        num_skipped_disk_tokens: cached tokens a blend computed instead of waiting for the disk
            (``BlendConfig.disk_policy``); they count as gaps in ``plan``.
        recomputed_positions: for ``blend``, the prompt positions computed in the last layer (the selection, the
            gaps and the last token), ascending; ``None`` for the other modes.
    """

    mode: PrefillMode
    logits: torch.Tensor
    cache: DynamicCache
    kv: torch.Tensor
    num_recomputed_tokens: int
    plan: BlendPlanSummary
    timings: PrefillTimings
    num_skipped_disk_tokens: int = 0
    recomputed_positions: torch.Tensor | None = None


class LayerwiseBlender:
    """Prefills prompts with ``model``, reusing KV cached in ``store``.

    Example::

        loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ))
        with TieredStore(loaded.layout, StoreConfig(enable_blend=True, data_dir=path)) as store:
            with LayerwiseBlender(loaded.model, store) as blender:
                for document in documents:
                    blender.prefill(document, mode="full")               # stores each document's KV
                output = blender.prefill(prompt_with_those_documents)    # blend: reuses them at new positions
                next_token = int(output.logits.argmax())

    Args:
        model: a Llama-family transformers causal LM in eval mode (llama, mistral, qwen2), loaded in its dtype
            (``from_pretrained(dtype=...)``, not ``.to(dtype)`` afterwards: the RoPE gate refuses that).
        store: the store to look up and keep KV in (a ``TieredStore`` or a ``Client``); its layout must be the
            model's.
        config: recompute ratio, check layer and deviation metric for ``blend`` prefills.

    Raises:
        ConfigError: an fp8 or MLA layout, not a Llama-family model, a check layer beyond the model's layers, or the
            RoPE gate failed.
        LayoutMismatchError: the store's layout is not the model's.
    """

    def __init__(self, model: torch.nn.Module, store: StoreSurface, config: BlendConfig | None = None) -> None:
        layout = store.layout
        if layout is None:
            raise ConfigError("the blender needs a store with a layout; an admin Client (layout=None) has none")
        if layout.dtype.is_quantized or layout.mla is not None:  # its pass computes float K/V of plain heads
            raise ConfigError(
                f"the blender does not blend {layout.describe()} (fp8 KV or MLA latents) yet; use the store for exact "
                "prefix reuse"
            )
        self._stack = LlamaStack(model)
        self.model = model
        self.store = store
        self.layout = layout
        self.config = config or BlendConfig()
        self._check_config(self.config)
        expected = layout_from_hf_config(getattr(model, "config", None), model_id=layout.model_id, dtype=layout.dtype)
        if expected != layout:
            differences = [
                f"{name}={getattr(layout, name)!r} (model: {getattr(expected, name)!r})"
                for name in ("num_layers", "num_kv_heads", "head_dim", "rope")
                if getattr(layout, name) != getattr(expected, name)
            ]
            raise LayoutMismatchError(
                f"store layout {layout.model_id} does not fit the model: {'; '.join(differences)}; open the store "
                "with kvstore.models.layout_from_hf_config(model.config)"
            )
        self.rope_gate: RopeGateReport = require_rope_gate(model, layout)
        self._rotator = RopeRotator(layout.rope, layout.head_dim)
        self._loader = KVLoader(self._stack.device)
        self._clock = StageClock(self._stack.device)
        self.load_costs = LoadCostModel(layout)  # learnt from every prefill it runs (``disk_policy="auto"``)

    def _check_config(self, config: BlendConfig) -> None:
        if config.check_layer >= self._stack.num_layers:
            raise ConfigError(
                f"check_layer={config.check_layer} is beyond the model's {self._stack.num_layers} layers; use a "
                f"layer in [0, {self._stack.num_layers - 1}] (default 1)"
            )

    def prefill(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        mode: PrefillMode | str = PrefillMode.BLEND,
        store_result: bool = True,
        session: Session | None = None,
        config: BlendConfig | None = None,
    ) -> BlendOutput:
        """Compute the prompt's KV and last-token logits; see the module docstring for the modes.

        Args:
            tokens: the prompt's token ids.
            mode: ``full``, ``prefix`` or ``blend``.
            store_result: store the prompt's KV afterwards (``timings.store_ms``).
            session: the store session the lookup belongs to; default a session of this call alone. Either way the
                plan is retrieved or released before this returns, on every path.
            config: overrides the blender's ``BlendConfig`` for this call.

        Raises:
            ConfigError: an unknown mode, an empty prompt, a bad config, or ``blend`` on a store without
                ``enable_blend``.
        """
        try:
            prefill_mode = PrefillMode(mode)
        except ValueError:
            raise ConfigError(f"mode={mode!r} is not one of full, prefix, blend") from None
        settings = config or self.config
        self._check_config(settings)
        token_array = as_token_array(tokens)
        if len(token_array) == 0:
            raise InvalidInputError("the prompt is empty; give at least one token id")
        owner = session if session is not None else self.store.session()
        try:
            with torch.inference_mode():
                if prefill_mode is PrefillMode.FULL:
                    output = self._full(token_array)
                elif prefill_mode is PrefillMode.PREFIX:
                    output = self._prefix(token_array, owner)
                else:
                    output = self._blend(token_array, owner, settings)
        finally:
            if session is None:
                owner.close()
        if not store_result:
            return output
        started = time.perf_counter()
        self.store.store(token_array, output.kv)
        store_ms = (time.perf_counter() - started) * 1e3
        return dataclasses.replace(output, timings=dataclasses.replace(output.timings, store_ms=store_ms))

    # -- modes --------------------------------------------------------------------------------------------------

    def _full(self, tokens: TokenArray) -> BlendOutput:
        clock = self._clock
        token_ids = self._token_ids(tokens)
        started = clock.mark()
        outputs = self.model(input_ids=token_ids[None], use_cache=True, logits_to_keep=1)
        finished = clock.mark()
        logits = outputs.logits[0, -1].float().cpu()
        clock.synchronize()
        total_ms = (time.perf_counter() - started.host_s) * 1e3
        recompute_ms = clock.between(started, finished)
        self.load_costs.observe_compute(len(tokens) * self._stack.num_layers, recompute_ms)
        cache = _cache_of(outputs)
        summary = BlendPlanSummary(
            num_tokens=len(tokens), num_exact_tokens=0, num_blend_tokens=0, num_gap_tokens=len(tokens)
        )
        return BlendOutput(
            mode=PrefillMode.FULL,
            logits=logits,
            cache=cache,
            kv=self._kv_of(cache),
            num_recomputed_tokens=len(tokens),
            plan=summary,
            timings=_timings(total_ms=total_ms, recompute_ms=recompute_ms),
        )

    def _prefix(self, tokens: TokenArray, owner: Session) -> BlendOutput:
        from transformers import DynamicCache

        clock = self._clock
        token_ids = self._token_ids(tokens)
        started = clock.mark()
        plan = owner.lookup(tokens, blend=False)
        looked_up = clock.mark()
        num_prefix = min(plan.num_prefix_tokens, len(tokens) - 1)
        cache = DynamicCache(config=getattr(self.model, "config", None))
        if num_prefix > 0:
            kv = torch.empty(self.layout.chunk_shape(plan.end), dtype=self.layout.dtype.torch_dtype,
                             device=self._stack.device)  # fmt: skip
            num_prefix = min(num_prefix, owner.retrieve(plan, kv).num_prefix_tokens)  # a corrupt chunk cuts it
            prefix = kv[:, :, :num_prefix]
            cache = DynamicCache(
                [(layer[0].to(self._stack.dtype).permute(1, 0, 2)[None], layer[1].to(self._stack.dtype)
                  .permute(1, 0, 2)[None]) for layer in prefix],
                config=getattr(self.model, "config", None),
            )  # fmt: skip
        else:
            owner.release(plan)
        loaded = clock.mark()
        outputs = self.model(
            input_ids=token_ids[None, num_prefix:],
            position_ids=torch.arange(num_prefix, len(tokens), device=self._stack.device)[None],
            **cache_argument(self.model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        finished = clock.mark()
        logits = outputs.logits[0, -1].float().cpu()
        clock.synchronize()
        total_ms = (time.perf_counter() - started.host_s) * 1e3
        result_cache = _cache_of(outputs)
        summary = BlendPlanSummary(
            num_tokens=len(tokens),
            num_exact_tokens=num_prefix,
            num_blend_tokens=0,
            num_gap_tokens=len(tokens) - num_prefix,
        )
        load_ms = clock.between(looked_up, loaded)
        recompute_ms = clock.between(loaded, finished)
        self.load_costs.observe_compute((len(tokens) - num_prefix) * self._stack.num_layers, recompute_ms)
        return BlendOutput(
            mode=PrefillMode.PREFIX,
            logits=logits,
            cache=result_cache,
            kv=self._kv_of(result_cache),
            num_recomputed_tokens=len(tokens) - num_prefix,
            plan=summary,
            timings=_timings(
                total_ms=total_ms,
                lookup_ms=(looked_up.host_s - started.host_s) * 1e3,
                load_ms=load_ms,
                load_total_ms=load_ms,
                recompute_ms=recompute_ms,
            ),
        )

    def _blend(self, tokens: TokenArray, owner: Session, settings: BlendConfig) -> BlendOutput:
        from transformers import DynamicCache

        started_s = time.perf_counter()
        result = run_blend_pass(
            stack=self._stack,
            rotator=self._rotator,
            loader=self._loader,
            owner=owner,
            layout=self.layout,
            tokens=tokens,
            settings=settings,
            clock=self._clock,
            costs=self.load_costs,
        )
        total_ms = (time.perf_counter() - started_s) * 1e3
        self.load_costs.observe_disk_wait(result.disk_wait_bytes, result.load_ms)
        self.load_costs.observe_compute(result.num_token_layers, result.recompute_ms)
        cache = DynamicCache(
            [(layer.keys, layer.values) for layer in result.layers], config=getattr(self.model, "config", None)
        )
        return BlendOutput(
            mode=PrefillMode.BLEND,
            logits=result.logits,
            cache=cache,
            kv=result.kv,
            num_recomputed_tokens=result.num_recomputed_tokens,
            plan=result.summary,
            num_skipped_disk_tokens=result.num_skipped_disk_tokens,
            recomputed_positions=result.recomputed_positions,
            timings=_timings(
                total_ms=total_ms,
                lookup_ms=result.lookup_ms,
                load_ms=result.load_ms,
                load_total_ms=result.load_total_ms,
                recompute_ms=result.recompute_ms,
            ),
        )

    # -- helpers ------------------------------------------------------------------------------------------------

    def _token_ids(self, tokens: TokenArray) -> torch.Tensor:
        return torch.as_tensor(tokens.astype(np.int64), device=self._stack.device)

    def _kv_of(self, cache: Any) -> torch.Tensor:
        """The layout-shaped KV ``[L, 2, T, Hkv, D]`` of a transformers cache (whose layers are ``[1, Hkv, T, D]``)."""
        dtype = self.layout.dtype.torch_dtype
        return torch.stack(
            [torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]) for layer in cache.layers]
        ).to(dtype)

    def close(self) -> None:
        """Join the loader thread. Idempotent; the model and the store stay open (the caller owns them)."""
        self._loader.close()

    def __enter__(self) -> LayerwiseBlender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _cache_of(outputs: Any) -> DynamicCache:
    # transformers 5.24 renamed the output's ``past_key_values`` to ``cache``; the old name still works but warns.
    cache: DynamicCache = outputs["cache"] if "cache" in outputs else outputs.get("past_key_values")
    return cache


def _timings(
    *,
    total_ms: float,
    recompute_ms: float,
    lookup_ms: float = 0.0,
    load_ms: float = 0.0,
    load_total_ms: float = 0.0,
) -> PrefillTimings:
    return PrefillTimings(
        lookup_ms=lookup_ms,
        load_ms=load_ms,
        load_total_ms=load_total_ms,
        recompute_ms=recompute_ms,
        other_ms=max(0.0, total_ms - lookup_ms - load_ms - recompute_ms),
        total_ms=total_ms,
    )
