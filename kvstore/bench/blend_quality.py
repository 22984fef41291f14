"""Quality of a reused-KV prefill against a full prefill of the same prompt.

Four measures, each per query, averaged per mode by the benchmark:

- **top-1 agreement**: the next token (argmax of the last prompt token's logits) equals full prefill's;
- **KL divergence** ``KL(P_full || P_mode)`` of the last token's next-token distribution (nats, float64);
- **continuation match**: greedy continuation of ``n`` tokens from each prefill's KV cache, the fraction of
  positions where the token equals full prefill's (position by position, so an early divergence costs the rest);
- **fact accuracy**: the first number in the greedy continuation is the planted fact's code (stricter than "the
  answer contains the code": a model that lists every code it saw gets no credit).

Runs the model under ``torch.inference_mode``; not thread-safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.blend import BlendOutput
from kvstore.models.cache_argument import cache_argument

__all__ = ["Continuation", "first_number", "greedy_continuation", "kl_divergence"]

_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Continuation:
    """Greedy tokens after a prompt and their text (empty when no tokenizer is given)."""

    tokens: tuple[int, ...]
    text: str


def greedy_continuation(model: Any, output: BlendOutput, num_tokens: int, tokenizer: Any | None) -> Continuation:
    """``num_tokens`` greedy tokens, the first from ``output.logits``, the rest decoded one by one on its cache.

    The output's cache grows by the decoded tokens (transformers caches are updated in place).
    """
    tokens = [int(output.logits.argmax())]
    cache = output.cache
    device = next(model.parameters()).device
    with torch.inference_mode():
        for _ in range(num_tokens - 1):
            token = torch.tensor([[tokens[-1]]], device=device)
            step = model(input_ids=token, **cache_argument(model, cache), use_cache=True)
            tokens.append(int(step.logits[0, -1].argmax()))
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return Continuation(tokens=tuple(tokens), text=text)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(softmax(reference) || softmax(logits))`` in nats, computed in float64."""
    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    candidate = torch.log_softmax(logits.double(), dim=-1)
    return float((reference.exp() * (reference - candidate)).sum())


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (the model's answer to "what is the access code ...")."""
    found = _NUMBER.search(text)
    return found.group(0) if found else None
