"""One blended prefill, layer by layer: reuse a plan's cached KV, recompute the tokens that need it.

Given a prompt of T tokens and its plan (exact segments, blend segments, gaps), the pass builds the prompt's KV
``[num_layers, 2, T, num_kv_heads, head_dim]`` (the layout dtype, on the model device) and the last token's logits::

    token classes (from the segments the retrieve actually loaded):
      exact  - cached for these tokens after the same preceding tokens: used as is, never computed
      blend  - cached at other positions: K re-rotated by the segment's rope_delta, then blended
      gap    - no cached KV (separators, the question, chunks that failed to load): always computed
    active   = blend U gap U {last token}        computed in layers 0..check_layer
    selected = top recompute_ratio of blend by K (or K+V) deviation at the check layer U gap U {last}
                                                 computed in the layers after it; the others keep their cached KV

    layer:     0 ........ c-1 | c (check) | c+1 ........ L-1
    fresh K/V: active         | active    | selected
    queries:   active         | selected  | selected
    KV:        fresh where computed, cached (rotated) for everything else, attention causal by absolute position
               (with ``stale_key_scale`` < 1 the cached keys kept after the check layer are scaled by it in the
               attention and the decode cache, not in the stored ``kv``)

At the check layer every active token's K/V is projected (the selection compares it with the cached K/V, and it
replaces the cached K/V of that layer), but only the selected tokens go on through attention and the MLP: the other
tokens' hidden states are never read again, so that work would be thrown away.

Special cases fall out of the same loop: ratio 1.0 selects every blend token (the cached blend KV is never read, so
it is not even loaded, and without exact segments the result is a full prefill); ratio 0 selects at "layer -1"
(only gaps and the last token are ever computed: plain reuse); a plan without blend segments is a prefix-cache hit
(the active tokens are computed, the exact ones reused).

Exact segments are never recomputed, not even at ratio 1.0: their KV is what a prefill of the same preceding
tokens produced (or, when a blended prefill stored it, the best KV the store has for that prefix), and a prefix
cache would reuse it the same way.

Loading overlaps compute (``kv_loading``): the retrieve copies the cached KV layer by layer on a worker thread (a
side stream on CUDA) and each layer waits only for its own copies. Layers before the first one that reads cached
KV compute every token and keep their fresh K/V aside (``pending_writes``) until the retrieve has written that
layer of the buffer, then write them over it.

Runs on the caller's thread under ``torch.inference_mode``; not thread-safe (one model).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import xxhash

from kvstore.blend.config import BlendConfig, SelectionPolicy
from kvstore.blend.kv_loading import KVLoader, PendingLoad
from kvstore.blend.layer_stack import LayerStack
from kvstore.blend.llama_layers import Projection
from kvstore.blend.load_cost import LoadCostModel
from kvstore.blend.pass_loads import NO_LOAD, PlanSource, start_load
from kvstore.blend.query_attention import QueryMask
from kvstore.blend.ranks import ONE_RANK, RankAgreement
from kvstore.blend.recurring_context import recurring_context_positions
from kvstore.blend.rope import RopeRotator, Rotation, token_deltas
from kvstore.blend.selection import (
    query_attention_mass,
    select_tokens,
    span_head_positions,
    span_start_order,
    token_deviation,
)
from kvstore.blend.stage_clock import Mark, StageClock
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import TokenArray
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, Segment

__all__ = ["BlendConfig", "BlendPassResult", "BlendPlanSummary", "LayerKV", "clip_segments", "run_blend_pass"]

logger = logging.getLogger(__name__)

_Waited = TypeVar("_Waited")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendPlanSummary:
    """How a prompt's tokens were served.

    Args:
        num_tokens: prompt length.
        num_exact_tokens: reused as cached (same tokens, same preceding tokens).
        num_blend_tokens: cached at other positions, re-rotated and blended.
        num_gap_tokens: no cached KV, computed.
    """

    num_tokens: int
    num_exact_tokens: int
    num_blend_tokens: int
    num_gap_tokens: int

    @property
    def num_cached_tokens(self) -> int:
        return self.num_exact_tokens + self.num_blend_tokens


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's K and V of the whole prompt in the model dtype, ``[1, num_kv_heads, T, head_dim]`` each."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendPassResult:
    """What one blended prefill produced; times in milliseconds on the model device."""

    logits: torch.Tensor
    kv: torch.Tensor
    layers: tuple[LayerKV, ...]
    num_recomputed_tokens: int
    summary: BlendPlanSummary
    lookup_ms: float
    load_ms: float
    load_total_ms: float
    recompute_ms: float
    num_token_layers: int
    disk_wait_bytes: int
    num_skipped_disk_tokens: int
    recomputed_positions: torch.Tensor


class _TokenClasses:
    """Exact / blend / gap membership of every prompt position, from the segments that were (or will be) loaded.

    ``forced`` (computed in every layer) is the gaps, the last token and, with a ratio strictly between 0 and 1,
    the extras the settings ask for: the head tokens of every reused span (``num_head_tokens``) and the tokens
    whose context recurs earlier in the prompt (``recurring_context_tokens``); ``blend_positions`` (what the ratio
    chooses among) are the blend tokens that are not forced extras, so extras come on top of the ratio's share.

    With ``span_end`` below the token count, the tokens past it are the prompt's tail an engine computes itself:
    they take part only in the layers up to the check layer, where the ``query_attention`` policies score with the
    tail's uncached tokens (the question); the tail's cached tokens (the rest of a document the span cut) are keys
    there, as in a whole prompt's pass, but never candidates. The span's last token is forced like the prompt's.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        tokens: TokenArray,
        settings: BlendConfig | None = None,
        span_end: int | None = None,
    ) -> None:
        num_tokens = int(tokens.shape[0])
        self.span_end = num_tokens if span_end is None else span_end
        self.exact = torch.zeros(num_tokens, dtype=torch.bool)
        self.blend = torch.zeros(num_tokens, dtype=torch.bool)
        for segment in segments:
            (self.exact if segment.exact else self.blend)[segment.start : segment.end] = True
        self.deltas = token_deltas(segments, num_tokens)
        extras = torch.zeros(num_tokens, dtype=torch.bool)
        if settings is not None and 0.0 < settings.recompute_ratio < 1.0:
            if settings.num_head_tokens:
                extras[span_head_positions(segments, settings.num_head_tokens, num_tokens)] = True
            if settings.recurring_context_tokens:
                extras[recurring_context_positions(tokens, segments, settings.recurring_context_tokens)] = True
        active = ~self.exact
        active[-1] = True
        active[self.span_end - 1] = True
        forced = (active & ~self.blend) | extras
        forced[-1] = True
        forced[self.span_end - 1] = True
        self.active = active.nonzero().flatten()
        self.forced = forced.nonzero().flatten()
        in_span = torch.arange(num_tokens) < self.span_end
        self.blend_positions = (self.blend & ~extras & in_span).nonzero().flatten()  # the budget's candidates
        self.computed = (active & ~self.blend).nonzero().flatten()  # gaps and the last token: the question
        self.span_starts: torch.Tensor | None = None
        if settings is not None and settings.selection.takes_chunk_starts:
            order = span_start_order(segments, settings.chunk_start_tokens, num_tokens)
            self.span_starts = order[self.blend[order] & ~extras[order] & (order < self.span_end)]

    @property
    def has_exact(self) -> bool:
        return bool(self.exact.any())

    @property
    def has_blend(self) -> bool:
        return bool(self.blend.any())

    def summary(self) -> BlendPlanSummary:
        """How the span's tokens were served (tokens past it, scored with, are vLLM's to compute)."""
        end = self.span_end
        num_exact, num_blend = int(self.exact[:end].sum()), int(self.blend[:end].sum())
        total = end
        return BlendPlanSummary(
            num_tokens=total,
            num_exact_tokens=num_exact,
            num_blend_tokens=num_blend,
            num_gap_tokens=total - num_exact - num_blend,
        )


def _narrow_layer(classes: _TokenClasses, settings: BlendConfig) -> int | None:
    """The layer after which only selected tokens are computed: -1 (from the start), the check layer, or never."""
    if not classes.has_blend or settings.recompute_ratio >= 1.0:
        return None
    return -1 if settings.recompute_ratio == 0.0 else settings.check_layer


def _first_cached_layer(
    classes: _TokenClasses, narrow: int | None, loads: bool, settings: BlendConfig, num_layers: int
) -> int:
    """The first layer that reads cached KV (the layers before it compute every token): 0 with exact segments or at
    ratio 0, the check layer when a retrieve ``loads`` blend KV, ``num_layers`` when nothing cached is read."""
    if classes.has_exact or narrow == -1:
        return 0
    if loads:
        return settings.check_layer
    return num_layers  # nothing cached is read: ratio 1.0 without exact segments


class _Pass:
    """The state of one blended prefill (see the module docstring)."""

    def __init__(
        self,
        stack: LayerStack,
        rotator: RopeRotator,
        layout: KVLayout,
        settings: BlendConfig,
        tokens: TokenArray,
        clock: StageClock,
        *,
        buffer_tokens: int,
        span_end: int | None = None,
        need_logits: bool = True,
        buffer: torch.Tensor | None = None,
        ranks: RankAgreement = ONE_RANK,
    ) -> None:
        self.stack = stack
        self.ranks = ranks
        self.rotator = rotator
        self.layout = layout
        self.settings = settings
        self.tokens = tokens
        self.token_ids = torch.as_tensor(tokens.astype("int64"), device=stack.device)
        self.clock = clock
        self.num_tokens = int(tokens.shape[0])
        self.span_end = self.num_tokens if span_end is None else span_end  # tokens past it: queries for scoring
        self.device = stack.device
        # The retrieve writes the plan's whole extent (it may run past a span); the pass reads its first tokens.
        # Every position of the span is loaded or computed in every layer, so a reused buffer needs no clearing.
        needed = max(buffer_tokens, self.num_tokens)
        if buffer is None:
            buffer = torch.zeros(layout.chunk_shape(needed), dtype=layout.dtype.torch_dtype, device=self.device)
        self.buffer = buffer[:, :, :needed]
        self.kv = self.buffer[:, :, : self.num_tokens]
        self.need_logits = need_logits
        self.same_dtype = layout.dtype.torch_dtype == stack.dtype
        self.layers: list[LayerKV] = []
        self.load_marks: list[tuple[Mark, Mark]] = []
        self.num_token_layers = 0  # a token through one layer's attention and MLP: the cost model's unit

    def run(
        self, classes: _TokenClasses, pending: PendingLoad | None
    ) -> tuple[torch.Tensor, torch.Tensor, BlendPlanSummary]:
        """The last layer's hidden states, the positions computed in it, and how the tokens were served."""
        stack, settings, num_tokens = self.stack, self.settings, self.num_tokens
        narrow = _narrow_layer(classes, settings)
        cache_from = _first_cached_layer(classes, narrow, pending is not None, settings, stack.num_layers)
        rotation: Rotation | None = None
        reuse_from: int | None = None
        pending_writes: list[tuple[int, Projection]] = []
        blend_in_active = torch.empty(0, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        hidden: torch.Tensor | None = None
        stale: torch.Tensor | None = None  # cached tokens whose keys are damped after the check layer
        for layer_idx in range(stack.num_layers):
            if layer_idx == cache_from:
                if pending is not None:
                    loaded = clip_segments(self._agreed(pending.segments), num_tokens)
                    if not self.ranks.all_equal(_segments_digest(loaded)):
                        raise KVStoreError("the ranks of the blend pass loaded different chunks of the prompt")
                    classes = _TokenClasses(loaded, self.tokens, settings, self.span_end)
                    narrow = _narrow_layer(classes, settings)
                for written_idx, written in pending_writes:  # after the retrieve has written that layer
                    if pending is not None:
                        self._agreed(functools.partial(pending.wait_layer, written_idx))
                    self._store_fresh(written_idx, written)
                if narrow is not None:
                    reuse_from = max(narrow, 0)
                    rotation = self.rotator.rotation(classes.deltas.to(self.device), device=self.device)
                if hidden is None:
                    source = classes.forced if narrow == -1 else classes.active
                    positions = source.to(self.device)
                blend_in_active = torch.searchsorted(positions, classes.blend_positions.to(self.device))
            if hidden is None:
                hidden = stack.embed(self.token_ids[positions])
                mask = QueryMask(positions, num_tokens, stack.dtype, settings.attention)
                rotary = stack.rotary(hidden, positions)
            projection = stack.project(layer_idx, hidden, rotary)
            if layer_idx < cache_from:  # every token, fresh K/V only: plain causal attention
                self.num_token_layers += int(positions.numel())
                hidden = stack.attend_and_finish(
                    layer_idx, hidden, projection.query,
                    projection.token_major_key(), projection.token_major_value(), mask,
                )  # fmt: skip
                if pending is None:
                    self._store_fresh(layer_idx, projection)
                else:  # the retrieve will still write this layer of the buffer
                    pending_writes.append((layer_idx, projection))
                span = slice(0, self.span_end)  # every token is computed here: positions are 0..T-1
                self.layers.append(LayerKV(projection.key[:, :, span], projection.value[:, :, span]))
                continue
            if pending is not None:
                self._agreed(functools.partial(pending.wait_layer, layer_idx))
            if rotation is not None and reuse_from is not None and layer_idx >= reuse_from:
                rotation.apply(self.kv[layer_idx, 0], in_place=True)
            keys, values = self._working_kv(layer_idx)
            query = projection.query
            selected: torch.Tensor | None = None
            if layer_idx == narrow:
                selected = self._select(classes, projection, keys, values, blend_in_active, positions)
                selected = selected[selected < self.span_end]  # the tail has done its scoring
                stale = self._stale_rows(classes, selected)
            self._write(layer_idx, keys, values, positions, projection)
            if not self.need_logits and layer_idx == stack.num_layers - 1:
                break  # the last layer's KV is final; its attention and MLP would only feed the logits
            if stale is not None and narrow is not None and layer_idx > narrow:
                keys = self._damped(keys, stale)
            if selected is not None:  # the check layer's K/V are fresh for every active token; from here on
                rows = torch.searchsorted(positions, selected)  # only the selected ones are computed
                hidden, query, positions = hidden[:, rows], query[:, :, rows], selected
                mask = QueryMask(positions, num_tokens, stack.dtype, settings.attention)
                rotary = stack.rotary(hidden, positions)
            self.num_token_layers += int(positions.numel())
            hidden = stack.attend_and_finish(layer_idx, hidden, query, keys, values, mask)
            span_keys, span_values = keys[: self.span_end], values[: self.span_end]
            self.layers.append(LayerKV(span_keys.permute(1, 0, 2)[None], span_values.permute(1, 0, 2)[None]))
        assert hidden is not None, "a model has at least one layer (LlamaStack checks)"
        return hidden, positions, classes.summary()

    def _timed(self, wait: Callable[[], _Waited]) -> _Waited:
        """Run a wait for loaded KV and count the time the compute stream (or the CPU) spent in it as load."""
        before = self.clock.mark()
        waited = wait()
        self.load_marks.append((before, self.clock.mark()))
        return waited

    def _agreed(self, wait: Callable[[], _Waited]) -> _Waited:
        """``_timed(wait)``, failing on every rank when it failed on one (before the layer's sums)."""
        return _on_every_rank(self.ranks, lambda: self._timed(wait), undo=lambda: None)

    def _store_fresh(self, layer_idx: int, fresh: Projection) -> None:
        """A layer computed for every token: its fresh K/V are the layer's KV."""
        self.kv[layer_idx, 0].copy_(fresh.token_major_key())
        self.kv[layer_idx, 1].copy_(fresh.token_major_value())

    def _working_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V ``[T, Hkv, D]`` in the model dtype: views of the output buffer when the dtypes agree."""
        keys, values = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        if self.same_dtype:
            return keys, values
        return keys.to(self.stack.dtype), values.to(self.stack.dtype)

    def _write(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, fresh: Projection
    ) -> None:
        keys.index_copy_(0, positions, fresh.token_major_key())
        values.index_copy_(0, positions, fresh.token_major_value())
        if not self.same_dtype:
            cache_dtype = self.layout.dtype.torch_dtype
            self.kv[layer_idx, 0].index_copy_(0, positions, fresh.token_major_key().to(cache_dtype))
            self.kv[layer_idx, 1].index_copy_(0, positions, fresh.token_major_value().to(cache_dtype))

    def _stale_rows(self, classes: _TokenClasses, selected: torch.Tensor) -> torch.Tensor | None:
        """The blend tokens left out of ``selected`` (they keep their cached KV), when their keys are damped.

        Called at the check layer only, which ratios 0 and 1.0 never narrow at: the option leaves them alone."""
        if self.settings.stale_key_scale == 1.0:
            return None
        stale = classes.blend.to(self.device, copy=True)
        stale[selected] = False
        return stale.nonzero().flatten()

    def _damped(self, keys: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
        """``keys`` with the stale rows scaled: a copy when ``keys`` is a view of the stored ``kv``."""
        damped = keys.clone() if self.same_dtype else keys
        damped[stale] *= self.settings.stale_key_scale
        return damped

    def _select(
        self,
        classes: _TokenClasses,
        fresh: Projection,
        keys: torch.Tensor,
        values: torch.Tensor,
        blend_in_active: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """At the check layer: the positions computed from here on (before ``keys`` get the fresh values).

        ``positions`` are the active tokens ``fresh`` was projected for."""
        blend_positions = classes.blend_positions.to(self.device)
        scorer = self.settings.selection.scorer
        scores: torch.Tensor | None = None
        if scorer is SelectionPolicy.KV_DEVIATION:
            scores = token_deviation(
                self.settings.deviation,
                fresh.token_major_key()[blend_in_active],
                keys[blend_positions],
                fresh.token_major_value()[blend_in_active],
                values[blend_positions],
            )
        elif scorer is SelectionPolicy.QUERY_ATTENTION:
            scores = self._question_attention(classes, fresh, keys, positions)[blend_positions]
        if scores is not None:
            scores = self.ranks.summed(scores)  # each rank scored its own heads
        span_starts = classes.span_starts
        return select_tokens(
            scores=scores,
            cached_positions=blend_positions,
            forced_positions=classes.forced.to(self.device),
            recompute_ratio=self.settings.recompute_ratio,
            first_positions=span_starts.to(self.device) if span_starts is not None else None,
        )

    def _question_attention(
        self, classes: _TokenClasses, fresh: Projection, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``[T]``: the attention the computed tokens (gaps, the question, the last token) pay every position at
        this layer, over the keys a full prefill would have here: fresh for every active token, cached (rotated)
        for the exact ones."""
        scored_keys = keys.clone()
        scored_keys.index_copy_(0, positions, fresh.token_major_key().to(keys.dtype))
        computed = classes.computed.to(self.device)
        rows = torch.searchsorted(positions, computed)
        return query_attention_mass(fresh.query[0][:, rows], computed, scored_keys)


def run_blend_pass(
    *,
    stack: LayerStack,
    rotator: RopeRotator,
    loader: KVLoader,
    owner: PlanSource,
    layout: KVLayout,
    tokens: TokenArray,
    settings: BlendConfig,
    clock: StageClock,
    costs: LoadCostModel,
    span_end: int | None = None,
    need_logits: bool = True,
    make_buffer: Callable[[int], torch.Tensor | None] | None = None,
    repeat_lookup: bool = False,
    ranks: RankAgreement = ONE_RANK,
) -> BlendPassResult:
    """Look the prompt up, load its cached KV on the loader, run every layer; see the module docstring.

    The plan is retrieved or released on every path (an exception included). Chunks only the disk holds are read
    or left to compute as ``settings.disk_policy`` and ``costs`` say (the caller feeds ``costs`` the result).

    Args:
        span_end: compute only the prompt's first ``span_end`` tokens (an engine computes the rest itself, over
            this KV): the whole prompt is looked up, so chunks that run past the span still match, and their
            tokens before ``span_end`` are used. ``None``: the whole prompt. With a ``query_attention`` policy the
            tokens past the span are computed too, up to the check layer only, so the question an engine computes
            after the pass still chooses what the pass recomputes.
        need_logits: ``False`` skips the last layer's attention and MLP and the LM head (the result's ``logits``
            is empty and ``layers`` lacks the last layer): an engine that computes the logits itself needs only
            the KV.
        make_buffer: ``make_buffer(num_tokens)`` gives the KV buffer the retrieve writes and the pass works in
            (layout shape and dtype, on the model device, at least that many tokens; e.g. shared memory the server
            writes directly), or ``None`` for a new one; the caller gets it back as the result's ``kv``.
        repeat_lookup: the engine looked the prompt up already for this request (a scheduler's probe): the pass's
            lookup is not counted again in the store's hit and miss figures.
        layout: the shape of the KV this worker holds (on a tensor-parallel rank: its KV heads, ``KVPart``).
        ranks: the tensor-parallel ranks running this pass together (``kvstore.blend.ranks``); ``owner`` then
            hands every rank the lead's plan. A failure on one rank fails the pass on all of them.

    Raises:
        ConfigError: the store was opened without ``enable_blend`` (from its lookup).
    """
    started = clock.mark()
    plan: LookupPlan = owner.lookup(tokens, blend=True, repeat=repeat_lookup)
    looked_up = clock.mark()
    end = _checked_span_end(owner, plan, len(tokens), span_end)
    computed = tokens if _scores_with_tail(settings) else tokens[:end]
    buffer = _on_every_rank(
        ranks,
        lambda: make_buffer(max(len(computed), plan.end)) if make_buffer is not None else None,
        undo=lambda: owner.release(plan),
    )
    work = _Pass(
        stack, rotator, layout, settings, computed, clock,
        buffer_tokens=plan.end, span_end=end, need_logits=need_logits, buffer=buffer, ranks=ranks,
    )  # fmt: skip
    classes = _TokenClasses(clip_segments(plan.segments, len(computed)), computed, settings, end)
    if classes.has_exact or (classes.has_blend and settings.recompute_ratio < 1.0):
        load = start_load(owner, loader, plan, work.buffer, settings, costs, num_layers=stack.num_layers, ranks=ranks)
    else:
        owner.release(plan)
        load = NO_LOAD
    try:
        layers_start = clock.mark()
        hidden, recomputed, summary = work.run(classes, load.pending)
        layers_end = clock.mark()
        logits = stack.logits(hidden).cpu() if need_logits else torch.empty(0)
    finally:
        load.settle()
    clock.synchronize()
    load_ms = sum(clock.between(before, after) for before, after in work.load_marks)
    return BlendPassResult(
        logits=logits,
        kv=work.kv[:, :, :end],
        layers=tuple(work.layers),
        num_recomputed_tokens=int(recomputed.numel()),
        recomputed_positions=recomputed.cpu(),
        summary=summary,
        lookup_ms=(looked_up.host_s - started.host_s) * 1e3,  # host work only
        load_ms=load_ms,
        load_total_ms=load.total_ms,
        recompute_ms=clock.between(layers_start, layers_end) - load_ms,
        num_token_layers=work.num_token_layers,
        disk_wait_bytes=load.disk_wait_bytes(layout),
        num_skipped_disk_tokens=load.num_skipped_disk_tokens,
    )


def _checked_span_end(owner: PlanSource, plan: LookupPlan, num_tokens: int, span_end: int | None) -> int:
    """The pass's span end (``None``: the whole prompt); releases ``plan`` before refusing one outside the prompt."""
    end = num_tokens if span_end is None else span_end
    if not 0 < end <= num_tokens:
        owner.release(plan)
        raise ConfigError(f"span_end={span_end} is outside the {num_tokens}-token prompt")
    return end


def clip_segments(segments: Sequence[Segment], end: int) -> tuple[Segment, ...]:
    """The segments' parts before token ``end`` (a segment that starts there or later is dropped; one cut short
    becomes a slice of its chunk)."""
    return tuple(
        segment
        if segment.end <= end
        else dataclasses.replace(segment, num_tokens=end - segment.start, chunk_tokens=segment.stored_tokens)
        for segment in segments
        if segment.start < end
    )


def _scores_with_tail(settings: BlendConfig) -> bool:
    """Whether the tokens past the span (the question an engine computes itself) are computed up to the check
    layer too: only a query-aware selection reads them, and only when it selects at all."""
    return settings.selection.scorer is SelectionPolicy.QUERY_ATTENTION and 0.0 < settings.recompute_ratio < 1.0


def _on_every_rank(ranks: RankAgreement, step: Callable[[], _Waited], *, undo: Callable[[], None]) -> _Waited:
    """``step()``, where it succeeded on every rank; else ``undo()`` and raise, on every rank at the same point."""
    try:
        done = step()
    except Exception:
        ranks.all_true(False)
        undo()
        raise
    if not ranks.all_true(True):
        undo()
        raise KVStoreError("another rank of the blend pass failed; the pass stops on every rank")
    return done


def _segments_digest(segments: Sequence[Segment]) -> int:
    """A 62-bit hash of where the loaded KV sits and where it was computed (not which tier it came from)."""
    placed = tuple((segment.start, segment.num_tokens, segment.source_start, segment.exact) for segment in segments)
    return xxhash.xxh64_intdigest(repr(placed).encode()) >> 2
