"""``VllmBlendEngine``: CacheBlend passes on the model a vLLM worker loaded, written into the engine's paged blocks.

Built once per worker, at ``register_kv_caches``, by the factory kvstore's plugin registers
(``kvstore.blend.vllm.hook``): it finds the loaded model (``model_lookup``), wraps its layers
(``VllmLlamaStack``), runs the RoPE gate on vLLM's own rotary embedding and refuses, with one line, anything the
pass cannot run exactly. Each ``run`` is one request's blended span ``[0, end)``: the layerwise pass
(``run_blend_pass``, the same code as the standalone ``LayerwiseBlender``) looks the whole prompt up by content,
loads its cached KV while it computes, re-rotates, selects at the check layer and recomputes; then every layer's
tokens ``[local_end, end)`` go into the request's blocks through the connector's ``SpanWriter`` (the engine knows
no block format). Tokens below ``local_end`` are vLLM's own prefix-cache blocks, possibly shared with other requests:
read by nobody here and never written. The pass attends over the store's KV for them (the same tokens after the same
prefix; a gap is computed).

The load-or-recompute choice learns from this engine's own passes (``LoadCostModel``): the compute rate from every
pass, the disk rate from every pass that waited for the disk, so ``disk_policy="auto"`` never waits for a disk that
is slower than recomputing.

On a tensor-parallel engine every rank runs each pass on its own KV heads, together: the lead rank's plan, the
same tokens loaded, the selection made from scores summed over the group (``tensor_parallel``), so every rank
recomputes the same tokens and the answer is the one-rank blend's. Pipeline stages are refused (``model_lookup``).

Runs on vLLM's model-runner thread (under ``torch.inference_mode``); the retrieve runs on the loader's thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kvstore.blend.kv_loading import KVLoader
from kvstore.blend.layerwise import BlendConfig, BlendPassResult, run_blend_pass
from kvstore.blend.load_cost import DiskPolicy, LoadCostModel
from kvstore.blend.pass_loads import PlanSource
from kvstore.blend.ranks import ONE_RANK
from kvstore.blend.rope import RopeRotator
from kvstore.blend.selection import SelectionPolicy
from kvstore.blend.stage_clock import StageClock
from kvstore.blend.vllm.hook import BlendEngineContext, BlendOutcome
from kvstore.blend.vllm.llama_stack import VllmLlamaStack
from kvstore.blend.vllm.model_lookup import find_loaded_model
from kvstore.blend.vllm.rope_gate import require_vllm_rope_gate
from kvstore.blend.vllm.tensor_parallel import LeadRankPlans, TensorParallelRanks
from kvstore.errors import ConfigError
from kvstore.keys import as_token_array

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvstore.client import Client

__all__ = ["VllmBlendEngine"]

logger = logging.getLogger(__name__)


class VllmBlendEngine:
    """Blend passes on a vLLM worker's model (see the module docstring).

    Raises:
        ConfigError: the model or the engine is one the pass cannot run, the check layer is beyond the model, or
            the RoPE gate failed.
    """

    def __init__(self, context: BlendEngineContext) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        vllm_config = context.engine_config
        registered = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
        attention = {name: registered[name] for name in context.layer_names}
        self._stack = VllmLlamaStack(find_loaded_model(vllm_config, attention))
        num_layers = self._stack.num_layers
        if context.check_layer >= num_layers:
            raise ConfigError(
                f"kvstore.blend_check_layer={context.check_layer} is beyond the model's {num_layers} layers; use a "
                f"layer in [0, {num_layers - 1}] (default 1)"
            )
        self.rope_gate = require_vllm_rope_gate(self._stack, context.layout, vllm_config.model_config.hf_config)
        self._part = context.part
        self._layout = context.layout if context.part is None else context.part.shape_layout(context.layout)
        self._ranks: TensorParallelRanks | None = None
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.distributed import get_tp_group

            self._ranks = TensorParallelRanks(get_tp_group())
        self._span_writer = context.span_writer
        self._check_layer = context.check_layer
        self._disk_policy = context.disk_policy
        self._selection = SelectionPolicy(context.selection)
        self._chunk_start_tokens = context.chunk_start_tokens
        device = self._stack.device
        self._rotator = RopeRotator(self._layout.rope, self._layout.head_dim)
        self._loader = KVLoader(device)
        self._buffers = context.buffers  # shared memory the server retrieves into, kept between passes (cpu engines)
        self._clock = StageClock(device)
        self._costs = LoadCostModel(self._layout)

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
        started = time.perf_counter()
        settings = BlendConfig(
            recompute_ratio=ratio,
            check_layer=self._check_layer,
            selection=self._selection,
            chunk_start_tokens=self._chunk_start_tokens,
            disk_policy=DiskPolicy(self._disk_policy),
        )
        on_cpu = self._stack.device.type == "cpu"
        taken: list[torch.Tensor] = []

        def make_buffer(num_tokens: int) -> torch.Tensor | None:
            buffer = self._buffers.take(client, num_tokens, part=self._part) if on_cpu else None
            taken.extend([buffer] if buffer is not None else [])
            return buffer

        with client.session() as session, torch.inference_mode():
            plans: PlanSource = session if self._ranks is None else LeadRankPlans(client, self._ranks, self._part)
            try:
                result = self._pass(plans, token_ids, end, settings, make_buffer)
                written = time.perf_counter()
                self._span_writer.write(result.kv, block_ids, local_end, end)
                write_ms = (time.perf_counter() - written) * 1e3
            finally:
                for buffer in taken:
                    self._buffers.give_back(buffer)
        self._costs.observe_disk_wait(result.disk_wait_bytes, result.load_ms)
        self._costs.observe_compute(result.num_token_layers, result.recompute_ms)
        summary = result.summary
        selected = tuple(int(position) for position in result.recomputed_positions) if report_selection else None
        return BlendOutcome(
            exact_tokens=summary.num_exact_tokens,
            blend_tokens=summary.num_blend_tokens,
            gap_tokens=summary.num_gap_tokens,
            recomputed_tokens=result.num_recomputed_tokens,
            skipped_disk_tokens=result.num_skipped_disk_tokens,
            selected=selected,
            blend_ms=(time.perf_counter() - started) * 1e3,
            load_wait_ms=result.load_ms,
            write_ms=write_ms,
        )

    def _pass(
        self,
        plans: PlanSource,
        token_ids: tuple[int, ...],
        end: int,
        settings: BlendConfig,
        make_buffer: Callable[[int], torch.Tensor | None],
    ) -> BlendPassResult:
        return run_blend_pass(
            stack=self._stack,
            rotator=self._rotator,
            loader=self._loader,
            owner=plans,
            layout=self._layout,
            tokens=as_token_array(token_ids),
            settings=settings,
            clock=self._clock,
            costs=self._costs,
            span_end=end,
            need_logits=False,
            make_buffer=make_buffer,
            repeat_lookup=True,  # the scheduler's probe counted the request
            ranks=self._ranks or ONE_RANK,
        )

    def close(self) -> None:
        """Join the loader thread. Idempotent."""
        self._loader.close()
