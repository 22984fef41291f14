"""A real vLLM engine on the exported SmolLM2 agrees with transformers: the baseline every connector test builds on.

If vLLM read the model wrongly (no architecture, the tied embedding under a name it skips), it would answer with
garbage and no error; comparing greedy tokens with transformers' float32 run of kvstore's own copy catches that.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kvstore.bench.vllm_engine import EngineSpec
from kvstore.models import default_model_cache_dir, load_smollm2
from tests.vllm.conftest import EngineRunner

PROMPT_TOKENS = 300
NEW_TOKENS = 24
CPU_BLOCK_SIZE_TOKENS = 128
"""vLLM's default KV block size on CPU; its prefix cache hits whole blocks."""


def test_float32_greedy_tokens_match_transformers_and_a_repeat_hits_the_prefix_cache(
    vllm_model_dir: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner
) -> None:
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ))
    text = inspect.cleandoc(os.walk.__doc__ or "")  # real English prose on every Python (absent only under -OO)
    prompt = loaded.tokenizer(text).input_ids[:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS, f"os.walk's docstring gave only {len(prompt)} tokens"

    cold, repeat = run_engine(
        EngineSpec(
            model_dir=vllm_model_dir,
            prompts=(prompt, prompt),
            max_tokens=NEW_TOKENS,
            enable_prefix_caching=True,
            env=vllm_env,
        )
    )

    expected = _transformers_greedy(loaded.model, prompt, NEW_TOKENS)
    assert cold.token_ids == expected
    assert repeat.token_ids == expected
    assert cold.num_cached_tokens == 0
    # Every whole block of the repeated prompt; vLLM recomputes at least the last prompt token.
    assert repeat.num_cached_tokens == (PROMPT_TOKENS - 1) // CPU_BLOCK_SIZE_TOKENS * CPU_BLOCK_SIZE_TOKENS == 256
    assert cold.ttft_s is not None and repeat.ttft_s is not None and cold.ttft_s > 0


def _transformers_greedy(model: torch.nn.Module, prompt: Sequence[int], num_new_tokens: int) -> tuple[int, ...]:
    """Greedy decoding with the model's KV cache, end-of-sequence ignored (as the driver's sampling does)."""
    generated: list[int] = []
    with torch.inference_mode():
        output = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        while True:
            generated.append(int(output.logits[0, -1].argmax()))
            if len(generated) == num_new_tokens:
                return tuple(generated)
            output = model(
                input_ids=torch.tensor([generated[-1:]]), past_key_values=output.past_key_values, use_cache=True
            )
