"""The multi-doc QA prompts of ``kvstore bench vllm --serve``: the guide's layout, built from separately encoded parts
(so the separator's ids recur verbatim, which is what the store's chunk separator cuts at)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.bench.vllm_serve_workload import DEFAULT_SEPARATOR, serve_workload
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.keys import as_token_array, separator_run_starts


def encode(text: str) -> list[int]:
    """A word-level toy tokenizer: one id per whitespace-separated word (stable across calls)."""
    return [sum(map(ord, word)) % 50_000 for word in text.split()]


@pytest.mark.parametrize("corpus", ["synthetic", "prose"])
def test_warm_up_and_queries_follow_the_guides_layout(corpus: str) -> None:
    workload = serve_workload(
        encode, corpus=corpus, num_documents=4, document_tokens=30, docs_per_query=3, num_queries=5, num_mixed=6
    )  # type: ignore[arg-type]
    system, sep, ask = (
        encode("You are a helpful assistant."),
        encode(DEFAULT_SEPARATOR),
        encode("What's up? how are you recently?"),
    )
    assert [prompt.documents for prompt in workload.warm_up] == [(0,), (1,), (2,), (3,)]
    documents = {}
    for prompt in workload.warm_up:
        tokens = list(prompt.tokens)
        assert tokens[: len(system) + len(sep)] == system + sep and tokens[-len(sep) - len(ask) :] == sep + ask
        documents[prompt.documents[0]] = tokens[len(system) + len(sep) : -len(sep) - len(ask)]
        assert len(documents[prompt.documents[0]]) == 30
    for query in workload.queries:
        assert len(set(query.documents)) == 3 and query.kind == "query"
        expected = system + [token for index in query.documents for token in sep + documents[index]] + sep + ask
        assert list(query.tokens) == expected
        # every document starts a separator run of the query, as in its warm-up prompt
        starts = separator_run_starts(as_token_array(query.tokens), tuple(sep))
        assert len(starts) == 1 + len(query.documents) + 1
    kinds = sorted(prompt.kind for prompt in workload.mixed)
    assert kinds == ["hit"] * 2 + ["miss"] * 2 + ["query"] * 2
    for prompt in workload.mixed:
        if prompt.kind == "hit":
            assert prompt.tokens == workload.warm_up[prompt.documents[0]].tokens
        if prompt.kind == "miss":
            assert prompt.documents[0] >= 4  # a document never sent before
    assert StoreConfig(chunk_separator=tuple(sep)).chunk_separator == tuple(sep)


def test_bad_counts_and_corpora_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="--docs-per-query 5"):
        serve_workload(encode, corpus="synthetic", num_documents=4, document_tokens=10, docs_per_query=5, num_queries=1)
    with pytest.raises(ConfigError, match="must be >= 1"):
        serve_workload(encode, corpus="synthetic", num_documents=0, document_tokens=10, docs_per_query=1, num_queries=1)
    with pytest.raises(ConfigError, match="synthetic or prose"):
        serve_workload(encode, corpus="poetry", num_documents=2, document_tokens=10, docs_per_query=1, num_queries=1)  # type: ignore[arg-type]


def test_chat_prompts_are_text_messages_templated_whole() -> None:
    from kvstore.bench.vllm_serve_workload import CHAT_SEPARATOR, ChatForm

    def decode(tokens: object) -> str:
        return " ".join(f"w{token}" for token in tokens)  # type: ignore[attr-defined]

    def template(messages: object) -> list[int]:
        return encode(" | ".join(f"<{role}> {content}" for role, content in messages) + " <assistant>")  # type: ignore[attr-defined]

    chat = ChatForm(decode=decode, template=template)
    workload = serve_workload(
        encode, corpus="prose", num_documents=3, document_tokens=20, docs_per_query=2, num_queries=2, num_mixed=3,
        separator=CHAT_SEPARATOR, chat=chat,
    )  # fmt: skip
    plain = serve_workload(
        encode, corpus="prose", num_documents=3, document_tokens=20, docs_per_query=2, num_queries=2, num_mixed=3
    )
    assert [prompt.documents for prompt in workload.queries] == [prompt.documents for prompt in plain.queries]
    for prompt in (*workload.warm_up, *workload.queries, *workload.mixed):
        (system_role, system), (user_role, user) = prompt.messages
        assert (system_role, system, user_role) == ("system", "You are a helpful assistant.", "user")
        texts = user.split(CHAT_SEPARATOR)
        assert len(texts) == len(prompt.documents) + 1 and texts[-1] == "What's up? how are you recently?"
        assert all(text.startswith("w") and len(text.split()) == 20 for text in texts[:-1])
        assert prompt.tokens == tuple(template(prompt.messages))
    hit = next(prompt for prompt in workload.mixed if prompt.kind == "hit")
    assert hit.messages == workload.warm_up[hit.documents[0]].messages


def test_the_vllm_server_beside_a_deployment_caches_prefixes_as_that_deployment_does(tmp_path: Path) -> None:
    """Interleaved, vLLM alone beside ``kvstore_blend`` runs without its prefix cache as ``kvstore_blend`` does, so the
    pair's TTFT ratio on a miss is the connector's cost alone (not vLLM's block hashing as well)."""
    from kvstore.bench.vllm_serve import _prefix_caching, _server_spec
    from kvstore.bench.vllm_serve_options import ServeBenchOptions

    options = ServeBenchOptions(model_dir=tmp_path)
    for deployment in ("kvstore", "kvstore_blend"):
        beside = _prefix_caching(deployment)
        reference, transfer = _server_spec(options, "vllm", {}, tmp_path, prefix_caching=beside)
        served, served_transfer = _server_spec(options, deployment, {}, tmp_path)
        assert reference.enable_prefix_caching == served.enable_prefix_caching == (deployment == "kvstore")
        assert transfer is None and served_transfer is not None
    assert _server_spec(options, "vllm", {}, tmp_path)[0].enable_prefix_caching, "alone, vLLM keeps its own cache"


def test_an_interleaved_pairs_two_runs_pool_into_one_round_of_every_request() -> None:
    """The pair runs in both start orders; each round's row reads the requests of both runs, in run order, with the
    servers' counters and the rounds' wall times summed, and each request's run."""
    from kvstore.bench.vllm_serve import _Measured, _pooled
    from kvstore.bench.vllm_serve_client import RequestOutcome, RoundResult

    def run(ttfts: list[float], hits: float, blends: int) -> dict[str, _Measured]:
        outcomes = tuple(RequestOutcome(index=i, prompt_tokens=100, ttft_s=ttft) for i, ttft in enumerate(ttfts))
        result = RoundResult(outcomes=outcomes, total_s=sum(ttfts))
        measured = _Measured(result=result, sources={"external_kv_transfer": hits}, blends=blends,
                             blend_recomputed_tokens=10 * blends)  # fmt: skip
        return {"warm_up": measured}

    pooled = _pooled([run([1.0, 2.0], 0.0, 0), run([3.0, 4.0], 256.0, 2)])["warm_up"]
    assert [outcome.ttft_s for outcome in pooled.result.outcomes] == [1.0, 2.0, 3.0, 4.0]
    assert pooled.result.total_s == 10.0
    assert pooled.sources == {"external_kv_transfer": 256.0}
    assert (pooled.blends, pooled.blend_recomputed_tokens) == (2, 20)
    assert pooled.strata == (0, 0, 1, 1), "each request's run: the paired ratio's bootstrap resamples within each"


def test_the_cold_deployment_is_vllm_without_its_prefix_cache_and_each_row_reads_against_it(tmp_path: Path) -> None:
    """``vllm_cold`` computes every prompt (no connector, no prefix cache): a later deployment's row reads its TTFT
    against it (``ttft_vs_cold``) as well as against vLLM as deployed (``ttft_vs_vllm``). It runs only when named."""
    from kvstore.bench.vllm_serve import _Measured, _rows, _server_spec
    from kvstore.bench.vllm_serve_client import RequestOutcome, RoundResult
    from kvstore.bench.vllm_serve_options import DEFAULT_DEPLOYMENTS, ServeBenchOptions
    from kvstore.bench.vllm_serve_workload import ServePrompt, ServeWorkload

    options = ServeBenchOptions(model_dir=tmp_path, deployments=("vllm", "vllm_cold", "kvstore_blend"))
    spec, transfer = _server_spec(options, "vllm_cold", {}, tmp_path)
    assert not spec.enable_prefix_caching and transfer is None
    assert "vllm_cold" not in DEFAULT_DEPLOYMENTS
    with pytest.raises(ConfigError, match="drop vllm_cold"):
        ServeBenchOptions(model_dir=tmp_path, deployments=("vllm", "vllm_cold", "kvstore_blend"), interleaved=True)

    def measured(ttft_s: float) -> dict[str, _Measured]:
        outcome = RequestOutcome(index=0, prompt_tokens=100, ttft_s=ttft_s, token_ids=(7,))
        return {"query": _Measured(result=RoundResult(outcomes=(outcome,), total_s=ttft_s), sources={}, blends=0,
                                   blend_recomputed_tokens=0)}  # fmt: skip

    query = ServePrompt(tokens=(1, 2), kind="query", documents=(0, 1))
    workload = ServeWorkload(warm_up=(), queries=(query,), mixed=())
    rows = _rows(options, "vllm", workload, measured(2.0), {}, [], set(), None, False)
    reference = {"query": measured(2.0)["query"].result}
    rows += _rows(options, "vllm_cold", workload, measured(4.0), reference, rows, set(), None, False)
    blend = _rows(options, "kvstore_blend", workload, measured(1.0), reference, rows, set(), None, False)[0]
    assert (blend.ttft_vs_vllm, blend.ttft_vs_cold) == (2.0, 4.0)
    assert rows[1].ttft_vs_vllm == 0.5 and not rows[1].chunking and not rows[1].chunk_separator


def test_vllms_request_timings_are_read_as_sums_and_counts_over_engines() -> None:
    """A row's ``engine_*_ms_mean`` come from vLLM's histograms: each timing's sum and count, summed over engines
    (a data-parallel server reports one series per engine); buckets and other metrics are not read."""
    from kvstore.bench.vllm_serve import _engine_mean_ms
    from kvstore.bench.vllm_serve_server import engine_timings

    text = "\n".join([
        '# TYPE vllm:time_to_first_token_seconds histogram',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 1.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.5',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0',
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 1.5',
        'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 3.0',
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0',
        'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 9.0',
    ])  # fmt: skip
    timings = engine_timings(text)
    assert timings == {"time_to_first_token_sum": 4.0, "time_to_first_token_count": 4.0,
                       "request_prefill_time_sum": 3.0, "request_prefill_time_count": 3.0}  # fmt: skip
    assert _engine_mean_ms(timings, "time_to_first_token") == 1000.0
    assert _engine_mean_ms(timings, "request_queue_time") is None
