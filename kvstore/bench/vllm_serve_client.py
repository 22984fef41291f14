"""The client side of ``kvstore bench vllm --serve``: one round of prompts sent to a vLLM OpenAI server with the
``openai`` package's ``AsyncOpenAI``, as LMCache's multi-doc QA benchmark sends them.

Each prompt goes to ``/v1/completions`` as a list of token ids (``prompt=[...]``), or, given as chat messages, to
``/v1/chat/completions`` as text (the server applies the model's chat template and tokenizes it), streamed, greedy
(``temperature=0``), ``ignore_eos`` so that every request yields ``max_tokens`` tokens, with at most
``max_inflight`` requests in flight (a new one starts as soon as one finishes). Measured per request, on the
client's clock:

- TTFT: from sending the request to the first streamed chunk that carries a token (what a user waits for; it
  includes the HTTP server, tokenisation-free request handling and any queueing behind other requests);
- inter-token latencies: the gaps between later token chunks (the decode stall a blend pass inside a step causes
  the other requests of that step shows here);
- the generated token ids (``return_token_ids``), to compare deployments;
- the prompt's length and cached tokens from the final usage chunk (``--enable-prompt-tokens-details``): vLLM's
  prefix-cache hit plus what a connector supplied;
- an error, for a request that failed (the round goes on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Prompt", "RequestOutcome", "RoundResult", "send_round"]

Prompt = Sequence[int] | Sequence[tuple[str, str]]
"""Token ids, or chat messages as ``(role, content)`` pairs."""

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutcome:
    """One request, as the client saw it."""

    index: int
    prompt_tokens: int
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_ids: tuple[int, ...] = ()
    cached_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """A round's requests (in prompt order) and its wall time, from the first send to the last response."""

    outcomes: tuple[RequestOutcome, ...]
    total_s: float


def _is_chat(prompt: Prompt) -> bool:
    return bool(prompt) and isinstance(prompt[0], tuple)


async def _stream(client: Any, model: str, prompt: Prompt, max_tokens: int, timeout_s: float) -> Any:
    """The streamed response of one request: a chat completion for messages, a completion for token ids."""
    common = {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "extra_body": {"return_token_ids": True, "ignore_eos": True},
        "timeout": timeout_s,
    }  # fmt: skip
    if _is_chat(prompt):
        messages = [{"role": role, "content": content} for role, content in prompt]  # type: ignore[misc]
        return await client.chat.completions.create(messages=messages, **common)
    return await client.completions.create(prompt=list(prompt), **common)


def _text_of(choice: Any) -> str:
    """A streamed choice's new text (a chat chunk carries it in its delta)."""
    delta = getattr(choice, "delta", None)
    return str((delta.content if delta is not None else getattr(choice, "text", "")) or "")


async def _one(
    client: Any, model: str, index: int, prompt: Prompt, max_tokens: int, timeout_s: float
) -> RequestOutcome:
    outcome = RequestOutcome(index=index, prompt_tokens=0 if _is_chat(prompt) else len(prompt))
    started = time.perf_counter()
    last: float | None = None
    tokens: list[int] = []
    try:
        stream = await _stream(client, model, prompt, max_tokens, timeout_s)
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                new = list(getattr(choice, "token_ids", None) or ())
                if not new and not _text_of(choice):
                    continue
                if last is None:
                    outcome.ttft_s = now - started
                else:
                    outcome.itl_s.append(now - last)
                last = now
                tokens += new
            usage = chunk.usage
            if usage is not None:
                outcome.prompt_tokens = int(usage.prompt_tokens or outcome.prompt_tokens)
                if usage.prompt_tokens_details is not None:
                    outcome.cached_tokens = usage.prompt_tokens_details.cached_tokens
        outcome.latency_s = time.perf_counter() - started
        outcome.token_ids = tuple(tokens)
        if outcome.ttft_s is None:
            outcome.error = "no token streamed"
    except Exception as exc:  # a failed request is counted, not fatal: the round's other requests go on
        outcome.error = f"{type(exc).__name__}: {exc}"
        logger.warning("request %d failed: %s", index, outcome.error)
    return outcome


async def _round(
    base_url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, max_inflight: int, timeout_s: float
) -> RoundResult:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(max_inflight)

    async def gated(index: int, prompt: Prompt) -> RequestOutcome:
        async with gate:
            return await _one(client, model, index, prompt, max_tokens, timeout_s)

    started = time.perf_counter()
    try:
        outcomes = await asyncio.gather(*(gated(index, prompt) for index, prompt in enumerate(prompts)))
    finally:
        await client.close()
    return RoundResult(outcomes=tuple(outcomes), total_s=time.perf_counter() - started)


def send_round(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int,
    max_inflight: int,
    timeout_s: float = 1800.0,
) -> RoundResult:
    """Send ``prompts`` (token ids or chat messages) with at most ``max_inflight`` in flight; blocks until every one
    finished or failed. ``model`` is the served model name (the server's ``--model`` unless ``--served-model-name``)."""
    if max_inflight < 1 or max_tokens < 1:
        raise ValueError(f"max_inflight={max_inflight}, max_tokens={max_tokens}: both must be >= 1")
    return asyncio.run(_round(base_url, model, prompts, max_tokens, max_inflight, timeout_s))
