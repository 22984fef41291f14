"""``kvstore bench vllm --serve``: the multi-document QA benchmark end to end, through vLLM's OpenAI server and the
``openai`` client, as LMCache's users run it.

Three deployments, each its own server process, started and stopped here one after another on the same prompts::

    deployment        server
    vllm              vLLM alone: no connector, vLLM's prefix cache on (vLLM's default)
    vllm_cold         vLLM alone, ``--no-enable-prefix-caching``: every prompt a cold prefill (only when named)
    kvstore_prefix    + kvstore's connector, exact prefix reuse only (vLLM's prefix cache on)
    kvstore_blend     + kvstore's connector with ``kvstore.blend: true``, ``--no-enable-prefix-caching``

and three rounds per deployment (``vllm_serve_workload``): ``warm_up`` (each document alone), ``query`` (k
documents in random order), ``mixed`` (exact repeats, never-seen documents and new queries shuffled together; its
requests generate ``mixed_max_tokens`` tokens, so the inter-token latency shows the decode stall a blend pass
causes). One row per deployment and round: TTFT mean/p50/p90/max, total time, requests/s, prompt tokens/s,
inter-token latency p50/p99, failed requests, tokens reused and recomputed, and output checks against ``vllm``; and
vLLM's own mean timings of the round's requests (``engine_*_ms_mean``: its TTFT, its wait to be scheduled, scheduled to
first token), which place a difference in TTFT inside the engine's step or outside it (HTTP, the API server).

Tokens reused and recomputed come from the server, per round: vLLM's ``prompt_tokens_by_source`` counters (its own
prefix-cache hits and the tokens the connector supplied) and the connector's stats lines in the server's log (how
many of the tokens a blend supplied the pass recomputed); see ``vllm_serve_server``. ``tokens_reused`` = vLLM's
prefix-cache hits + the connector's tokens - the blend pass's recomputed tokens; ``tokens_recomputed`` = the round's
prompt tokens - ``tokens_reused``.

Output checks (greedy, ``ignore_eos``): ``output_mismatches`` counts requests whose KV is exact by construction and
whose tokens differ from ``vllm``'s on the same prompt: every request of ``kvstore_prefix``, and the ``mixed``
round's exact repeats in ``kvstore_blend`` whose warm-up prompt the store held whole. ``output_agreement`` is the
share of all the row's requests equal to ``vllm``'s (for blended queries, a quality signal, not a correctness one).

With a connector setting ``kvstore.chunk_separator`` in the installed kvstore, the kvstore
deployments pass the separator string in it, so the store cuts chunks where documents start; without it, or with
``connector_separator`` off, they run without (the row says which).

With ``interleaved`` each kvstore deployment runs beside a ``vllm`` server of its own, both up at once, and every
request goes to both, one after the other (which first alternates), with a pause between sends; the pair runs twice,
its servers started in both orders (the one started first ran slower here, whichever it was): machine drift then
cancels in each pair, and a row's ``ttft_paired_ratio`` (this deployment's TTFT over vLLM's, geometric mean of the
pairs, with a bootstrap 95% interval resampling each start order's pairs within themselves: ``paired_ratio``)
resolves a few percent, e.g. what a miss costs. The vLLM server beside ``kvstore_blend`` runs without its prefix
cache too, so that the pair differs by the connector alone (its block hashing is part of what vLLM alone's misses
cost otherwise).

With ``chat`` the prompts are text through ``/v1/chat/completions`` (``vllm_serve_workload.ChatForm``): a system
message, then the documents joined by blank lines and the question in one user message, as a RAG client sends them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.paired_ratio import paired_ratio
from kvstore.bench.vllm_engine import EngineSpec, wait_until_stored
from kvstore.bench.vllm_serve_client import RequestOutcome, RoundResult, send_round
from kvstore.bench.vllm_serve_options import DEPLOYMENTS, VLLM_ALONE, ServeBenchOptions
from kvstore.bench.vllm_serve_server import OpenAIServer, ServerSpec, engine_timings, prompt_token_sources
from kvstore.bench.vllm_serve_workload import (
    ChatForm,
    ChatMessage,
    ServePrompt,
    ServeWorkload,
    serve_workload,
)
from kvstore.bench.vllm_ttft import CONNECTOR_CONFIG, CPU_ENGINE_ENV
from kvstore.connectors.settings import parse_connector_settings
from kvstore.errors import ConfigError

__all__ = [
    "DEPLOYMENTS",
    "ROUNDS",
    "ServeBenchOptions",
    "ServeRow",
    "chunk_separator_setting",
    "run_serve_benchmark",
    "ttft_gain_failure",
]

logger = logging.getLogger(__name__)

ROUNDS = ("warm_up", "query", "mixed")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeRow:
    """One deployment's round (see the module docstring for the token and output figures)."""

    deployment: str
    round: str
    requests: int
    failed: int
    max_inflight: int
    max_tokens: int
    prompt_tokens_mean: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_max: float
    total_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    vllm_cache_hit_tokens: int
    connector_tokens: int
    blends: int
    blend_recomputed_tokens: int
    tokens_reused: int
    tokens_recomputed: int
    outputs_compared: int
    output_mismatches: int
    output_agreement: float | None
    ttft_vs_vllm: float | None = None
    ttft_vs_cold: float | None = None
    engine_ttft_ms_mean: float | None = None
    engine_queue_ms_mean: float | None = None
    engine_prefill_ms_mean: float | None = None
    ttft_ratio_max_vs_vllm: float | None = None
    ttft_gain: float | None = None
    warm_up_stored: int | None = None
    chunk_separator: bool = False
    chunking: str | None = None
    chat: bool = False
    paired_with: str | None = None
    ttft_paired_ratio: float | None = None
    ttft_paired_low: float | None = None
    ttft_paired_high: float | None = None
    server_stop_s: float | None = None
    errors: tuple[str, ...] = ()

    def to_json_dict(self) -> dict[str, object]:
        values = dataclasses.asdict(self)
        for name, value in values.items():
            if isinstance(value, float):
                values[name] = round(value, 3)
        values["errors"] = list(self.errors)
        return values


@dataclass(frozen=True, slots=True, kw_only=True)
class _Measured:
    """One round as measured, before the rows compare deployments."""

    result: RoundResult
    sources: Mapping[str, float]
    """The change of the server's counters over the round: prompt tokens by source, vLLM's timings' sums and counts."""
    blends: int
    blend_recomputed_tokens: int
    strata: tuple[int, ...] = ()
    """Each request's run, where runs were pooled (``_pooled``); empty: one run."""


def chunk_separator_setting(separator: str) -> dict[str, object]:
    """``{"kvstore.chunk_separator": separator}`` when the installed connector accepts that setting, else
    ``{}``: asked of the connector's own settings parser, so a kvstore without it still runs."""
    try:
        parse_connector_settings({"kvstore.chunk_separator": separator})
    except ConfigError:
        return {}
    return {"kvstore.chunk_separator": separator}


def run_serve_benchmark(options: ServeBenchOptions, progress: Callable[[str], None] = lambda _: None) -> list[ServeRow]:
    """Run every deployment's rounds; one row per deployment and round, in ``DEPLOYMENTS`` x ``ROUNDS`` order."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
    workload = serve_workload(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        corpus=options.corpus,
        num_documents=options.num_documents,
        document_tokens=options.document_tokens,
        docs_per_query=options.docs_per_query,
        num_queries=options.num_queries,
        num_mixed=options.num_mixed,
        separator=options.joiner,
        system_prompt=options.system_prompt,
        question=options.question,
        seed=options.seed,
        chat=_chat_form(tokenizer) if options.chat else None,
    )
    separator = chunk_separator_setting(options.joiner) if options.connector_separator else {}
    rows: list[ServeRow] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-serve-") as scratch:
        work_dir = options.work_dir or Path(scratch)
        if options.interleaved:
            return _interleaved_rows(options, workload, separator, work_dir, progress)
        reference: dict[str, RoundResult] = {}
        for deployment in options.deployments:
            measured, stored, stop_s = _run_deployment(options, deployment, workload, separator, work_dir, progress)
            if deployment == "vllm":
                reference = {name: m.result for name, m in measured.items()}
            rows += _rows(options, deployment, workload, measured, reference, rows, stored, stop_s, bool(separator))
    return rows


def _chat_form(tokenizer: Any) -> ChatForm:
    """Chat prompts through the model's own chat template, as vLLM's OpenAI server applies it."""

    def template(messages: Sequence[ChatMessage]) -> Sequence[int]:
        turns = [{"role": role, "content": content} for role, content in messages]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    return ChatForm(decode=lambda tokens: str(tokenizer.decode(list(tokens))), template=template)


def _interleaved_rows(
    options: ServeBenchOptions,
    workload: ServeWorkload,
    separator: Mapping[str, object],
    work_dir: Path,
    progress: Callable[[str], None],
) -> list[ServeRow]:
    """Each kvstore deployment beside a vLLM server of its own, every request sent to both: the pair's rows.

    The pair runs twice on fresh servers, started in both orders, and its rows pool both runs (each round's prompts
    twice): on the dev VM the server started first of a pair answered 13-15% slower, whichever deployment it was
    (docs/benchmarks.md), an order effect that a single run would charge to one side.
    """
    rows: list[ServeRow] = []
    for deployment in (name for name in options.deployments if name not in VLLM_ALONE):
        names = ("vllm", deployment)
        runs = [
            _run_pair(options, workload, separator, work_dir / f"beside-{deployment}-{order}", started, progress)
            for order, started in enumerate((names, names[::-1]))
        ]
        measured = {name: _pooled([run.measured[name] for run in runs]) for name in names}
        stored = set.intersection(*(run.stored for run in runs))
        twice = dataclasses.replace(
            workload, **{name: getattr(workload, name) * len(runs) for name in ("warm_up", "queries", "mixed")}
        )
        stops = {name: max((run.stop_s[name] or 0.0 for run in runs), default=0.0) for name in names}
        reference = {name: round_.result for name, round_ in measured["vllm"].items()}
        pair = _rows(options, "vllm", twice, measured["vllm"], {}, [], set(), stops["vllm"], False)
        pair += _rows(options, deployment, twice, measured[deployment], reference, pair, stored, stops[deployment],
                      bool(separator))  # fmt: skip
        rows += [
            dataclasses.replace(row, paired_with=deployment if row.deployment == "vllm" else "vllm") for row in pair
        ]
    return rows


@dataclass(frozen=True, slots=True)
class _PairRun:
    """One run of an interleaved pair: each server's rounds, the warm-up prompts stored, each server's exit time."""

    measured: Mapping[str, Mapping[str, _Measured]]
    stored: set[int]
    stop_s: Mapping[str, float | None]


def _run_pair(
    options: ServeBenchOptions,
    workload: ServeWorkload,
    separator: Mapping[str, object],
    work_dir: Path,
    started: Sequence[str],
    progress: Callable[[str], None],
) -> _PairRun:
    """Start the two deployments' servers in ``started``'s order, send every round to both, interleaved; stop them.
    vLLM alone runs as its neighbour does with its own prefix cache: the pair differs by the connector only."""
    deployment = next(name for name in started if name != "vllm")
    prefix_caching = _prefix_caching(deployment)
    specs = {name: _server_spec(options, name, separator, work_dir, prefix_caching=prefix_caching) for name in started}
    progress(f"{' and '.join(started)}: starting both servers, in that order")
    measured: dict[str, dict[str, _Measured]] = {name: {} for name in started}
    stored: set[int] = set()
    with OpenAIServer(specs[started[0]][0]) as first, OpenAIServer(specs[started[1]][0]) as second:
        servers = {started[0]: first, started[1]: second}
        for name, prompts in _rounds(workload).items():
            progress(f"{' and '.join(started)}: {name} round ({len(prompts)} requests to each, interleaved)")
            for served, round_ in _measure_interleaved(servers, options, prompts, name).items():
                measured[served][name] = round_
            transfer = specs[deployment][1]
            if name == "warm_up" and transfer is not None:
                stored = _wait_stored(options, transfer, workload.warm_up)
    return _PairRun(measured=measured, stored=stored, stop_s={name: servers[name].stop_seconds for name in started})


def _pooled(runs: Sequence[Mapping[str, _Measured]]) -> dict[str, _Measured]:
    """Each round's requests of every run, in run order, as one round."""
    return {
        name: _Measured(
            result=RoundResult(
                outcomes=tuple(outcome for run in runs for outcome in run[name].result.outcomes),
                total_s=sum(run[name].result.total_s for run in runs),
            ),
            sources={
                source: sum(run[name].sources.get(source, 0.0) for run in runs)
                for source in {source for run in runs for source in run[name].sources}
            },
            blends=sum(run[name].blends for run in runs),
            blend_recomputed_tokens=sum(run[name].blend_recomputed_tokens for run in runs),
            strata=tuple(index for index, run in enumerate(runs) for _ in run[name].result.outcomes),
        )
        for name in runs[0]
    }


def _rounds(workload: ServeWorkload) -> dict[str, Sequence[ServePrompt]]:
    rounds = {"warm_up": workload.warm_up, "query": workload.queries, "mixed": workload.mixed}
    return {name: prompts for name, prompts in rounds.items() if prompts}


def _measure_interleaved(
    servers: Mapping[str, OpenAIServer], options: ServeBenchOptions, prompts: Sequence[ServePrompt], name: str
) -> dict[str, _Measured]:
    """Send each prompt to every server, one at a time, the first server alternating, ``pause_s`` between sends."""
    before = {served: _metric_totals(server) for served, server in servers.items()}
    offsets = {served: server.log_offset() for served, server in servers.items()}
    outcomes: dict[str, list[RequestOutcome]] = {served: [] for served in servers}
    order = list(servers)
    for index, prompt in enumerate(prompts):
        for served in order if index % 2 == 0 else order[::-1]:
            time.sleep(options.pause_s)  # the server that just answered polls its queues for a while
            sent = send_round(
                servers[served].base_url, str(options.model_dir), [prompt.messages or prompt.tokens],
                max_tokens=options.mixed_max_tokens if name == "mixed" else options.max_tokens, max_inflight=1,
            )  # fmt: skip
            outcomes[served].append(dataclasses.replace(sent.outcomes[0], index=index))
    measured = {}
    for served, server in servers.items():
        counters = server.connector_counters(offsets[served])
        after = _metric_totals(server)
        sources = {source: after.get(source, 0.0) - before[served].get(source, 0.0) for source in after}
        total_s = sum(outcome.latency_s or 0.0 for outcome in outcomes[served]) or 1e-9
        measured[served] = _Measured(
            result=RoundResult(outcomes=tuple(outcomes[served]), total_s=total_s), sources=sources,
            blends=counters.blends, blend_recomputed_tokens=counters.blend_recomputed_tokens,
        )  # fmt: skip
    return measured


def _prefix_caching(deployment: str) -> bool:
    """Whether a deployment runs with vLLM's own prefix cache: all but ``vllm_cold`` and ``kvstore_blend``, whose
    blended prompts vLLM's block hashes would otherwise claim first."""
    return deployment not in ("vllm_cold", "kvstore_blend")


def _server_spec(
    options: ServeBenchOptions,
    deployment: str,
    separator: Mapping[str, object],
    work_dir: Path,
    *,
    prefix_caching: bool | None = None,
) -> tuple[ServerSpec, dict[str, Any] | None]:
    """The deployment's server, and its connector's config (``None``: vLLM alone). ``prefix_caching``: vLLM's own
    prefix cache (default: as the deployment runs it)."""
    extra: dict[str, object] = {}
    if deployment not in VLLM_ALONE:
        extra = {"kvstore.data_dir": str(work_dir / f"{deployment}-data"), "kvstore.tiers": "cpu",
                 "kvstore.cpu_size": "2GiB", **separator}  # fmt: skip
        if options.chunk_size is not None:
            extra["kvstore.chunk_size"] = options.chunk_size
        if options.chunking is not None:
            extra["kvstore.chunking"] = options.chunking
        if deployment == "kvstore_blend":
            extra |= {"kvstore.blend": True, "kvstore.blend_ratio": options.ratio}
    transfer = None if deployment in VLLM_ALONE else {**CONNECTOR_CONFIG, "kv_connector_extra_config": extra}
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(
        model_dir=options.model_dir,
        log_path=work_dir / f"{deployment}-server.log",
        kv_transfer_config=transfer,
        enable_prefix_caching=_prefix_caching(deployment) if prefix_caching is None else prefix_caching,
        dtype=options.dtype,
        env={**CPU_ENGINE_ENV, **(options.env or {})},
    )
    return spec, transfer


def _run_deployment(
    options: ServeBenchOptions,
    deployment: str,
    workload: ServeWorkload,
    separator: Mapping[str, object],
    work_dir: Path,
    progress: Callable[[str], None],
) -> tuple[dict[str, _Measured], set[int], float | None]:
    """Start the deployment's server, send its rounds, stop it; what each round measured, the warm-up prompts the
    store held whole after the warm-up round, and how long the server took to exit."""
    spec, transfer = _server_spec(options, deployment, separator, work_dir)
    progress(f"{deployment}: starting vLLM's OpenAI server")
    measured: dict[str, _Measured] = {}
    stored: set[int] = set()
    with OpenAIServer(spec) as server:
        for name, prompts in _rounds(workload).items():
            progress(f"{deployment}: {name} round ({len(prompts)} requests, {options.max_inflight} in flight)")
            measured[name] = _measure_round(server, options, prompts, name)
            if name == "warm_up" and transfer is not None:
                stored = _wait_stored(options, transfer, workload.warm_up)
    logger.info("%s: server exited %s after SIGINT", deployment, server.stop_seconds)
    return measured, stored, server.stop_seconds


def _measure_round(
    server: OpenAIServer, options: ServeBenchOptions, prompts: Sequence[ServePrompt], name: str
) -> _Measured:
    before = _metric_totals(server)
    offset = server.log_offset()
    result = send_round(
        server.base_url,
        str(options.model_dir),
        [prompt.messages or prompt.tokens for prompt in prompts],
        max_tokens=options.mixed_max_tokens if name == "mixed" else options.max_tokens,
        max_inflight=options.max_inflight,
    )
    counters = server.connector_counters(offset)
    after = _metric_totals(server)
    sources = {source: after.get(source, 0.0) - before.get(source, 0.0) for source in after}
    return _Measured(
        result=result, sources=sources, blends=counters.blends, blend_recomputed_tokens=counters.blend_recomputed_tokens
    )


def _metric_totals(server: OpenAIServer) -> dict[str, float]:
    """What a round reads the change of on the server: prompt tokens by source, and vLLM's own request timings."""
    text = server.metrics_text()
    return {**prompt_token_sources(text), **engine_timings(text)}


def _engine_mean_ms(counters: Mapping[str, float], name: str) -> float | None:
    """The mean of one of vLLM's request timings over a round, in ms (``None``: the server reported none)."""
    count = counters.get(f"{name}_count", 0.0)
    return 1000.0 * counters.get(f"{name}_sum", 0.0) / count if count else None


def _wait_stored(options: ServeBenchOptions, transfer: Mapping[str, Any], warm_up: Sequence[ServePrompt]) -> set[int]:
    """The warm-up prompts the store holds whole, waiting (up to ``stored_wait_s`` in all) for the asynchronous
    saves to land. A prompt the connector blended is never stored, so one may be missing for good."""
    probe = EngineSpec(model_dir=options.model_dir, prompts=[[0]], max_tokens=1, kv_transfer_config=transfer)
    deadline = time.monotonic() + options.stored_wait_s
    stored = set()
    for prompt in warm_up:
        if wait_until_stored(probe, prompt.tokens, max(0.1, deadline - time.monotonic())):
            stored.add(prompt.documents[0])
    return stored


def _percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile (no interpolation: a p99 of 30 samples is their maximum, not a blend of two)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _rows(
    options: ServeBenchOptions,
    deployment: str,
    workload: ServeWorkload,
    measured: Mapping[str, _Measured],
    reference: Mapping[str, RoundResult],
    earlier: Sequence[ServeRow],
    stored: set[int],
    stop_s: float | None,
    separator: bool,
) -> list[ServeRow]:
    prompts = {"warm_up": workload.warm_up, "query": workload.queries, "mixed": workload.mixed}
    rows: list[ServeRow] = []
    for name, round_ in measured.items():
        outcomes = round_.result.outcomes
        good = [outcome for outcome in outcomes if outcome.error is None]
        ttft = [1000 * (outcome.ttft_s or 0.0) for outcome in good] or [0.0]
        itl = [1000 * gap for outcome in good for gap in outcome.itl_s]
        prompt_tokens = sum(outcome.prompt_tokens for outcome in outcomes)
        hit = int(round_.sources.get("local_cache_hit", 0.0))
        external = int(round_.sources.get("external_kv_transfer", 0.0))
        reused = hit + external - round_.blend_recomputed_tokens
        base_round = reference.get(name)
        compared = mismatched = agreed = 0
        ratios: list[float] = []
        pairs: list[tuple[float, float, int]] = []  # (vLLM's TTFT, this deployment's, the run) of the same prompt
        strata = round_.strata or (0,) * len(outcomes)
        if base_round is not None and deployment != "vllm":
            compared_rounds = zip(prompts[name], outcomes, base_round.outcomes, strata, strict=True)
            for prompt, outcome, base, stratum in compared_rounds:
                if outcome.error is not None or base.error is not None:
                    continue
                same = outcome.token_ids == base.token_ids
                agreed += same
                exact = deployment == "kvstore_prefix" or (prompt.kind == "hit" and prompt.documents[0] in stored)
                if exact:
                    compared += 1
                    mismatched += not same
                if base.ttft_s:
                    ratios.append((outcome.ttft_s or 0.0) / base.ttft_s)
                    pairs += [(base.ttft_s, outcome.ttft_s, stratum)] if outcome.ttft_s else []
        vllm_row = next((row for row in earlier if row.deployment == "vllm" and row.round == name), None)
        cold_row = next((row for row in earlier if row.deployment == "vllm_cold" and row.round == name), None)
        mean = statistics.fmean(ttft) or 1e-9  # a round of failed requests: no division by zero
        warm_up_row = rows[0] if rows and rows[0].round == "warm_up" else None
        paired = None
        if options.interleaved and pairs:
            reference_s, measured_s, runs = zip(*pairs, strict=True)
            paired = paired_ratio(reference_s, measured_s, strata=runs)
        rows.append(
            ServeRow(
                deployment=deployment,
                round=name,
                requests=len(outcomes),
                failed=len(outcomes) - len(good),
                max_inflight=options.max_inflight,
                max_tokens=options.mixed_max_tokens if name == "mixed" else options.max_tokens,
                prompt_tokens_mean=prompt_tokens / max(1, len(outcomes)),
                ttft_ms_mean=mean,
                ttft_ms_p50=statistics.median(ttft),
                ttft_ms_p90=_percentile(ttft, 0.90),
                ttft_ms_max=max(ttft),
                total_s=round_.result.total_s,
                requests_per_s=len(good) / round_.result.total_s,
                prompt_tokens_per_s=prompt_tokens / round_.result.total_s,
                itl_ms_p50=statistics.median(itl) if itl else None,
                itl_ms_p99=_percentile(itl, 0.99) if itl else None,
                vllm_cache_hit_tokens=hit,
                connector_tokens=external,
                blends=round_.blends,
                blend_recomputed_tokens=round_.blend_recomputed_tokens,
                tokens_reused=reused,
                tokens_recomputed=prompt_tokens - reused,
                outputs_compared=compared,
                output_mismatches=mismatched,
                output_agreement=None if base_round is None or deployment == "vllm" else agreed / max(1, len(outcomes)),
                ttft_vs_vllm=None if vllm_row is None else vllm_row.ttft_ms_mean / mean,
                ttft_vs_cold=None if cold_row is None else cold_row.ttft_ms_mean / mean,
                engine_ttft_ms_mean=_engine_mean_ms(round_.sources, "time_to_first_token"),
                engine_queue_ms_mean=_engine_mean_ms(round_.sources, "request_queue_time"),
                engine_prefill_ms_mean=_engine_mean_ms(round_.sources, "request_prefill_time"),
                ttft_ratio_max_vs_vllm=max(ratios) if ratios else None,
                ttft_gain=None if warm_up_row is None or name == "warm_up" else warm_up_row.ttft_ms_mean / mean,
                warm_up_stored=len(stored) if name == "warm_up" and deployment not in VLLM_ALONE else None,
                chunk_separator=separator and deployment not in VLLM_ALONE,
                chunking=None if deployment in VLLM_ALONE else (options.chunking or "fixed"),
                chat=options.chat,
                ttft_paired_ratio=None if paired is None else paired.ratio,
                ttft_paired_low=None if paired is None else paired.low,
                ttft_paired_high=None if paired is None else paired.high,
                server_stop_s=stop_s,
                errors=tuple(outcome.error for outcome in outcomes if outcome.error is not None)[:5],
            )
        )
    return rows


def ttft_gain_failure(rows: Sequence[ServeRow], expected: float) -> str | None:
    """Why the run misses ``--expected-ttft-gain`` (``None``: it meets it): the blending deployment's query-round
    mean TTFT must be at least ``expected`` times faster than vLLM alone's."""
    row = next((row for row in rows if row.deployment == "kvstore_blend" and row.round == "query"), None)
    if row is None or row.ttft_vs_vllm is None:
        return "no kvstore_blend query row against vLLM alone to check --expected-ttft-gain on"
    if row.failed:
        return f"kvstore_blend's query round had {row.failed} failed requests"
    if row.ttft_vs_vllm < expected:
        return (
            f"kvstore_blend's query-round TTFT gain over vLLM alone is {row.ttft_vs_vllm:.2f}x "
            f"({row.ttft_ms_mean:,.0f} ms against vLLM's), below --expected-ttft-gain {expected:g}"
        )
    return None
