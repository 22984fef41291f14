"""Why a request's looked-up tokens were not served: the store's reasons and the connector's, adding up exactly.

A request looks up ``[local, T)``: the prompt past vLLM's own prefix-cache hit. The connector serves
``[local, served_end)`` (an exact load, or a blend pass's span) and vLLM computes the rest. Every other token is
missed under one reason (``kvstore.misses``):

- a token no segment of the probe covers: the store's reason for it (``never_stored``, ``evicted_cpu``, ...),
  inside a blend span too (the pass computed it);
- a cached token past ``served_end``: ``block_boundary`` when it is in the exact prefix (vLLM takes whole blocks and
  computes the prompt's last token), else ``blend_gate`` when the gate chose a prefill over a blend pass, else
  ``behind_gap`` (vLLM takes only a contiguous prefix); or ``declined`` for every one of them when the connector
  did not load at all (the store unreachable, a load that failed before);
- a cached token the load or pass did not deliver: the worker's reasons (``checksum``, ``remote_unavailable``,
  ``disk_slower``, ``load_failed``).

So ``served + sum(reasons) == T - local`` by construction: the probe's segments and misses tile the prompt.

``MissAccount`` keeps one request's arguments as its admission and its load or pass fill them in.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.misses import Miss, MissReason, tokens_by_reason
from kvstore.plan import Segment

__all__ = ["MissAccount", "cached_tokens", "declined_account", "request_misses"]


def cached_tokens(segments: tuple[Segment, ...], start: int, end: int) -> int:
    """Tokens of ``[start, end)`` some segment covers."""
    return sum(max(0, min(segment.end, end) - max(segment.start, start)) for segment in segments)


def request_misses(
    segments: tuple[Segment, ...],
    misses: tuple[Miss, ...],
    *,
    local_end: int,
    num_tokens: int,
    served_end: int,
    exact_end: int,
    gate_refused: bool = False,
    declined: MissReason | None = None,
    undelivered: Mapping[MissReason, int] | None = None,
) -> Counter[MissReason]:
    """Missed tokens of ``[local_end, num_tokens)`` by reason (the module docstring's rules).

    Args:
        segments: the probe's segments.
        misses: the probe's misses (with the segments they tile the prompt).
        local_end: vLLM's own prefix-cache hit: where the lookup's tokens begin.
        num_tokens: the prompt's length.
        served_end: the end of what the connector loaded or blended (``local_end``: nothing).
        exact_end: the end of the probe's exact prefix.
        gate_refused: the blend gate chose a prefill for the request's span.
        declined: the reason of every cached token past ``served_end``, when the connector did not load at all.
        undelivered: tokens of ``[local_end, served_end)`` that the worker did not deliver, by its reasons.
    """
    missed = tokens_by_reason(misses, local_end, num_tokens)
    past = max(served_end, local_end)
    for segment in segments:
        start, end = max(segment.start, past), segment.end
        if end <= start:
            continue
        if declined is not None:
            missed[declined] += end - start
            continue
        in_prefix = max(0, min(end, exact_end) - start)
        if in_prefix:
            missed[MissReason.BLOCK_BOUNDARY] += in_prefix
        if end - start - in_prefix:
            missed[MissReason.BLEND_GATE if gate_refused else MissReason.BEHIND_GAP] += end - start - in_prefix
    missed.update(undelivered or {})
    return +missed


@dataclass(slots=True, kw_only=True)
class MissAccount:
    """What a request's last admission looked up and what became of it (``request_misses``'s arguments, which the
    admission, the load and the pass fill in)."""

    segments: tuple[Segment, ...]
    misses: tuple[Miss, ...]
    local_end: int
    num_tokens: int
    exact_end: int
    gate_refused: bool = False
    declined: MissReason | None = None
    served_end: int = 0
    undelivered: Counter[MissReason] = field(default_factory=Counter)

    def report(self) -> dict[str, object]:
        """The looked-up and missed tokens, for the request's ``kv_transfer_params``."""
        missed = request_misses(
            self.segments, self.misses, local_end=self.local_end, num_tokens=self.num_tokens,
            served_end=self.served_end, exact_end=self.exact_end, gate_refused=self.gate_refused,
            declined=self.declined, undelivered=self.undelivered,
        )  # fmt: skip
        return {
            "looked_up_tokens": self.num_tokens - self.local_end,
            "missed_tokens": sum(missed.values()),
            "miss_reasons": {reason.value: count for reason, count in missed.most_common()},
        }

    def fail_delivery(self, num_tokens: int, reasons: Mapping[str, int]) -> None:
        """``num_tokens`` of the served span were not delivered: under the worker's ``reasons`` as far as they go,
        the rest ``load_failed`` (a failed call, a block cut short)."""
        for name, count in reasons.items():
            taken = min(count, num_tokens)
            self.undelivered[MissReason(name)] += taken
            num_tokens -= taken
        if num_tokens:
            self.undelivered[MissReason.LOAD_FAILED] += num_tokens

    def record_blend(self, local_end: int, end: int, skipped_disk_tokens: int | None) -> None:
        """A pass over ``[local_end, end)`` failed (``None``) or computed ``skipped_disk_tokens`` cached tokens
        rather than wait for the disk: its cached tokens are ``load_failed``, or that many ``disk_slower``."""
        cached = cached_tokens(self.segments, local_end, end)
        if skipped_disk_tokens is None:
            self.undelivered[MissReason.LOAD_FAILED] += cached
        elif skipped_disk_tokens:
            self.undelivered[MissReason.DISK_SLOWER] += min(cached, skipped_disk_tokens)


def declined_account(prompt_tokens: int, local_end: int, previous: MissAccount | None = None) -> MissAccount:
    """The account of a request the connector did not look up: what its ``previous`` probe cached is
    ``load_failed`` (a load of it failed before, and it is not retried), the rest keeps its store reasons; without
    one (the store unreachable) every looked-up token is ``load_failed``."""
    if previous is not None:
        return dataclasses.replace(
            previous, local_end=local_end, served_end=local_end, declined=MissReason.LOAD_FAILED, undelivered=Counter()
        )
    miss = Miss(0, prompt_tokens, MissReason.LOAD_FAILED)
    return MissAccount(segments=(), misses=(miss,), local_end=local_end, num_tokens=prompt_tokens, exact_end=0)
