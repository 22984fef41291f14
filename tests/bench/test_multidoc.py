"""``kvstore bench multi-doc-qa`` / ``shuffle`` end to end on a tiny random model, and the workload's pieces."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from kvstore.bench.multidoc import (
    BenchMode,
    BenchWorkload,
    MultiDocOptions,
    WarmUp,
    run_multidoc_benchmark,
    warm_up_prompts,
)
from kvstore.bench.multidoc_workload import (
    FACT_NAMES,
    RELATIONS,
    Document,
    FactStyle,
    PromptFormat,
    docstring_corpus,
    pick_combinations,
    pick_derangements,
    prose_documents,
)
from kvstore.cli.main import main
from kvstore.errors import ConfigError
from kvstore.models import default_model_cache_dir, load_smollm2

TINY = ["--random-init", "tiny-llama", "--device", "cpu", "--num-documents", "4", "--document-tokens", "40",
        "--num-queries", "2", "--docs-per-query", "3", "--chunk-size", "8"]  # fmt: skip
ROW_FIELDS = ("mode", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "speedup_vs_full", "top1_agreement", "kl_mean",
              "continuation_match", "fact_accuracy", "lookup_ms_mean", "load_ms_mean", "recompute_ms_mean",
              "other_ms_mean", "skipped_disk_tokens_mean", "disk_policy", "fact_agreement_with_full", "fact_full_only",
              "fact_mode_only",
              "fact_difference_vs_full", "fact_difference_ci95_low", "fact_difference_ci95_high",
              "fact_accuracy_ci95_low", "fact_accuracy_ci95_high", "num_head_tokens", "seed", "facts")  # fmt: skip


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), captured.out, captured.err


def test_multi_doc_qa_prints_one_json_row_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["bench", "multi-doc-qa", *TINY, "--json"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["mode"] for row in rows] == ["full", "prefix", "blend", "reuse"]
    for row in rows:
        assert all(name in row for name in ROW_FIELDS)
        assert row["top1_agreement"] is None and row["fact_accuracy"] is None  # random-init: TTFT only
        assert row["fact_agreement_with_full"] is None and row["fact_difference_ci95_low"] is None
        assert row["num_queries"] == 2 and row["ttft_ms_p50"] <= row["ttft_ms_max"]
    full, prefix, blend, reuse = rows
    assert full["speedup_vs_full"] == 1.0 and full["cached_tokens_mean"] == 0 and full["warm_up"] == "preamble"
    assert full["facts"] == "none"  # random documents plant no facts
    # Documents were stored after the 16-token preamble (two whole chunks): a query's first document is an exact
    # prefix (7 whole chunks for a prefix cache, its partial last chunk too for the content match) and the other
    # two, separator included, are found at their new offsets.
    assert prefix["exact_tokens_mean"] == 56 and prefix["recomputed_tokens_mean"] == 176 - 56
    assert blend["exact_tokens_mean"] == 58 and blend["blend_tokens_mean"] == 2 * 42
    assert blend["recompute_ratio"] == 0.15 and blend["recomputed_tokens_mean"] == 34 + 13
    assert reuse["recompute_ratio"] == 0.0 and reuse["recomputed_tokens_mean"] == 176 - 58 - 84


@pytest.mark.parametrize("selection", ["query_attention", "chunk_start+query_attention"])
def test_the_selection_policy_is_a_flag_and_a_row_field(selection: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--modes", "blend", "--json", "--selection", selection, "--chunk-start-tokens", "2"]
    code, out, err = run(["bench", "multi-doc-qa", *TINY, *flags], capsys)
    assert code == 0, err
    full, blend = (json.loads(line) for line in out.splitlines())
    assert blend["selection"] == full["selection"] == selection and blend["chunk_start_tokens"] == 2
    assert blend["recomputed_tokens_mean"] == 34 + 13, "the same budget as kv_deviation's: one ratio of the reused"


def test_documents_stored_alone_are_no_prefix_hit_and_blend_in_whole(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["bench", "multi-doc-qa", *TINY, "--warm-up", "alone", "--modes", "prefix,blend", "--json"],
                         capsys)  # fmt: skip
    assert code == 0, err
    _, prefix, blend = (json.loads(line) for line in out.splitlines())
    assert prefix["exact_tokens_mean"] == 0 and prefix["warm_up"] == "alone"
    assert blend["exact_tokens_mean"] == 0 and blend["blend_tokens_mean"] == 3 * 42


def test_documents_only_on_disk_are_read_or_recomputed_as_the_disk_policy_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = {}
    for policy in ("wait", "recompute"):
        argv = ["bench", "multi-doc-qa", *TINY, "--warm-up", "alone", "--tiers", "disk", "--modes", "blend",
                "--disk-policy", policy, "--json"]  # fmt: skip
        code, out, err = run(argv, capsys)
        assert code == 0, err
        rows[policy] = json.loads(out.splitlines()[1])
    assert rows["wait"]["disk_policy"] == "wait" and rows["wait"]["skipped_disk_tokens_mean"] == 0
    assert rows["wait"]["blend_tokens_mean"] == 3 * 42
    assert rows["recompute"]["skipped_disk_tokens_mean"] == 3 * 42 and rows["recompute"]["blend_tokens_mean"] == 0
    assert rows["recompute"]["recomputed_tokens_mean"] == rows["recompute"]["prompt_tokens_mean"]


def test_an_unmet_expected_ttft_gain_exits_non_zero_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["bench", "shuffle", *TINY, "--modes", "blend", "--json", "--expected-ttft-gain", "1000"],
                         capsys)  # fmt: skip
    assert code == 1
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["mode"] for row in rows] == ["full", "blend"] and rows[1]["docs_per_query"] == 4
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: blend TTFT speedup")
    assert "below --expected-ttft-gain 1000" in lines[0]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--modes", "fast"], "--modes 'fast': each mode must be one of full, prefix, blend, reuse"),
        (["--docs-per-query", "9"], "--docs-per-query 9 must be between 1 and --num-documents 4"),
        (["--recompute-ratio", "2"], "recompute_ratio=2.0 must be a fraction in [0, 1]"),
        (["--check-layer", "7"], "check_layer=7 is beyond the model's 4 layers"),
        (["--tiers", "tape"], "--tiers 'tape'"),
        (["--deviation", "cosine"], "--deviation 'cosine': use key, value or key_value"),
        (["--warm-up", "cold"], "--warm-up 'cold': use preamble, alone or grouped"),
        (["--num-head-tokens", "-1"], "num_head_tokens=-1 must be a token count >= 0"),
        (["--model", "/nonexistent"], "--model and --random-init exclude each other"),
        (["--disk-policy", "never"], "disk_policy='never' is not one of auto, wait, recompute"),
        (["--selection", "attention"], "selection='attention' is not one of kv_deviation, query_attention"),
        (["--chunk-start-tokens", "0"], "chunk_start_tokens=0 must be a token count >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["bench", "multi-doc-qa", *TINY, *flags], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("kvstore: error:"), err
    assert fragment in lines[0]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["shuffle", "--num-documents", "1"], "a derangement needs at least 2 documents"),
        (["multi-doc-qa", "--num-documents", "2", "--docs-per-query", "3"], "--docs-per-query 3 must be between"),
    ],
)
def test_bad_document_counts_fail_before_the_model_loads(
    argv: list[str], fragment: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A model directory without config.json fails as soon as it is loaded, so the count error proves it came first.
    code, _, err = run(["bench", *argv, "--model", str(tmp_path), "--device", "cpu"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and fragment in lines[0], err


def test_derangements_move_every_document() -> None:
    for num_documents in (2, 5, 9):
        queries = pick_derangements(num_documents, 12, seed=3)
        assert len(queries) == 12
        for query in queries:
            assert sorted(query.order) == list(range(num_documents)) and query.asked in query.order
            assert all(document != slot for slot, document in enumerate(query.order))
    with pytest.raises(ConfigError, match="a derangement needs at least 2 documents"):
        pick_derangements(1, 3, seed=0)


def test_combinations_are_distinct_documents_and_reproducible() -> None:
    first = pick_combinations(10, 4, 20, seed=5)
    assert first == pick_combinations(10, 4, 20, seed=5)
    for query in first:
        assert len(set(query.order)) == 4 and query.asked in query.order


def test_prose_documents_have_the_exact_length_and_their_fact() -> None:
    # The real tokenizer, from the cached converted copy (made on first use, as tests/blend do).
    tokenizer = load_smollm2(cache_dir=default_model_cache_dir(os.environ)).tokenizer
    documents = prose_documents(tokenizer, 3, 300, seed=1)
    assert len(docstring_corpus()) > 500
    prompt_format = PromptFormat.for_tokenizer(tokenizer)
    for index, document in enumerate(documents):
        assert document.tokens.shape == (300,) and document.fact is not None
        assert document.fact.name == FACT_NAMES[index] and len(document.fact.code) == 4
        assert document.fact.sentence in tokenizer.decode(document.tokens)
    question = prompt_format.question(documents[1].fact, np.random.default_rng(0), 49152)
    prompt = prompt_format.query_prompt([documents[2], documents[0]], question)
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "How long is the Juniper bridge, in meters?" in text  # document 1's own relation
    start = len(prompt_format.preamble) + len(prompt_format.separator)
    assert np.array_equal(prompt[start : start + 300], documents[2].tokens)  # tokenised alone, placed as is


def test_distinct_facts_state_one_relation_per_name_and_same_facts_one_sentence() -> None:
    tokenizer = load_smollm2(cache_dir=default_model_cache_dir(os.environ)).tokenizer
    distinct = prose_documents(tokenizer, len(RELATIONS) + 2, 120, seed=2)
    same = prose_documents(tokenizer, 4, 120, seed=2, style=FactStyle.SAME)
    facts = [document.fact for document in distinct]
    assert all(fact is not None for fact in facts)
    relations = [fact.relation for fact in facts if fact is not None]
    assert relations[: len(RELATIONS)] == list(range(len(RELATIONS))) and relations[len(RELATIONS)] == 0
    sentences = [fact.sentence.replace(fact.name, "").replace(fact.code, "") for fact in facts if fact is not None]
    assert len(set(sentences[: len(RELATIONS)])) == len(RELATIONS)  # the words around name and code differ
    for document in [*distinct, *same]:
        fact = document.fact
        assert fact is not None and fact.name in fact.question and fact.code not in fact.question
        assert fact.sentence in tokenizer.decode(document.tokens)
    assert {document.fact.question.replace(document.fact.name, "") for document in same if document.fact} == {
        "Question: What is the access code for the  archive?"
    }


def test_a_small_quality_run_on_smollm2() -> None:
    """The quality path end to end on the real model: continuations, KL, fact answers (tiny sizes)."""
    options = MultiDocOptions(
        workload=BenchWorkload.MULTI_DOC_QA,
        model_cache_dir=default_model_cache_dir(os.environ),
        device="cpu",
        num_documents=3,
        document_tokens=120,
        docs_per_query=2,
        num_queries=1,
        chunk_size=32,
        modes=(BenchMode.FULL, BenchMode.BLEND),
        continuation_tokens=8,
        facts=FactStyle.SAME,
    )
    full, blend = run_multidoc_benchmark(options)
    assert full.facts == blend.facts == "same"
    assert full.top1_agreement == 1.0 and full.kl_mean == 0.0 and full.continuation_match == 1.0
    assert full.fact_accuracy in (0.0, 1.0) and blend.fact_accuracy in (0.0, 1.0)
    # Paired with full prefill on the same query: full agrees with itself; blend's counts follow its answer.
    assert full.fact_agreement_with_full == 1.0 and full.fact_full_only == full.fact_mode_only == 0
    assert blend.fact_difference_vs_full == blend.fact_accuracy - full.fact_accuracy
    assert blend.fact_full_only == int(full.fact_accuracy > blend.fact_accuracy)
    assert blend.fact_mode_only == int(blend.fact_accuracy > full.fact_accuracy)
    assert blend.fact_difference_ci95_low is not None and blend.fact_difference_ci95_high is not None
    assert blend.fact_difference_ci95_low < blend.fact_difference_vs_full < blend.fact_difference_ci95_high
    assert blend.exact_tokens_mean > 100 and blend.blend_tokens_mean > 100  # the first document is an exact prefix
    assert blend.kl_mean is not None and blend.kl_mean < 1.0


def test_without_json_a_table_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["bench", "shuffle", *TINY, "--modes", "reuse"], capsys)
    assert code == 0, err
    assert "kvstore bench shuffle (random-init/tiny-llama-seed0, cpu)" in out
    assert "reuse" in out and "speedup" in out


def test_samples_are_written_one_line_per_query_and_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    samples = tmp_path / "samples.jsonl"
    code, out, err = run(["bench", "multi-doc-qa", *TINY, "--modes", "blend", "--samples", str(samples), "--json"],
                         capsys)  # fmt: skip
    assert code == 0, err
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(line["query"], line["mode"]) for line in lines] == [(0, "full"), (0, "blend"), (1, "full"), (1, "blend")]
    full_row = json.loads(out.splitlines()[0])
    assert full_row["ttft_ms_mean"] == pytest.approx(sum(line["total_ms"] for line in lines[::2]) / 2, abs=1e-3)
    assert all(len(line["order"]) == 3 and line["asked"] in line["order"] for line in lines)
    assert lines[1]["recomputed_tokens"] < lines[0]["recomputed_tokens"] and lines[1]["fact_correct"] is None


def test_an_unwritable_samples_path_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    code, _, err = run(["bench", "multi-doc-qa", *TINY, "--samples", str(tmp_path / "missing" / "s.jsonl")], capsys)
    assert code != 0 and "--samples" in err and "Traceback" not in err


def test_grouped_warm_up_stores_documents_a_query_at_a_time_and_blend_finds_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(["bench", "multi-doc-qa", *TINY, "--warm-up", "grouped", "--modes", "blend", "--json"],
                         capsys)  # fmt: skip
    assert code == 0, err
    _, blend = (json.loads(line) for line in out.splitlines())
    assert blend["warm_up"] == "grouped"
    # Every document of a query was cached (documents 0-2 in one prompt, 3 in another): all but the chunk-aligned
    # heads and the question are served from the store.
    assert blend["exact_tokens_mean"] + blend["blend_tokens_mean"] >= 3 * 32


def test_groupedwarm_up_prompts_are_query_contexts_of_consecutive_documents() -> None:
    prompt_format = PromptFormat(np.arange(3), np.array([7]), np.array([9]))
    documents = [Document(tokens=np.full(4, 100 + index), fact=None) for index in range(5)]
    options = MultiDocOptions(warm_up=WarmUp.GROUPED, docs_per_query=2)
    prompts = warm_up_prompts(options, prompt_format, documents)
    expected = [documents[0:2], documents[2:4], documents[4:5]]
    assert [prompt.tolist() for prompt in prompts] == [
        prompt_format.context_prompt(group).tolist() for group in expected
    ]


@pytest.mark.parametrize("asked", [("blend", "full"), ("blend",), ("full", "blend", "blend")])
def test_full_prefill_runs_first_whatever_order_the_modes_are_asked_in(asked: tuple[str, ...]) -> None:
    """Quality is always scored against full prefill: ``--modes blend,full`` used to score blend against itself."""
    options = MultiDocOptions(modes=asked)  # type: ignore[arg-type]
    assert options.modes == (BenchMode.FULL, BenchMode.BLEND)
