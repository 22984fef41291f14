"""The proxy of a prefill/decode split (``kvstore bench vllm --prefill-decode``): each request goes to the prefill
engine with ``max_tokens`` 1, and once it answered, to the decode engine with the client's ``max_tokens``.

The two engines share one kvstore: the prefill engine's connector (``kv_role: kv_producer``) answers only once the
prompt's KV is stored, and the decode engine's (``kv_consumer``) finds it there by the prompt's tokens. So nothing
passes between the engines but the prompt: unlike a proxy for a connector that moves KV from one engine's memory to
the other's, this one forwards no ``kv_transfer_params`` (kvstore's are a report on the request, not a handle).
The client sees the decode engine's tokens; the prefill engine's one token is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.bench.vllm_engine import RequestResult

__all__ = ["Generate", "PrefillDecodeProxy", "RoutedRequest"]

Generate = Callable[[Sequence[int], int], RequestResult]
"""One engine's request: ``generate(prompt, max_tokens)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutedRequest:
    """A request as the proxy served it: the prefill engine's answer, then the decode engine's."""

    prefill: RequestResult
    decode: RequestResult

    @property
    def ttft_s(self) -> float | None:
        """The time to first token the proxy's client sees: from the prefill call to the decode engine's first token
        (prefill, the hop, and the decode engine's load)."""
        if self.decode.ttft_s is None:
            return None
        return self.decode.started_at - self.prefill.started_at + self.decode.ttft_s


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillDecodeProxy:
    """Routes each request to ``prefill`` (one token), then to ``decode``."""

    prefill: Generate
    decode: Generate

    def complete(self, prompt: Sequence[int], max_tokens: int) -> RoutedRequest:
        prefilled = self.prefill(prompt, 1)
        return RoutedRequest(prefill=prefilled, decode=self.decode(prompt, max_tokens))
