"""A real vLLM engine on the exported SmolLM2 agrees with transformers: the baseline every connector test builds on.

If vLLM read the model wrongly (no architecture, the tied embedding under a name it skips), it would answer with
garbage and no error; comparing greedy tokens with transformers' float32 run of kvstore's own copy catches that. The
vLLM side is the session's cold reference engine (``cold_reference``), which the connector tests compare with too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvstore.models import default_model_cache_dir, load_smollm2
from tests.vllm.conftest import REFERENCE_NEW_TOKENS, ColdReference


def test_float32_greedy_tokens_match_transformers(cold_reference: ColdReference) -> None:
    loaded = load_smollm2(cache_dir=default_model_cache_dir(os.environ))
    prompt = cold_reference.prompts["baseline"]
    cold = cold_reference.outputs["baseline"]

    assert cold.token_ids == _transformers_greedy(loaded.model, prompt, REFERENCE_NEW_TOKENS)
    assert cold.num_cached_tokens == 0, "no prefix cache, no connector: every prompt token computed"
    assert cold.ttft_s is not None and cold.ttft_s > 0
    assert all(result.kv_transfer_params is None for result in cold_reference.outputs.values())


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
